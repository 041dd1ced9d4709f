"""The trainer's end of ``prm.verdicts``: verdicts in, deduplicated :class:`TrainingBatch`\\ es out.

Long on purpose: dedupe, filtering, commit-after-acknowledge and batching share one offset discipline.

::

    async with VerdictConsumer(cfg) as consumer:
        async for batch in consumer:       # asking for the next batch acknowledges this one
            train_step(batch.to(device))

Per record: decode (an undecodable record is logged and counted, never fatal) -> a
verdict of another experiment is skipped (below) -> dedupe on
``(experiment_id, group_id, verdict_version)`` -> an accepted verdict that names its
members' records (``worker.verdict_tokens: reference``, or ``auto`` for a verdict too
large to carry the tokens; decided per verdict) gets its members' token turns read back from the
trajectories topic (:mod:`infra.readback`, the worker's own read-back and its
``tokens_unavailable`` rule; outages are retried with backoff) -> count its metrics -> rejected and
discarded groups stop here -> an accepted group is exported to concat rows
(:func:`shaper.batch.export_group`; a :class:`~shaper.batch.ConcatExportError` drops
the group and is counted) -> the configured group filter judges the complete group ->
kept groups wait in a buffer until ``batch_groups`` of them make a batch.

Online mode (``trainer.online_samples``, OpenClaw-RL's recipe only): a member marked
``online_samples`` had each of its turns trained as an online turn sample
(:class:`shaper.online.TurnSampleConsumer`) while its session ran, so it is left out of
its group here (``pipeline/members/trained_online``); a group left empty adds no rows.
OpenClaw-RL's recipe trains each turn as a group of one, so the other members' rows do
not change.

Experiments (docs/fleet.md). A consumer trains one experiment, ``trainer.experiment``:
it reads that experiment's verdicts topic (``prm.verdicts.<experiment>``; the default
experiment keeps ``prm.verdicts``) in the group :attr:`infra.config.TrainerConfig.consumer_group`.
Two experiments may use the same group ids: the dedupe key names the experiment, so
neither hides the other's verdicts. A verdict on this topic that names another
experiment was published to the wrong topic; it is skipped, counted
(``pipeline/verdicts/wrong_experiment``) and warned about at most once a minute with its
coordinates, never trained on.

Commit discipline (docs/architecture.md, "Commit discipline"). A record's offset is committed only when nothing
derived from it is still owed to the caller: records that produce no rows
(rejected, discarded, duplicate, undecodable, filtered, unexportable) are finished
when processed; a record whose group went into a batch is finished when that batch has
been handed out **and** the caller came back — asked for the next batch, called
:meth:`VerdictConsumer.commit`, or left the ``async with`` block without an exception.
Commits only happen at those moments, per partition up to the lowest unfinished
offset, so a trainer that crashes mid-step gets its unfinished groups again.

Dedupe guarantees, in layers:

* **within one instance** (also across :meth:`~VerdictConsumer.stop` /
  :meth:`~VerdictConsumer.start` and rebalances): a group is handed out at most once.
  Every processed key stays in an in-memory seen-set (bounded by
  ``trainer.dedupe_max_seen``, oldest evicted first) until the instance is dropped; redelivered copies of groups
  already handed out are
  counted as duplicates and acknowledged.
* **across restarts**, only with a durable :class:`DedupeStore` (``dedupe_store=`` a
  path, :class:`SqliteDedupeStore`): keys are written to it when their records are
  acknowledged, *before* the offset commit. A verdict re-published by a worker after
  the original was acknowledged, or redelivered because the process died between the
  store write and the commit, is skipped. Groups handed out but never acknowledged are
  deliberately *not* in the store: a crash mid-step must redo them.
* **a fresh instance without a durable store** relies on committed offsets alone:
  unacknowledged groups are delivered again (at-least-once — intended: that work was
  not finished), and a worker's re-published duplicate of an already acknowledged
  verdict would be trained on a second time.

Metrics follow the seed: they are scoring metrics, not exactly-once accounting; a
redelivered record whose key is unknown to the instance and the store counts again.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

import msgspec
import torch
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.structs import ConsumerRecord, TopicPartition

from infra.config import ConfigError, PipelineConfig
from infra.experiments import check_experiment_id, scoped_group, trajectories_topic, verdicts_topic
from infra.kafka import make_consumer, require_topics
from infra.offsets import OffsetCommitter
from infra.readback import TOKENS_RETRY, VerdictTokens, needs_tokens
from infra.schema import GroupVerdict, SchemaError, decode_verdict
from infra.throttle import Every

from .batch import ConcatExportError, ExportedGroup, TrainingBatch, collate, export_group, resolve_device
from .filters import GroupFilter, get_filter
from .metrics import VerdictMetrics

__all__ = ["DedupeKey", "DedupeStore", "SqliteDedupeStore", "VerdictConsumer"]

log = logging.getLogger(__name__)

DedupeKey = tuple[str, str, int]
"""``(experiment_id, group_id, verdict_version)``: the identity of a verdict (docs/architecture.md,
"Guarantees"); two experiments may use the same group ids."""

WRONG_EXPERIMENT_WARN_EVERY_S = 60.0
"""At most one warning per this many seconds about verdicts of another experiment (each is counted)."""

_FROM_CONFIG: Final[Any] = object()


# --------------------------------------------------------------------------- dedupe store
@runtime_checkable
class DedupeStore(Protocol):
    """Durable memory of acknowledged verdict keys, for dedupe across restarts."""

    def contains(self, key: DedupeKey) -> bool: ...

    def add_many(self, keys: Iterable[DedupeKey]) -> None: ...

    def close(self) -> None: ...


class SqliteDedupeStore:
    """A :class:`DedupeStore` in one sqlite file (stdlib, no server, survives restarts).

    The ``group_id`` column holds the scoped group (:func:`infra.experiments.scoped_group`):
    the bare id for the default experiment, so a file written before experiments existed
    keeps deduplicating the same verdicts.

    Each acknowledgement is one transaction, so a crash leaves either all or none of a
    batch's keys. Entries older than ``retention_s`` are pruned when the store is
    opened and hourly while it is used: a duplicate cannot arrive after the verdicts
    topic itself forgot the record. Not meant to be shared by trainers on different hosts (use one consumer
    group member per store file).
    """

    def __init__(self, path: str | os.PathLike[str], *, retention_s: float | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS acknowledged ("
            " group_id TEXT NOT NULL, verdict_version INTEGER NOT NULL, acked_at REAL NOT NULL,"
            " PRIMARY KEY (group_id, verdict_version)) WITHOUT ROWID"
        )
        self.retention_s = retention_s
        self._pruned_at = 0.0
        self._prune()

    def _prune(self) -> None:
        """Drop keys older than ``retention_s``: on open and then at most every
        ``PRUNE_INTERVAL_S`` while acknowledging, so a trainer that runs for weeks keeps a
        file bounded by the verdicts' retention rather than by its uptime."""
        if self.retention_s is None:
            return
        now = time.time()
        self._db.execute("DELETE FROM acknowledged WHERE acked_at < ?", (now - self.retention_s,))
        self._pruned_at = now

    def contains(self, key: DedupeKey) -> bool:
        experiment_id, group_id, version = key
        row = self._db.execute(
            "SELECT 1 FROM acknowledged WHERE group_id = ? AND verdict_version = ?",
            (scoped_group(experiment_id, group_id), version),
        ).fetchone()
        return row is not None

    PRUNE_INTERVAL_S = 3600.0

    def add_many(self, keys: Iterable[DedupeKey]) -> None:
        now = time.time()
        if now - self._pruned_at >= self.PRUNE_INTERVAL_S:
            self._prune()
        rows = [(scoped_group(e, g), v, now) for e, g, v in keys]
        if not rows:
            return
        self._db.execute("BEGIN")
        try:
            self._db.executemany("INSERT OR IGNORE INTO acknowledged VALUES (?, ?, ?)", rows)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM acknowledged").fetchone()[0])

    def close(self) -> None:
        self._db.close()


# --------------------------------------------------------------------------- offsets
@dataclass(frozen=True, slots=True)
class _Ticket:
    """Where a batched group came from, so its offset can be finished on acknowledgement."""

    tp: TopicPartition
    offset: int
    key: DedupeKey
    policy_version: int | None = None  # the group's oldest member's (None: unknown)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, owner: VerdictConsumer) -> None:
        self.owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        if revoked:
            await self.owner._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("trainer consumer assigned %s", sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))


def _oldest_policy_version(verdict: GroupVerdict) -> int | None:
    """The oldest policy that produced a member of the group; None if any member does not say."""
    versions = [s.policy_version for s in verdict.sessions]
    if not versions or any(v is None for v in versions):
        return None
    return min(versions)  # type: ignore[type-var]


# --------------------------------------------------------------------------- consumer
class VerdictConsumer:
    """Consume the experiment's verdicts topic in the trainer's group; yield deduplicated batches.

    Args:
        cfg: the pipeline config (Kafka settings, ``topics.verdicts``, ``trainer.*``).
        experiment: the experiment trained on; default ``cfg.trainer.experiment``. Its
            verdicts topic is read (:func:`infra.experiments.verdicts_topic`).
        batch_groups: accepted (and kept) groups per batch; default
            ``cfg.trainer.batch_groups``.
        group_filter: a name in :data:`shaper.filters.FILTERS`, a filter callable (it is given the
            :class:`~shaper.batch.ExportedGroup`, a mapping of the filter tensors), or
            ``None`` for none; default ``cfg.trainer.filter``.
        group_id: the consumer group; default ``cfg.trainer.group_id`` for the default
            experiment, ``<cfg.trainer.group_id>.<experiment>`` for another.
        dedupe_store: a path (opened as :class:`SqliteDedupeStore`) or a
            :class:`DedupeStore` for dedupe across restarts; ``None`` = in-memory only.
        device: where batches are delivered; default ``cfg.trainer.device``
            (``auto`` = cuda if available).
        pad_token_id: padding id for ``input_ids``.
        pad_to_multiple_of: round the padded width up to a multiple of this.
        train_on_eval: batch groups whose members are evaluation rollouts
            (``is_eval``); off by default, their metrics still count under
            ``eval-rollout/``.
        poll_timeout_ms: longest single poll; bounds how quickly :meth:`request_stop`
            and idle timeouts are noticed.
        max_seen: size bound of the in-memory seen-set; default
            ``cfg.trainer.dedupe_max_seen``.
        max_policy_lag: staleness bound; default ``cfg.trainer.max_policy_lag``
            (``None``: off). Once the trainer says its policy version
            (:meth:`set_policy_version`), an accepted group whose oldest member is more
            than this many versions behind is dropped and counted as
            ``pipeline/filter/stale`` — also a group already buffered when the version
            moves on. Members without a ``policy_version`` never make a group stale.
        consumer_overrides: extra :func:`infra.kafka.make_consumer` keyword arguments.

    Keep ``kafka.max_poll_interval_ms`` above the longest training step: the consumer
    polls only while the caller waits for the next batch.
    """

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        batch_groups: int | None = None,
        group_filter: str | GroupFilter | None = _FROM_CONFIG,
        group_id: str | None = None,
        dedupe_store: str | os.PathLike[str] | DedupeStore | None = None,
        device: str | torch.device | None = None,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        train_on_eval: bool = False,
        poll_timeout_ms: int = 200,
        max_seen: int | None = None,
        max_policy_lag: int | None | Any = _FROM_CONFIG,
        consumer_overrides: dict[str, Any] | None = None,
        experiment: str | None = None,
    ) -> None:
        self.cfg = cfg
        trainer = cfg.trainer if experiment is None else msgspec.structs.replace(cfg.trainer, experiment=experiment)
        self.experiment = check_experiment_id(trainer.experiment)
        self.topic = verdicts_topic(cfg.topics.verdicts, self.experiment)
        self.group_id = group_id or trainer.consumer_group
        self._wrong_experiment_warning = Every(WRONG_EXPERIMENT_WARN_EVERY_S)
        self.wrong_experiment = 0  # verdicts of another experiment skipped (also pipeline/verdicts/wrong_experiment)
        self.batch_groups = int(batch_groups if batch_groups is not None else cfg.trainer.batch_groups)
        if self.batch_groups < 1:
            raise ConfigError(f"batch_groups must be >= 1, got {self.batch_groups}")
        if group_filter is _FROM_CONFIG:
            group_filter = cfg.trainer.filter
        self.filter_name = group_filter if isinstance(group_filter, str) else getattr(group_filter, "__name__", None)
        self._filter: GroupFilter | None = get_filter(group_filter) if isinstance(group_filter, str) else group_filter
        self.device = resolve_device(device if device is not None else cfg.trainer.device)
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.train_on_eval = train_on_eval
        self.poll_timeout_ms = max(1, int(poll_timeout_ms))
        # "waiting for N more groups": first after this long without a full batch, then at most this often
        self.wait_log_after_s = 5.0
        self.wait_log_every_s = 30.0
        self.max_seen = max(1, int(max_seen if max_seen is not None else cfg.trainer.dedupe_max_seen))
        self._overrides = dict(consumer_overrides or {})
        self.max_policy_lag: int | None = (
            cfg.trainer.max_policy_lag if max_policy_lag is _FROM_CONFIG else max_policy_lag
        )
        if self.max_policy_lag is not None and self.max_policy_lag < 0:
            raise ConfigError(f"max_policy_lag must be >= 0 or None, got {self.max_policy_lag}")
        self.policy_version: int | None = None  # the trainer's current policy (set_policy_version)
        # online mode: members whose turns went out as online turn samples are trained from those
        self.skip_online_members = cfg.trainer.online_samples
        if isinstance(dedupe_store, (str, os.PathLike)):
            self._store: DedupeStore | None = SqliteDedupeStore(
                dedupe_store, retention_s=2 * cfg.topics.retention_ms / 1000.0
            )
            self._owns_store = True
        else:
            self._store = dedupe_store
            self._owns_store = False

        self.metrics = VerdictMetrics()
        self._tokens = VerdictTokens(cfg)  # reads referenced members' turns (no connection until needed)
        self._consumer: AIOKafkaConsumer | None = None
        self._committer: OffsetCommitter | None = None  # one per start(): it owns the offsets
        self._seen: dict[DedupeKey, None] = {}  # insertion-ordered: evict oldest first
        self._buffer: list[tuple[ExportedGroup, _Ticket]] = []
        self._handed: list[_Ticket] = []  # in batches handed out, not yet acknowledged
        self._to_store: list[DedupeKey] = []  # finished keys not yet written to the store
        self._stop_requested = False
        self._closed = False

    @property
    def dedupe_size(self) -> int:
        """Keys in the in-memory seen-set (never above :attr:`max_seen`)."""
        return len(self._seen)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Join the consumer group. May be called again after :meth:`stop` (seen-set kept).
        A verdicts topic that does not exist is :class:`infra.kafka.TopicMissing` at once
        (a subscription to it would wait in silence)."""
        if self._closed:
            raise RuntimeError("VerdictConsumer was closed; create a new one")
        if self._consumer is not None:
            raise RuntimeError("VerdictConsumer is already started")
        await require_topics(self.cfg.kafka, [self.topic])
        consumer = make_consumer(self.cfg.kafka, group_id=self.group_id, **self._overrides)
        consumer.subscribe([self.topic], listener=_Rebalance(self))
        self._committer = OffsetCommitter(consumer, owner=f"trainer consumer ({self.group_id})")
        try:
            await consumer.start()
        except BaseException:
            self._committer = None
            await consumer.stop()  # release the half-started client's connections
            raise
        self._consumer = consumer
        self._stop_requested = False

    async def stop(self, *, commit: bool = True) -> None:
        """Leave the group.

        ``commit=True`` (a graceful stop) first acknowledges every batch handed out;
        ``commit=False`` behaves like a crash for Kafka: the handed-out groups'
        offsets stay uncommitted and a new consumer in the group gets them again
        (this instance still remembers them, see the module docstring). Buffered
        groups never handed out are forgotten either way, so they are processed
        again when redelivered.
        """
        consumer = self._consumer
        if consumer is None:
            return
        try:
            if commit:
                await self._acknowledge()
        finally:
            for _group, ticket in self._buffer:
                self._seen.pop(ticket.key, None)
            self._buffer.clear()
            self._handed.clear()
            self._committer = None
            self._consumer = None
            await consumer.stop()
            await self._tokens.aclose()

    async def aclose(self, *, commit: bool = True) -> None:
        """:meth:`stop`, then close an owned dedupe store; the instance cannot restart.

        :meth:`stop` is the pause that :meth:`start` undoes; this is the end.
        """
        try:
            await self.stop(commit=commit)
        finally:
            self._closed = True
            if self._owns_store and self._store is not None:
                self._store.close()

    async def close(self, *, commit: bool = True) -> None:
        """The former name of :meth:`aclose`, kept because docs/trainer.md documented it."""
        await self.aclose(commit=commit)

    async def __aenter__(self) -> VerdictConsumer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        # Leaving the block normally means the caller is done with every batch it got;
        # an exception means the last one may be unfinished: leave it for redelivery.
        await self.aclose(commit=exc_type is None)

    def request_stop(self) -> None:
        """Make a waiting :meth:`next_batch` return ``None`` (and ``async for`` end) soon.

        Safe from a signal handler installed with ``loop.add_signal_handler``.
        """
        self._stop_requested = True

    # ------------------------------------------------------------------ batches
    def __aiter__(self) -> AsyncIterator[TrainingBatch]:
        return self

    async def __anext__(self) -> TrainingBatch:
        batch = await self.next_batch()
        if batch is None:
            raise StopAsyncIteration
        return batch

    async def next_batch(
        self, *, idle_timeout_s: float | None = None, flush_partial: bool = True
    ) -> TrainingBatch | None:
        """Acknowledge the previous batch, then return the next one.

        Waits until ``batch_groups`` groups are ready. With ``idle_timeout_s``, when no
        record arrived for that long: returns the groups buffered so far as a smaller
        batch (``flush_partial``), else ``None``. Also returns ``None`` after
        :meth:`request_stop`.
        """
        consumer = self._require_started()
        await self._acknowledge()
        last_activity = time.monotonic()
        waiting = Every(self.wait_log_every_s, first_s=self.wait_log_after_s)
        while len(self._buffer) < self.batch_groups:
            if self._stop_requested:
                return None
            if waiting.due():
                self._log_waiting(idle_timeout_s if flush_partial else None)
            remaining = None if idle_timeout_s is None else idle_timeout_s - (time.monotonic() - last_activity)
            if remaining is not None and remaining <= 0:
                return self._emit(len(self._buffer)) if flush_partial and self._buffer else None
            timeout_ms = (
                self.poll_timeout_ms if remaining is None else max(1, min(self.poll_timeout_ms, int(remaining * 1000)))
            )
            # Fetch no more than the batch still needs: the client prefetches, so this
            # costs no round trips, and each batch's metrics cover the verdicts read for it.
            want = self.batch_groups - len(self._buffer)
            polled = await consumer.getmany(timeout_ms=timeout_ms, max_records=want)
            records = [record for part in polled.values() for record in part]
            if records:
                last_activity = time.monotonic()
                await self._process(records)
        return self._emit(self.batch_groups)

    def _log_waiting(self, idle_timeout_s: float | None) -> None:
        """Say why no batch comes yet: a trainer that prints nothing looks hung."""
        need = self.batch_groups - len(self._buffer)
        then = (
            f"a partial batch goes after {idle_timeout_s:g}s without a verdict"
            if idle_timeout_s is not None
            else "an idle timeout (trainer --idle-timeout S) would train on a partial batch"
        )
        log.info(
            "waiting for %d more group%s to fill a batch of %d (%d buffered); %s",
            need,
            "" if need == 1 else "s",
            self.batch_groups,
            len(self._buffer),
            then,
        )

    async def batches(
        self,
        *,
        max_batches: int | None = None,
        idle_timeout_s: float | None = None,
        flush_partial: bool = True,
    ) -> AsyncIterator[TrainingBatch]:
        """Yield up to ``max_batches`` batches; stop early after ``idle_timeout_s`` without records."""
        produced = 0
        while max_batches is None or produced < max_batches:
            batch = await self.next_batch(idle_timeout_s=idle_timeout_s, flush_partial=flush_partial)
            if batch is None:
                return
            produced += 1
            yield batch

    async def commit(self) -> None:
        """Acknowledge every batch handed out so far and commit what is finished."""
        self._require_started()
        await self._acknowledge()

    # ------------------------------------------------------------------ introspection
    def totals(self) -> dict[str, float]:
        """Merged scoring metrics and pipeline counters since this instance was created."""
        return self.metrics.totals()

    def set_policy_version(self, version: int) -> None:
        """The trainer's current policy version (after each optimiser step that publishes weights).

        With ``max_policy_lag`` set, buffered groups that are now too old are dropped (and
        counted) at once, so a batch never carries a group staler than the bound."""
        self.policy_version = int(version)
        if self.max_policy_lag is None:
            return
        kept = []
        for group, ticket in self._buffer:
            if self._too_old(ticket.policy_version):
                self.metrics.count("filter/stale")
                log.info(
                    "group %s: policy v%s is more than %d versions behind v%d, dropped (stale)",
                    ticket.key[1],
                    ticket.policy_version,
                    self.max_policy_lag,
                    self.policy_version,
                )
                if self._committer is not None:
                    self._committer.tracker.finish(ticket.tp, ticket.offset)
                self._to_store.append(ticket.key)
            else:
                kept.append((group, ticket))
        self._buffer = kept

    def _too_old(self, version: int | None) -> bool:
        return (
            self.max_policy_lag is not None
            and self.policy_version is not None
            and version is not None
            and self.policy_version - version > self.max_policy_lag
        )

    @property
    def buffered_groups(self) -> int:
        return len(self._buffer)

    @property
    def unacknowledged_groups(self) -> int:
        return len(self._handed)

    # ------------------------------------------------------------------ internals
    def _require_started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError("VerdictConsumer is not started: use 'async with VerdictConsumer(cfg)' or await start()")
        return self._consumer

    def _remember(self, key: DedupeKey) -> None:
        self._seen[key] = None
        while len(self._seen) > self.max_seen:
            self._seen.pop(next(iter(self._seen)))

    def _is_duplicate(self, key: DedupeKey) -> bool:
        if key in self._seen:
            return True
        return self._store is not None and self._store.contains(key)

    async def _process(self, records: list[ConsumerRecord]) -> None:
        if self._consumer is None or self._committer is None:
            return
        assigned = self._consumer.assignment()
        decoded: list[tuple[ConsumerRecord, TopicPartition, GroupVerdict | None]] = []
        for record in records:
            tp = TopicPartition(record.topic, record.partition)
            if tp not in assigned:
                continue  # revoked while the fetch was in flight: the new owner has it
            decoded.append((record, tp, self._decode(record)))
        await self._read_tokens(decoded)
        committer = self._committer
        if committer is None:  # stopped while reading tokens back
            return
        for record, tp, verdict in decoded:
            committer.tracker.begin(tp, record.offset)
            if verdict is None or not self._handle(verdict, record, tp):
                committer.tracker.finish(tp, record.offset)

    def _decode(self, record: ConsumerRecord) -> GroupVerdict | None:
        try:
            return decode_verdict(record.value, record.headers)
        except SchemaError as exc:
            self.metrics.count("verdicts/undecodable")
            log.error(
                "undecodable verdict at %s:%d offset %d skipped: %s: %s",
                record.topic,
                record.partition,
                record.offset,
                type(exc).__name__,
                exc,
            )
            return None

    async def _read_tokens(self, decoded: list[tuple[ConsumerRecord, TopicPartition, GroupVerdict | None]]) -> None:
        """Fill in referenced members' turns of the accepted, new verdicts (one read for all).

        Only those can become rows; a broker outage is retried with backoff (the records
        are not begun yet, so a stop meanwhile leaves them for redelivery)."""
        todo = [
            i
            for i, (_, _, v) in enumerate(decoded)
            if v is not None
            and v.status == "accepted"
            and needs_tokens(v)
            and v.experiment_id == self.experiment
            and not self._is_duplicate((v.experiment_id, v.group_id, v.verdict_version))
        ]
        if not todo:
            return

        def on_retry(exc: BaseException, _attempt: int, delay: float) -> None:
            log.warning(
                "reading members' tokens back from %s failed (%s: %s); retrying in %.1fs",
                trajectories_topic(self.cfg.topics.trajectories, self.experiment),
                type(exc).__name__,
                exc,
                delay,
            )

        resolved = await TOKENS_RETRY.run(
            lambda: self._tokens.resolve([decoded[i][2] for i in todo]),  # type: ignore[misc]
            what="reading members' tokens back",
            on_retry=on_retry,
        )
        for i, verdict in zip(todo, resolved):
            decoded[i] = (decoded[i][0], decoded[i][1], verdict)

    def _handle(self, verdict: GroupVerdict, record: ConsumerRecord, tp: TopicPartition) -> bool:
        """Process one decoded verdict; True when its group was buffered (offset stays pending)."""
        m = self.metrics
        if verdict.experiment_id != self.experiment:
            m.count("verdicts/wrong_experiment")
            self.wrong_experiment += 1
            if self._wrong_experiment_warning.due():
                log.warning(
                    "verdict of group %s of experiment %r at %s:%d offset %d skipped: this trainer trains "
                    "experiment %r (it was published to the wrong topic; %d such verdicts so far)",
                    verdict.group_id,
                    verdict.experiment_id,
                    record.topic,
                    record.partition,
                    record.offset,
                    self.experiment,
                    self.wrong_experiment,
                )
            return False
        key: DedupeKey = (verdict.experiment_id, verdict.group_id, verdict.verdict_version)
        if self._is_duplicate(key):
            m.count("verdicts/duplicate")
            log.debug(
                "group %s v%d: duplicate verdict at %s:%d offset %d skipped",
                key[1],
                key[2],
                record.topic,
                record.partition,
                record.offset,
            )
            return False
        self._remember(key)
        m.observe(verdict)
        version = _oldest_policy_version(verdict)
        group = self._admit(verdict, version)
        if group is None:
            self._to_store.append(key)
            return False
        self._buffer.append((group, _Ticket(tp, record.offset, key, version)))
        return True

    def _admit(self, verdict: GroupVerdict, version: int | None = None) -> ExportedGroup | None:
        """Export and filter an accepted verdict; None when it contributes no rows."""
        m = self.metrics
        if verdict.status != "accepted":
            log.info(
                "group %s %s (%s: %s): not trained on",
                verdict.group_id,
                verdict.status,
                verdict.reason_code or "-",
                verdict.reason,
            )
            return None
        if self.skip_online_members and any(s.online_samples for s in verdict.sessions):
            kept = [s for s in verdict.sessions if not s.online_samples]
            m.count("members/trained_online", len(verdict.sessions) - len(kept))
            if not kept:
                return None
            verdict = msgspec.structs.replace(verdict, sessions=kept)
        if self._too_old(version):
            m.count("filter/stale")
            log.info(
                "group %s: policy v%s is more than %d versions behind v%d, dropped (stale)",
                verdict.group_id,
                version,
                self.max_policy_lag,
                self.policy_version,
            )
            return None
        try:
            group = export_group(verdict)
        except ConcatExportError as exc:
            m.count("groups/dropped/concat_export_error")
            m.count(f"groups/dropped/concat_export_error/{exc.reason}")
            log.error("dropping group %s: %s", verdict.group_id, exc)
            return None
        except Exception:  # a verdict that trips a bug must not crash-loop the trainer
            m.count("groups/dropped/export_failed")
            log.exception("dropping group %s: exporting its rows failed", verdict.group_id)
            return None
        if not group.rows:
            m.count("groups/dropped/empty")
            return None
        if group.is_eval and not self.train_on_eval:
            m.count("groups/eval_not_trained")
            return None
        if self._filter is not None:
            try:
                decision = self._filter(group)  # the exported group itself: nothing is batched to filter it
            except Exception as exc:  # noqa: BLE001 - filters raise ValueError on bad groups
                m.count("groups/dropped/filter_error")
                log.error("dropping group %s: filter %s failed: %s", verdict.group_id, self.filter_name, exc)
                return None
            m.record_filter(decision)
            if not decision.keep:
                m.count("groups/dropped/filtered")
                return None
        return group

    def _emit(self, n: int) -> TrainingBatch:
        taken, self._buffer = self._buffer[:n], self._buffer[n:]
        self.metrics.count("groups/batched", len(taken))
        batch = collate(
            [group for group, _ in taken],
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            metrics=self.metrics.drain(),
        )
        self._handed.extend(ticket for _, ticket in taken)
        return batch if self.device.type == "cpu" else batch.to(self.device)

    async def _acknowledge(self) -> None:
        """The caller is done with every handed-out batch: store keys, then commit offsets."""
        committer = self._committer
        for ticket in self._handed:
            if committer is not None:
                committer.tracker.finish(ticket.tp, ticket.offset)
            self._to_store.append(ticket.key)
        self._handed.clear()
        if self._store is not None and self._to_store:
            self._store.add_many(self._to_store)  # before the commit: see the module docstring
        self._to_store.clear()
        if committer is not None:
            await committer.commit()

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit what is finished on ``revoked``, then forget them (another member takes over).

        Buffered groups from those partitions are dropped and un-remembered: the new
        owner (or this member, if they come back) processes them again. Groups
        already handed out stay remembered; if the caller never acknowledges them,
        the new owner redelivers them (at-least-once across members).
        """
        kept = []
        for group, ticket in self._buffer:
            if ticket.tp in revoked:
                self._seen.pop(ticket.key, None)
            else:
                kept.append((group, ticket))
        self._buffer = kept
        if self._committer is not None:
            await self._committer.revoke(revoked)
