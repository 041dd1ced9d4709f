"""Which fetched records need a ledger probe before scoring: only those a previous owner
of their partition may have seen.

A worker learns, per assigned partition, the partition's highwater as first known after
the assignment (the consumer's ``highwater(tp)`` once a fetch answered; on the embedded
tansu broker ``end_offsets``/``seek_to_end`` are not reliable, the fetch's highwater is).
Every record a previous owner could have read lies below that mark: those are probed
(the previous owner may have scored and parked them without committing). A record at or
past the mark was published after this worker took the partition over, so no other
worker read it from here and the probe's round trip is skipped: its park still re-checks
atomically (a member parked already, or a group decided or finished, comes back as such
and the record is acknowledged), so a duplicate — a publisher that re-sent a trajectory,
or a zombie previous owner — costs one wasted scoring, never a second verdict.

A chunked trajectory is read in full only with its last chunk: the mark is compared with
the offset of the chunk that completed it. Marks are forgotten when a partition is
revoked (or assigned again): the next assignment learns a new one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aiokafka.structs import TopicPartition


class ProbeMarks:
    """Per assigned partition, the first offset no previous owner can have read."""

    def __init__(self) -> None:
        self._marks: dict[TopicPartition, int] = {}

    def learn(self, assigned: Iterable[TopicPartition], highwater: Callable[[TopicPartition], int | None]) -> None:
        """Set the mark of each assigned partition that has none yet and whose highwater is
        known (a fetch answered since the assignment); a mark, once set, stays until forgotten."""
        for tp in assigned:
            if tp not in self._marks and (hw := highwater(tp)) is not None:
                self._marks[tp] = hw

    def needs_probe(self, tp: TopicPartition, offset: int) -> bool:
        """Whether the record at ``offset`` (a chunked trajectory: its last chunk's) may have
        been read by a previous owner: below the mark, or no mark known yet."""
        mark = self._marks.get(tp)
        return mark is None or offset < mark

    def mark(self, tp: TopicPartition) -> int | None:
        return self._marks.get(tp)

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Drop the marks of ``tps``: revoked, or assigned anew."""
        for tp in tps:
            self._marks.pop(tp, None)
