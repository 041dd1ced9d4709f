"""Admission and backpressure: which fetched records start now, which wait, when to pause.

The worker runs at most ``concurrency`` records at once: while that many are in flight
every assigned partition is paused. With several experiments each experiment also gets its
fair share of the slots (:func:`scoring_workers.fair_share.slot_caps`): its partitions
are paused while it uses its share, and records it fetched beyond its share wait here —
in consumption order, uncommitted — until it has a free slot again, since a quota caps
records *in flight*, not fetches.

A record counts in flight from its start until its outcome is durable (or its task
ends): :meth:`Admission.count` and :meth:`Admission.release`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from scoring_workers.fair_share import slot_caps
from scoring_workers.fleet import Experiment, Fleet
from scoring_workers.jobs import Job
from scoring_workers.telemetry import WorkerTelemetry


class Admission:
    """The worker's slots: records in flight, per-experiment caps, and the records held back.

    ``start`` starts a held record once its experiment has room (the worker's ``_spawn``,
    which routes it again)."""

    def __init__(
        self, concurrency: int, fleet: Fleet, telemetry: WorkerTelemetry, start: Callable[[Job], None]
    ) -> None:
        self.concurrency = concurrency
        self.fleet = fleet  # replaced when the worker builds its runners (Worker._run)
        self._telemetry = telemetry
        self._start = start
        self.in_flight = 0  # records started and not yet durable
        self._held: dict[str, deque[Job]] = {}  # experiment -> its records waiting for a slot, in order
        self._caps: dict[str, int] = {}  # experiment -> its slots, while several share the worker
        self._counted: dict[Job, Experiment | None] = {}  # in flight -> the experiment whose slot it holds

    @property
    def room(self) -> int:
        """How many more records may start (at least 1: a poll always asks for one)."""
        return max(1, self.concurrency - self.in_flight)

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def apply_backpressure(self, consumer: AIOKafkaConsumer) -> None:
        """Pause every assigned partition while ``concurrency`` records are in flight, and
        with several experiments each experiment's partitions while it uses its fair share.

        Reads the assignment as it is now (a rebalance may have changed it since the
        last poll): partitions assigned while full are paused too, and only partitions
        still ours are resumed.
        """
        full = self.in_flight >= self.concurrency
        experiments = list(self.fleet)
        if len(experiments) == 1 or full:
            if len(experiments) == 1:
                self._caps = {}
            if full:
                if fresh := consumer.assignment() - consumer.paused():
                    consumer.pause(*fresh)
            elif paused := consumer.paused():
                consumer.resume(*paused)
            return
        self._caps = caps = slot_caps(
            self.concurrency,
            {e.experiment_id: e.weight for e in experiments},
            {e.experiment_id: len(e.in_flight) for e in experiments},
            {e.experiment_id: e.max_in_flight for e in experiments},
        )
        over: set[str] = set()
        for e in experiments:
            self._telemetry.experiment_slots.labels(e.experiment_id).set(caps[e.experiment_id])
            self._telemetry.experiment_in_flight.labels(e.experiment_id).set(len(e.in_flight))
            if len(e.in_flight) >= caps[e.experiment_id]:
                over.add(e.trajectories_topic)
        assigned, paused = consumer.assignment(), consumer.paused()
        if fresh := {tp for tp in assigned - paused if tp.topic in over}:
            consumer.pause(*fresh)
        if back := {tp for tp in paused & assigned if tp.topic not in over}:
            consumer.resume(*back)

    def admit(self, jobs: Iterable[Job]) -> tuple[list[Job], list[Job]]:
        """Split a poll's jobs (in consumption order) into those to start now and those held:
        a record of an experiment at its cap, or behind a held record of its experiment, waits."""
        start: list[Job] = []
        held: list[Job] = []
        planned: dict[str, int] = {}  # records of each experiment started by this poll so far
        for job in jobs:
            owner = self.fleet.of_topic(job.record.topic)
            if owner is None:
                start.append(job)
                continue
            if owner.experiment_id in self._held or self._at_cap(owner, planned.get(owner.experiment_id, 0)):
                self._held.setdefault(owner.experiment_id, deque()).append(job)
                held.append(job)
                continue
            planned[owner.experiment_id] = planned.get(owner.experiment_id, 0) + 1
            start.append(job)
        return start, held

    def _at_cap(self, experiment: Experiment, planned: int = 0) -> bool:
        cap = self._caps.get(experiment.experiment_id)
        return cap is not None and len(experiment.in_flight) + planned >= cap

    def release_held(self) -> None:
        """Start held records of experiments that have a free slot again, in order."""
        for experiment_id in list(self._held):
            queue = self._held[experiment_id]
            owner = self.fleet.get(experiment_id)
            while queue and (owner is None or not self._at_cap(owner)):
                self._start(queue.popleft())
            if not queue:
                del self._held[experiment_id]

    def forget_held(self, tps: set[TopicPartition] | None) -> None:
        """Drop held records of ``tps`` (all if None): not started, the next owner reads them again."""
        for experiment_id, queue in list(self._held.items()):
            kept = deque(job for job in queue if tps is not None and job.tp not in tps)
            if kept:
                self._held[experiment_id] = kept
            else:
                del self._held[experiment_id]

    def count(self, job: Job, task: asyncio.Task[Any]) -> None:
        """``job`` runs in ``task``: it counts in flight (in all, and in its topic's experiment's slots)."""
        owner = self.fleet.of_topic(job.record.topic)  # slots are counted per topic's experiment
        if owner is not None:
            owner.in_flight[job] = task
        self._counted[job] = owner
        self.in_flight += 1
        self._telemetry.in_flight.set(self.in_flight)

    def release(self, job: Job) -> None:
        """``job`` no longer counts in flight: its slot is free for the next record."""
        if job not in self._counted:
            return
        owner = self._counted.pop(job)
        self.in_flight -= 1
        self._telemetry.in_flight.set(self.in_flight)
        if owner is not None:
            owner.in_flight.pop(job, None)
            if self._held:
                self.release_held()
