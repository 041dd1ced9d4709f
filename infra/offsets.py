"""Which offsets may be committed while records of one partition finish out of order.

Shared by the scoring worker and the trainer's verdict consumer.

Records of a partition are processed concurrently, so record 7 may be done while
record 5 is still scoring. Kafka's committed offset means "everything below is
done", so we may only commit up to the lowest unfinished offset; committing 8 there
would lose record 5 if the worker died.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

log = logging.getLogger(__name__)


@dataclass
class _PartitionState:
    pending: set[int] = field(default_factory=set)
    next_offset: int = -1  # one past the highest offset seen
    committed: int = -1


class OffsetTracker:
    """Tracks in-flight offsets per partition and answers what is safe to commit."""

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _PartitionState] = {}

    def begin(self, tp: TopicPartition, offset: int) -> None:
        st = self._parts.setdefault(tp, _PartitionState())
        st.pending.add(offset)
        st.next_offset = max(st.next_offset, offset + 1)

    def finish(self, tp: TopicPartition, offset: int) -> None:
        st = self._parts.get(tp)
        if st is not None:  # the partition may have been revoked meanwhile
            st.pending.discard(offset)

    def in_flight(self, tps: set[TopicPartition] | None = None) -> int:
        return sum(len(st.pending) for tp, st in self._parts.items() if tps is None or tp in tps)

    def committable(self, tps: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Offsets to commit now (only partitions whose safe offset moved since the last commit)."""
        out: dict[TopicPartition, int] = {}
        for tp, st in self._parts.items():
            if tps is not None and tp not in tps:
                continue
            safe = min(st.pending) if st.pending else st.next_offset
            if safe > st.committed and safe >= 0:
                out[tp] = safe
        return out

    def committed(self, tp: TopicPartition) -> int | None:
        """The highest offset committed for ``tp`` through this tracker (None: none yet)."""
        st = self._parts.get(tp)
        return st.committed if st is not None and st.committed >= 0 else None

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, offset in offsets.items():
            st = self._parts.get(tp)
            if st is not None:
                st.committed = max(st.committed, offset)

    def drop(self, tps: Iterable[TopicPartition] | None = None) -> None:
        """Forget revoked partitions (all when None); their unfinished records will be redelivered."""
        if tps is None:
            self._parts.clear()
        for tp in tps or ():
            self._parts.pop(tp, None)


class OffsetCommitter:
    """The one commit path of a group-managed consumer: tracker, commit call, revoke handling.

    Shared by the scoring worker and the trainer's verdict consumer, so both follow the
    same discipline: commit only what :class:`OffsetTracker` says is safe, one commit at
    a time, and on revocation commit the revoked partitions' finished offsets before
    forgetting them. A rebalance can land at any ``await``; every step here tolerates a
    partition that stopped being ours meanwhile (its commit fails, is logged and the new
    owner gets the records again — at-least-once, never a crash).
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        *,
        owner: str,
        on_failure: Callable[[BaseException], None] | None = None,
        min_interval_s: float = 0.0,
    ) -> None:
        self.consumer = consumer
        self.tracker = OffsetTracker()
        self.owner = owner
        self._on_failure = on_failure
        self._lock = asyncio.Lock()
        # Routine commits at most this often: each is a broker request (client and broker
        # CPU) whatever it carries, and a later one covers the offsets of the ones skipped.
        # A crash redelivers at most this much more, deduplicated downstream. Revocation
        # and shutdown commits are never delayed.
        self.min_interval_s = min_interval_s
        self._last_commit = -float("inf")

    @property
    def busy(self) -> bool:
        """A commit is in flight (a caller polling in a loop need not queue another)."""
        return self._lock.locked()

    @property
    def due(self) -> bool:
        """A routine :meth:`commit` would act now (``min_interval_s`` since the last one)."""
        return time.monotonic() - self._last_commit >= self.min_interval_s

    def committed(self, tp: TopicPartition) -> int | None:
        """The last offset this member committed for ``tp`` (None: nothing yet)."""
        return self.tracker.committed(tp)

    async def commit(self, tps: set[TopicPartition] | None = None, *, routine: bool = False) -> None:
        """Commit what is safe on ``tps`` (all if None); a refused commit is logged, never raised.

        The records whose offsets did not land are redelivered (to us or to the
        partition's next owner) and deduplicated downstream. A ``routine`` commit (a
        polling loop's) does nothing until ``min_interval_s`` passed since the last one.
        """
        if routine and not self.due:
            return
        async with self._lock:
            offsets = self.tracker.committable(tps)
            assigned = self.consumer.assignment()  # no await before the commit call: stays current
            gone = {tp for tp in offsets if tp not in assigned}
            if gone:  # revoked while its records were in flight: the new owner commits them
                self.tracker.drop(gone)
                offsets = {tp: off for tp, off in offsets.items() if tp not in gone}
            if not offsets:
                return
            self._last_commit = time.monotonic()
            try:
                await self.consumer.commit(offsets)
            except KafkaError as exc:  # CommitFailedError, IllegalStateError (revoked meanwhile), ...
                if self._on_failure is not None:
                    self._on_failure(exc)
                log.warning(
                    "%s: commit of %s failed (%s: %s); those records will be redelivered",
                    self.owner,
                    _describe(offsets),
                    type(exc).__name__,
                    exc,
                )
                return
            self.tracker.mark_committed(offsets)

    async def lag(self) -> dict[TopicPartition, int]:
        """``highwater - committed`` per assigned partition whose highwater is known.

        The assignment is read and every ``highwater()`` taken with no ``await`` between
        them, so a rebalance cannot revoke a partition halfway (aiokafka asserts on an
        unassigned one); committed offsets this member has not written yet are asked of
        the broker, and a partition revoked during that ask is skipped.
        """
        highs = {tp: high for tp in self.consumer.assignment() if (high := self.consumer.highwater(tp)) is not None}
        out: dict[TopicPartition, int] = {}
        for tp, high in highs.items():
            committed = self.tracker.committed(tp)
            if committed is None:
                try:
                    committed = await self.consumer.committed(tp)
                except KafkaError:
                    continue
                if tp not in self.consumer.assignment():
                    continue
            out[tp] = max(0, high - (committed or 0))
        return out

    async def revoke(self, tps: set[TopicPartition] | None) -> None:
        """Commit what is finished on ``tps`` (all if None), then forget them."""
        await self.commit(tps)
        self.tracker.drop(tps)


def _describe(offsets: dict[TopicPartition, int]) -> str:
    return ", ".join(f"{tp.topic}:{tp.partition}@{off}" for tp, off in sorted(offsets.items()))
