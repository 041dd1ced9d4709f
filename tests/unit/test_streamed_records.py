"""The worker's decisions on a streamed session's records, against an in-memory ledger and session store.

Each test hands the worker one poll of ``turn``/``end`` records (``Worker._dispatch``, the
path every record takes; :class:`~scoring_workers.streamed_records.StreamedRecords`
handles them) and asserts what it decided: what it parked, published, dead-lettered and
acknowledged, and which sessions it closed. Redis itself is tests/integration/test_streaming.py's.
"""

from __future__ import annotations

import time
from typing import Any

from infra.schema import Interaction, SessionEnd, SessionTurn, stream_session
from prm_pipeline.demo.synthetic import make_session
from scoring_workers.ledger import DecisionKind, ParkedMember
from scoring_workers.streams import SessionStreams
from scoring_workers.worker import Worker
from tests.fakes.ledger import FakeGroup, FakeLedger
from tests.fakes.producer import FakeProducer
from tests.fakes.session_store import FakeSessionStore
from tests.unit.test_worker import _committable, _member, _poll, _Runner, _worker


class _Samples:
    """Keeps the sessions whose end the online turn samples were told of, with their last turns."""

    def __init__(self) -> None:
        self.sessions: list[tuple[str, str, list[tuple[Interaction, int]]]] = []

    async def ended(self, group: str, end: SessionEnd, leaves: list[tuple[Interaction, int]]) -> None:
        self.sessions.append((group, end.trajectory_id, leaves))


def _streaming(**settings: Any) -> tuple[Worker, FakeLedger, FakeProducer, _Runner, FakeSessionStore, _Samples]:
    worker, ledger, producer, runner = _worker(**settings)
    store, samples = FakeSessionStore(), _Samples()
    worker._attach(ledger, producer, SessionStreams(store), samples)  # type: ignore[arg-type]
    return worker, ledger, producer, runner, store, samples


def _session(group_id: str, tid: str, size: int = 1) -> tuple[list[SessionTurn], SessionEnd]:
    """A session of two turns (the second one's parent is the first) as ``turn`` records and its ``end``."""
    return stream_session(
        make_session(trajectory_id=tid, session_id=f"s-{tid}", group_id=group_id, group_size=size, turns=2)
    )


async def test_a_session_is_parked_turn_by_turn_then_scored_at_its_end_like_a_ready_member() -> None:
    worker, ledger, producer, runner, store, samples = _streaming()
    turns, end = _session("g", "a", size=2)
    await _poll(worker, turns)
    assert len(store.sessions[("g", "a")].turns) == 2 and runner.ran == [] and ledger.called("park") == []
    await _poll(worker, [end], first=2)
    assert runner.ran == ["a"] and producer.sent == []
    parked = ledger.groups["g"].members["a"]
    assert (parked.partition, parked.offset) == (0, 0)  # at its first turn's record: any worker reads it back
    assert store.dropped == [("g", "a")] and [(g, t) for g, t, _ in samples.sessions] == [("g", "a")]
    await _poll(worker, [_member("g", "b")], first=3)
    (verdict,) = producer.verdicts()
    assert verdict.status == "accepted" and sorted(s.trajectory_id for s in verdict.sessions) == ["a", "b"]
    assert _committable(worker) == 4


async def test_a_turn_of_a_member_parked_already_is_acknowledged_and_not_parked_again() -> None:
    worker, ledger, producer, _, store, _ = _streaming()
    ledger.groups["g"] = FakeGroup(2, int(time.time() * 1000) + 60_000)
    ledger.groups["g"].members["a"] = ParkedMember(await worker._score(_member("g", "a", size=2)))
    turns, _ = _session("g", "a", size=2)
    await _poll(worker, turns[:1])
    assert store.sessions == {} and producer.sent == []
    assert worker.telemetry.snapshot()["prm_worker_deduplicated_total"] == 1.0
    assert _committable(worker) == 1


async def test_a_turn_of_a_decided_group_brings_its_sweep_forward_by_the_grace() -> None:
    worker, ledger, producer, _, store, _ = _streaming(republish_grace_s=3.0)
    ledger.groups["g"] = FakeGroup(2, 0, decision=DecisionKind.DISCARD)
    ledger.index["g"] = int(time.time() * 1000) + 600_000
    turns, _ = _session("g", "a", size=2)
    await _poll(worker, turns[:1])
    assert store.sessions == {} and producer.sent == []
    assert ledger.called("nudge") == ["g"] and ledger.index["g"] <= int(time.time() * 1000) + 3_000


async def test_a_turn_that_does_not_continue_its_session_is_dead_lettered_and_rejects_its_group() -> None:
    worker, ledger, producer, _, store, _ = _streaming()
    turns, _ = _session("g", "a", size=2)
    await _poll(worker, turns[1:])  # names a parent the session never had
    assert producer.dead_letters() == [b"g"] and ledger.called("decide:invalid") == ["g"]
    (verdict,) = producer.verdicts()
    assert verdict.status == "rejected" and verdict.reason.startswith("invalid_member")
    assert store.sessions == {}
    assert _committable(worker) == 1


async def test_an_end_parked_before_a_crash_decides_its_group_again_and_closes_its_session() -> None:
    worker, ledger, producer, runner, store, _ = _streaming()
    ledger.groups["g"] = FakeGroup(1, int(time.time() * 1000) + 60_000)
    ledger.groups["g"].members["a"] = ParkedMember(await worker._score(_member("g", "a")))
    runner.ran.clear()
    turns, end = _session("g", "a")
    await _poll(worker, [end])
    assert runner.ran == [] and ledger.called("decide:complete") == ["g"]
    (verdict,) = producer.verdicts()
    assert verdict.status == "accepted"
    assert store.dropped == [("g", "a")]


async def test_an_end_without_its_turns_is_dead_lettered_and_its_session_closed() -> None:
    worker, ledger, producer, runner, store, samples = _streaming()
    _, end = _session("g", "a", size=2)
    await _poll(worker, [end])
    assert runner.ran == [] and producer.dead_letters() == [b"g"]
    (verdict,) = producer.verdicts()
    assert verdict.status == "rejected" and "ended without a turn" in verdict.reason
    assert store.dropped == [("g", "a")] and samples.sessions == []


async def test_a_worker_without_a_session_store_dead_letters_streamed_records() -> None:
    worker, ledger, producer, _ = _worker()
    turns, _ = _session("g", "a", size=2)
    await _poll(worker, turns[:1])
    assert producer.dead_letters() == [b"g"] and ledger.called("decide:invalid") == ["g"]
