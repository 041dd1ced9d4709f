"""Which offsets may be committed while records of one partition finish out of order.

Shared by the scoring worker and the trainer's verdict consumer.

Records of a partition are processed concurrently, so record 7 may be done while
record 5 is still scoring. Kafka's committed offset means "everything below is
done", so we may only commit up to the lowest unfinished offset; committing 8 there
would lose record 5 if the worker died.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition


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
