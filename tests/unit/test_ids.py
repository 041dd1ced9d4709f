"""The id grammar of infra.ids, where msgspec decodes records: ids that could forge a scoped
key, a log line or a terminal escape, or grow without bound, are refused as invalid records."""

from __future__ import annotations

import msgspec
import pytest

from infra.experiments import SCOPE_SEPARATOR
from infra.ids import MAX_ID_LENGTH, is_wire_id
from infra.jsonl import JsonlError, parse
from infra.schema import DiscardGroup, GroupVerdict, InvalidMessage, decode_message, decode_verdict, encode
from prm_pipeline.demo.synthetic import make_group
from scoring_workers.dead_letters import group_of

BAD_IDS = {
    "scope separator": f"exp-a{SCOPE_SEPARATOR}g1",
    "newline": "g1\n2030-01-01 00:00:00,000 ERROR forged",
    "trailing newline": "g1\n",
    "carriage return": "g1\r",
    "ANSI escape": "\x1b[31mred",
    "NUL": "g\x00",
    "DEL": "g\x7f",
    "C1 (CSI)": "g\x9b31m",
    "line separator": "g\u2028x",
    "bidi override": "g\u202ex",
    "zero width": "g\u200bx",
    "too long": "g" * (MAX_ID_LENGTH + 1),
}
GOOD_IDS = ["g1", "group 7 (math)", "grüppe-ß", "数学-1", "a" * MAX_ID_LENGTH, "x:y/z@w#1"]


@pytest.mark.parametrize("good", GOOD_IDS)
def test_printable_ids_pass(good: str) -> None:
    assert is_wire_id(good)
    (member,) = make_group("g", 1, turns=1, output_tokens=2)
    decoded = decode_message(
        *encode(msgspec.structs.replace(member, group_id=good, trajectory_id=good, session_id=good))
    )
    assert (decoded.group_id, decoded.trajectory_id, decoded.session_id) == (good, good, good)


@pytest.mark.parametrize("name", sorted(BAD_IDS))
def test_every_id_of_a_trajectory_record_follows_the_grammar(name: str) -> None:
    bad = BAD_IDS[name]
    assert not is_wire_id(bad)
    (member,) = make_group("g", 1, turns=2, output_tokens=2)
    root, child = member.interactions
    forged = {
        "group_id": msgspec.structs.replace(member, group_id=bad),
        "trajectory_id": msgspec.structs.replace(member, trajectory_id=bad),
        "session_id": msgspec.structs.replace(member, session_id=bad),
        "interaction_id": msgspec.structs.replace(
            member,
            interactions=[
                msgspec.structs.replace(root, interaction_id=bad),
                msgspec.structs.replace(child, parent_id=bad),
            ],
        ),
        "discard group_id": DiscardGroup(group_id=bad),
    }
    for field, message in forged.items():
        with pytest.raises(InvalidMessage, match=r"matching regex|length"):
            decode_message(*encode(message))
        assert field  # every field refused, each on its own
    # a parent is one of the trajectory's interaction ids (the tree check), so it has their grammar
    value, headers = encode(member)
    raw = msgspec.msgpack.decode(value)
    raw["interactions"][1]["parent_id"] = bad
    with pytest.raises(InvalidMessage, match="unknown parent_id"):
        decode_message(msgspec.msgpack.encode(raw), headers)


def test_verdict_ids_follow_the_grammar() -> None:
    for bad in (BAD_IDS["scope separator"], BAD_IDS["newline"]):
        with pytest.raises(InvalidMessage):
            decode_verdict(*encode(GroupVerdict(group_id=bad, status="accepted")))


def test_experiment_ids_are_refused_by_the_decoder_not_only_by_constructors() -> None:
    (member,) = make_group("g", 1, turns=1, output_tokens=2)
    value, headers = encode(member)
    raw = msgspec.msgpack.decode(value)
    raw["experiment_id"] = f"exp-a{SCOPE_SEPARATOR}x"
    with pytest.raises(InvalidMessage):
        decode_message(msgspec.msgpack.encode(raw), headers)


def test_a_jsonl_line_follows_the_grammar() -> None:
    with pytest.raises(JsonlError, match="group_id"):
        parse({"kind": "discard", "group_id": "a\x1fb"})


def test_a_record_key_that_breaks_the_grammar_names_no_group() -> None:
    """An undecodable record's key names its group: a forged one must name none, not another
    experiment's group."""
    assert group_of(b"g1") == "g1"
    for bad in BAD_IDS.values():
        assert group_of(bad.encode()) is None
    assert group_of(b"\xff\xfe") is None and group_of(b"") is None and group_of(None) is None
