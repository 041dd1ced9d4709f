"""Chunked trajectories in the worker: buffer chunk records per partition, hand on whole ones.

The worker's half of :mod:`infra.chunks`. A chunk record's offset is begun (in the
offset tracker) when it arrives and finished only with the task that processes the
whole trajectory, so the partition's commit stays below the first chunk until the
trajectory's outcome is durable: a crash or a rebalance replays every chunk. The
finished trajectory is processed as if it were its first chunk's record (that offset is
where the ledger parks it and where the token read-back starts). Chunks that never
complete are given up after ``worker.group_timeout_s`` and dead-lettered as one record
(the first chunk's), like a record that does not decode; a revoked partition's
partial trajectories are forgotten (the new owner replays them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiokafka.structs import ConsumerRecord, TopicPartition

from infra.chunks import Assembled, ChunkAssembler, IncompleteTrajectory, reassembled
from infra.schema import SchemaError, TrajectoryChunk

Dispatch = tuple[ConsumerRecord, Any, list[int]]
"""(record to process as, decoded message or SchemaError, other chunk offsets to finish with it)."""


class WorkerChunks:
    """The worker's chunk buffers, one scope per partition."""

    def __init__(self) -> None:
        self._assembler: ChunkAssembler[ConsumerRecord] = ChunkAssembler()

    def __len__(self) -> int:
        return len(self._assembler)

    def add(self, record: ConsumerRecord, chunk: TrajectoryChunk) -> list[Dispatch]:
        """Buffer one chunk record; returns the trajectories it finished, ready to dispatch."""
        tp = TopicPartition(record.topic, record.partition)
        return [self._dispatch(done) for done in self._assembler.add(tp, chunk, record)]

    def expired(self, max_age_s: float) -> list[Dispatch]:
        """Trajectories whose chunks stopped arriving, as dead-letter work (an IncompleteTrajectory each)."""
        return [self._dispatch(done, max_age_s) for done in self._assembler.expire(max_age_s)]

    def drop(self, tps: Iterable[TopicPartition] | None) -> None:
        self._assembler.drop(tps)

    @staticmethod
    def _dispatch(done: Assembled[ConsumerRecord], max_age_s: float | None = None) -> Dispatch:
        first = done.coords[0]
        extra = sorted({r.offset for r in done.coords} - {first.offset})
        message: Any
        try:
            message = reassembled(done)
        except SchemaError as exc:
            where = f"{first.topic}:{first.partition}@{','.join(str(r.offset) for r in done.coords)}"
            setting = "" if max_age_s is None else " (worker.group_timeout_s)"
            message = (
                type(exc)(f"{exc}{setting}; chunk records {where}") if isinstance(exc, IncompleteTrajectory) else exc
            )
        return first, message, extra
