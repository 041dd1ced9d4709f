"""The golden wire vectors are the contract of docs/wire.md.

Every committed ``NAME.msgpack`` must decode with the pipeline's own decoders (the
headers come from its JSON twin) and re-encode byte for byte; the twin must describe
the same bytes; and the generator must still produce them. A failure here after a
schema change means either an OPTIONAL field was added (regenerate with
``python tests/vectors/generate.py`` and commit) or the wire broke.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from infra.chunks import ChunkAssembler, reassembled
from infra.schema import (
    SCHEMA_HEADER,
    STREAM_KINDS,
    TRAJECTORY_KINDS,
    InvalidMessage,
    SessionTurn,
    UnknownMessageKind,
    UnknownSchemaVersion,
    decode_message,
    decode_verdict,
    encode,
    stream_session,
    streamed_trajectory,
)
from scoring_workers.open_sessions import OpenSession
from tests.vectors.generate import VECTORS, readable, ready_compact_full

HERE = Path(__file__).resolve().parent
REGENERATE = "if the change only adds optional fields, run `python tests/vectors/generate.py` and commit"


def _load(name: str) -> tuple[bytes, dict]:
    return (HERE / f"{name}.msgpack").read_bytes(), json.loads((HERE / f"{name}.json").read_text())


def _decode(value: bytes, headers: list[tuple[str, bytes]]):
    """The wire form (compact trajectories not expanded), to re-encode byte for byte."""
    kind = dict(headers)["prm-kind"].decode()
    return (
        decode_verdict(value, headers)
        if kind == "verdict"
        else decode_message(value, headers, expand=False, kinds=TRAJECTORY_KINDS + STREAM_KINDS)
    )


def test_every_kind_and_status_has_a_vector() -> None:
    kinds, statuses = set(), set()
    for name in VECTORS:
        _, twin = _load(name)
        kinds.add(twin["headers"]["prm-kind"])
        if twin["headers"]["prm-kind"] == "verdict":
            statuses.add(twin["value"]["status"])
    assert kinds == {"ready", "discard", "chunk", "turn", "end", "verdict"}
    assert statuses == {"accepted", "rejected", "discarded"}
    _, branching = _load("ready_branching")
    parents = [i.get("parent_id") for i in branching["value"]["interactions"]]
    assert len(parents) != len(set(parents)), "the branching vector must have a turn with two children"


@pytest.mark.parametrize("name", list(VECTORS))
def test_vector_decodes_and_reencodes_byte_for_byte(name: str) -> None:
    value, twin = _load(name)
    headers = [(k, v.encode()) for k, v in twin["headers"].items()]
    message = _decode(value, headers)
    again, again_headers = encode(message)
    assert again == value, f"{name}: re-encoding changed the bytes ({REGENERATE})"
    assert again_headers == headers
    assert twin["key"] == message.group_id


@pytest.mark.parametrize("name", list(VECTORS))
def test_json_twin_describes_the_bytes(name: str) -> None:
    value, twin = _load(name)
    assert readable(msgspec.msgpack.decode(value)) == twin["value"]


@pytest.mark.parametrize("name", list(VECTORS))
def test_generator_still_writes_the_committed_bytes(name: str) -> None:
    value, _ = _load(name)
    assert encode(VECTORS[name]())[0] == value, f"{name}: the generator's output differs ({REGENERATE})"


def test_schema_versions_per_vector() -> None:
    """Version 2 only where version 1 cannot express the record: compact trajectories and turns, and chunks."""
    versions = {name: _load(name)[1]["headers"][SCHEMA_HEADER] for name in VECTORS}
    assert {n for n, v in versions.items() if v == "2"} == {"ready_compact", "chunk_0", "chunk_1", "turn_compact"}
    assert set(versions.values()) == {"1", "2"}


def test_the_compact_vector_expands_to_its_full_form() -> None:
    value, twin = _load("ready_compact")
    headers = [(k, v.encode()) for k, v in twin["headers"].items()]
    full = ready_compact_full()
    assert decode_message(value, headers) == full
    shared = {
        i["interaction_id"]: (i.get("shared_messages", 0), i.get("shared_tokens", 0))
        for i in twin["value"]["interactions"]
    }
    assert shared == {"root": (0, 0), "step": (3, 5), "leaf-a": (5, 8), "leaf-b": (2, 6)}


def test_the_chunk_vectors_reassemble_into_the_compact_vector() -> None:
    assembler: ChunkAssembler[str] = ChunkAssembler()
    done = []
    for name in ("chunk_0", "chunk_1"):
        value, twin = _load(name)
        done += assembler.add("p", _decode(value, [(k, v.encode()) for k, v in twin["headers"].items()]), name)
    (whole,) = done
    assert whole.value == _load("ready_compact")[0]
    assert reassembled(whole) == ready_compact_full()


def test_packed_arrays_are_little_endian() -> None:
    value, _ = _load("ready_single_turn")
    response = msgspec.msgpack.decode(value)["interactions"][0]["model_response"]
    assert response["output_tokens"] == b"\x07\x00\x00\x00\x08\x00\x00\x00\x09\x00\x00\x00\x02\x00\x00\x00"
    assert response["output_logprobs"][:4] == b"\x00\x00\x00\xbf"  # -0.5 as float32, little-endian


# --------------------------------------------------------------------------- compatibility rules
def test_reader_ignores_unknown_fields_a_newer_minor_adds() -> None:
    value, twin = _load("ready_single_turn")
    raw = msgspec.msgpack.decode(value)
    raw["future_optional_field"] = {"anything": [1, 2]}
    raw["interactions"][0]["another_new_field"] = "x"
    headers = [(k, v.encode()) for k, v in twin["headers"].items()]
    assert decode_message(msgspec.msgpack.encode(raw), headers) == decode_message(value, headers)


def test_numbers_may_be_msgpack_ints_where_floats_are_expected() -> None:
    """JavaScript encoders write 1.0 as the integer 1; readers must accept it."""
    value, twin = _load("ready_single_turn")
    raw = msgspec.msgpack.decode(value)
    raw["outcome_reward"], raw["created_at"] = 1, 1764500000
    headers = [(k, v.encode()) for k, v in twin["headers"].items()]
    message = decode_message(msgspec.msgpack.encode(raw), headers)
    assert message.outcome_reward == 1.0 and isinstance(message.outcome_reward, float)


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ([("prm-kind", b"ready")], UnknownSchemaVersion),
        ([(SCHEMA_HEADER, b"3"), ("prm-kind", b"ready")], UnknownSchemaVersion),
        ([(SCHEMA_HEADER, b"1")], UnknownMessageKind),
        ([(SCHEMA_HEADER, b"1"), ("prm-kind", b"discard")], InvalidMessage),
    ],
)
def test_what_makes_a_record_undecodable(headers, error) -> None:
    value, _ = _load("ready_single_turn")
    with pytest.raises(error):
        decode_message(value, headers)


def test_missing_required_field_and_wrong_array_type_are_refused() -> None:
    value, twin = _load("ready_single_turn")
    headers = [(k, v.encode()) for k, v in twin["headers"].items()]
    raw = msgspec.msgpack.decode(value)
    del raw["group_size"]
    with pytest.raises(InvalidMessage, match="group_size"):
        decode_message(msgspec.msgpack.encode(raw), headers)
    raw = msgspec.msgpack.decode(value)
    raw["interactions"][0]["model_response"]["output_tokens"] = [7, 8, 9, 2]  # a list, not packed bytes
    with pytest.raises(InvalidMessage, match="Expected `bytes`"):
        decode_message(msgspec.msgpack.encode(raw), headers)


def test_the_streamed_vectors_are_the_compact_session() -> None:
    """``turn_compact`` expands, against the turns before it, to the turn of ``ready_compact_full``."""
    value, twin = _load("turn_compact")
    turn = decode_message(value, [(k, v.encode()) for k, v in twin["headers"].items()], kinds=STREAM_KINDS)
    assert isinstance(turn, SessionTurn) and turn.interaction.shared_tokens == 8
    full, end = stream_session(ready_compact_full())
    session = OpenSession("s")
    for earlier in full[:2]:
        session.add(earlier.interaction)
    assert session.add(turn.interaction) == full[2].interaction
    value, twin = _load("end_session")
    decoded_end = decode_message(value, [(k, v.encode()) for k, v in twin["headers"].items()], kinds=STREAM_KINDS)
    assert decoded_end == end
    assert streamed_trajectory([t.interaction for t in full], end).interactions == ready_compact_full().interactions
