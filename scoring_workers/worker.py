"""The scoring worker: ``prm.trajectories`` in, ``prm.verdicts`` (and dead letters) out.

Long on purpose: the whole consume/score/park/decide/commit loop fits in one readable module, like arq's worker.

(Over 500 lines: one record lifecycle — dispatch, retries, handlers, publish, sweep — whose
steps share the commit discipline below.)

One asyncio loop per process, in the spirit of arq: poll, hand each record to a task,
commit what is finished, sweep deadlines. Run several processes for scale; they
share nothing but Kafka and Redis.

Per record (see docs/architecture.md):

1. decode — undecodable, unknown-version or invalid records go to the dead-letter
   topic with the reason in headers (capped so the whole dead letter fits the size
   limit); when the record's key names its group, the group is rejected at once
   (``invalid_member``) instead of waiting for its deadline;
2. pre-check the ledger for the whole poll in one round trip — duplicates and members
   of decided groups are acknowledged without scoring;
3. score with :class:`PRMRunner` under ``worker.scorer_timeout_s``; a failure parks a
   failed member (the group will be rejected, other members keep their stats);
4. park the result; whoever parks the last member decides the group and publishes
   the verdict, then the ledger leaves a tombstone. A verdict over
   ``kafka.max_message_bytes`` is published as ``rejected`` / ``verdict_too_large``
   (stats kept, token turns dropped) — it never blocks.

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
from typing import Any

import msgspec
from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition
from redis.exceptions import BusyLoadingError, OutOfMemoryError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from infra.config import PipelineConfig
from infra.kafka import backoff_delay, is_permanent, is_retriable, make_consumer, make_producer
from infra.offsets import OffsetTracker
from infra.redis import verify_access
from infra.schema import (
    DiscardGroup,
    GroupVerdict,
    NotConcatExport,
    ReadyTrajectory,
    SchemaError,
    ScorerInfo,
    SessionResult,
    compact_turns,
    dead_letter_headers,
    decode_message,
)
from scoring_workers.dead_letters import ProcessingError, capped_letter, group_of
from scoring_workers.heartbeat import Heartbeat
from scoring_workers.ledger import Decision, GroupLedger
from scoring_workers.scoring import score_member
from scoring_workers.telemetry import WorkerTelemetry
from scoring_workers.tokens import MemberTokens
from scoring_workers.verdicts import assemble_verdict, encode_scorers, fit_verdict

log = logging.getLogger(__name__)

# Retried with backoff for as long as they last (the record stays uncommitted): an
# outage must delay work, never dead-letter valid records. A full Redis (noeviction)
# or one loading its AOF after a restart is an outage too.
REDIS_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, BusyLoadingError, OutOfMemoryError, TryAgainError,
)
MAX_ATTEMPTS = 3  # non-transient processing errors before a record is dead-lettered
REPUBLISH_GRACE_S = 5.0
SWEEP_INTERVAL_S = 0.5
SWEEP_BACKOFF_S = 30.0  # a group the sweeper failed on (not an outage) is looked at again after this


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def is_transient(exc: BaseException) -> bool:
    """An outage worth waiting for: Redis unavailable/loading/full, or a retriable Kafka or network error."""
    return isinstance(exc, REDIS_TRANSIENT_ERRORS) or is_retriable(exc)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.worker._drain_partitions(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.worker.telemetry.ready = True  # joined the group (even with nothing assigned)
        log.info("worker %s assigned %s", self.worker.worker_id, sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))


class Worker:
    """One scoring worker process. ``await Worker(cfg).run(stop_event)``."""

    def __init__(self, cfg: PipelineConfig, *, worker_id: str | None = None,
                 concurrency: int | None = None, runner: Any | None = None) -> None:
        self.cfg = cfg
        self.worker_id = worker_id or default_worker_id()
        self.concurrency = concurrency or cfg.worker.concurrency
        self.telemetry = WorkerTelemetry()
        self._runner = runner
        self._owns_runner = runner is None
        self._tracker = OffsetTracker()
        self._tasks: dict[asyncio.Task[None], TopicPartition] = {}
        self._discards: dict[str, asyncio.Task[None]] = {}  # group_id -> in-flight DiscardGroup
        self._members: dict[str, set[asyncio.Task[None]]] = {}  # group_id -> in-flight members
        self._scorers_blob = encode_scorers([])
        self._tokens = MemberTokens(cfg)
        self._paused = False
        self._committing: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()

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
            await beats.step(getattr(self, "ledger", None), ready=self.telemetry.ready, stopping=stop.is_set())
            if stop.is_set():
                await asyncio.sleep(1.0)
            else:  # wake at stop: leave the heartbeat set while the ledger is still open
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

    async def _run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        if self._runner is None and cfg.prm.active:
            from scoring_workers.prm import PRMRunner

            self._runner = await PRMRunner.create(cfg.prm, allowed_prefixes=cfg.worker.allowed_scorer_modules)
        if self._runner is not None:
            self._scorers_blob = encode_scorers(
                [ScorerInfo(s.name, s.version) for s in self._runner.scorer_infos()]
            )
        self.ledger = GroupLedger.from_config(cfg.redis, dedupe_window_s=cfg.worker.dedupe_window_s)
        try:
            await verify_access(self.ledger.redis, cfg.redis)  # wrong credentials / untrusted TLS: stop, clearly
        except BaseException:
            await self.ledger.aclose()
            if self._owns_runner and self._runner is not None:
                await self._runner.aclose()
            raise
        self.producer = make_producer(cfg.kafka)
        self.consumer = make_consumer(cfg.kafka, group_id=cfg.worker.group_id)
        await self.producer.start()
        try:
            self.consumer.subscribe([cfg.topics.trajectories], listener=_Rebalance(self))
            if not await _unless_stopped(self.consumer.start(), stop):
                await self.consumer.stop()
                return  # stopped while joining: nothing consumed, nothing to commit
            try:
                await self._loop(stop)
            finally:
                await self._drain_partitions(None)
                await self.consumer.stop()
        finally:
            await self.producer.stop()
            await self.ledger.aclose()
            await self._tokens.aclose()
            if self._owns_runner and self._runner is not None:
                await self._runner.aclose()
            log.info("worker %s stopped: %s", self.worker_id, self.telemetry.snapshot())

    async def _loop(self, stop: asyncio.Event) -> None:
        last_sweep = last_lag = 0.0
        sweeper: asyncio.Task[None] | None = None
        self.ready.set()
        log.info("worker %s polling %s", self.worker_id, self.cfg.topics.trajectories)
        while not stop.is_set():
            self._apply_backpressure()
            room = max(1, self.concurrency - len(self._tasks))
            batch = await self.consumer.getmany(
                timeout_ms=100, max_records=min(room, self.cfg.worker.poll_max_records)
            )
            records = [r for rs in batch.values() for r in rs]
            if records:
                await self._dispatch(records)
            if self._committing is None or self._committing.done():
                # in the background: polling never waits for the commit round trip
                self._committing = asyncio.create_task(self._commit())
            now = time.monotonic()
            if now - last_sweep >= SWEEP_INTERVAL_S * random.uniform(0.8, 1.2) and (sweeper is None or sweeper.done()):
                sweeper = asyncio.create_task(self._sweep())
                last_sweep = now
            if now - last_lag >= 5.0:
                await self._update_lag()
                last_lag = now
        log.info("worker %s stopping: draining %d in-flight records", self.worker_id, len(self._tasks))
        if sweeper is not None:
            with contextlib.suppress(Exception):
                await sweeper

    def _apply_backpressure(self) -> None:
        full = len(self._tasks) >= self.concurrency
        assignment = self.consumer.assignment()
        if full and not self._paused and assignment:
            self.consumer.pause(*assignment)
            self._paused = True
        elif not full and self._paused:
            self.consumer.resume(*assignment)
            self._paused = False

    async def _drain_partitions(self, tps: set[TopicPartition] | None) -> None:
        """Wait (bounded) for in-flight records of ``tps`` (all if None), commit, forget them."""
        tasks = [t for t, tp in self._tasks.items() if tps is None or tp in tps]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.cfg.worker.drain_timeout_s)
            if pending:
                log.warning("worker %s: %d records still running after drain timeout; "
                            "they will be redelivered", self.worker_id, len(pending))
        if self._committing is not None:  # one commit at a time: let the background one land
            with contextlib.suppress(Exception):
                await self._committing
        await self._commit()
        if tps is not None:
            self._tracker.drop(tps)

    async def _commit(self) -> None:
        offsets = self._tracker.committable()
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
            self._tracker.mark_committed(offsets)
        except (CommitFailedError, KafkaError) as exc:
            log.warning("worker %s: commit of %s failed (%s); records will be redelivered", self.worker_id, offsets, exc)

    async def _update_lag(self) -> None:
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is None:
                continue
            committed = await self.consumer.committed(tp) or 0
            self.telemetry.lag.labels(tp.topic, str(tp.partition)).set(max(0, high - committed))

    # ------------------------------------------------------------------ dispatch
    async def _dispatch(self, records: list[ConsumerRecord]) -> None:
        consumed_at = time.time()
        decoded: list[tuple[ConsumerRecord, Any]] = []
        for record in records:
            try:
                decoded.append((record, decode_message(record.value, record.headers)))
            except SchemaError as exc:
                decoded.append((record, exc))
        ready = [(r, m) for r, m in decoded if isinstance(m, ReadyTrajectory)]
        probes = dict(zip((id(r) for r, _ in ready), await self._with_retry(
            lambda: self.ledger.probe_many([(m.group_id, m.trajectory_id) for _, m in ready]), "probe")))
        for record, message in decoded:
            tp = TopicPartition(record.topic, record.partition)
            self._tracker.begin(tp, record.offset)
            probe = probes.get(id(record))
            barrier: asyncio.Future[Any] | None = None
            if isinstance(message, ReadyTrajectory):
                barrier = self._discards.get(message.group_id)
                if barrier is not None:
                    probe = None  # stale: the discard ahead of it may decide the group
            elif isinstance(message, SchemaError) and (earlier := self._members.get(group_of(record.key) or "")):
                # its group is rejected (invalid_member) once the members consumed before it have parked
                barrier = asyncio.ensure_future(asyncio.wait(list(earlier)))
            task = asyncio.create_task(self._process(record, message, probe, after=barrier, consumed_at=consumed_at))
            if isinstance(message, ReadyTrajectory):
                self._members.setdefault(message.group_id, set()).add(task)
                task.add_done_callback(lambda t, g=message.group_id: self._member_done(g, t))
            if isinstance(message, DiscardGroup):
                # Records of a group behind its discard (same partition, later offset)
                # must see the discard's decision: they wait for it, not for each other.
                self._discards[message.group_id] = task
                task.add_done_callback(lambda t, g=message.group_id: self._discards.get(g) is t
                                       and self._discards.pop(g))
            self._tasks[task] = tp
            self.telemetry.in_flight.set(len(self._tasks))
            task.add_done_callback(lambda t, tp=tp, off=record.offset: self._done(t, tp, off))

    def _member_done(self, group_id: str, task: asyncio.Task[None]) -> None:
        members = self._members.get(group_id)
        if members is not None:
            members.discard(task)
            if not members:
                del self._members[group_id]

    def _done(self, task: asyncio.Task[None], tp: TopicPartition, offset: int) -> None:
        self._tasks.pop(task, None)
        self.telemetry.in_flight.set(len(self._tasks))
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():
                log.error("worker %s: record %s:%d not finished: %r", self.worker_id, tp, offset, task.exception())
            return  # not marked done: it will be redelivered
        self._tracker.finish(tp, offset)

    async def _process(self, record: ConsumerRecord, message: Any, probe: str | None,
                       after: asyncio.Future[Any] | None = None, consumed_at: float = 0.0) -> None:
        if after is not None:
            await asyncio.wait([after])  # its outcome, success or not, is in the ledger or retried
        attempt = 0
        while True:
            attempt += 1
            try:
                if isinstance(message, SchemaError):
                    self.telemetry.consumed.labels("invalid").inc()
                    await self._dead_letter(record, message, attempt)
                elif isinstance(message, DiscardGroup):
                    self.telemetry.consumed.labels("discard").inc()
                    await self._handle_discard(message)
                else:
                    self.telemetry.consumed.labels("ready").inc()
                    await self._handle_ready(message, probe, record, consumed_at)
                return
            except Exception as exc:
                if is_transient(exc):
                    self.telemetry.retries.labels(type(exc).__name__).inc()
                    delay = backoff_delay(attempt)
                    log.warning("worker %s: transient %s on %s:%d offset %d (attempt %d), retrying in %.2fs",
                                self.worker_id, type(exc).__name__, record.topic, record.partition, record.offset,
                                attempt, delay)
                    probe = None
                    await asyncio.sleep(delay)
                    continue
                # a bug or poison record: retry a little, then dead-letter it
                log.exception("worker %s: failed processing %s:%d offset %d (attempt %d)",
                              self.worker_id, record.topic, record.partition, record.offset, attempt)
                if attempt >= MAX_ATTEMPTS:
                    group_id = message.group_id if isinstance(message, (ReadyTrajectory, DiscardGroup)) else None
                    message = exc if isinstance(exc, SchemaError) else ProcessingError(exc)
                    await self._dead_letter(record, message, attempt, group_id=group_id)
                    return
                probe = None

    async def _with_retry(self, op: Any, what: str) -> Any:
        attempt = 0
        while True:
            attempt += 1
            try:
                return await op()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.telemetry.retries.labels(type(exc).__name__).inc()
                delay = backoff_delay(attempt, jitter=False)
                log.warning("worker %s: transient %s during %s, retrying in %.2fs", self.worker_id,
                            type(exc).__name__, what, delay)
                await asyncio.sleep(delay)

    # ------------------------------------------------------------------ handlers
    async def _handle_ready(self, traj: ReadyTrajectory, probe: str | None, record: ConsumerRecord,
                            consumed_at: float) -> None:
        wc = self.cfg.worker
        if probe is None:
            (probe,) = await self.ledger.probe_many([(traj.group_id, traj.trajectory_id)])
        if probe in ("done", "decided"):
            self.telemetry.deduplicated.inc()
            log.debug("group=%s traj=%s: group already decided, acknowledged", traj.group_id, traj.trajectory_id)
            if probe == "decided":  # decided, not finished: make sure a sweeper publishes soon
                await self.ledger.nudge(traj.group_id, REPUBLISH_GRACE_S)
            return
        if probe == "duplicate":
            # Already parked (a redelivery). If the crash came between parking the last
            # member and deciding, finish that decision now; the record in hand spares
            # reading its tokens back from the log.
            self.telemetry.deduplicated.inc()
            with contextlib.suppress(NotConcatExport):
                self._tokens.remember(traj.group_id, traj.trajectory_id, compact_turns(traj.interactions))
            await self._decide_and_publish(traj.group_id, "complete")
            return
        result = await self._score(traj)
        self._tokens.remember(traj.group_id, traj.trajectory_id, result.turns)
        result = msgspec.structs.replace(result, consumed_at=consumed_at, parked_at=time.time())
        outcome, decision = await self.ledger.park(
            result, group_id=traj.group_id, group_size=traj.group_size, group_timeout_s=wc.group_timeout_s,
            worker_id=self.worker_id, scorers=self._scorers_blob, republish_grace_s=REPUBLISH_GRACE_S,
            partition=record.partition, offset=record.offset,
        )
        if outcome in ("done", "decided"):
            self.telemetry.deduplicated.inc()  # the group was decided while we scored
            if outcome == "decided":
                await self.ledger.nudge(traj.group_id, REPUBLISH_GRACE_S)
        elif decision is not None and decision.outcome == "decided_now":
            await self._publish(decision)  # this member completed the group

    async def _score(self, traj: ReadyTrajectory) -> SessionResult:
        t0 = time.perf_counter()
        result = await score_member(self._runner, traj, timeout_s=self.cfg.worker.scorer_timeout_s,
                                    keep_channels=self.cfg.worker.keep_scorer_channels)
        if result.status == "failed":  # the member fails; the group will be rejected
            code = result.failure_code
            self.telemetry.member_failures.labels(code).inc()
            log.info("group=%s traj=%s: scoring failed: %s", traj.group_id, traj.trajectory_id, result.error)
        elif self._runner is not None:
            self.telemetry.scoring_seconds.observe(time.perf_counter() - t0)
            self.telemetry.scored.inc()
        return result

    async def _handle_discard(self, msg: DiscardGroup) -> None:
        await self._decide_and_publish(msg.group_id, "discard", discard_reason=msg.reason or "discarded")

    async def _decide_and_publish(self, group_id: str, kind: str, *, discard_reason: str = "") -> None:
        decision = await self.ledger.decide(
            group_id, kind, worker_id=self.worker_id, scorers=self._scorers_blob,  # type: ignore[arg-type]
            discard_reason=discard_reason, group_timeout_s=self.cfg.worker.group_timeout_s,
            republish_grace_s=REPUBLISH_GRACE_S,
        )
        if decision.outcome == "decided_now":
            await self._publish(decision)
        elif decision.outcome == "already_decided":
            await self.ledger.nudge(group_id, REPUBLISH_GRACE_S)
        elif decision.outcome in ("done", "gone"):
            await self.ledger.forget(group_id)

    async def _publish(self, decision: Decision) -> GroupVerdict | None:
        """Publish the decision's verdict and finish the group; None when Kafka refused it for good.

        A refused verdict (an authorization or topic error: the operator must act) stays
        decided in Redis, so the sweeper tries again after the re-publish grace — never
        in a tight loop, and never holding up other records or groups.
        """
        if decision.state.get("decision") == "discard":  # listed without results: no tokens needed
            members = [m.result for m in decision.members]
        else:
            members = await self._tokens.members(decision.group_id, decision.members)
        full = assemble_verdict(decision.group_id, decision.state, members)
        verdict, value, headers = fit_verdict(full, self.cfg.kafka.max_message_bytes)
        if verdict is not full:
            log.warning("group=%s: verdict over kafka.max_message_bytes=%d, published as %s",
                        verdict.group_id, self.cfg.kafka.max_message_bytes, verdict.reason[:200])
        try:
            await self.producer.send_and_wait(
                self.cfg.topics.verdicts, value, key=verdict.group_id.encode(), headers=headers
            )
            sent_at = time.time()
        except Exception as exc:
            if not is_permanent(exc):
                raise
            self.telemetry.publish_failures.labels(type(exc).__name__).inc()
            log.error("worker %s: verdict for group %s refused by Kafka (%s: %s); it stays decided and is "
                      "re-published after %.0fs", self.worker_id, verdict.group_id, type(exc).__name__, exc,
                      REPUBLISH_GRACE_S)
            await self.ledger.postpone(verdict.group_id, REPUBLISH_GRACE_S)
            return None
        await self.ledger.finish(verdict.group_id, verdict.status)
        self._tokens.forget_group(verdict.group_id)
        self.telemetry.observe_stages(verdict, sent_at)
        self.telemetry.verdicts.labels(verdict.status, verdict.reason.split(":", 1)[0]).inc()
        log.info("group=%s verdict=%s reason=%s sessions=%d by=%s", verdict.group_id, verdict.status,
                 verdict.reason, len(verdict.sessions), self.worker_id)
        return verdict

    async def _sweep(self) -> None:
        """Reject overdue groups and re-publish decisions whose publisher died.

        Each group is handled in isolation: a failure is logged and counted
        (``prm_worker_sweep_failures_total``) and the sweep goes on with the next group.
        """
        try:
            due = await self.ledger.due_groups()
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
                log.exception("worker %s: sweep failed for group %s; next look in %.0fs", self.worker_id,
                              group_id, SWEEP_BACKOFF_S)
                with contextlib.suppress(Exception):  # not every sweep: a broken group must not flood the log
                    await self.ledger.postpone(group_id, SWEEP_BACKOFF_S)

    async def _sweep_group(self, group_id: str) -> None:
        decision = await self.ledger.decide(
            group_id, "deadline", worker_id=self.worker_id, scorers=self._scorers_blob,
            group_timeout_s=self.cfg.worker.group_timeout_s, republish_grace_s=REPUBLISH_GRACE_S,
        )
        overdue = decision.outcome == "already_decided" and (
            time.time() * 1000 - decision.decided_at_ms >= REPUBLISH_GRACE_S * 1000
        )
        if decision.outcome == "decided_now" or overdue:
            await self._publish(decision)
        elif decision.outcome in ("done", "gone"):
            await self.ledger.forget(group_id)

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
        group_id = group_id or group_of(record.key)
        if group_id is not None:
            reason = (f"invalid_member: record {record.topic}:{record.partition}@{record.offset} was dead-lettered "
                      f"({letter.error_class}: {letter.error_message[:200]})")
            await self._decide_and_publish(group_id, "invalid", discard_reason=reason)


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
