"""The worker's decisions, against an in-memory ledger and producer (tests/fakes).

Each test hands the worker one poll (``Worker._dispatch``, the path every record takes)
and waits for its records' tasks; what it asserts is what the worker decided: which
verdicts it published, which records it dead-lettered, what it asked of the ledger, and
which offsets became committable. Kafka and Redis themselves are the integration tests'.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import msgspec
import pytest
from aiokafka import errors as kerr
from aiokafka.structs import ConsumerRecord, TopicPartition
from redis.exceptions import ConnectionError as RedisConnectionError

from infra.config import PipelineConfig, PRMConfig, WorkerConfig
from infra.offsets import OffsetCommitter
from infra.schema import DiscardGroup, ReadyTrajectory, encode
from prm_pipeline.demo.synthetic import make_session
from scoring_workers.ledger import DecisionKind, ParkedMember
from scoring_workers.prm import BaseScorer, PRMRunner
from scoring_workers.worker import Worker
from tests.fakes.ledger import FakeGroup, FakeLedger
from tests.fakes.producer import FakeProducer

TOPIC = PipelineConfig().topics.trajectories


class _Zero(BaseScorer):
    name = "zero"

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        return 0.0


class _Runner:
    """A real runner (one rule-based scorer) that fails the trajectories in ``fail`` and holds
    those in ``gates`` until their event is set; counts the trajectories it scored."""

    def __init__(self) -> None:
        self.inner = PRMRunner(PRMConfig(scorers=[_Zero()]))
        self.config, self.scorers, self.active = self.inner.config, self.inner.scorers, True
        self.fail: set[str] = set()
        self.gates: dict[str, asyncio.Event] = {}
        self.ran: list[str] = []
        self.entered: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)

    def scorer_infos(self) -> Any:
        return self.inner.scorer_infos()

    async def run(self, trajectory: ReadyTrajectory, **kwargs: Any) -> Any:
        self.ran.append(trajectory.trajectory_id)
        self.entered[trajectory.trajectory_id].set()
        if (gate := self.gates.get(trajectory.trajectory_id)) is not None:
            await gate.wait()
        if trajectory.trajectory_id in self.fail:
            raise RuntimeError("scripted scorer failure")
        return await self.inner.run(trajectory, **kwargs)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _worker(**settings: Any) -> tuple[Worker, FakeLedger, FakeProducer, _Runner]:
    runner, ledger, producer = _Runner(), FakeLedger(), FakeProducer()
    cfg = PipelineConfig(worker=WorkerConfig(**settings))
    worker = Worker(cfg, worker_id="w-unit", runner=runner)  # type: ignore[arg-type]
    worker._attach(ledger, producer)  # type: ignore[arg-type]
    worker._committer = OffsetCommitter(None, owner="w-unit")  # type: ignore[arg-type]  # only its offset tracker
    return worker, ledger, producer, runner


def _member(group_id: str, tid: str, size: int = 2, **kw: Any) -> ReadyTrajectory:
    traj = make_session(
        trajectory_id=tid, session_id=f"s-{tid}", group_id=group_id, group_size=size, turns=1, output_tokens=4
    )
    return msgspec.structs.replace(traj, **kw) if kw else traj


def _records(messages: list[Any], first: int = 0) -> list[ConsumerRecord]:
    out = []
    for offset, message in enumerate(messages, first):
        if isinstance(message, bytes):  # an undecodable record, keyed by its group
            value, headers, key = message, [], b"g"
        else:
            (value, headers), key = encode(message), message.group_id.encode()
        out.append(ConsumerRecord(TOPIC, 0, offset, 0, 0, key, value, None, len(key), len(value), headers))
    return out


async def _poll(worker: Worker, messages: list[Any], *, first: int = 0) -> None:
    """Hand the worker one poll and wait until each of its records' tasks has ended."""
    await worker._dispatch(_records(messages, first))
    while worker._tasks:
        await asyncio.wait(list(worker._tasks))


def _committable(worker: Worker) -> int | None:
    return worker._committer.tracker.committable().get(TopicPartition(TOPIC, 0))


async def test_the_member_that_completes_its_group_publishes_one_verdict_and_finishes_it() -> None:
    worker, ledger, producer, runner = _worker()
    await _poll(worker, [_member("g", "a"), _member("g", "b")])
    (verdict,) = producer.verdicts()
    assert verdict.status == "accepted"
    assert sorted(s.trajectory_id for s in verdict.sessions) == ["a", "b"]
    assert sorted(runner.ran) == ["a", "b"] and "g" in ledger.done and "g" not in ledger.index
    assert _committable(worker) == 2


async def test_a_redelivered_member_is_not_scored_again_and_its_group_is_decided() -> None:
    """Both members were parked when the previous owner died before deciding: the redelivered
    record re-runs the ``complete`` decision instead of being scored again."""
    worker, ledger, producer, runner = _worker()
    ledger.groups["g"] = FakeGroup(2, int(time.time() * 1000) + 60_000)
    for tid in ("a", "b"):
        ledger.groups["g"].members[tid] = ParkedMember(await worker._score(_member("g", tid)))
    runner.ran.clear()
    await _poll(worker, [_member("g", "b")])
    assert runner.ran == []
    assert ledger.called("decide:complete") == ["g"]
    (verdict,) = producer.verdicts()
    assert verdict.status == "accepted" and len(verdict.sessions) == 2
    assert worker.telemetry.snapshot()["prm_worker_deduplicated_total"] == 1.0


async def test_a_member_of_a_decided_group_is_acknowledged_and_its_sweep_brought_forward() -> None:
    worker, ledger, producer, runner = _worker(republish_grace_s=3.0)
    await _poll(worker, [DiscardGroup(group_id="g")])
    producer.sent.clear()
    ledger.done.clear()  # decided, not finished: as if its verdict never went out
    ledger.groups["g"] = FakeGroup(2, 0, decision=DecisionKind.DISCARD)
    ledger.index["g"] = int(time.time() * 1000) + 600_000
    await _poll(worker, [_member("g", "a")], first=1)
    assert runner.ran == [] and producer.sent == []
    assert ledger.called("nudge") == ["g"] and ledger.index["g"] <= int(time.time() * 1000) + 3_000
    assert _committable(worker) == 2


async def test_a_discard_waits_for_the_member_before_it_and_its_verdict_lists_it() -> None:
    worker, ledger, producer, runner = _worker()
    runner.gates["a"] = gate = asyncio.Event()
    poll = asyncio.create_task(_poll(worker, [_member("g", "a", size=3), DiscardGroup(group_id="g", reason="r")]))
    await asyncio.wait_for(runner.entered["a"].wait(), 10)  # held at its gate: the discard ran up to its wait
    gate.set()
    await poll
    (verdict,) = producer.verdicts()
    assert verdict.status == "discarded"
    assert [s.trajectory_id for s in verdict.sessions] == ["a"]  # parked before the discard decided


async def test_a_failed_member_waits_for_the_members_before_it_so_the_rejection_lists_them() -> None:
    worker, ledger, producer, runner = _worker()
    runner.gates["a"] = gate = asyncio.Event()
    runner.fail.add("b")
    poll = asyncio.create_task(_poll(worker, [_member("g", "a", size=3), _member("g", "b", size=3)]))
    await asyncio.wait_for(runner.entered["b"].wait(), 10)  # b failed while a is held at its gate
    gate.set()
    await poll
    (verdict,) = producer.verdicts()
    assert verdict.status == "rejected"
    assert sorted(s.trajectory_id for s in verdict.sessions) == ["a", "b"]


async def test_a_member_behind_a_discard_sees_its_decision_and_is_not_scored() -> None:
    worker, ledger, producer, runner = _worker()
    await _poll(worker, [DiscardGroup(group_id="g"), _member("g", "a")])
    assert runner.ran == []
    (verdict,) = producer.verdicts()
    assert verdict.status == "discarded" and verdict.sessions == []
    assert _committable(worker) == 2


async def test_an_undecodable_record_is_dead_lettered_and_the_group_its_key_names_rejected() -> None:
    worker, ledger, producer, _ = _worker()
    await _poll(worker, [b"\xff not msgpack"])
    assert producer.dead_letters() == [b"g"]
    assert ledger.called("decide:invalid") == ["g"]
    (verdict,) = producer.verdicts()
    assert verdict.status == "rejected" and verdict.reason.startswith("invalid_member")
    assert _committable(worker) == 1


async def test_a_record_naming_another_experiment_is_dead_lettered_in_its_topics_experiment() -> None:
    worker, _, producer, runner = _worker()
    await _poll(worker, [_member("g", "a", experiment_id="nope")])
    assert runner.ran == [] and producer.dead_letters() == [b"g"]  # the topic is the tenant: never scored
    (verdict,) = producer.verdicts()
    assert (verdict.status, verdict.reason_code) == ("rejected", "invalid_member")
    assert "ExperimentMismatch" in verdict.reason and verdict.experiment_id in (None, "", "default")


async def test_a_transient_park_error_is_retried_without_scoring_again() -> None:
    worker, ledger, producer, runner = _worker()
    ledger.fail["park"] = [RedisConnectionError("injected outage")]
    await _poll(worker, [_member("g", "a", size=1)])
    assert runner.ran == ["a"] and ledger.called("park") == ["g", "g"]
    (verdict,) = producer.verdicts()
    assert verdict.status == "accepted"
    assert worker.telemetry.snapshot()["prm_worker_retries_total{error=ConnectionError}"] == 1.0


async def test_a_verdict_kafka_refuses_for_good_stays_decided_for_the_sweeper() -> None:
    worker, ledger, producer, _ = _worker(republish_grace_s=9.0)
    producer.fail.append(kerr.TopicAuthorizationFailedError())
    await _poll(worker, [_member("g", "a", size=1)])
    assert producer.verdicts() == []
    assert ledger.called("postpone") == ["g"] and "g" in ledger.groups and "g" not in ledger.done
    assert _committable(worker) == 1  # its outcome is durable: decided in the ledger


@pytest.mark.parametrize(("decided_s_ago", "republished"), [(60.0, True), (0.0, False)])
async def test_the_sweeper_republishes_a_decision_only_after_the_grace(decided_s_ago: float, republished: bool) -> None:
    worker, ledger, producer, _ = _worker(republish_grace_s=5.0)
    now = int(time.time() * 1000)
    ledger.groups["g"] = FakeGroup(2, now, decision=DecisionKind.COMPLETE, decided_at=now - int(decided_s_ago * 1000))
    ledger.index["g"] = now - 1
    await worker.sweeper.sweep()
    assert len(producer.verdicts()) == (1 if republished else 0)
    assert ("g" in ledger.done) is republished


async def test_the_sweeper_rejects_an_overdue_group_with_the_members_it_has() -> None:
    worker, ledger, producer, _ = _worker()
    await _poll(worker, [_member("g", "a", size=2)])
    ledger.groups["g"].deadline = ledger.index["g"] = int(time.time() * 1000) - 1
    await worker.sweeper.sweep()
    (verdict,) = producer.verdicts()
    assert verdict.status == "rejected" and [s.trajectory_id for s in verdict.sessions] == ["a"]
    assert ledger.called("decide:deadline") == ["g"] and "g" in ledger.done
