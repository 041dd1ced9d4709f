"""Admission and backpressure (scoring_workers/admission.py): when the worker pauses which
partitions, which fetched records wait, and when they start — with a stand-in fleet and
consumer (the pausing itself is aiokafka's; tests/integration/test_fleet.py runs it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from aiokafka.structs import ConsumerRecord, TopicPartition

from infra.schema import DiscardGroup
from scoring_workers.admission import Admission
from scoring_workers.fleet import Experiment
from scoring_workers.jobs import DiscardJob, Job, Routed
from scoring_workers.telemetry import WorkerTelemetry


class _Fleet:
    def __init__(self, *ids: str) -> None:
        self.experiments = {e: Experiment(e, None, b"", 60.0, trajectories_topic=f"t-{e}") for e in ids}

    def __iter__(self) -> Iterator[Experiment]:
        return iter(self.experiments.values())

    def get(self, experiment_id: str) -> Experiment | None:
        return self.experiments.get(experiment_id)

    def of_topic(self, topic: str) -> Experiment | None:
        return self.experiments.get(topic.removeprefix("t-"))


class _Consumer:
    def __init__(self, *topics: str) -> None:
        self._assigned = {TopicPartition(t, 0) for t in topics}
        self._paused: set[TopicPartition] = set()

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def pause(self, *tps: TopicPartition) -> None:
        self._paused |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self._paused -= set(tps)

    def paused_topics(self) -> set[str]:
        return {tp.topic for tp in self._paused}


def _job(experiment_id: str, offset: int) -> Job:
    record = ConsumerRecord(f"t-{experiment_id}", 0, offset, 0, 0, b"g", b"", None, 1, 0, [])
    return DiscardJob(record=record, route=Routed(experiment_id, None, None), message=DiscardGroup(group_id="g"))


def _admission(concurrency: int, *ids: str) -> tuple[Admission, list[Job]]:
    """An admission whose ``start`` counts the record in flight at once, as the worker's does."""
    started: list[Job] = []

    def start(job: Job) -> None:
        started.append(job)
        admission.count(job, _task())

    admission = Admission(concurrency, _Fleet(*ids), WorkerTelemetry(), start)  # type: ignore[arg-type]
    return admission, started


def _task() -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_future()  # type: ignore[return-value]  # only kept, never awaited


async def test_one_experiment_pauses_everything_while_full_and_resumes_when_a_slot_frees() -> None:
    admission, _ = _admission(2, "a")
    consumer = _Consumer("t-a")
    jobs = [_job("a", i) for i in range(2)]
    for job in jobs:
        admission.count(job, _task())
    admission.apply_backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.paused_topics() == {"t-a"} and admission.room == 1
    admission.release(jobs[0])
    admission.release(jobs[0])  # released once only
    assert admission.in_flight == 1
    admission.apply_backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.paused_topics() == set()


async def test_an_experiment_at_its_share_is_paused_and_its_fetched_records_wait_in_order() -> None:
    admission, started = _admission(4, "a", "b")
    consumer = _Consumer("t-a", "t-b")
    running = [_job("a", i) for i in range(3)]
    for job in running:
        admission.count(job, _task())
    admission.apply_backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.paused_topics() == {"t-a"}  # a uses its share (3 of 4: one kept for the idle b)
    late_a, late_a2, b = _job("a", 3), _job("a", 4), _job("b", 0)
    start, held = admission.admit([late_a, b, late_a2])
    assert (start, held) == ([b], [late_a, late_a2]) and admission.holding
    admission.release(running[0])  # a slot of a frees: its first held record starts, the next still waits
    assert started == [late_a] and admission.in_flight == 3
    admission.forget_held({TopicPartition("t-a", 0)})  # revoked: the next owner reads it again
    assert not admission.holding
