"""Records of the trajectories topic as producers send them: compact, and chunked when large.

A long agent session (100 turns, 128k tokens of context) does not fit one Kafka record
even in the compact form: its content alone — the token ids, the output log-probs and
the message text — is over a megabyte, and the default record limit is 1 MiB
(``kafka.max_message_bytes``). :func:`to_records` therefore splits such a ``ready``
message into ``chunk`` records (:class:`infra.schema.TrajectoryChunk`) of at most
:func:`infra.kafka.max_record_size` of the limit each (the batch a broker checks, once
compressed, stays within it), and :class:`ChunkAssembler` puts them back together on the reading side
(the worker, its token read-back, the audit).

Delivery stays at-least-once: a worker marks a chunk's offset finished only when the
whole trajectory it belongs to has been processed, so the committed offset never passes
the first chunk of an unfinished trajectory and a crash or rebalance replays all its
chunks. Duplicated chunks (a producer retry) are harmless: a chunk is identified by
(trajectory, index). A trajectory whose chunks stop arriving is given up after a
deadline and its chunks are dead-lettered (:class:`IncompleteTrajectory`), like any
record that cannot be processed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from infra.kafka import MessageTooLarge, max_record_size, record_size
from infra.schema import (
    COMPACT_SCHEMA_VERSION,
    KIND_HEADER,
    MAX_CHUNKS,
    SCHEMA_HEADER,
    InvalidMessage,
    ReadyTrajectory,
    SchemaError,
    TrajectoryChunk,
    TrajectoryMessage,
    compact_trajectory,
    decode_message,
    encode,
)

__all__ = [
    "IncompleteTrajectory",
    "Assembled",
    "ChunkAssembler",
    "READY_HEADERS",
    "to_records",
    "too_large",
    "reassembled",
]

Record = tuple[bytes, list[tuple[str, bytes]]]
"""A record's ``(value, headers)``; its key is always the message's ``group_id``."""

READY_HEADERS: list[tuple[str, bytes]] = [
    (SCHEMA_HEADER, str(COMPACT_SCHEMA_VERSION).encode()),
    (KIND_HEADER, b"ready"),
]
"""The headers a reassembled value is decoded with (chunks carry compact ``ready`` messages)."""

_SLACK = 64  # bytes: varint widths of the record framing grow with the value


class IncompleteTrajectory(InvalidMessage):
    """A chunked trajectory could not be reassembled (chunks missing past the deadline, or they disagree)."""


def too_large(traj: ReadyTrajectory, size: int, max_message_bytes: int, needed: int) -> MessageTooLarge:
    """The one-line error for a session no chunking fits: names it, its size, turns and the settings."""
    return MessageTooLarge(
        f"session {traj.session_id!r} (trajectory {traj.trajectory_id!r}, group {traj.group_id!r}) is {size} bytes "
        f"in compact form over {len(traj.interactions)} turns: {needed} records of kafka.max_message_bytes="
        f"{max_message_bytes}, over the {MAX_CHUNKS} chunks a trajectory may have; raise kafka.max_message_bytes "
        "(here and on the broker/topic: message.max.bytes / max.message.bytes) or split the session"
    )


def to_records(message: TrajectoryMessage, max_message_bytes: int) -> list[Record]:
    """The records that carry ``message``: a ready trajectory compacted, then chunked if too large.

    Raises :class:`infra.kafka.MessageTooLarge` (a one-line reason) when even
    :data:`infra.schema.MAX_CHUNKS` chunks cannot carry it, or for a discard over the limit.
    """
    if isinstance(message, ReadyTrajectory):
        message = compact_trajectory(message)
    value, headers = encode(message)
    key = message.group_id.encode()
    safe = max_record_size(max_message_bytes)
    if record_size(key, value, headers) <= safe:
        return [(value, headers)]
    if not isinstance(message, ReadyTrajectory):
        raise MessageTooLarge(
            f"{type(message).__name__} for group {message.group_id!r} is a record of "
            f"{record_size(key, value, headers)} bytes, over the {safe} a record may have under "
            f"kafka.max_message_bytes={max_message_bytes}"
        )
    probe = TrajectoryChunk(
        group_id=message.group_id,
        trajectory_id=message.trajectory_id,
        index=MAX_CHUNKS - 1,
        count=MAX_CHUNKS,
        total_bytes=len(value),
        data=memoryview(b"x"),
    )
    probe_value, chunk_headers = encode(probe)
    budget = safe - record_size(key, probe_value, chunk_headers) - 4 - _SLACK  # bin8 -> bin32 header
    count = max(2, math.ceil(len(value) / budget)) if budget > 0 else MAX_CHUNKS + 1
    if count > MAX_CHUNKS:
        raise too_large(message, len(value), max_message_bytes, count)
    size = math.ceil(len(value) / count)
    records = []
    for i in range(count):
        chunk = TrajectoryChunk(
            group_id=message.group_id,
            trajectory_id=message.trajectory_id,
            index=i,
            count=count,
            total_bytes=len(value),
            data=memoryview(value)[i * size : (i + 1) * size],
        )
        chunk_value, chunk_headers = encode(chunk)
        assert record_size(key, chunk_value, chunk_headers) <= safe, "chunk budget miscomputed"
        records.append((chunk_value, chunk_headers))
    return records


C = TypeVar("C")  # whatever the caller uses to find a chunk's record again (a ConsumerRecord, an offset)


@dataclass
class _Pending(Generic[C]):
    count: int
    total_bytes: int
    started: float
    parts: dict[int, bytes | memoryview] = field(default_factory=dict)
    coords: list[C] = field(default_factory=list)


@dataclass(frozen=True)
class Assembled(Generic[C]):
    """What became of a chunked trajectory: reassembled (``value`` decodes with
    :data:`READY_HEADERS`) or given up (``error`` says why, ``value`` is empty).
    ``coords`` are its chunk records' coordinates in arrival order (first chunk first)."""

    trajectory_id: str
    group_id: str
    value: bytes
    coords: list[C]
    error: str = ""


class ChunkAssembler(Generic[C]):
    """Buffers chunks per (scope, group, trajectory) until the last one arrives.

    ``scope`` separates independent streams (the worker passes the partition). Memory
    is bounded by what is in flight: at most :data:`infra.schema.MAX_CHUNKS` chunks per
    trajectory, each at most one record.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pending: dict[tuple[Hashable, str, str], _Pending[C]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def buffered_bytes(self) -> int:
        return sum(len(d) for p in self._pending.values() for d in p.parts.values())

    def add(self, scope: Hashable, chunk: TrajectoryChunk, coord: C) -> list[Assembled[C]]:
        """Add one chunk; returns the trajectories it finished (usually none or one).

        A trajectory is finished when this chunk was its last missing one (reassembled,
        or an error when the pieces do not add up to the announced size), or when this
        chunk supersedes a partial one (the same trajectory id published again with a
        different size: the partial one is given up, its chunks are the caller's to
        dead-letter).
        """
        key = (scope, chunk.group_id, chunk.trajectory_id)
        out: list[Assembled[C]] = []
        pending = self._pending.get(key)
        if pending is not None and (pending.count, pending.total_bytes) != (chunk.count, chunk.total_bytes):
            del self._pending[key]
            out.append(
                Assembled(
                    chunk.trajectory_id,
                    chunk.group_id,
                    b"",
                    pending.coords,
                    error=(
                        f"trajectory {chunk.trajectory_id!r}: {len(pending.parts)} of {pending.count} chunks "
                        f"arrived before a re-publication with a different size superseded them"
                    ),
                )
            )
            pending = None
        if pending is None:
            pending = self._pending[key] = _Pending(chunk.count, chunk.total_bytes, self._clock())
        pending.parts.setdefault(chunk.index, chunk.data)  # a duplicate carries the same bytes
        pending.coords.append(coord)
        if len(pending.parts) < pending.count:
            return out
        del self._pending[key]
        value = b"".join(pending.parts[i] for i in range(pending.count))
        if len(value) != pending.total_bytes:
            out.append(
                Assembled(
                    chunk.trajectory_id,
                    chunk.group_id,
                    b"",
                    pending.coords,
                    error=(
                        f"trajectory {chunk.trajectory_id!r}: its {pending.count} chunks hold {len(value)} bytes, "
                        f"not the announced {pending.total_bytes}"
                    ),
                )
            )
        else:
            out.append(Assembled(chunk.trajectory_id, chunk.group_id, value, pending.coords))
        return out

    def expire(self, max_age_s: float) -> list[Assembled[C]]:
        """Give up trajectories whose first chunk arrived over ``max_age_s`` ago."""
        now = self._clock()
        out = []
        for key in [k for k, p in self._pending.items() if now - p.started > max_age_s]:
            p = self._pending.pop(key)
            out.append(
                Assembled(
                    key[2],
                    key[1],
                    b"",
                    p.coords,
                    error=(
                        f"trajectory {key[2]!r}: only {len(p.parts)} of its {p.count} chunks arrived within "
                        f"{max_age_s:g}s"
                    ),
                )
            )
        return out

    def drop(self, scopes: Iterable[Hashable] | None = None) -> None:
        """Forget partial trajectories of ``scopes`` (all when None): revoked partitions are replayed elsewhere."""
        if scopes is None:
            self._pending.clear()
            return
        gone = set(scopes)
        for key in [k for k in self._pending if k[0] in gone]:
            del self._pending[key]


def reassembled(done: Assembled[Any]) -> ReadyTrajectory:
    """Decode a finished trajectory (expanded); raises a :class:`infra.schema.SchemaError`
    (:class:`IncompleteTrajectory` when it was given up) that names the trajectory."""
    if done.error:
        raise IncompleteTrajectory(done.error)
    try:
        message = decode_message(done.value, READY_HEADERS)
    except SchemaError as exc:
        raise type(exc)(
            f"trajectory {done.trajectory_id!r} reassembled from {len(done.coords)} chunks: {exc}"
        ) from None
    if not isinstance(message, ReadyTrajectory) or message.trajectory_id != done.trajectory_id:
        raise IncompleteTrajectory(f"the chunks of trajectory {done.trajectory_id!r} reassemble into another message")
    return message
