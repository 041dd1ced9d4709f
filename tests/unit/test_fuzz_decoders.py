"""Fuzz every decoder that reads untrusted bytes: none may raise anything but its typed error.

Issue 33 ("tenants stay data"): what a producer, an operator or a broken client writes is
data, never a crash. Each entry point and the one error it may raise (a subclass of
:class:`prm_pipeline.PRMPipelineError` with a message that says what is wrong):

* a line of ``prm-pipeline publish FILE.jsonl`` — :func:`infra.jsonl.load`, then the
  publisher's :meth:`~producers.publisher.TrajectoryPublisher.records` — ``JsonlError``
  (``MessageTooLarge`` / ``ExperimentMismatch`` once it is a message);
* a ``prm.trajectories`` record as the worker reads it (``decode_message(expand=False)``
  then ``check_expandable``, the expansion it makes later, and chunks through
  ``ChunkAssembler`` + ``reassembled``) and as the read-back/audit read it (expanded) —
  ``SchemaError``, the one class the worker catches to dead-letter a record with a reason;
* a ``prm.verdicts`` record — ``decode_verdict`` — ``SchemaError``;
* a registry record — ``infra.registry.decode_record`` — ``RegistryError``.

Inputs: arbitrary bytes and headers; valid records (the golden wire vectors, the JSONL
examples, :func:`prm_pipeline.demo.synthetic.make_group`) with bytes flipped, truncated,
deleted, duplicated or inserted; and valid records with one value replaced by something
hostile (JSON/msgpack nested 100,000 deep, integers past int64 and past Python's
4,300-digit limit, NaN/inf, lone surrogates, invalid UTF-8, wrong types, msgpack headers
announcing 4 GiB, timestamp extensions).

Runs are bounded and reproducible (derandomized, no example database): about a minute
for the whole module on one core. ``PRM_FUZZ_SCALE=20`` runs twenty times the examples
with fresh randomness; a failure prints the ``@reproduce_failure`` line to replay it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from infra import jsonl
from infra.chunks import Assembled, ChunkAssembler, reassembled
from infra.config import KafkaConfig, TopicsConfig
from infra.errors import PRMPipelineError
from infra.jsonl import JsonlError
from infra.kafka import MessageTooLarge
from infra.registry import RegistryError, decode_record
from infra.schema import (
    KIND_HEADER,
    MAX_TURN_TOKENS,
    SCHEMA_HEADER,
    DiscardGroup,
    ExperimentMismatch,
    GroupVerdict,
    InvalidMessage,
    ReadyTrajectory,
    SchemaError,
    TrajectoryChunk,
    UnknownSchemaVersion,
    check_expandable,
    decode_message,
    decode_verdict,
    encode,
    expand_trajectory,
)
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher

pytestmark = pytest.mark.slow  # about a minute of fuzzing: `make test` runs it, `make test-unit` does not

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "tests" / "vectors"

SCALE = float(os.environ.get("PRM_FUZZ_SCALE", "1"))


def fuzz(max_examples: int) -> settings:
    """Bounded and reproducible by default; ``PRM_FUZZ_SCALE`` for longer, random local runs."""
    return settings(
        max_examples=max(1, int(max_examples * SCALE)),
        deadline=None,
        derandomize=SCALE == 1,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


def refused_as(allowed: type[PRMPipelineError] | tuple[type[PRMPipelineError], ...], call: Callable[[], Any]) -> Any:
    """``call()``'s result, or None when it raised one of ``allowed`` with a message; any
    other exception (RecursionError, a bare ValueError, KeyError, …) fails the test."""
    try:
        result = call()
    except allowed as exc:
        assert isinstance(exc, PRMPipelineError)
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        event(f"refused: {type(exc).__name__}")  # pytest --hypothesis-show-statistics
        return None
    event(f"accepted: {type(result).__name__}")
    return result


# --------------------------------------------------------------------------- hostile values
_ANY_CHAR = st.characters(exclude_categories=())  # lone surrogates included
_DEPTHS = st.sampled_from([2, 64, 500, 900, 1_000, 1_100, 5_000, 30_000, 100_000])


def _nest(depth: int, how: str, opening: Callable[[str], bytes], leaf: bytes, closing: Callable[[str], bytes]) -> bytes:
    kinds = ["list", "dict"] * (depth // 2 + 1) if how == "mixed" else [how] * depth
    kinds = kinds[:depth]
    return b"".join(opening(k) for k in kinds) + leaf + b"".join(closing(k) for k in reversed(kinds))


def _json_deep(depth: int, how: str) -> bytes:
    return _nest(depth, how, lambda k: b"[" if k == "list" else b'{"a":', b"1", lambda k: b"]" if k == "list" else b"}")


def _msgpack_deep(depth: int, how: str) -> bytes:  # fixarray(1) / fixmap(1) with key "a"
    return _nest(depth, how, lambda k: b"\x91" if k == "list" else b"\x81\xa1a", b"\xc0", lambda _k: b"")


_JSON_SPECIAL = [
    b"9" * 5000,
    b"-" + b"9" * 5000,
    b"1" + b"0" * 400,
    b"1e400",
    b"-1e400",
    b"1e-400",
    b"0." + b"0" * 5000 + b"1",
    b"NaN",
    b"-Infinity",
    b"Infinity",
    b'"\\ud800"',
    b'"\\udc00\\ud800"',
    b'"\xed\xa0\x80"',
    b'"\xff\xfe"',
    b"2147483648",
    b"-2147483649",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"1.5",
    b"-0",
    b"true",
    b"null",
    b"[]",
    b"{}",
    b'""',
    b'"\\u0000"',
    b"[1,]",
    b'{"a":1,"a":2}',
    b"\x00",
    b'"' + b"x" * 70_000 + b'"',
]


def json_fragments() -> st.SearchStrategy[bytes]:
    """One JSON value as text, valid or not (json.dumps writes NaN and escaped surrogates)."""
    plain = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(_ANY_CHAR, max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(_ANY_CHAR, max_size=6), inner, max_size=4),
        max_leaves=10,
    ).map(lambda v: json.dumps(v).encode())
    deep = st.builds(_json_deep, _DEPTHS, st.sampled_from(["list", "dict", "mixed"]))
    return st.one_of(plain, deep, st.sampled_from(_JSON_SPECIAL))


_MSGPACK_SPECIAL = [
    b"\xcf" + b"\xff" * 8,
    b"\xd3\x80" + b"\x00" * 7,
    b"\xcb\x7f\xf8" + b"\x00" * 6,
    b"\xcb\xff\xf0" + b"\x00" * 6,
    b"\xca\x7f\xc0\x00\x00",
    b"\xca\x7f\x80\x00\x00",
    b"\xa3\xed\xa0\x80",
    b"\xa2\xff\xfe",
    b"\xc1",
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xdb\xff\xff\xff\xff",
    b"\xda\x00\x10abc",
    b"\xd4\x01\x00",
    b"\xc7\x00\x05",
    b"\xd6\xff\x00\x00\x00\x00",
    b"\xd7\xff" + b"\xff" * 8,
    b"\xc7\x0c\xff" + b"\xff\xff\xff\xff" + b"\x7f" + b"\xff" * 7,
    b"\xc7\x0c\xff" + b"\x00" * 4 + b"\x80" + b"\x00" * 7,
    b"\xc4\x03abc",
    b"\xc4\x05ab",
    b"\x90",
    b"\x80",
    b"\xc0",
    b"\xc2",
    b"\xc3",
    b"\x7f",
    b"\xe0",
    b"\xcc\xff",
    b"\xce\xff\xff\xff\xff",
]


def msgpack_fragments() -> st.SearchStrategy[bytes]:
    """One msgpack value as bytes, valid or not."""
    plain = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats(width=32)
        | st.floats()
        | st.text(max_size=8)
        | st.binary(max_size=12),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=10,
    ).map(msgspec.msgpack.encode)
    deep = st.builds(_msgpack_deep, _DEPTHS, st.sampled_from(["list", "dict", "mixed"]))
    return st.one_of(plain, deep, st.sampled_from(_MSGPACK_SPECIAL))


@st.composite
def mutated(draw: st.DrawFn, originals: list[bytes], tokens: st.SearchStrategy[bytes]) -> bytes:
    """A valid encoding with one to four byte-level edits."""
    data = bytearray(draw(st.sampled_from(originals)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("truncate", "flip", "set", "delete", "duplicate", "insert", "insert")))
        pos = draw(st.integers(0, len(data)))
        last = min(pos, len(data) - 1)
        if op == "truncate":
            del data[pos:]
        elif op == "flip" and data:
            data[last] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[last] = draw(st.integers(0, 255))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 32))]
        elif op == "duplicate":
            data[pos:pos] = data[pos : pos + draw(st.integers(1, 64))]
        elif op == "insert":
            data[pos:pos] = draw(tokens | st.binary(min_size=1, max_size=8))
    return bytes(data)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a decoded document: each value, and a new key in each mapping."""
    if prefix:
        yield prefix
    if isinstance(obj, dict):
        yield (*prefix, "zz_unknown")
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    doc = msgspec.msgpack.decode(msgspec.msgpack.encode(doc))  # a deep copy that keeps bytes as bytes
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return doc


_SENTINEL = "\u2603fuzz-value\u2603"


@st.composite
def json_with_hostile_value(draw: st.DrawFn, originals: list[Any]) -> bytes:
    """A valid JSON document with one value (or a new key's value) replaced by ``json_fragments``."""
    doc = draw(st.sampled_from(originals))
    path = draw(st.sampled_from(list(_paths(doc))))
    text = json.dumps(_replaced(doc, path, _SENTINEL)).encode()
    return text.replace(json.dumps(_SENTINEL).encode(), draw(json_fragments()), 1)


@st.composite
def msgpack_with_hostile_value(draw: st.DrawFn, originals: list[Any]) -> bytes:
    """A valid msgpack map with one value (or a new key's value) replaced by ``msgpack_fragments``."""
    doc = draw(st.sampled_from(originals))
    path = draw(st.sampled_from(list(_paths(doc))))
    return msgspec.msgpack.encode(_replaced(doc, path, msgspec.Raw(draw(msgpack_fragments()))))


# --------------------------------------------------------------------------- 1. JSONL lines for `publish`
def _valid_lines() -> list[bytes]:
    lines = [line for line in (ROOT / "examples" / "trajectories.jsonl").read_bytes().splitlines() if line.strip()]
    group = make_group("fz", 2, turns=3, output_tokens=4)
    rich = jsonl.dump(group[0])
    rich.update(policy_version=3, created_at=1.5, experiment_id="default")
    rich["interactions"][1].update(reward=0.5, token_rewards=[0.25] * 4, output_logprobs=[-0.5] * 4, stop_reason="stop")
    messages = [*group, DiscardGroup(group_id="fz", reason="env crashed", requested_at=2.0)]
    return lines + [msgspec.json.encode(jsonl.dump(m)) for m in messages] + [msgspec.json.encode(rich)]


JSONL_LINES = _valid_lines()
JSONL_DOCS = [json.loads(line) for line in JSONL_LINES]
PUBLISHER = TrajectoryPublisher(KafkaConfig(), TopicsConfig())
_JSON_TOKENS = st.sampled_from(
    [b"[", b"]", b"{", b"}", b'"', b",", b":", b"\\", b"\n", b"\r", *_JSON_SPECIAL]
) | st.builds(_json_deep, _DEPTHS, st.just("list"))


@pytest.fixture(scope="module")
def line_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-jsonl") / "lines.jsonl"


def publish_file(path: Path, data: bytes) -> None:
    """What ``prm-pipeline publish FILE`` does before it sends anything: every line to a
    message (JsonlError naming ``file:line``), every message to its records."""
    path.write_bytes(data)
    try:
        messages = list(jsonl.load(path))
    except JsonlError as exc:
        assert str(exc).startswith(f"{path}:"), str(exc)[:200]
        raise
    for message in messages:
        PUBLISHER.records(message)


PUBLISH_ERRORS = (JsonlError, MessageTooLarge, ExperimentMismatch)


def test_valid_jsonl_lines_publish(line_file: Path) -> None:
    publish_file(line_file, b"\n".join(JSONL_LINES))


@fuzz(500)
@given(
    data=st.binary(max_size=300) | st.text(_ANY_CHAR, max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass"))
)
@example(data=b"[" * 100_000)  # RecursionError before
@example(data=b'{"kind": "ready", "interactions": ' + b"[" * 100_000)
def test_jsonl_arbitrary_bytes(line_file: Path, data: bytes) -> None:
    refused_as(PUBLISH_ERRORS, lambda: publish_file(line_file, data))


@fuzz(1000)
@given(data=mutated(JSONL_LINES, _JSON_TOKENS))
def test_jsonl_mutated_lines(line_file: Path, data: bytes) -> None:
    refused_as(PUBLISH_ERRORS, lambda: publish_file(line_file, data))


@fuzz(1200)
@given(data=json_with_hostile_value(JSONL_DOCS))
def test_jsonl_lines_with_a_hostile_value(line_file: Path, data: bytes) -> None:
    refused_as(PUBLISH_ERRORS, lambda: publish_file(line_file, data))


def _deep_messages_line(depth: int) -> bytes:
    doc = json.loads(JSONL_LINES[0])
    doc["interactions"][0]["messages"] = [{"content": _SENTINEL}]
    return json.dumps(doc).encode().replace(json.dumps(_SENTINEL).encode(), _json_deep(depth, "list"))


@pytest.mark.parametrize("depth", [100_000, 30_000, 1_000])
def test_deeply_nested_json_is_a_jsonl_error(line_file: Path, depth: int) -> None:
    for line in (_json_deep(depth, "list"), _json_deep(depth, "dict"), _deep_messages_line(depth)):
        line_file.write_bytes(line)
        with pytest.raises(JsonlError, match=r"lines\.jsonl:1: (\S+: )?nested more than 128 arrays/objects deep$"):
            list(jsonl.load(line_file))
    obj: Any = 1
    for _ in range(depth):
        obj = [obj]
    with pytest.raises(JsonlError, match="nested more than 128"):  # the decoded-object API refuses it too
        jsonl.parse(_replaced(JSONL_DOCS[0], ("interactions", 0, "messages", 0, "content"), obj))


def test_nesting_a_line_may_have_publishes(line_file: Path) -> None:
    """Free-form ``messages`` nested up to the limit still load and encode; one level more is refused."""
    line_file.write_bytes(_deep_messages_line(jsonl.MAX_NESTING - 5))  # the line, interactions, one, messages, one
    (message,) = jsonl.load(line_file)
    ((value, headers),) = PUBLISHER.records(message)
    assert decode_message(value, headers) is not None
    line_file.write_bytes(_deep_messages_line(jsonl.MAX_NESTING - 4))
    with pytest.raises(JsonlError, match=r"lines\.jsonl:1: interactions\[0\]\.messages: nested more than 128"):
        list(jsonl.load(line_file))


def _line_with(path: tuple[Any, ...], fragment: bytes) -> bytes:
    text = json.dumps(_replaced(JSONL_DOCS[0], path, _SENTINEL)).encode()
    return text.replace(json.dumps(_SENTINEL).encode(), fragment, 1)


@pytest.mark.parametrize(
    ("path", "number", "needle"),
    [
        (
            ("interactions", 0, "messages", 0, "n"),
            b"18446744073709551616",
            r"interactions\[0\]\.messages: an integer outside",
        ),
        (
            ("interactions", 1, "output_message_list", 0, "n"),
            b"-9223372036854775809",
            "output_message_list: an integer",
        ),
        (("policy_version",), b"9223372036854775808", "policy_version: Expected `int` <= 9223372036854775807"),
        (("group_size",), b"1" + b"0" * 30, "group_size: Expected `int` <= 9223372036854775807"),
    ],
)
def test_an_integer_the_wire_cannot_carry_is_a_jsonl_error(
    line_file: Path, path: tuple[Any, ...], number: bytes, needle: str
) -> None:
    """JSON integers have no bound, msgpack's 64 bits: OverflowError from the encoder before."""
    with pytest.raises(JsonlError, match=needle):
        publish_file(line_file, _line_with(path, number))
    publish_file(line_file, _line_with(path, b"7"))  # a small one is fine


def test_a_line_of_another_experiment_is_a_typed_refusal(line_file: Path) -> None:
    doc = dict(JSONL_DOCS[0], experiment_id="exp-b")
    with pytest.raises(ExperimentMismatch, match="names experiment 'exp-b'") as info:
        publish_file(line_file, json.dumps(doc).encode())
    assert isinstance(info.value, ValueError)  # what callers caught before the type existed


# --------------------------------------------------------------------------- 2. trajectory and verdict records
def _vector(name: str) -> tuple[bytes, list[tuple[str, bytes]]]:
    twin = json.loads((VECTORS / f"{name}.json").read_text())
    return (VECTORS / f"{name}.msgpack").read_bytes(), [(k, v.encode()) for k, v in twin["headers"].items()]


TRAJECTORY_VECTORS = [
    "ready_single_turn",
    "ready_branching",
    "ready_compact",
    "ready_experiment",
    "discard",
    "chunk_0",
    "chunk_1",
]
VERDICT_VECTORS = [
    "verdict_accepted",
    "verdict_rejected",
    "verdict_discarded",
    "verdict_experiment",
    "verdict_reference",
]
TRAJECTORY_RECORDS = [_vector(n) for n in TRAJECTORY_VECTORS] + [encode(m) for m in make_group("fz", 2, turns=3)]
VERDICT_RECORDS = [_vector(n) for n in VERDICT_VECTORS]
CHUNKS = [_vector("chunk_0"), _vector("chunk_1")]

_HEADER_VALUES = (
    st.sampled_from(
        [
            b"1",
            b"2",
            b"3",
            b"0",
            b"01",
            b"",
            b" 1",
            b"1 ",
            b"-1",
            b"+1",
            b"1.0",
            "²".encode(),
            "١".encode(),
            "𝟏".encode(),
            b"9" * 5000,
            b"\xff",
            b"ready",
            b"discard",
            b"chunk",
            b"verdict",
            b"READY",
            b"ready\x00",
        ]
    )
    | st.binary(max_size=8)
    | st.none()
)


_MSGPACK_TOKENS = st.sampled_from(_MSGPACK_SPECIAL) | st.builds(_msgpack_deep, _DEPTHS, st.just("list"))
FUZZED_HEADERS = (
    st.lists(
        st.tuples(st.sampled_from([SCHEMA_HEADER, KIND_HEADER]) | st.text(_ANY_CHAR, max_size=4), _HEADER_VALUES),
        max_size=4,
    )
    | st.none()
)


@st.composite
def mutated_record(draw: st.DrawFn, records: list[tuple[bytes, list[tuple[str, bytes]]]]) -> tuple[bytes, Any]:
    """A valid record's value with byte-level edits, under its own headers."""
    value, headers = draw(st.sampled_from(records))
    return draw(mutated([value], _MSGPACK_TOKENS)), headers


def worker_reads(value: bytes | None, headers: Any) -> None:
    """A ``prm.trajectories`` record as every reader takes it; SchemaError is the only way out.

    The worker (scoring_workers/worker.py ``_dispatch``): the wire form, ``check_expandable``
    for ready records, the expansion it makes when it scores, chunks buffered and
    reassembled (scoring_workers/chunked.py). The read-back, the audit and the
    dead-letter tool: the expanded form.
    """
    message = refused_as(SchemaError, lambda: decode_message(value, headers, expand=False))
    if isinstance(message, ReadyTrajectory) and refused_as(SchemaError, lambda: check_expandable(message) or True):
        assert not expand_trajectory(message).is_compact  # what check_expandable lets through expands
    elif isinstance(message, TrajectoryChunk):
        assembler: ChunkAssembler[int] = ChunkAssembler()
        parts = [(i, decode_message(v, h, expand=False)) for i, (v, h) in enumerate(CHUNKS)]
        parts[message.index if message.index < 2 else 0] = (9, message)
        for coord, chunk in parts:
            for done in assembler.add(None, chunk, coord):
                refused_as(SchemaError, lambda done=done: reassembled(done))
    refused_as(SchemaError, lambda: decode_message(value, headers))
    if value is not None:  # a chunked trajectory's joined bytes are decoded with READY_HEADERS
        refused_as(SchemaError, lambda: reassembled(Assembled("t", "g", bytes(value), [0, 1])))


def test_valid_records_decode() -> None:
    for value, headers in TRAJECTORY_RECORDS:
        assert decode_message(value, headers) is not None
    for value, headers in VERDICT_RECORDS:
        assert decode_verdict(value, headers) is not None


@fuzz(500)
@given(value=st.binary(max_size=400) | st.none(), headers=st.sampled_from([h for _, h in TRAJECTORY_RECORDS]))
def test_trajectory_records_arbitrary_bytes(value: bytes | None, headers: Any) -> None:
    worker_reads(value, headers)


@fuzz(1200)
@given(record=mutated_record(TRAJECTORY_RECORDS))
def test_trajectory_records_mutated(record: tuple[bytes, Any]) -> None:
    worker_reads(*record)


@fuzz(1200)
@given(data=st.data())
def test_trajectory_records_with_a_hostile_value(data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(TRAJECTORY_RECORDS) - 1))
    original, headers = TRAJECTORY_RECORDS[i]
    value = data.draw(msgpack_with_hostile_value([msgspec.msgpack.decode(original)]))
    worker_reads(value, headers)


def _deep_messages_record(depth: int) -> tuple[bytes, list[tuple[str, bytes]]]:
    value, headers = TRAJECTORY_RECORDS[0]
    doc = msgspec.msgpack.decode(value)
    doc["interactions"][0]["messages"] = [{"content": msgspec.Raw(_msgpack_deep(depth, "mixed"))}]
    return msgspec.msgpack.encode(doc), headers


@pytest.mark.parametrize("depth", [100_000, 1_000])
def test_deeply_nested_msgpack_is_an_invalid_message(depth: int) -> None:
    value, headers = _deep_messages_record(depth)
    with pytest.raises(SchemaError, match="nested"):  # RecursionError before
        decode_message(value, headers)
    with pytest.raises(SchemaError):  # not even an object
        decode_message(_msgpack_deep(depth, "list"), headers)


@pytest.mark.parametrize("version", ["²", "𝟏", "١", "9" * 5000, "0" * 30 + "1"])
def test_a_schema_version_that_is_not_a_plain_number_is_refused(version: str) -> None:
    value, headers = TRAJECTORY_RECORDS[0]
    weird = [(SCHEMA_HEADER, version.encode()), (KIND_HEADER, b"ready")]
    with pytest.raises(UnknownSchemaVersion, match="is not supported") as info:  # ValueError from int() before
        decode_message(value, weird)
    assert len(str(info.value)) < 300
    with pytest.raises(UnknownSchemaVersion):
        decode_verdict(VERDICT_RECORDS[0][0], [(SCHEMA_HEADER, version.encode()), (KIND_HEADER, b"verdict")])


@fuzz(400)
@given(record=st.sampled_from(TRAJECTORY_RECORDS + VERDICT_RECORDS), headers=FUZZED_HEADERS)
@example(record=TRAJECTORY_RECORDS[0], headers=[(SCHEMA_HEADER, "²".encode()), (KIND_HEADER, b"ready")])
@example(record=VERDICT_RECORDS[0], headers=[(SCHEMA_HEADER, b"9" * 5000), (KIND_HEADER, b"verdict")])
def test_records_with_fuzzed_headers(record: tuple[bytes, Any], headers: Any) -> None:
    worker_reads(record[0], headers)
    verdict_reads(record[0], headers)


def verdict_reads(value: bytes | None, headers: Any) -> None:
    """A ``prm.verdicts`` record as the trainer, ``verdicts`` and the audit read it."""
    verdict = refused_as(SchemaError, lambda: decode_verdict(value, headers))
    if verdict is not None and _reward_tokens(verdict) <= 100_000:  # what `prm-pipeline verdicts` prints
        refused_as(PRMPipelineError, lambda: jsonl.dump_verdict(verdict, include_tokens=True))


def _reward_tokens(verdict: GroupVerdict) -> int:
    """How many floats laying out the verdict's token rewards takes (the test's memory, not a rule)."""
    return sum(
        tr.length
        for s in verdict.sessions
        for b in s.branches
        for rewards in (b.token_rewards, *b.channels.values())
        for tr in rewards.values()
    )


def test_a_token_rewards_length_no_reader_can_lay_out_is_refused() -> None:
    """A 12-byte ``uniform`` map announced 2**64-1 tokens: ValueError from numpy in `verdicts` before."""
    value, headers = VERDICT_RECORDS[0]
    doc = msgspec.msgpack.decode(value)
    rewards = doc["sessions"][0]["branches"][0]["token_rewards"]
    for length in (2**64 - 1, MAX_TURN_TOKENS + 1):
        rewards[next(iter(rewards))] = {"length": length, "uniform": 0.5}
        with pytest.raises(InvalidMessage, match=f"length must be >= 0 and <= {MAX_TURN_TOKENS}, got {length}"):
            decode_verdict(msgspec.msgpack.encode(doc), headers)


@fuzz(300)
@given(value=st.binary(max_size=300) | st.none(), headers=st.sampled_from([h for _, h in VERDICT_RECORDS]))
def test_verdict_records_arbitrary_bytes(value: bytes | None, headers: Any) -> None:
    verdict_reads(value, headers)


@fuzz(800)
@given(record=mutated_record(VERDICT_RECORDS))
def test_verdict_records_mutated(record: tuple[bytes, Any]) -> None:
    verdict_reads(*record)


@fuzz(800)
@given(data=st.data())
def test_verdict_records_with_a_hostile_value(data: st.DataObject) -> None:
    original, headers = data.draw(st.sampled_from(VERDICT_RECORDS))
    verdict_reads(data.draw(msgpack_with_hostile_value([msgspec.msgpack.decode(original)])), headers)


# --------------------------------------------------------------------------- 3. registry records
# infra/registry.py documents ``decode_record`` as raising only RegistryError: a regression
# guard for its bounded decoding (30,000 nested `[` once escaped as a RecursionError).
REGISTRY_GOOD = {
    "experiment_id": "exp-ok",
    "prm": {"scorers": [{"path": "scoring_workers.scorers.LengthBudgetScorer", "kwargs": {"max_output_tokens": 8}}]},
    "weight": 2.0,
    "max_in_flight": 4,
    "group_timeout_s": 60.0,
    "judge_quota": {"max_in_flight": 2, "rps": 5.0},
    "description": "fuzz",
}
REGISTRY_VALUES = [json.dumps(REGISTRY_GOOD).encode(), json.dumps({**REGISTRY_GOOD, "judge_quota": None}).encode()]
_REGISTRY_KEYS = (
    st.sampled_from([b"exp-ok", b"exp-ok", b"exp-ok", b"default", b"", b"exp ok", b"\xff", b"x" * 65])
    | st.binary(max_size=12)
    | st.none()
)


def registry_reads(key: bytes | None, value: bytes | None) -> None:
    refused_as(RegistryError, lambda: decode_record(key, value))


def test_a_valid_registry_record_decodes() -> None:
    assert decode_record(b"exp-ok", REGISTRY_VALUES[0]) is not None


@fuzz(400)
@given(key=_REGISTRY_KEYS, value=st.binary(max_size=300) | st.none())
@example(key=b"exp-ok", value=b"[" * 30_000)
@example(key=b"exp-ok", value=b'{"experiment_id": "exp-ok", "prm": ' + b"[" * 30_000)
def test_registry_records_arbitrary_bytes(key: bytes | None, value: bytes | None) -> None:
    registry_reads(key, value)


@fuzz(600)
@given(value=mutated(REGISTRY_VALUES, _JSON_TOKENS))
def test_registry_records_mutated(value: bytes) -> None:
    registry_reads(b"exp-ok", value)


@fuzz(700)
@given(value=json_with_hostile_value([json.loads(v) for v in REGISTRY_VALUES]))
def test_registry_records_with_a_hostile_value(value: bytes) -> None:
    registry_reads(b"exp-ok", value)


def test_registry_nested_brackets_are_a_registry_error() -> None:
    with pytest.raises(RegistryError):
        decode_record(b"exp-ok", b"[" * 30_000)


def test_a_dead_letter_with_a_corrupt_number_header_is_an_invalid_message() -> None:
    from infra.schema import InvalidMessage, dead_letter_from_record

    for bad in (b"\xb2", b"9" * 5000, b"1e3", b""):
        with pytest.raises(InvalidMessage, match="prm-dl-source-offset"):
            dead_letter_from_record(b"x", [("prm-dl-source-offset", bad)])
    assert dead_letter_from_record(b"x", [("prm-dl-source-offset", b"-1")]).source_offset == -1
