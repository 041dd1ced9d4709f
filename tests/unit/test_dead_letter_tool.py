"""The redrive plan (pure): what is republished, what is skipped and why, and the selectors."""

from __future__ import annotations

import argparse

import pytest

from infra.schema import DeadLetter, DiscardGroup, TrajectoryChunk, encode, stream_session
from prm_pipeline.dead_letter_tool import (
    LetterRecord,
    Selection,
    parse_offsets,
    plan_redrive,
)
from prm_pipeline.demo.synthetic import make_group


def _letter(
    offset: int,
    message=None,
    *,
    key: bytes | None = None,
    error_class: str = "UnknownSchemaVersion",
    payload: bytes | None = None,
    original_size: int = -1,
    source_topic: str = "traj",
) -> LetterRecord:
    value, headers = encode(message) if message is not None else (b"\x00garbage", [])
    letter = DeadLetter(
        payload=payload if payload is not None else value,
        error_class=error_class,
        error_message="why",
        source_topic=source_topic,
        source_partition=1,
        source_offset=100 + offset,
        attempt=1,
        worker_id="w",
        original_headers={k: v.decode() for k, v in headers},
        original_size=original_size,
    )
    return LetterRecord("dlq", 0, offset, 0, key, letter)


def test_plan_skips_what_a_redrive_cannot_help_and_repeats_within_a_run() -> None:
    (a,) = make_group("g-a", 1, turns=1, output_tokens=2)
    (b,) = make_group("g-b", 1, turns=1, output_tokens=2)
    value, _ = encode(b)
    records = [
        _letter(0, a),
        _letter(1, a),  # the same trajectory again
        _letter(2, b, payload=value[:10], original_size=len(value)),  # cut when dead-lettered
        _letter(3, None, error_class="InvalidMessage"),  # still undecodable
        _letter(4, DiscardGroup(group_id="g-d", reason="r")),
        _letter(5, b, key=b"g-b", error_class="ProcessingError"),
    ]
    plan = plan_redrive(records, Selection())
    assert [e.redrive for e in plan] == [True, False, False, False, True, True]
    assert "already redriven from dlq:0@0" in plan[1].why_skipped
    assert "cut to 10 of" in plan[2].why_skipped and "traj:1@102" in plan[2].why_skipped
    assert "still cannot decode" in plan[3].why_skipped
    assert plan[0].note == ""  # key-less and undecodable when dead-lettered: no group was rejected
    assert "rejected group g-b (invalid_member)" in plan[5].note
    assert "discard of group g-d" in plan[4].describe() and plan[0].describe().startswith("redrive dlq:0@0: trajectory")


def test_selectors_and_together_and_or_within_a_kind() -> None:
    (a,) = make_group("g-a", 1, turns=1, output_tokens=2)
    (b,) = make_group("g-b", 1, turns=1, output_tokens=2)
    records = [_letter(0, a), _letter(1, b, error_class="ProcessingError"), _letter(2, b)]
    chosen = lambda sel: [e.record.offset for e in plan_redrive(records, sel)]  # noqa: E731
    assert chosen(Selection(reasons=frozenset({"ProcessingError", "UnknownSchemaVersion"}))) == [0, 1, 2]
    assert chosen(Selection(reasons=frozenset({"UnknownSchemaVersion"}), groups=frozenset({"g-b"}))) == [2]
    assert chosen(Selection(trajectories=frozenset({a.trajectory_id}))) == [0]
    assert chosen(Selection(offsets=frozenset({(0, 1), (0, 2)}))) == [1, 2]


def test_offsets_argument() -> None:
    assert parse_offsets("0:12, 1:4") == {(None, 0, 12), (None, 1, 4)}
    with pytest.raises(argparse.ArgumentTypeError, match="PARTITION:OFFSET"):
        parse_offsets("12")


def test_offsets_argument_takes_the_dead_letter_field_as_printed() -> None:
    """The listing's ``dead_letter`` field (``topic:partition@offset``) is what --offsets takes."""
    assert parse_offsets("prm.dead-letters:3@0,2@7") == {("prm.dead-letters", 3, 0), (None, 2, 7)}
    assert parse_offsets("my.dl-topic.v2:0:5") == {("my.dl-topic.v2", 0, 5)}
    for bad in ("prm.dead-letters:3", "prm.dead-letters@0", "a:b@c", "3@"):
        with pytest.raises(argparse.ArgumentTypeError, match="TOPIC:PARTITION@OFFSET"):
            parse_offsets(bad)


def test_the_plan_shows_the_records_text_escaped() -> None:
    hostile = "g-1\n2030-01-01 00:00:00,000 ERROR forged\x1b[31m\u202e"
    (member,) = make_group(hostile, 1, turns=1, output_tokens=2)
    plan = plan_redrive(
        [_letter(0, member, key=hostile.encode()), _letter(1, None, error_class="InvalidMessage")], Selection()
    )
    for entry in plan:
        line = entry.describe()
        assert line.splitlines() == [line] and "\x1b" not in line and "\u202e" not in line
    assert "undecodable record" in plan[0].describe()  # the id grammar refuses such a group id: it names no group


def test_an_unknown_experiment_is_the_letters_topic_not_a_field_of_its_payload() -> None:
    """A record of an undeclared experiment names it by its topic: its payload may name none (a
    ready record on its experiment's topic) or cannot (the first chunk of a chunked trajectory,
    the record a worker dead-letters for it); the plan names the topic's experiment either way."""
    (member,) = make_group("g-a", 1, turns=1, output_tokens=2)
    chunk = TrajectoryChunk(group_id="g-c", trajectory_id="t-c", index=0, count=2, total_bytes=2, data=memoryview(b"x"))
    records = [
        _letter(0, member, key=b"g-a", error_class="UnknownExperiment", source_topic="traj.exp7"),
        _letter(1, chunk, key=b"g-c", error_class="UnknownExperiment", source_topic="traj.exp7"),
    ]
    plan = plan_redrive(records, Selection(trajectories_base="traj"))
    assert [e.redrive for e in plan] == [True, True]
    for entry, group in zip(plan, ("g-a", "g-c")):
        assert f"rejected group {group} (unknown_experiment)" in entry.note
        assert "once experiment 'exp7' is declared" in entry.note and entry.experiment == "exp7"


def _streamed(group: str) -> tuple[list, object]:
    (member,) = make_group(group, 1, turns=2, output_tokens=2)
    return stream_session(member)


def test_a_streamed_sessions_turn_and_end_are_described_not_undecodable() -> None:
    """``turn`` and ``end`` records (a streamed session) decode: the listing names their kind,
    group and trajectory (and a turn's interaction), as for a ready record; a chunk is a chunk."""
    (turn, _), end = _streamed("g-s")
    chunk = TrajectoryChunk(group_id="g-c", trajectory_id="t-c", index=0, count=2, total_bytes=2, data=memoryview(b"x"))
    rows = [_letter(i, m, key=m.group_id.encode()).to_json() for i, m in enumerate((turn, end, chunk))]
    for row in rows:
        assert "decode_error" not in row, row
    assert [r["kind"] for r in rows] == ["turn", "end", "chunk"]
    assert [r["group_id"] for r in rows] == ["g-s", "g-s", "g-c"]
    assert [r["trajectory_id"] for r in rows] == [turn.trajectory_id, end.trajectory_id, "t-c"]
    assert rows[0]["interaction_id"] == turn.interaction.interaction_id and rows[2]["chunk"] == "0/2"


def test_turn_and_end_letters_are_chosen_by_trajectory_and_planned_one_by_one() -> None:
    """``--trajectory`` matches a streamed session's records by their trajectory id; each turn and
    the end is its own record to redrive (a repeat of one of them is skipped, not its siblings)."""
    (t0, t1), end = _streamed("g-s")
    (other,) = make_group("g-o", 1, turns=1, output_tokens=2)
    records = [
        _letter(0, t0, key=b"g-s", error_class="ProcessingError"),
        _letter(1, t1, key=b"g-s", error_class="ProcessingError"),
        _letter(2, end, key=b"g-s", error_class="ProcessingError"),
        _letter(3, t1, key=b"g-s", error_class="ProcessingError"),  # the same turn again
        _letter(4, other, key=b"g-o", error_class="ProcessingError"),
    ]
    plan = plan_redrive(records, Selection(trajectories=frozenset({end.trajectory_id})))
    assert [e.record.offset for e in plan] == [0, 1, 2, 3]
    assert [e.redrive for e in plan] == [True, True, True, False]
    assert "already redriven from dlq:0@1" in plan[3].why_skipped
    assert {e.trajectory_id for e in plan} == {end.trajectory_id} and {e.group_id for e in plan} == {"g-s"}
    assert f"turn {t0.interaction.interaction_id} of trajectory {t0.trajectory_id} of group g-s" in plan[0].describe()
    assert f"end of trajectory {end.trajectory_id} of group g-s" in plan[2].describe()
    assert "rejected group g-s (invalid_member)" in plan[2].note
    by_group = plan_redrive(records, Selection(groups=frozenset({"g-s"})))
    assert [e.record.offset for e in by_group] == [0, 1, 2, 3]
