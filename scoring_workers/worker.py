"""The scoring worker: ``prm.trajectories`` in, ``prm.verdicts`` (and dead letters) out.

The whole consume/score/park/decide/commit loop is one module, like arq's worker: its
steps share the commit discipline below.

One asyncio loop per process: poll, decode the poll into typed jobs, start its work,
commit what is finished, sweep deadlines. Run several processes for scale; they share
nothing but Kafka and Redis.

Per poll: one partition's members that need only scoring and parking — the common case —
are one task. They are scored in turn in that task (a scorer that finishes without
waiting costs no task of its own), parked in one ledger call, and the verdicts they decide
are produced together; each record is finished as its outcome lands. Every other record
(a discard, an invalid record, a redelivered member, a member behind a discard, a member
of an experiment whose scoring waits on a judge) takes a task of its own, and so does
any record of a batch that fails on the way (it is retried on its own).

Per record (see docs/architecture.md):

1. decode — chunks of a large trajectory are buffered until the last one arrives
   (:mod:`scoring_workers.chunked`; their offsets are finished with the trajectory);
   undecodable, unknown-version or invalid records go to the dead-letter
   topic with the reason in headers (capped so the whole dead letter fits the size
   limit); when the record's key names its group, the group is rejected at once
   (``invalid_member``) instead of waiting for its deadline;
2. pre-check the ledger for the whole poll in one round trip — duplicates and members
   of decided groups are acknowledged without scoring — but only records a previous
   owner of their partition may have read (below the partition's highwater as first
   known after the assignment, :mod:`scoring_workers.probe_marks`); later records go
   straight to scoring, their park re-checks atomically;
3. score with :class:`PRMRunner` under ``worker.scorer_timeout_s``; a failure parks a
   failed member, which rejects the group at once — after the group's members consumed
   before it have parked (in a poll's batch, after every member of the batch that
   scored), so they are listed with their stats;
4. park the result; whoever parks the last member decides the group and publishes
   the verdict; once Kafka acknowledged it the record is released and the group's
   finish (drop its hash, remember it as done) rides along with the next ledger call. A verdict over
   ``kafka.max_message_bytes`` names its members' records instead of carrying their
   token turns (``worker.verdict_tokens: auto``, the default); with ``inline``, or when
   even that does not fit, it is published as ``rejected`` / ``verdict_too_large``
   (stats kept, token turns dropped) — it never blocks. A ``DiscardGroup`` decides its
   group once the members consumed before it have parked, so the discarded verdict
   lists them.

Errors: transient ones (Redis outages, Kafka errors aiokafka flags retriable, broker
timeouts — :func:`infra.kafka.is_retriable`) are retried with bounded backoff and
counted; permanent Kafka errors (:func:`infra.kafka.is_permanent`) are never retried in
a loop: a dead letter that cannot be written is logged with the record's coordinates
and counted (``prm_worker_poison_total``), a verdict that cannot be written stays decided
in Redis for the sweeper.

Commit discipline: an offset is committed only when its outcome (parked result,
verdict or dead letter) is durable, and per partition only up to the lowest unfinished
offset. Scoring runs in tasks, so polling (and the consumer's liveness) never waits on
a slow scorer; when ``concurrency`` records are in flight the partitions are paused.
A background sweeper rejects groups whose deadline passed (``missing_sessions``) and
re-publishes decisions whose publisher died before finishing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgspec
from aiokafka import ConsumerRebalanceListener
from aiokafka.structs import ConsumerRecord, TopicPartition

from infra import reasons
from infra.config import PipelineConfig
from infra.experiments import DEFAULT_EXPERIMENT, UnknownExperiment, scoped_group, split_scoped, verdicts_topic
from infra.kafka import is_permanent, is_retriable, make_consumer, make_producer
from infra.offsets import OffsetCommitter
from infra.redis import verify_access
from infra.registry import RegistryFollower, RegistryRecord
from infra.retry import RetryPolicy
from infra.schema import (
    DiscardGroup,
    GroupVerdict,
    NotConcatExport,
    ReadyTrajectory,
    SchemaError,
    SessionResult,
    TrajectoryChunk,
    check_expandable,
    compact_turns,
    dead_letter_headers,
    decode_message,
)
from infra.throttle import LogThrottle
from scoring_workers.chunked import WorkerChunks
from scoring_workers.dead_letters import ProcessingError, capped_letter, group_of
from scoring_workers.eager import Resume
from scoring_workers.fair_share import slot_caps
from scoring_workers.fleet import Experiment, Fleet
from scoring_workers.heartbeat import Heartbeat
from scoring_workers.ledger import TRANSIENT_ERRORS, Decision, DecisionKind, GroupLedger, Outcome, ParkRequest
from scoring_workers.prm import ScoringRunner
from scoring_workers.probe_marks import ProbeMarks
from scoring_workers.scorer_report import log_scorers
from scoring_workers.scoring import score_member
from scoring_workers.telemetry import WorkerTelemetry
from scoring_workers.tokens import MemberTokens
from scoring_workers.verdicts import assemble_verdict, fit_verdict

log = logging.getLogger(__name__)

# Retried with backoff for as long as they last (the record stays uncommitted): an
# outage must delay work, never dead-letter valid records. A full Redis (noeviction)
# or one loading its AOF after a restart is an outage too.
REDIS_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = TRANSIENT_ERRORS
LAG_INTERVAL_S = 5.0  # how often the consumer-lag gauge is refreshed
POLL_TIMEOUT_S = 0.1  # a poll's wait while records are in flight (or held, buffered, paused)
IDLE_POLL_S = 0.5  # an idle poll waits until the next sweep, at most this long
REGISTRY_POLL_MS = 2000  # the registry follower's poll (it returns as soon as a record arrives)
UNKNOWN_LABEL = "unknown"  # the experiment label of records from the topic of an experiment no longer served


class Routed(msgspec.Struct, frozen=True):
    """Where a record belongs: its experiment (None: not served here) and its scoped group key."""

    experiment_id: str
    experiment: Experiment | None
    scoped: str | None  # scoped_group(experiment_id, group_id); None when the record names no group


class JobKind(Enum):
    """What a fetched record is: decided once, when its poll is decoded."""

    READY = "ready"  # a ReadyTrajectory (a chunked one with its last chunk)
    DISCARD = "discard"  # a DiscardGroup
    INVALID = "invalid"  # did not decode, or broke a schema rule: a dead letter


@dataclass(slots=True, eq=False)
class Job:
    """One fetched record, decoded once into what the worker does with it.

    ``extra``: offsets of the other chunks of a chunked trajectory (same partition),
    finished with it; ``probe``: what the ledger said before scoring (None: ask when it
    starts); ``earlier``: the in-flight members of its group consumed before it (a failed
    member waits for them before it parks); ``attempt``: the current attempt; ``result``:
    its scoring result once scored (a poll's batch that falls back to this record alone
    parks it without scoring it again)."""

    kind: JobKind
    record: ConsumerRecord
    message: ReadyTrajectory | DiscardGroup | SchemaError
    route: Routed
    extra: list[int]
    consumed_at: float
    probe: Outcome | None = None
    earlier: tuple[asyncio.Future[Any], ...] = ()
    attempt: int = 0
    result: SessionResult | None = None
    slots: dict[Any, asyncio.Task[None]] | None = None  # while counted in flight: its experiment's slots
    counted: bool = False  # counted in the worker's records in flight

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.record.topic, self.record.partition)


class Step(Enum):
    """Which ledger call an answer came from (:meth:`Worker._settle`)."""

    PROBE = "probe"  # before scoring
    PARK = "park"  # the member's park
    DECIDE = "decide"  # a decision (a discard, a dead letter, a redelivered last member)
    SWEEP = "sweep"  # the sweeper's deadline decision


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def is_transient(exc: BaseException) -> bool:
    """An outage worth waiting for: Redis unavailable/loading/full, or a retriable Kafka or network error."""
    return isinstance(exc, REDIS_TRANSIENT_ERRORS) or is_retriable(exc)


# A record's transient errors are retried with jittered backoff (workers hit by one outage
# do not retry in step); a plumbing call's (:meth:`Worker._with_retry`) without jitter.
RECORD_RETRY = RetryPolicy(retryable=is_transient)
CALL_RETRY = RetryPolicy(retryable=is_transient, jitter=False)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.worker._marks.forget(revoked)  # whoever owns them next learns its own marks
        await self.worker._drain_partitions(set(revoked))
        for tp in revoked:  # no stale lag series for partitions another member now owns
            with contextlib.suppress(KeyError):
                self.worker.telemetry.lag.remove(tp.topic, str(tp.partition))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.worker.telemetry.ready = True  # joined the group (even with nothing assigned)
        self.worker._marks.forget(assigned)  # learnt again from the first fetch of this assignment
        log.info("worker %s assigned %s", self.worker.worker_id, sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))


class Worker:
    """One scoring worker process. ``await Worker(cfg).run(stop_event)``."""

    def __init__(self, cfg: PipelineConfig, *, worker_id: str | None = None,
                 concurrency: int | None = None, runner: ScoringRunner | None = None) -> None:
        self.cfg = cfg
        self.worker_id = worker_id or default_worker_id()
        self.concurrency = concurrency or cfg.worker.concurrency
        self.telemetry = WorkerTelemetry()
        self._runner = runner
        self._owns_runner = runner is None
        self._tasks: dict[asyncio.Task[None], TopicPartition] = {}
        self._in_flight = 0  # records in the tasks, until each one's outcome is durable
        self._discards: dict[str, asyncio.Task[None]] = {}  # scoped group -> in-flight DiscardGroup
        self._members: dict[str, set[asyncio.Task[None]]] = {}  # scoped group -> in-flight members
        self.fleet = Fleet(cfg, runner)
        self._registry: RegistryFollower | None = None
        # Fetched records of an experiment at its slot cap wait here (in consumption order,
        # uncommitted) until it has a free slot: a quota caps records *in flight*, not fetches.
        self._held: dict[str, deque[Job]] = {}
        self._caps: dict[str, int] = {}
        self._tokens = MemberTokens(cfg)
        self._chunks = WorkerChunks()
        self._marks = ProbeMarks()
        self._waits: set[str] = set()  # experiments whose scoring waited once: their records take a task each
        self._committing: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        self._duplicates_log = LogThrottle(log, burst=20, window_s=60.0)  # duplicates are normal, but say so

    # ------------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        cfg = self.cfg
        if cfg.worker.metrics_port is not None:  # health first: scorer start-up may be slow
            self.metrics_port = self.telemetry.serve(cfg.worker.metrics_port)
        heartbeat = asyncio.create_task(self._heartbeat(stop))
        try:
            await self._run(stop)
        finally:
            heartbeat.cancel()
            self.telemetry.ready = False
            self.telemetry.close()

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        """Liveness = the event loop runs (not: Kafka and Redis answer); readiness ends at stop.
        A ready worker also beats in Redis (scoring_workers/heartbeat.py) and leaves at stop."""
        beats = Heartbeat(self.worker_id)
        while True:
            self.telemetry.tick()
            if stop.is_set():
                self.telemetry.ready = False
            ledger = getattr(self, "ledger", None)
            await beats.step(ledger and ledger.view, ready=self.telemetry.ready, stopping=stop.is_set())
            if stop.is_set():
                await asyncio.sleep(1.0)
            else:  # wake at stop: leave the heartbeat set while the ledger is still open
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), beats.wait_s(ready=self.telemetry.ready))

    async def _run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        if self._runner is None and cfg.prm.active:
            from scoring_workers.judge.hosts import judge_hosts_allowed
            from scoring_workers.prm import PRMRunner

            with judge_hosts_allowed(cfg.worker.allowed_judge_hosts):  # no judge client outside the list
                self._runner = await PRMRunner.create(cfg.prm, allowed_prefixes=cfg.worker.allowed_scorer_modules)
        log_scorers(log, self.worker_id, self._runner, self._runner.config if self._runner is not None else cfg.prm)
        self.fleet = Fleet(cfg, self._runner, on_refused=lambda _e, _why: self.telemetry.registry_records.labels(
            "refused").inc())
        self.ledger = GroupLedger.from_config(cfg.redis, dedupe_window_s=cfg.worker.dedupe_window_s)
        self.ledger.on_finish_error = lambda exc: self.telemetry.finish_failures.labels(type(exc).__name__).inc()
        try:
            await verify_access(self.ledger.redis, cfg.redis)  # wrong credentials / untrusted TLS: stop, clearly
        except BaseException:
            await self.ledger.aclose()
            if self._owns_runner and self._runner is not None:
                await self._runner.aclose()
            raise
        self.producer = make_producer(cfg.kafka)
        self.consumer = make_consumer(cfg.kafka, group_id=cfg.worker.group_id)
        self._committer = OffsetCommitter(self.consumer, owner=f"worker {self.worker_id}",
                                          on_failure=lambda exc: self.telemetry.commit_failures.labels(
                                              type(exc).__name__).inc(),
                                          min_interval_s=cfg.worker.commit_interval_s)
        await self.producer.start()
        self._registry = RegistryFollower(cfg)
        try:
            # Every declared experiment is known before the first trajectory is read; one
            # removed longer ago than its group timeout is not served again (Fleet.settle).
            await self._registry.start()
            for entry in self.fleet.settle(await self._registry.catch_up()):
                await self._apply_registry(entry)
            self.fleet.expire()
            self._subscribe()
            if not await _unless_stopped(self.consumer.start(), stop):
                await self.consumer.stop()
                return  # stopped while joining: nothing consumed, nothing to commit
            try:
                await self._loop(stop)
            finally:
                await self._drain_partitions(None)
                await self.consumer.stop()
        finally:
            await self._registry.aclose()
            await self.fleet.aclose()
            await self.producer.stop()
            await self.ledger.aclose()
            await self._tokens.aclose()
            if self._owns_runner and self._runner is not None:
                await self._runner.aclose()
            log.info("worker %s stopped: %s", self.worker_id, self.telemetry.snapshot())

    async def _loop(self, stop: asyncio.Event) -> None:
        next_sweep = last_lag = 0.0
        sweeper: asyncio.Task[None] | None = None
        lag: asyncio.Task[None] | None = None
        registry: asyncio.Task[None] | None = None
        self.ready.set()
        log.info("worker %s polling %s", self.worker_id, self.cfg.topics.trajectories)
        while not stop.is_set():
            self._apply_backpressure()
            self._release_held()
            room = max(1, self.concurrency - self._in_flight)
            batch = await self.consumer.getmany(
                timeout_ms=self._poll_timeout_ms(next_sweep), max_records=min(room, self.cfg.worker.poll_max_records)
            )
            records = [r for rs in batch.values() for r in rs]
            # the first highwater known since the assignment: no previous owner read at or past it
            self._marks.learn(self.consumer.assignment(), self.consumer.highwater)
            if records:
                await self._dispatch(records)
            # Background steps: polling never waits for them, a rebalance may land at any of
            # their awaits, and one that fails is logged and counted and runs again later.
            if (self._committing is None or self._committing.done()) and not self._committer.busy \
                    and self._committer.due:
                self._committing = self._background("commit", self._committer.commit(routine=True))
            now = time.monotonic()
            if now >= next_sweep and (sweeper is None or sweeper.done()):
                sweeper = self._background("sweep", self._sweep())
                next_sweep = now + self.cfg.worker.sweep_interval_s * random.uniform(0.8, 1.2)
                for record, error, extra in self._chunks.expired(self.cfg.worker.group_timeout_s):
                    self._spawn(self._job(record, error, extra, time.time()))
            if now - last_lag >= LAG_INTERVAL_S and (lag is None or lag.done()):
                lag = self._background("lag", self._update_lag())
                last_lag = now
            if registry is None or registry.done():
                registry = self._background("registry", self._follow_registry())
        log.info("worker %s stopping: draining %d in-flight records", self.worker_id, self._in_flight)
        if registry is not None:
            registry.cancel()
        for step in (sweeper, lag):
            if step is not None:
                await asyncio.wait([step])  # its failure, if any, is already logged and counted

    def _poll_timeout_ms(self, next_sweep: float) -> int:
        """How long the next poll may wait for records: ``POLL_TIMEOUT_S`` while records are
        in flight, held or buffered, or partitions paused (their end must be seen soon: a
        commit, a resume); idle, until the next sweep is due (at most ``IDLE_POLL_S``), so an
        idle loop wakes for its periodic steps, not ten times a second."""
        if self._tasks or self._held or len(self._chunks) or self.consumer.paused():
            return int(POLL_TIMEOUT_S * 1000)
        wait_s = min(IDLE_POLL_S, next_sweep - time.monotonic())
        return max(int(POLL_TIMEOUT_S * 1000), int(wait_s * 1000))

    def _background(self, step: str, coro: Any) -> asyncio.Task[None]:
        """Run a periodic step as a task whose unexpected failure is logged and counted, never fatal."""
        task = asyncio.create_task(coro, name=f"{self.worker_id}:{step}")
        task.add_done_callback(lambda t: self._background_done(step, t))
        return task

    def _background_done(self, step: str, task: asyncio.Task[None]) -> None:
        if task.cancelled() or (exc := task.exception()) is None:
            return
        self.telemetry.background_errors.labels(step, type(exc).__name__).inc()
        log.error("worker %s: background step %r failed (%s: %s); the worker goes on and the step runs again",
                  self.worker_id, step, type(exc).__name__, exc, exc_info=exc)

    def _apply_backpressure(self) -> None:
        """Pause every assigned partition while ``concurrency`` records are in flight, and
        with several experiments each experiment's partitions while it uses its fair share
        of the slots (:func:`scoring_workers.fair_share.slot_caps`).

        Reads the assignment as it is now (a rebalance may have changed it since the
        last poll): partitions assigned while full are paused too, and only partitions
        still ours are resumed.
        """
        full = self._in_flight >= self.concurrency
        experiments = list(self.fleet)
        if len(experiments) == 1 or full:
            if len(experiments) == 1:
                self._caps = {}
            if full:
                if fresh := self.consumer.assignment() - self.consumer.paused():
                    self.consumer.pause(*fresh)
            elif paused := self.consumer.paused():
                self.consumer.resume(*paused)
            return
        self._caps = caps = slot_caps(self.concurrency, {e.experiment_id: e.weight for e in experiments},
                                      {e.experiment_id: len(e.in_flight) for e in experiments},
                                      {e.experiment_id: e.max_in_flight for e in experiments})
        over: set[str] = set()
        for e in experiments:
            self.telemetry.experiment_slots.labels(e.experiment_id).set(caps[e.experiment_id])
            self.telemetry.experiment_in_flight.labels(e.experiment_id).set(len(e.in_flight))
            if len(e.in_flight) >= caps[e.experiment_id]:
                over.add(e.trajectories_topic)
        assigned, paused = self.consumer.assignment(), self.consumer.paused()
        if fresh := {tp for tp in assigned - paused if tp.topic in over}:
            self.consumer.pause(*fresh)
        if back := {tp for tp in paused & assigned if tp.topic not in over}:
            self.consumer.resume(*back)

    # ------------------------------------------------------------------ experiments
    def _subscribe(self) -> None:
        """Consume every served experiment's trajectories topic (a change rebalances the group)."""
        topics = self.fleet.topics()
        if set(topics) != self.consumer.subscription():
            self.consumer.subscribe(topics, listener=_Rebalance(self))
            log.info("worker %s consumes %s", self.worker_id, topics)
        for state, count in self.fleet.states().items():
            self.telemetry.experiments.labels(state).set(count)

    async def _apply_registry(self, entry: RegistryRecord) -> None:
        await self.fleet.apply(entry)
        if not entry.error:
            self.telemetry.registry_records.labels("removed" if entry.removal else "declared").inc()

    async def _follow_registry(self) -> None:
        """Apply what the registry says as it says it; retire removed experiments in time."""
        assert self._registry is not None
        for entry in await self._registry.poll(timeout_ms=REGISTRY_POLL_MS):
            await self._apply_registry(entry)
        self.fleet.expire()
        self._subscribe()

    def _route(self, record: ConsumerRecord, message: Any) -> Routed:
        """The experiment and scoped group of a record: its topic's experiment (:meth:`Fleet.admit`
        turned a record naming another one into an invalid record)."""
        experiment_id = self.fleet.experiment_of(record.topic)
        if isinstance(message, (ReadyTrajectory, DiscardGroup)):
            group_id: str | None = message.group_id
        else:  # undecodable: its key names the group, its topic the experiment
            group_id = group_of(record.key)
        scoped = scoped_group(experiment_id, group_id) if group_id else None
        return Routed(experiment_id, self.fleet.get(experiment_id), scoped)

    def _served(self, scoped: str) -> tuple[str, Experiment]:
        """The experiment of a scoped group and its runtime; for one no longer served (a removed
        experiment's last groups still get their verdicts) the worker's group timeout and no scorers."""
        experiment_id, _ = split_scoped(scoped)
        return experiment_id, self.fleet.get(experiment_id) or self.fleet.retired(experiment_id)

    async def _drain_partitions(self, tps: set[TopicPartition] | None) -> None:
        """Wait (bounded) for in-flight records of ``tps`` (all if None), commit, forget them."""
        tasks = [t for t, tp in self._tasks.items() if tps is None or tp in tps]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.cfg.worker.drain_timeout_s)
            if pending:
                log.warning("worker %s: %d records still running after drain timeout; "
                            "they will be redelivered", self.worker_id, len(pending))
        for experiment_id, queue in list(self._held.items()):  # not started: the next owner reads them again
            kept = deque(h for h in queue if tps is not None
                         and TopicPartition(h.record.topic, h.record.partition) not in tps)
            if kept:
                self._held[experiment_id] = kept
            else:
                del self._held[experiment_id]
        await self._committer.revoke(tps)  # waits for a background commit in flight first
        self._chunks.drop(tps)  # partial chunked trajectories are replayed from the committed offset

    async def _update_lag(self) -> None:
        for tp, lag in (await self._committer.lag()).items():
            self.telemetry.lag.labels(tp.topic, str(tp.partition)).set(lag)

    # ------------------------------------------------------------------ dispatch
    def _decode(self, records: list[ConsumerRecord]) -> list[Job]:
        """A poll's records, decoded in one pass into typed jobs (in consumption order).

        The wire form stays compact: scoring takes its token turns from it, then expands it
        once. Chunks are buffered until their trajectory is whole (their offsets are
        finished with it: the commit stays below its first chunk until then)."""
        consumed_at = time.time()
        jobs: list[Job] = []
        for record in records:
            try:
                message: Any = decode_message(record.value, record.headers, expand=False)
                if isinstance(message, ReadyTrajectory):
                    check_expandable(message)
            except SchemaError as exc:
                message = exc
            if isinstance(message, TrajectoryChunk):
                self._committer.tracker.begin(TopicPartition(record.topic, record.partition), record.offset)
                jobs += (self._job(r, m, extra, consumed_at) for r, m, extra in self._chunks.add(record, message))
            else:
                jobs.append(self._job(record, message, [], consumed_at))
        return jobs

    def _job(self, record: ConsumerRecord, message: Any, extra: list[int], consumed_at: float) -> Job:
        message = self.fleet.admit(record.topic, message)
        kind = JobKind.READY if isinstance(message, ReadyTrajectory) else JobKind.DISCARD \
            if isinstance(message, DiscardGroup) else JobKind.INVALID
        return Job(kind, record, message, self._route(record, message), extra, consumed_at)

    async def _dispatch(self, records: list[ConsumerRecord]) -> None:
        """Decode a poll, probe what needs it in one call, then start its work: per partition,
        one task for the members that need nothing but scoring and parking
        (:meth:`_process_batch`), one task per other record (:meth:`_spawn`). Records of an
        experiment at its slot cap are held, in order, until it has room."""
        jobs = self._decode(records)
        ready = [j for j in jobs if j.kind is JobKind.READY and j.route.experiment is not None]
        probed: list[Job] = []
        for job in ready:  # a chunked trajectory is read whole with its last chunk: that one decides
            if self._marks.needs_probe(job.tp, max([job.record.offset, *job.extra])):
                probed.append(job)
            else:
                job.probe = Outcome.NEW  # new to everyone: the park re-checks
        self.ledger.expect([(j.route.scoped, j.message.trajectory_id) for j in ready  # type: ignore[union-attr]
                            if j.probe is Outcome.NEW])
        if probed:
            answers = await self._with_retry(lambda: self.ledger.probe_many(
                [(j.route.scoped, j.message.trajectory_id) for j in probed]), "probe")  # type: ignore[union-attr]
            for job, answer in zip(probed, answers):
                job.probe = answer
        self.telemetry.probes.labels("probed").inc(len(probed))
        self.telemetry.probes.labels("skipped").inc(len(ready) - len(probed))
        start: list[Job] = []
        planned: dict[str, int] = {}  # records of each experiment started by this poll so far
        for job in jobs:
            owner = self.fleet.of_topic(job.record.topic)
            if owner is not None and (owner.experiment_id in self._held or self._at_cap(
                    owner, planned.get(owner.experiment_id, 0))):
                self._committer.tracker.begin(job.tp, job.record.offset)
                self._held.setdefault(owner.experiment_id, deque()).append(job)
                continue
            if owner is not None:
                planned[owner.experiment_id] = planned.get(owner.experiment_id, 0) + 1
            start.append(job)
        batches: dict[TopicPartition, list[Job]] = {}
        alone = self._alone(start)
        for job in start:
            if job.route.scoped in alone:
                self._spawn(job)
            else:
                batches.setdefault(job.tp, []).append(job)
        for batch in batches.values():
            self._spawn_batch(batch)
        self._release_held()

    def _alone(self, jobs: list[Job]) -> set[str | None]:
        """The groups whose records of this poll each take a task of their own: those with a
        discard, an invalid record, a member already known to the ledger (a redelivery) or
        an unknown experiment among them, those behind a discard in flight, and those of an
        experiment whose scoring waits (a judge: its members must not wait for each other
        to park). The other groups' members only need scoring and parking: a poll's batch
        does that for them."""
        alone: set[str | None] = {None}
        for job in jobs:
            scoped = job.route.scoped
            if (job.kind is not JobKind.READY or job.route.experiment is None or job.probe is not Outcome.NEW
                    or scoped in self._discards or job.route.experiment_id in self._waits):
                alone.add(scoped)
        return alone

    def _at_cap(self, experiment: Experiment, planned: int = 0) -> bool:
        cap = self._caps.get(experiment.experiment_id)
        return cap is not None and len(experiment.in_flight) + planned >= cap

    def _release_held(self, *_: Any) -> None:
        """Start held records of experiments that have a free slot again, in order."""
        if not self._held:
            return
        for experiment_id in list(self._held):
            queue = self._held[experiment_id]
            owner = self.fleet.get(experiment_id)
            while queue and (owner is None or not self._at_cap(owner)):
                job = queue.popleft()  # routed again: its experiment may have been re-declared meanwhile
                job.route = self._route(job.record, job.message)
                self._spawn(job)
            if not queue:
                del self._held[experiment_id]

    def _spawn(self, job: Job) -> None:
        """Process one job in a task. The one switch on the record's kind: which handler runs
        it, and what it waits for — a member for a discard of its group consumed before it;
        a discard or an invalid member (each decides its group) for the members consumed
        before it, so that the verdict lists them."""
        scoped = job.route.scoped or ""
        self._committer.tracker.begin(job.tp, job.record.offset)
        members = self._members.get(scoped)
        served = job.route.experiment is not None
        match job.kind:
            case JobKind.READY:
                discard = self._discards.get(scoped)
                if discard is not None:
                    job.probe = None  # stale: the discard ahead of it may decide the group
                job.earlier = tuple(members or ())  # a failure decides the group, not before these parked
                task = asyncio.create_task(self._process(
                    job, self._handle_ready if served else self._reject_unknown, after=discard))
                self._joins(scoped, task)
            case JobKind.DISCARD:
                task = asyncio.create_task(self._process(
                    job, self._handle_discard if served else self._reject_unknown, after=_all_of(members)))
                # Records of a group behind its discard (same partition, later offset)
                # must see the discard's decision: they wait for it, not for each other.
                self._discards[scoped] = task
                task.add_done_callback(lambda t, g=scoped: self._discards.get(g) is t and self._discards.pop(g))
            case JobKind.INVALID:
                task = asyncio.create_task(self._process(job, self._handle_invalid, after=_all_of(members)))
        self._started(task, [job], finish=True)

    def _spawn_batch(self, jobs: list[Job]) -> None:
        """Process one partition's members of a poll in one task (:meth:`_process_batch`)."""
        tracker = self._committer.tracker
        for job in jobs:
            tracker.begin(job.tp, job.record.offset)
            job.earlier = tuple(self._members.get(job.route.scoped or "", ()))
        self.telemetry.batch_records.observe(len(jobs))
        task = asyncio.create_task(self._process_batch(jobs))
        for scoped in {job.route.scoped or "" for job in jobs}:
            self._joins(scoped, task)
        self._started(task, jobs, finish=False)

    def _joins(self, scoped: str, task: asyncio.Task[None]) -> None:
        """``task`` scores members of group ``scoped``: a discard or invalid record of the group waits for it."""
        self._members.setdefault(scoped, set()).add(task)
        task.add_done_callback(lambda t, g=scoped: self._member_done(g, t))

    def _started(self, task: asyncio.Task[None], jobs: list[Job], *, finish: bool) -> None:
        """Count ``task``'s records in flight (in all, and per experiment for the slot caps) until
        each one's outcome is durable or the task is done; with ``finish``, its records' offsets
        are finished when it succeeds (a batch finishes each of its records itself, as it lands)."""
        self._tasks[task] = jobs[0].tp
        owner = self.fleet.of_topic(jobs[0].tp.topic)  # slots are counted per topic's experiment
        for job in jobs:
            job.counted = True
            if owner is not None:
                job.slots = owner.in_flight
                owner.in_flight[job] = task
        self._in_flight += len(jobs)
        self.telemetry.in_flight.set(self._in_flight)
        task.add_done_callback(lambda t: self._done(t, jobs, finish))

    def _release(self, job: Job) -> None:
        """``job`` no longer counts in flight: its slot is free for the next record."""
        if not job.counted:
            return
        job.counted = False
        self._in_flight -= 1
        self.telemetry.in_flight.set(self._in_flight)
        if job.slots is not None:
            job.slots.pop(job, None)
            job.slots = None
            self._release_held()

    def _member_done(self, group_id: str, task: asyncio.Task[None]) -> None:
        members = self._members.get(group_id)
        if members is not None:
            members.discard(task)
            if not members:
                del self._members[group_id]

    def _done(self, task: asyncio.Task[None], jobs: list[Job], finish: bool) -> None:
        self._tasks.pop(task, None)
        failed = task.cancelled() or task.exception() is not None
        if failed and not task.cancelled():
            log.error("worker %s: record %s:%d not finished: %r", self.worker_id, jobs[0].tp, jobs[0].record.offset,
                      task.exception())
        for job in jobs:  # a record not finished is redelivered (to the partition's next owner)
            if finish and not failed:
                self._finished(job)
            self._release(job)

    def _finished(self, job: Job) -> None:
        """``job``'s outcome is durable: its offset (and its other chunks') may be committed."""
        tracker, tp = self._committer.tracker, job.tp
        tracker.finish(tp, job.record.offset)
        for off in job.extra:
            tracker.finish(tp, off)
        self._release(job)

    async def _process(self, job: Job, handle: Callable[[Job], Awaitable[None]],
                       after: asyncio.Future[Any] | None = None, *, counted: bool = False) -> None:
        """Run ``handle(job)``: transient errors retried with backoff for as long as they last,
        others ``worker.max_attempts`` times, then the record is dead-lettered. ``counted``:
        its batch counted the record already (a batch that fell back to it)."""
        record, route = job.record, job.route
        if after is not None:
            await asyncio.wait([after])  # its outcome, success or not, is in the ledger or retried
        label = job.kind.value
        if not counted:
            self.telemetry.experiment_records.labels(
                route.experiment_id if route.experiment is not None else UNKNOWN_LABEL, label).inc()
        # Not RECORD_RETRY.run: this loop also retries permanent errors (up to
        # worker.max_attempts, then dead-letters the record), counts every attempt as
        # consumed, keeps the attempt on the job and drops the job's probe before a retry;
        # it takes only the policy's delays.
        while True:
            job.attempt += 1
            try:
                self.telemetry.consumed.labels(label).inc()
                await handle(job)
                return
            except Exception as exc:
                if RECORD_RETRY.retryable(exc):
                    self.telemetry.retries.labels(type(exc).__name__).inc()
                    delay = RECORD_RETRY.delay(job.attempt)
                    log.warning("worker %s: transient %s on %s:%d offset %d (attempt %d), retrying in %.2fs",
                                self.worker_id, type(exc).__name__, record.topic, record.partition, record.offset,
                                job.attempt, delay)
                    job.probe = None
                    await asyncio.sleep(delay)
                    continue
                # a bug or poison record: retry a little, then dead-letter it
                log.exception("worker %s: failed processing %s:%d offset %d (attempt %d)",
                              self.worker_id, record.topic, record.partition, record.offset, job.attempt)
                if job.attempt >= self.cfg.worker.max_attempts:
                    error = exc if isinstance(exc, SchemaError) else ProcessingError(exc)
                    await self._dead_letter(record, error, job.attempt, group_id=route.scoped)
                    return
                job.probe = None

    async def _with_retry(self, op: Any, what: str) -> Any:
        """``await op()``, transient errors retried (:data:`CALL_RETRY`), each counted and logged."""
        def on_retry(exc: BaseException, _attempt: int, delay: float) -> None:
            self.telemetry.retries.labels(type(exc).__name__).inc()
            log.warning("worker %s: transient %s during %s, retrying in %.2fs", self.worker_id,
                        type(exc).__name__, what, delay)
        return await CALL_RETRY.run(op, what=what, on_retry=on_retry)

    # ------------------------------------------------------------------ handlers
    async def _handle_ready(self, job: Job) -> None:
        traj, experiment, group = job.message, job.route.experiment, job.route.scoped
        assert isinstance(traj, ReadyTrajectory) and experiment is not None and group is not None
        if job.probe is None:
            (job.probe,) = await self.ledger.probe_many([(group, traj.trajectory_id)])
        if job.probe is not Outcome.NEW:  # parked already, or its group decided or finished
            if job.probe is Outcome.DUPLICATE and self._tokens.inline:
                with contextlib.suppress(NotConcatExport):  # the record in hand spares reading its tokens back
                    self._tokens.remember(group, traj.trajectory_id, compact_turns(traj.interactions))
            await self._settle(Decision.bare(job.probe, group), job, Step.PROBE)
            return
        if job.result is None:
            job.result = await self._score(traj, experiment)
            self._tokens.remember(group, traj.trajectory_id, job.result.turns)
        result = job.result
        if result.status == "failed" and (pending := self._pending_earlier(job)):
            # Parking a failed member decides (rejects) the group: the members consumed
            # before it go first, so the verdict lists them with their stats.
            await asyncio.wait(pending)
        ((outcome, decision),) = await self.ledger.park_many([self._park_request(job, time.time())])
        await self._settle(decision or Decision.bare(outcome, group), job, Step.PARK)

    def _pending_earlier(self, job: Job) -> list[asyncio.Future[Any]]:
        """What ``job`` waits for before a failure of it may park: its groupmates consumed before
        it that are still running (their tasks, or the parks of its own batch), not its own task."""
        me = asyncio.current_task()
        return [t for t in job.earlier if not t.done() and t is not me]

    def _park_request(self, job: Job, parked_at: float) -> ParkRequest:
        traj, experiment, result = job.message, job.route.experiment, job.result
        assert isinstance(traj, ReadyTrajectory) and experiment is not None and result is not None
        assert job.route.scoped is not None
        return ParkRequest(msgspec.structs.replace(result, consumed_at=job.consumed_at, parked_at=parked_at),
                           job.route.scoped, traj.group_size, experiment.group_timeout_s, self.worker_id,
                           experiment.scorers_blob, job.record.partition, job.record.offset)

    async def _process_batch(self, jobs: list[Job]) -> None:
        """One partition's members of a poll that need only scoring and parking, in one task.

        Scored in turn, each by hand in this task (:mod:`scoring_workers.eager`), parked in
        one ledger call, the verdicts they decide produced together, each record finished as
        its outcome lands. A member whose scoring waits (a judge) marks its experiment as one
        that waits: it is finished here, the rest of the poll goes the per-record way
        concurrently, and so do its experiment's later records (:meth:`_alone`). Any failure
        on the way hands the records not yet finished to the per-record path
        (:meth:`_process`: retries, dead letters), keeping their scores: every ledger step is
        safe to repeat, so nothing is lost or decided twice."""
        self.telemetry.consumed.labels(JobKind.READY.value).inc(len(jobs))
        for experiment_id in {job.route.experiment_id for job in jobs}:
            self.telemetry.experiment_records.labels(experiment_id, JobKind.READY.value).inc(
                sum(job.route.experiment_id == experiment_id for job in jobs))
        scored, waiting, rest = self._score_eagerly(jobs)
        parked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ahead = {job.route.scoped for job in jobs[:len(jobs) - len(rest)]}
        for job in rest:  # a failure of a group with members ahead of it here waits for them to park
            if job.route.scoped in ahead:
                job.earlier += (parked,)
        others = asyncio.gather(*(self._alone_process(job) for job in rest)) if rest else None
        try:
            if waiting is not None:  # finished at once, in this task: its timeout belongs to this task
                job, coro, first = waiting
                job.result = await Resume(coro, first)
                self._remember(job)
            await self._park_batch(scored)
            if waiting is not None:
                await self._alone_process(waiting[0])
            parked.set_result(None)
        except BaseException:
            if others is not None:
                others.cancel()
            raise
        finally:
            if not parked.done():
                parked.cancel()
            if others is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([others])

    async def _alone_process(self, job: Job) -> None:
        """``job`` of a batch, the per-record way (its batch counted it already)."""
        await self._process(job, self._handle_ready, counted=True)
        self._finished(job)

    def _score_eagerly(self, jobs: list[Job]) -> tuple[list[Job], tuple[Job, Any, Any] | None, list[Job]]:
        """Score ``jobs`` in turn by hand, each to ``job.result``, while scoring finishes without
        waiting. Returns (the scored, the first that waited with its coroutine and what it
        waits for — or None —, the jobs after it, not started)."""
        for i, job in enumerate(jobs):
            coro = self._score(job.message, job.route.experiment)  # type: ignore[arg-type]
            try:
                first = coro.send(None)
            except StopIteration as stop:
                job.result = stop.value
                self._remember(job)
                continue
            self._waits.add(job.route.experiment_id)
            return jobs[:i], (job, coro, first), jobs[i + 1:]
        return jobs, None, []

    def _remember(self, job: Job) -> None:
        assert job.result is not None and isinstance(job.message, ReadyTrajectory) and job.route.scoped
        self._tokens.remember(job.route.scoped, job.message.trajectory_id, job.result.turns)

    async def _park_batch(self, jobs: list[Job]) -> None:
        """Park scored ``jobs`` in one ledger call, publish the verdicts they decide together,
        finish each record as its outcome lands; on a failure, the records left go on one by one."""
        if not jobs:
            return
        for job in jobs:
            job.attempt = 1
        landed: set[Job] = set()

        def land(job: Job) -> None:
            self._finished(job)
            landed.add(job)

        try:
            if pending := [t for job in jobs if job.result.status == "failed"  # type: ignore[union-attr]
                           for t in self._pending_earlier(job)]:
                await asyncio.wait(pending)  # a failed member rejects its group: the members before it park first
            parked_at = time.time()
            # failed members last: each rejects its group, which then lists the members parked before it
            order = sorted(jobs, key=lambda job: job.result.status == "failed")  # type: ignore[union-attr]
            answers = await self.ledger.park_many([self._park_request(job, parked_at) for job in order])
            decided: list[tuple[Job, Decision]] = []
            for job, (outcome, decision) in zip(order, answers):
                if decision is not None and decision.outcome is Outcome.DECIDED_NOW:
                    decided.append((job, decision))  # finished once its verdict is out
                    continue
                if outcome is not Outcome.PARKED:  # a duplicate, or its group decided or finished meanwhile
                    await self._settle(decision or Decision.bare(outcome, job.route.scoped or ""), job, Step.PARK)
                land(job)
            failure: BaseException | None = None
            for (job, _), sent in zip(decided, await self._publish_many([d for _, d in decided])):
                if isinstance(sent, BaseException):
                    failure = failure or sent
                else:
                    land(job)
            if failure is not None:
                raise failure
        except Exception as exc:  # noqa: BLE001 - each record left is retried on its own
            left = [job for job in jobs if job not in landed]
            self.telemetry.retries.labels(type(exc).__name__).inc()
            log.warning("worker %s: parking a batch of %d records on %s:%d failed (%s: %s); %d go on one by one",
                        self.worker_id, len(jobs), jobs[0].record.topic, jobs[0].record.partition,
                        type(exc).__name__, exc, len(left))
            for job in left:
                job.probe = None  # asked again: the batch may have parked it
                await self._alone_process(job)

    async def _settle(self, decision: Decision, job: Job | None = None, step: Step = Step.DECIDE) -> None:
        """Act on what the ledger answered about a group: the one place that does.

        ``DECIDED_NOW``: this call decided the group, publish its verdict. A group decided
        and not finished: bring its sweep forward (its decider may have died before
        publishing) — or, for the sweeper, re-publish it once the grace has passed. A
        finished (or vanished) group that a decision found: drop its index entry. A member
        already parked found by the probe (a redelivery): re-run the ``complete`` decision,
        in case the crash came between parking the last member and deciding. Members of
        decided or finished groups, and members parked already, are acknowledged (counted
        as deduplicated) without being scored again.
        """
        group, grace_s = decision.group_id, self.cfg.worker.republish_grace_s
        match decision.outcome:
            case Outcome.DECIDED_NOW:
                await self._publish(decision)  # this member completed (or failed) the group, or this decision
            case Outcome.ALREADY_DECIDED if step is Step.SWEEP:
                if time.time() * 1000 - decision.decided_at_ms >= grace_s * 1000:
                    await self._publish(decision)  # its publisher died: re-publish
            case Outcome.ALREADY_DECIDED | Outcome.DECIDED:
                await self.ledger.nudge(group, grace_s)
            case Outcome.DONE | Outcome.GONE if step in (Step.DECIDE, Step.SWEEP):
                await self.ledger.forget(group)
            case Outcome.DUPLICATE if step is Step.PROBE:
                await self._decide(group, DecisionKind.COMPLETE)
            case _:  # NEW, PARKED, NOT_DUE, INCOMPLETE; DONE or DUPLICATE at a park: nothing to do
                pass
        if job is not None and decision.outcome in (Outcome.DECIDED, Outcome.DONE, Outcome.DUPLICATE):
            self.telemetry.deduplicated.inc()
            traj = job.message
            assert isinstance(traj, ReadyTrajectory)
            at = " at park" if step is Step.PARK else ""
            what = ("already scored (a redelivery or a re-published record)" if decision.outcome is Outcome.DUPLICATE
                    else "its group is already decided (a re-published or redriven record"
                    + (", or decided while it was scored)" if step is Step.PARK else ")"))
            self._duplicates_log.log(logging.INFO, "group=%s traj=%s: duplicate acknowledged%s, %s",
                                     traj.group_id, traj.trajectory_id, at, what)

    async def _score(self, traj: ReadyTrajectory, experiment: Experiment | None = None) -> SessionResult:
        experiment = experiment or self.fleet.get(DEFAULT_EXPERIMENT)
        assert experiment is not None
        t0 = time.perf_counter()
        result = await score_member(experiment.runner, traj, timeout_s=self.cfg.worker.scorer_timeout_s,
                                    keep_channels=self.cfg.worker.keep_scorer_channels)
        if result.status == "failed":  # the member fails; the group will be rejected
            self.telemetry.member_failures.labels(reasons.metric_label("failed", result.failure_code)).inc()
            log.info("group=%s traj=%s: scoring failed: %s", traj.group_id, traj.trajectory_id, result.error)
        elif experiment.runner is not None:
            self.telemetry.scoring_seconds.observe(time.perf_counter() - t0)
            self.telemetry.scored.inc()
        return result

    async def _handle_discard(self, job: Job) -> None:
        msg = job.message
        assert isinstance(msg, DiscardGroup) and job.route.scoped is not None
        await self._decide(job.route.scoped, DecisionKind.DISCARD, discard_reason=msg.reason or "discarded")

    async def _handle_invalid(self, job: Job) -> None:
        assert isinstance(job.message, SchemaError)
        await self._dead_letter(job.record, job.message, job.attempt, group_id=job.route.scoped)

    async def _reject_unknown(self, job: Job) -> None:
        """A record read from the topic of an experiment no longer served: the record is dead-lettered
        (``UnknownExperiment``: ``prm-pipeline dead-letters`` shows it, and redrives it once the
        experiment is declared) and its group is rejected (``unknown_experiment``) on the default
        verdicts topic, without touching the ledger (ids named by producers must not grow
        Redis). Every such record says so again; the trainer's dedupe keeps one verdict per group."""
        message, route = job.message, job.route
        assert isinstance(message, (ReadyTrajectory, DiscardGroup))
        await self._dead_letter(job.record, UnknownExperiment(
            f"experiment {route.experiment_id!r} is not in the experiment registry of worker {self.worker_id} "
            "(never added, removed, or its record was refused); declare it (prm-pipeline experiment add), then "
            "redrive this record"), job.attempt)
        members = []
        if isinstance(message, ReadyTrajectory):
            members = [SessionResult.failure(
                code=reasons.UNKNOWN_EXPERIMENT, detail=f"experiment {route.experiment_id!r} is not served",
                session_id=message.session_id, trajectory_id=message.trajectory_id,
                outcome_reward=message.outcome_reward, is_eval=message.is_eval,
                policy_version=message.policy_version, created_at=message.created_at)]
        verdict = GroupVerdict(
            group_id=message.group_id, status="rejected", reason_code=reasons.UNKNOWN_EXPERIMENT,
            reason=f"unknown_experiment: {route.experiment_id!r} is not in the experiment registry of worker "
                   f"{self.worker_id} (never added, removed, or its record was refused)",
            group_size=getattr(message, "group_size", 0), sessions=members, worker_id=self.worker_id,
            decided_at=time.time(), experiment_id=route.experiment_id)
        _, value, headers = fit_verdict(verdict, self.cfg.kafka.max_message_bytes)
        await self.producer.send_and_wait(self.cfg.topics.verdicts, value, key=verdict.group_id.encode(),
                                          headers=headers)
        self.telemetry.verdicts.labels("rejected", reasons.UNKNOWN_EXPERIMENT).inc()
        self._duplicates_log.log(logging.WARNING, "group=%s: rejected, unknown experiment %r", message.group_id,
                                 route.experiment_id)

    async def _decide(self, group_id: str, kind: DecisionKind, *, discard_reason: str = "") -> None:
        """Decide the (scoped) group ``group_id``, then settle what the ledger answered."""
        _, experiment = self._served(group_id)
        decision = await self.ledger.decide(
            group_id, kind, worker_id=self.worker_id, scorers=experiment.scorers_blob,
            discard_reason=discard_reason, group_timeout_s=experiment.group_timeout_s,
            republish_grace_s=self.cfg.worker.republish_grace_s,
        )
        await self._settle(decision)

    async def _publish(self, decision: Decision) -> GroupVerdict | None:
        """Publish the decision's verdict and finish the group (:meth:`_publish_many` of one)."""
        (sent,) = await self._publish_many([decision])
        if isinstance(sent, BaseException):
            raise sent
        return sent

    async def _publish_many(self, decisions: list[Decision]) -> list[GroupVerdict | None | BaseException]:
        """Produce the decisions' verdicts together, then finish each group Kafka acknowledged.

        One answer per decision: its verdict once acknowledged; None when Kafka refused it for
        good (an authorization or topic error: the operator must act) — it stays decided in
        Redis, so the sweeper tries again after the re-publish grace, never in a tight loop and
        never holding up other records or groups —; the exception when the error is transient
        (the caller retries)."""
        outgoing = [await self._verdict_of(decision) for decision in decisions]
        acks: list[asyncio.Future[Any] | BaseException] = []
        for verdict, topic, value, headers in outgoing:
            try:
                acks.append(await self.producer.send(topic, value, key=verdict.group_id.encode(), headers=headers))
            except Exception as exc:  # noqa: BLE001 - answered below, per verdict
                acks.append(exc)
        answers: list[GroupVerdict | None | BaseException] = []
        for decision, (verdict, _, _, _), ack in zip(decisions, outgoing, acks):
            if not isinstance(ack, BaseException):
                try:
                    await ack
                except Exception as exc:  # noqa: BLE001 - answered below
                    ack = exc
            if not isinstance(ack, BaseException):
                self._published(decision, verdict, time.time())
                answers.append(verdict)
            elif is_permanent(ack):
                grace_s = self.cfg.worker.republish_grace_s
                self.telemetry.publish_failures.labels(type(ack).__name__).inc()
                log.error("worker %s: verdict for group %s refused by Kafka (%s: %s); it stays decided and is "
                          "re-published after %.0fs", self.worker_id, verdict.group_id, type(ack).__name__, ack,
                          grace_s)
                await self.ledger.postpone(decision.group_id, grace_s)
                answers.append(None)
            else:
                answers.append(ack)
        return answers

    async def _verdict_of(self, decision: Decision) -> tuple[GroupVerdict, str, bytes, list[tuple[str, bytes]]]:
        """The verdict of ``decision`` as it goes to Kafka: (verdict, topic, value, headers), fitted
        to ``kafka.max_message_bytes`` (token turns by reference, or ``verdict_too_large``)."""
        experiment_id, group_id = split_scoped(decision.group_id)
        if decision.state.decision == "discard":  # listed without results: no tokens needed
            members = [m.result for m in decision.members]
        else:
            members = await self._tokens.members(decision.group_id, decision.members, experiment_id=experiment_id)
        full = assemble_verdict(group_id, decision.state, members)
        if experiment_id != DEFAULT_EXPERIMENT:
            full = msgspec.structs.replace(full, experiment_id=experiment_id)
        limit = self.cfg.kafka.max_message_bytes
        verdict, value, headers = fit_verdict(full, limit, self._tokens.references(decision.members))
        if verdict is not full and verdict.reason_code != reasons.VERDICT_TOO_LARGE:
            log.info("group=%s: verdict too large for kafka.max_message_bytes=%d (as a compressed batch) with its "
                     "members' token turns: published with their records' coordinates instead "
                     "(worker.verdict_tokens: auto)", verdict.group_id, limit)
        elif verdict is not full:
            log.warning("group=%s: verdict too large for kafka.max_message_bytes=%d (as a compressed batch), published as %s",
                        verdict.group_id, limit, verdict.reason[:200])
        return verdict, verdicts_topic(self.cfg.topics.verdicts, experiment_id), value, headers

    def _published(self, decision: Decision, verdict: GroupVerdict, sent_at: float) -> None:
        """Kafka acknowledged ``verdict``: finish its group (cleanup that rides along with the next ledger call)."""
        experiment_id, _ = split_scoped(decision.group_id)
        self.ledger.finish_soon(decision.group_id)
        self._tokens.forget_group(decision.group_id)
        self.telemetry.experiment_verdicts.labels(experiment_id, verdict.status).inc()
        self.telemetry.observe_stages(verdict, sent_at)
        self.telemetry.verdicts.labels(verdict.status, reasons.metric_label(verdict.status, verdict.reason_code)).inc()
        log.info("group=%s verdict=%s code=%s reason=%s sessions=%d by=%s", verdict.group_id, verdict.status,
                 verdict.reason_code or "-", verdict.reason, len(verdict.sessions), self.worker_id)

    async def _sweep(self) -> None:
        """Reject overdue groups and re-publish decisions whose publisher died.

        Each group is handled in isolation: a failure is logged and counted
        (``prm_worker_sweep_failures_total``) and the sweep goes on with the next group.
        """
        try:
            due = await self.ledger.due_groups(linger_s=self.cfg.worker.sweep_interval_s / 2)
        except Exception as exc:  # noqa: BLE001 - Redis down: the next sweep tries again
            self.telemetry.sweep_failures.labels(type(exc).__name__).inc()
            log.warning("worker %s: sweep skipped: %s: %s", self.worker_id, type(exc).__name__, exc)
            return
        for group_id in due:
            try:
                await self._sweep_group(group_id)
            except Exception as exc:  # never let one group stop the others, or the sweeper die
                self.telemetry.sweep_failures.labels(type(exc).__name__).inc()
                if is_transient(exc):
                    log.warning("worker %s: sweep skipped for group %s: transient %s: %s", self.worker_id,
                                group_id, type(exc).__name__, exc)
                    continue
                backoff_s = self.cfg.worker.sweep_backoff_s
                log.exception("worker %s: sweep failed for group %s; next look in %.0fs", self.worker_id,
                              group_id, backoff_s)
                with contextlib.suppress(Exception):  # not every sweep: a broken group must not flood the log
                    await self.ledger.postpone(group_id, backoff_s)

    async def _sweep_group(self, group_id: str) -> None:
        _, experiment = self._served(group_id)
        decision = await self.ledger.decide(
            group_id, DecisionKind.DEADLINE, worker_id=self.worker_id, scorers=experiment.scorers_blob,
            group_timeout_s=experiment.group_timeout_s, republish_grace_s=self.cfg.worker.republish_grace_s,
        )
        await self._settle(decision, step=Step.SWEEP)

    async def _dead_letter(self, record: ConsumerRecord, error: BaseException, attempt: int, *,
                           group_id: str | None = None) -> None:
        """Dead-letter ``record`` (then reject the group its key names, ``invalid_member``).

        The payload is capped so that the whole dead letter — payload, key and headers —
        fits ``kafka.max_message_bytes``. If Kafka still refuses it for good, the record's
        coordinates are logged and counted (``prm_worker_poison_total``) and the record is
        committed: the source topic still holds it for audit.
        """
        cause = error.cause if isinstance(error, ProcessingError) else error
        letter, key = capped_letter(record, cause, attempt, worker_id=self.worker_id,
                                    max_message_bytes=self.cfg.kafka.max_message_bytes,
                                    dead_letter_max_bytes=self.cfg.worker.dead_letter_max_bytes)
        try:
            await self.producer.send_and_wait(
                self.cfg.topics.dead_letters, letter.payload, key=key, headers=dead_letter_headers(letter)
            )
        except Exception as exc:
            if not is_permanent(exc):
                raise
            self.telemetry.poison.inc()
            log.error("worker %s: POISON record %s:%d offset %d could not be dead-lettered (%s: %s); "
                      "committed without a dead letter (the source topic keeps it): %s: %s", self.worker_id,
                      record.topic, record.partition, record.offset, type(exc).__name__, exc,
                      letter.error_class, letter.error_message[:300])
        else:
            self.telemetry.dead_lettered.labels(letter.error_class).inc()
            log.warning("dead-lettered %s:%d offset %d: %s: %s", record.topic, record.partition, record.offset,
                        letter.error_class, letter.error_message[:300])
        if group_id is not None:  # the scoped group its key names
            reason = (f"invalid_member: record {record.topic}:{record.partition}@{record.offset} was dead-lettered "
                      f"({letter.error_class}: {letter.error_message[:200]})")
            await self._decide(group_id, DecisionKind.INVALID, discard_reason=reason)


def _all_of(tasks: set[asyncio.Task[None]] | None) -> asyncio.Future[Any] | None:
    """A future done when every task in ``tasks`` is (None when there are none)."""
    return asyncio.ensure_future(asyncio.wait(list(tasks))) if tasks else None


async def _unless_stopped(coro: Any, stop: asyncio.Event) -> bool:
    """Run ``coro`` unless ``stop`` is set first (then cancel it); True when it finished."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return False
