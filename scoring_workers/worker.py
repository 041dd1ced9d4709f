"""The scoring worker: ``prm.trajectories`` in, ``prm.verdicts`` (and dead letters) out.

The consume/score/park/decide/commit loop, like arq's worker. Its other concerns have a
module each, the way quixstreams splits pausing, checkpointing and processing:
admission and backpressure (:mod:`~scoring_workers.admission`), verdicts and dead letters
(:mod:`~scoring_workers.publishing`), the sweeper (:mod:`~scoring_workers.sweeper`); the
ledger is reached through its protocol (:class:`~scoring_workers.ledger.Ledger`). One
asyncio loop per process; run several processes for scale: they share only Kafka and Redis.

Every record takes one path (docs/architecture.md): ``_dispatch`` decodes a poll into
typed jobs (:mod:`~scoring_workers.jobs`; chunks are buffered until their trajectory is
whole), probes the ledger in one round trip for the records a previous owner of their
partition may have read (:mod:`~scoring_workers.probe_marks`; later ones go straight to
scoring, their park re-checks atomically) and starts each record in a task;
``_process`` retries it (transient errors, :func:`infra.retry.is_transient`, with backoff
for as long as they last; others ``worker.max_attempts`` times, then a dead letter);
``_handle`` switches on its kind — score and park a member (concurrent parks share one
ledger call), decide a discard, dead-letter an invalid record and reject its group
(``invalid_member``) —; ``_settle_*`` acts on the ledger's answer, one per ledger call:
whoever decides a group publishes its verdict. A record that decides its group (a
discard, an invalid record, a failed member's park) first waits for the records of its
group consumed before it, so that the verdict lists them.

Commit discipline: an offset is committed only when its outcome (parked result, verdict
or dead letter) is durable, and per partition only up to the lowest unfinished offset.
Polling never waits on a slow scorer; when ``concurrency`` records are in flight the
partitions are paused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import socket
import time
from typing import Any

import msgspec
from aiokafka import AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.structs import ConsumerRecord, TopicPartition

from infra import reasons
from infra.config import PipelineConfig
from infra.experiments import DEFAULT_EXPERIMENT, scoped_group, split_scoped
from infra.kafka import make_consumer, make_producer
from infra.offsets import OffsetCommitter
from infra.redis import verify_access
from infra.registry import RegistryFollower, RegistryRecord
from infra.retry import RetryPolicy, is_transient
from infra.schema import (
    STREAM_KINDS,
    TRAJECTORY_KINDS,
    DiscardGroup,
    InvalidMessage,
    NotConcatExport,
    ReadyTrajectory,
    SchemaError,
    SessionEnd,
    SessionResult,
    SessionTurn,
    TrajectoryChunk,
    check_expandable,
    compact_turns,
    decode_message,
)
from infra.throttle import LogThrottle
from scoring_workers.admission import Admission
from scoring_workers.chunked import WorkerChunks
from scoring_workers.dead_letters import ProcessingError, group_of
from scoring_workers.fleet import Experiment, Fleet
from scoring_workers.heartbeat import Heartbeat
from scoring_workers.jobs import DiscardJob, EndJob, InFlightGroups, InvalidJob, Job, ReadyJob, Routed, TurnJob, job_of
from scoring_workers.ledger import (
    STREAMED_PARTITION,
    DecideOutcome,
    Decision,
    DecisionKind,
    GroupLedger,
    Ledger,
    LedgerView,
    ParkOutcome,
    ParkRequest,
    ProbeOutcome,
)
from scoring_workers.prm import ScoringRunner
from scoring_workers.prm.streamed import Reuse
from scoring_workers.probe_marks import ProbeMarks
from scoring_workers.publishing import Publisher
from scoring_workers.scorer_report import log_scorers
from scoring_workers.scoring import score_member
from scoring_workers.session_store import SessionStore, TurnOutcome
from scoring_workers.streams import SessionStreams
from scoring_workers.sweeper import Sweeper
from scoring_workers.telemetry import WorkerTelemetry
from scoring_workers.tokens import MemberTokens
from scoring_workers.turn_samples import TurnSamples

log = logging.getLogger(__name__)

LAG_INTERVAL_S = 5.0  # how often the consumer-lag gauge is refreshed
POLL_TIMEOUT_S = 0.1  # a poll's wait while records are in flight (or held, buffered, paused)
IDLE_POLL_S = 0.5  # an idle poll waits until the next sweep, at most this long
REGISTRY_POLL_MS = 2000  # the registry follower's poll (it returns as soon as a record arrives)
UNKNOWN_LABEL = "unknown"  # the experiment label of records from the topic of an experiment no longer served


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# A record's transient errors are retried with jittered backoff (workers hit by one outage
# do not retry in step); a plumbing call's (the poll's probe) without jitter.
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
        log.info(
            "worker %s assigned %s", self.worker.worker_id, sorted(f"{tp.topic}:{tp.partition}" for tp in assigned)
        )


class Worker:
    """One scoring worker process. ``await Worker(cfg).run(stop_event)``."""

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        worker_id: str | None = None,
        concurrency: int | None = None,
        runner: ScoringRunner | None = None,
    ) -> None:
        self.cfg = cfg
        self.worker_id = worker_id or default_worker_id()
        self.telemetry = WorkerTelemetry()
        self._runner = runner
        self._owns_runner = runner is None
        self._tasks: dict[asyncio.Task[None], TopicPartition] = {}
        self._groups = InFlightGroups()
        self.fleet = Fleet(cfg, runner)
        self.admission = Admission(
            concurrency or cfg.worker.concurrency,
            self.fleet,
            self.telemetry,
            functools.partial(self._spawn, reroute=True),
        )
        self._registry: RegistryFollower | None = None
        self._view: LedgerView | None = None  # the ledger's read side once open (the heartbeat's)
        self._tokens = MemberTokens(cfg)
        self._chunks = WorkerChunks()
        self._marks = ProbeMarks()
        self._committing: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        self._duplicates_log = LogThrottle(log, burst=20, window_s=60.0)  # duplicates are normal, but say so
        self._samples: TurnSamples | None = None  # online turn samples (worker.turn_samples)

    def _attach(self, ledger: Ledger, producer: AIOKafkaProducer, streams: SessionStreams | None = None) -> None:
        """Wire the parts that talk to Redis and Kafka (at start; the unit tests attach fakes).
        ``streams``: the open streamed sessions (None: ``turn``/``end`` records are refused)."""
        self.ledger = ledger
        self.producer = producer
        self.streams = streams
        self.publisher = Publisher(self.cfg, producer, ledger, self._tokens, self.telemetry, self.worker_id)
        self.sweeper = Sweeper(self.cfg, ledger, self.publisher, self._served, self.telemetry, self.worker_id)

    # ------------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        cfg = self.cfg
        if cfg.worker.metrics_port is not None:  # health first: scorer start-up may be slow
            self.metrics_port = self.telemetry.serve(cfg.worker.metrics_port)
        heartbeat = asyncio.create_task(Heartbeat(self.worker_id).run(stop, self.telemetry, lambda: self._view))
        try:
            await self._run(stop)
        finally:
            heartbeat.cancel()
            self.telemetry.ready = False
            self.telemetry.close()

    async def _run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        if self._runner is None and cfg.prm.active:
            from scoring_workers.judge.hosts import judge_hosts_allowed
            from scoring_workers.prm import PRMRunner

            with judge_hosts_allowed(cfg.worker.allowed_judge_hosts):  # no judge client outside the list
                self._runner = await PRMRunner.create(cfg.prm, allowed_prefixes=cfg.worker.allowed_scorer_modules)
        log_scorers(log, self.worker_id, self._runner, self._runner.config if self._runner is not None else cfg.prm)
        self.fleet = self.admission.fleet = Fleet(
            cfg, self._runner, on_refused=lambda _e, _why: self.telemetry.registry_records.labels("refused").inc()
        )
        ledger = GroupLedger.from_config(cfg.redis, dedupe_window_s=cfg.worker.dedupe_window_s)
        ledger.on_finish_error = lambda exc: self.telemetry.finish_failures.labels(type(exc).__name__).inc()
        try:
            await verify_access(ledger.redis, cfg.redis)  # wrong credentials / untrusted TLS: stop, clearly
        except BaseException:
            await ledger.aclose()
            if self._owns_runner and self._runner is not None:
                await self._runner.aclose()
            raise
        store = SessionStore(
            ledger.redis, cfg.redis, idle_s=cfg.worker.session_idle_s, max_turns=cfg.worker.session_max_turns
        )
        producer = make_producer(cfg.kafka)
        self._samples = (
            TurnSamples(producer, cfg.kafka, cfg.topics, self.worker_id) if cfg.worker.turn_samples else None
        )
        self._attach(
            ledger,
            producer,
            SessionStreams(store, on_judged=self._samples.judged if self._samples is not None else None),
        )
        self._view = ledger.view
        self.consumer = make_consumer(cfg.kafka, group_id=cfg.worker.group_id)
        self._committer = OffsetCommitter(
            self.consumer,
            owner=f"worker {self.worker_id}",
            on_failure=lambda exc: self.telemetry.commit_failures.labels(type(exc).__name__).inc(),
            min_interval_s=cfg.worker.commit_interval_s,
        )
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
            if self.streams is not None:
                await self.streams.aclose()
            await self.fleet.aclose()
            await self.producer.stop()
            await ledger.aclose()
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
            self.admission.apply_backpressure(self.consumer)
            self.admission.release_held()
            batch = await self.consumer.getmany(
                timeout_ms=self._poll_timeout_ms(next_sweep),
                max_records=min(self.admission.room, self.cfg.worker.poll_max_records),
            )
            records = [r for rs in batch.values() for r in rs]
            # the first highwater known since the assignment: no previous owner read at or past it
            self._marks.learn(self.consumer.assignment(), self.consumer.highwater)
            if records:
                await self._dispatch(records)
            # Background steps: polling never waits for them, a rebalance may land at any of
            # their awaits, and one that fails is logged and counted and runs again later.
            if (
                (self._committing is None or self._committing.done())
                and not self._committer.busy
                and self._committer.due
            ):
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
        log.info("worker %s stopping: draining %d in-flight records", self.worker_id, self.admission.in_flight)
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
        if self._tasks or self.admission.holding or len(self._chunks) or self.consumer.paused():
            return int(POLL_TIMEOUT_S * 1000)
        wait_s = min(IDLE_POLL_S, next_sweep - time.monotonic())
        return max(int(POLL_TIMEOUT_S * 1000), int(wait_s * 1000))

    def _background(self, step: str, coro: Any) -> asyncio.Task[None]:
        """Run a periodic step as a task whose unexpected failure is logged and counted, never fatal."""
        task = asyncio.create_task(coro, name=f"{self.worker_id}:{step}")

        def done(task: asyncio.Task[None]) -> None:
            if task.cancelled() or (exc := task.exception()) is None:
                return
            self.telemetry.background_errors.labels(step, type(exc).__name__).inc()
            log.error(
                "worker %s: background step %r failed (%s: %s); the worker goes on and the step runs again",
                self.worker_id,
                step,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )

        task.add_done_callback(done)
        return task

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
        if isinstance(message, (ReadyTrajectory, DiscardGroup, SessionTurn, SessionEnd)):
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
                log.warning(
                    "worker %s: %d records still running after drain timeout; they will be redelivered",
                    self.worker_id,
                    len(pending),
                )
        self.admission.forget_held(tps)  # not started: the next owner reads them again
        await self._committer.revoke(tps)  # waits for a background commit in flight first
        self._chunks.drop(tps)  # partial chunked trajectories are replayed from the committed offset
        if self.streams is not None:
            self.streams.drop()  # open sessions are loaded again from Redis by whoever reads them next

    async def _update_lag(self) -> None:
        for tp, lag in (await self._committer.lag()).items():
            self.telemetry.lag.labels(tp.topic, str(tp.partition)).set(lag)

    @property
    def _kinds(self) -> tuple[str, ...]:
        """The record kinds this worker takes (streamed sessions only with their store)."""
        return TRAJECTORY_KINDS + STREAM_KINDS if self.streams is not None else TRAJECTORY_KINDS

    async def _sweep(self) -> None:
        """The sweeper's round (overdue groups), then the streamed sessions gone idle."""
        await self.sweeper.sweep()
        if self.streams is not None:
            await self._sweep_sessions()

    async def _sweep_sessions(self) -> None:
        """Answer the groups of streamed sessions idle past ``worker.session_idle_s``: the
        member is parked ``failed`` (``session_idle``), which rejects its group at once."""
        assert self.streams is not None
        store = self.streams.store
        for group, trajectory_id in await store.due():
            seen = await store.idle(group, trajectory_id)
            if seen is None:  # closed (its member parked) or expired
                await store.forget(group, trajectory_id)
                continue
            idle_s, session_id, group_size = seen
            if idle_s < store.idle_s:  # a record came since it was indexed
                await store.postpone(group, trajectory_id, idle_s)
                continue
            _, experiment = self._served(group)
            result = SessionResult.failure(
                code=reasons.SESSION_IDLE,
                session_id=session_id or trajectory_id,
                trajectory_id=trajectory_id,
                detail=f"streamed session {session_id!r} received no record for {idle_s:.0f}s "
                f"(worker.session_idle_s={store.idle_s:g}) and never ended",
                scored_at=time.time(),
            )
            ((_, decision),) = await self.ledger.park_many(
                [
                    ParkRequest(
                        result, group, group_size, experiment.group_timeout_s, self.worker_id, experiment.scorers_blob
                    )
                ]
            )
            if decision is not None:
                await self.publisher.publish(decision)
            await self.streams.close(group, trajectory_id)

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
                message: Any = decode_message(record.value, record.headers, expand=False, kinds=self._kinds)
                if isinstance(message, ReadyTrajectory):
                    check_expandable(message)
            except SchemaError as exc:
                message = exc
            if isinstance(message, TrajectoryChunk):
                self._committer.tracker.begin(TopicPartition(record.topic, record.partition), record.offset)
                for first, whole, extra in self._chunks.add(record, message):
                    jobs.append(self._job(first, whole, extra, consumed_at))
            else:
                jobs.append(self._job(record, message, [], consumed_at))
        return jobs

    def _job(self, record: ConsumerRecord, message: Any, extra: list[int], consumed_at: float) -> Job:
        message = self.fleet.admit(record.topic, message)  # the topic is the tenant: naming another is invalid
        return job_of(record, message, self._route(record, message), extra, consumed_at)

    async def _dispatch(self, records: list[ConsumerRecord]) -> None:
        """Decode a poll, probe what needs it in one call, then start each record in a task
        (:meth:`_spawn`); records of an experiment at its slot cap are held, in order, until
        it has room (:class:`~scoring_workers.admission.Admission`)."""
        jobs = self._decode(records)
        ready = [j for j in jobs if isinstance(j, ReadyJob) and j.route.experiment is not None]
        probed: list[ReadyJob] = []
        for job in ready:  # a chunked trajectory is read whole with its last chunk: that one decides
            if self._marks.needs_probe(job.tp, max([job.record.offset, *job.extra])):
                probed.append(job)
            else:
                job.probe = ProbeOutcome.NEW  # new to everyone: the park re-checks
        self.ledger.expect([(j.group, j.message.trajectory_id) for j in ready if j.probe is ProbeOutcome.NEW])
        if probed:

            def on_retry(exc: BaseException, _attempt: int, delay: float) -> None:
                self.telemetry.retries.labels(type(exc).__name__).inc()
                log.warning(
                    "worker %s: transient %s during probe, retrying in %.2fs", self.worker_id, type(exc).__name__, delay
                )

            answers = await CALL_RETRY.run(
                lambda: self.ledger.probe_many([(j.group, j.message.trajectory_id) for j in probed]),
                what="probe",
                on_retry=on_retry,
            )
            for job, answer in zip(probed, answers):
                job.probe = answer
        self.telemetry.probes.labels("probed").inc(len(probed))
        self.telemetry.probes.labels("skipped").inc(len(ready) - len(probed))
        start, held = self.admission.admit(jobs)
        for job in held:
            self._committer.tracker.begin(job.tp, job.record.offset)
        for job in start:
            self._spawn(job)
        self.admission.release_held()

    def _spawn(self, job: Job, *, reroute: bool = False) -> None:
        """Process one job in a task, after the records of its group it must wait for
        (:class:`~scoring_workers.jobs.InFlightGroups`). ``reroute``: a held record, routed
        again (its experiment may have been re-declared meanwhile)."""
        if reroute:
            job.route = self._route(job.record, job.error if isinstance(job, InvalidJob) else job.message)
        self._committer.tracker.begin(job.tp, job.record.offset)
        task = self._groups.start(job, self._process)
        self._tasks[task] = job.tp
        self.admission.count(job, task)
        task.add_done_callback(functools.partial(self._done, job))

    def _done(self, job: Job, task: asyncio.Task[None]) -> None:
        """``job``'s task ended: its offsets (its other chunks' too) may be committed if it succeeded;
        a record not finished is redelivered (to the partition's next owner)."""
        self._tasks.pop(task, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("worker %s: record %s:%d not finished: %r", self.worker_id, job.tp, job.record.offset, exc)
        elif not task.cancelled():
            for offset in (job.record.offset, *job.extra):
                self._committer.tracker.finish(job.tp, offset)
        self.admission.release(job)

    async def _process(self, job: Job) -> None:
        """Run :meth:`_handle` on ``job``: transient errors retried with backoff for as long as
        they last, others ``worker.max_attempts`` times, then the record is dead-lettered."""
        record, route = job.record, job.route
        if not isinstance(job, ReadyJob) or job.behind_discard:
            await job.wait_earlier()
        self.telemetry.experiment_records.labels(
            route.experiment_id if route.experiment is not None else UNKNOWN_LABEL, job.kind
        ).inc()
        # Not RECORD_RETRY.run: this loop also retries permanent errors (up to
        # worker.max_attempts, then dead-letters the record), counts every attempt as
        # consumed, keeps the attempt on the job and drops the job's probe before a retry;
        # it takes only the policy's delays.
        while True:
            job.attempt += 1
            try:
                self.telemetry.consumed.labels(job.kind).inc()
                await self._handle(job)
                return
            except Exception as exc:
                if isinstance(job, ReadyJob):
                    job.probe = None  # asked again: the attempt may have parked it
                if RECORD_RETRY.retryable(exc):
                    self.telemetry.retries.labels(type(exc).__name__).inc()
                    delay = RECORD_RETRY.delay(job.attempt)
                    log.warning(
                        "worker %s: transient %s on %s:%d offset %d (attempt %d), retrying in %.2fs",
                        self.worker_id,
                        type(exc).__name__,
                        record.topic,
                        record.partition,
                        record.offset,
                        job.attempt,
                        delay,
                    )
                    await asyncio.sleep(delay)
                    continue
                # a bug or poison record: retry a little, then dead-letter it
                log.exception(
                    "worker %s: failed processing %s:%d offset %d (attempt %d)",
                    self.worker_id,
                    record.topic,
                    record.partition,
                    record.offset,
                    job.attempt,
                )
                if job.attempt >= self.cfg.worker.max_attempts:
                    error = exc if isinstance(exc, SchemaError) else ProcessingError(exc)
                    await self._dead_letter(record, error, job.attempt, group_id=route.scoped)
                    return

    # ------------------------------------------------------------------ handlers
    async def _handle(self, job: Job) -> None:
        """The one switch on the record's kind."""
        match job:
            case InvalidJob(error=error):
                await self._dead_letter(job.record, error, job.attempt, group_id=job.route.scoped)
            case ReadyJob(route=Routed(experiment=Experiment() as experiment)):
                await self._handle_ready(job, experiment)
            case TurnJob(route=Routed(experiment=Experiment() as experiment)) if self.streams is not None:
                await self._handle_turn(job, experiment)
            case EndJob(route=Routed(experiment=Experiment() as experiment)) if self.streams is not None:
                await self._handle_end(job, experiment)
            case TurnJob() | EndJob() if self.streams is None:  # a worker built without Redis (unit tests)
                await self._dead_letter(
                    job.record,
                    InvalidMessage("this worker does not take streamed sessions"),
                    job.attempt,
                    group_id=job.route.scoped,
                )
            case DiscardJob(route=Routed(experiment=Experiment()), message=discard):
                await self._decide(job.group, DecisionKind.DISCARD, discard_reason=discard.reason or "discarded")
            case ReadyJob() | DiscardJob() | TurnJob() | EndJob():  # names an experiment this worker does not serve
                await self.publisher.reject_unknown(job.record, job.message, job.route.experiment_id, job.attempt)

    async def _handle_ready(self, job: ReadyJob, experiment: Experiment) -> None:
        traj, group = job.message, job.group
        if job.probe is None:
            (job.probe,) = await self.ledger.probe_many([(group, traj.trajectory_id)])
        if job.probe is not ProbeOutcome.NEW:  # parked already, or its group decided or finished
            await self._settle_probe(job, job.probe)
            return
        if job.result is None:
            job.result = await self._score(traj, experiment)
            self._tokens.remember(group, traj.trajectory_id, job.result.turns)
        await self._park(job, traj.group_size, experiment, job.record.partition, job.record.offset)

    async def _park(
        self, job: ReadyJob | EndJob, group_size: int, experiment: Experiment, partition: int, offset: int
    ) -> None:
        """Park ``job.result``, then settle what the ledger answered."""
        assert job.result is not None
        if job.result.status == "failed":
            # Parking a failed member decides (rejects) the group: the members consumed
            # before it go first, so the verdict lists them with their stats.
            await job.wait_earlier()
        result = msgspec.structs.replace(job.result, consumed_at=job.consumed_at, parked_at=time.time())
        ((outcome, decision),) = await self.ledger.park_many(
            [
                ParkRequest(
                    result,
                    job.group,
                    group_size,
                    experiment.group_timeout_s,
                    self.worker_id,
                    experiment.scorers_blob,
                    partition,
                    offset,
                )
            ]
        )
        await self._settle_park(job, outcome, decision)

    async def _handle_turn(self, job: TurnJob, experiment: Experiment) -> None:
        """Park a streamed turn and start judging its parent; a turn of a member already parked,
        or of a decided group, is acknowledged as a duplicate. One that does not continue its
        session is dead-lettered and rejects its group."""
        turn, group = job.message, job.group
        (probe,) = await self.ledger.probe_many([(group, turn.trajectory_id)])
        if probe is not ProbeOutcome.NEW:
            if probe is ProbeOutcome.DECIDED:
                await self.ledger.nudge(group, self.cfg.worker.republish_grace_s)
            self._acknowledged(job, duplicate=probe is ProbeOutcome.DUPLICATE, at_park=False)
            return
        assert self.streams is not None
        try:
            outcome = await self.streams.add_turn(group, turn, experiment.runner)
        except InvalidMessage as exc:
            await self._dead_letter(job.record, exc, job.attempt, group_id=group)
            return
        if outcome is TurnOutcome.DUPLICATE:
            self._acknowledged(job, duplicate=True, at_park=False)

    async def _handle_end(self, job: EndJob, experiment: Experiment) -> None:
        """Score a streamed session's member once it ends — its streamed turn results reused,
        only the rest run — and park it exactly as a ``ready`` member."""
        end, group = job.message, job.group
        assert self.streams is not None
        if job.probe is None:
            (job.probe,) = await self.ledger.probe_many([(group, end.trajectory_id)])
        if job.probe is not ProbeOutcome.NEW:
            await self._settle_probe(job, job.probe)
            if job.probe is ProbeOutcome.DUPLICATE:  # parked before a crash: the session is done
                await self.streams.close(group, end.trajectory_id)
            return
        if job.result is None:
            try:
                traj, reuse = await self.streams.ended(group, end)
            except InvalidMessage as exc:
                await self._dead_letter(job.record, exc, job.attempt, group_id=group)
                await self.streams.close(group, end.trajectory_id)
                return
            job.result = await self._score(traj, experiment, reuse)
            if self._samples is not None:  # its turns went out as online samples: online trainers have them
                job.result = msgspec.structs.replace(job.result, online_samples=True)
            self._tokens.remember(group, end.trajectory_id, job.result.turns)
        # no record holds a streamed member whole: its token turns come from this worker's memory
        await self._park(job, end.group_size, experiment, STREAMED_PARTITION, -1)
        if self._samples is not None:
            await self._samples.ended(group, end, self.streams.last_turns(group, end.trajectory_id))
        await self.streams.close(group, end.trajectory_id)

    async def _score(
        self, traj: ReadyTrajectory, experiment: Experiment | None = None, reuse: Reuse | None = None
    ) -> SessionResult:
        experiment = experiment or self.fleet.get(DEFAULT_EXPERIMENT) or self.fleet.retired(DEFAULT_EXPERIMENT)
        t0 = time.perf_counter()
        result = await score_member(
            experiment.runner,
            traj,
            timeout_s=self.cfg.worker.scorer_timeout_s,
            keep_channels=self.cfg.worker.keep_scorer_channels,
            reuse=reuse,
        )
        if result.status == "failed":  # the member fails; the group will be rejected
            self.telemetry.member_failures.labels(reasons.metric_label("failed", result.failure_code)).inc()
            log.info("group=%s traj=%s: scoring failed: %s", traj.group_id, traj.trajectory_id, result.error)
        elif experiment.runner is not None:
            self.telemetry.scoring_seconds.observe(time.perf_counter() - t0)
            self.telemetry.scored.inc()
        return result

    async def _dead_letter(
        self, record: ConsumerRecord, error: BaseException, attempt: int, *, group_id: str | None = None
    ) -> None:
        """Dead-letter ``record`` (:meth:`Publisher.dead_letter`), then reject the (scoped) group
        its key names (``invalid_member``) instead of letting it wait for its deadline."""
        letter = await self.publisher.dead_letter(record, error, attempt)
        if group_id is not None:
            reason = (
                f"invalid_member: record {record.topic}:{record.partition}@{record.offset} was dead-lettered "
                f"({letter.error_class}: {letter.error_message[:200]})"
            )
            await self._decide(group_id, DecisionKind.INVALID, discard_reason=reason)

    async def _decide(self, group_id: str, kind: DecisionKind, *, discard_reason: str = "") -> None:
        """Decide the (scoped) group ``group_id``, then settle what the ledger answered."""
        _, experiment = self._served(group_id)
        decision = await self.ledger.decide(
            group_id,
            kind,
            worker_id=self.worker_id,
            scorers=experiment.scorers_blob,
            discard_reason=discard_reason,
            group_timeout_s=experiment.group_timeout_s,
            republish_grace_s=self.cfg.worker.republish_grace_s,
        )
        await self._settle_decision(decision)

    # ------------------------------------------------------------------ settling: one per ledger call
    async def _settle_probe(self, job: ReadyJob | EndJob, probe: ProbeOutcome) -> None:
        """A member the probe found known is acknowledged without scoring. Parked already (a
        redelivery): re-run the ``complete`` decision, in case the crash came between parking
        the last member and deciding. Its group decided and not finished: bring its sweep
        forward (its decider may have died before publishing)."""
        match probe:
            case ProbeOutcome.DUPLICATE:
                if self._tokens.inline and isinstance(job, ReadyJob):
                    with contextlib.suppress(NotConcatExport):  # the record in hand spares reading its tokens back
                        self._tokens.remember(
                            job.group, job.message.trajectory_id, compact_turns(job.message.interactions)
                        )
                await self._decide(job.group, DecisionKind.COMPLETE)
            case ProbeOutcome.DECIDED:
                await self.ledger.nudge(job.group, self.cfg.worker.republish_grace_s)
            case ProbeOutcome.DONE | ProbeOutcome.NEW:
                pass
        self._acknowledged(job, duplicate=probe is ProbeOutcome.DUPLICATE, at_park=False)

    async def _settle_park(self, job: ReadyJob | EndJob, outcome: ParkOutcome, decision: Decision | None) -> None:
        """This park decided the group (it completed it, or failed): publish its verdict. A
        member of a group decided meanwhile nudges it (as :meth:`_settle_probe`); one parked
        before, or of a finished group, is acknowledged."""
        if decision is not None:
            await self.publisher.publish(decision)
            return
        match outcome:
            case ParkOutcome.PARKED:
                return
            case ParkOutcome.DECIDED:
                await self.ledger.nudge(job.group, self.cfg.worker.republish_grace_s)
            case ParkOutcome.DUPLICATE | ParkOutcome.DONE:
                pass
        self._acknowledged(job, duplicate=outcome is ParkOutcome.DUPLICATE, at_park=True)

    async def _settle_decision(self, decision: Decision) -> None:
        """This call decided the group: publish its verdict. Decided before and not finished:
        bring its sweep forward. Finished (or vanished): drop its index entry."""
        match decision.outcome:
            case DecideOutcome.DECIDED_NOW:
                await self.publisher.publish(decision)
            case DecideOutcome.ALREADY_DECIDED:
                await self.ledger.nudge(decision.group_id, self.cfg.worker.republish_grace_s)
            case DecideOutcome.DONE | DecideOutcome.GONE:
                await self.ledger.forget(decision.group_id)
            case DecideOutcome.NOT_DUE | DecideOutcome.INCOMPLETE:
                pass

    def _acknowledged(self, job: ReadyJob | EndJob | TurnJob, *, duplicate: bool, at_park: bool) -> None:
        """``job`` is acknowledged without being scored (again): counted as deduplicated, and said (throttled)."""
        self.telemetry.deduplicated.inc()
        what = (
            "already scored (a redelivery or a re-published record)"
            if duplicate
            else "its group is already decided (a re-published or redriven record"
            + (", or decided while it was scored)" if at_park else ")")
        )
        self._duplicates_log.log(
            logging.INFO,
            "group=%s traj=%s: duplicate acknowledged%s, %s",
            job.message.group_id,
            job.message.trajectory_id,
            " at park" if at_park else "",
            what,
        )


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
