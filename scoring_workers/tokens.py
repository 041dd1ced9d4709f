"""Where a deciding worker gets its group members' token turns: Redis holds none.

The ledger parks what scoring produced plus each member's record coordinates
(partition, offset in the trajectories topic). Members of a group share its key, so they
land on one partition and are consumed by one worker at a time; that worker keeps the
compact token turns of the members it scored in memory (:meth:`MemberTokens.remember`).
A member consumed before a rebalance or a crash is read back from the log at its parked
coordinates. Either way the turns are ``compact_turns`` of the same record bytes, so any
worker builds the identical verdict. A chunked trajectory is parked at its first chunk's
coordinates; reading it back reads on from there until its last chunk.

The log must therefore keep a trajectory at least as long as its group can stay open
(``topics.retention_ms`` > ``worker.group_timeout_s`` + the re-publish grace, with room
for outages). A record that is gone anyway (deleted by retention, topic recreated)
cannot be trained on: its member is published ``failed`` with ``tokens_unavailable``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from infra.chunks import ChunkAssembler, reassembled
from infra.config import PipelineConfig
from infra.kafka import make_consumer
from infra.schema import (
    ReadyTrajectory,
    SchemaError,
    SessionResult,
    TokenTurn,
    TrajectoryChunk,
    TrajectoryMessage,
    compact_turns,
    decode_message,
)
from scoring_workers.ledger import ParkedMember

log = logging.getLogger(__name__)

def _size(turns: Sequence[TokenTurn]) -> int:
    return sum(len(t.prompt_delta_raw) + len(t.output_tokens_raw) + len(t.output_logprobs_raw or b"") for t in turns)


class MemberTokens:
    """Token turns of group members: remembered when scored, read from the log otherwise."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        # token bytes kept in memory (worker.token_cache_bytes); beyond it the oldest are read back from the log
        self.max_bytes = cfg.worker.token_cache_bytes
        self._cache: OrderedDict[tuple[str, str], list[TokenTurn]] = OrderedDict()
        self._bytes = 0
        self._groups: dict[str, set[str]] = {}
        self._reader: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        self.log_reads = 0

    # ------------------------------------------------------------------ memory
    def remember(self, group_id: str, trajectory_id: str, turns: list[TokenTurn]) -> None:
        key = (group_id, trajectory_id)
        if key in self._cache or not turns:
            return
        self._cache[key] = turns
        self._groups.setdefault(group_id, set()).add(trajectory_id)
        self._bytes += _size(turns)
        while self._bytes > self.max_bytes and self._cache:
            (g, t), old = self._cache.popitem(last=False)
            self._bytes -= _size(old)
            self._drop_index(g, t)

    def forget_group(self, group_id: str) -> None:
        for t in self._groups.pop(group_id, ()):
            turns = self._cache.pop((group_id, t), None)
            if turns is not None:
                self._bytes -= _size(turns)

    def _drop_index(self, group_id: str, trajectory_id: str) -> None:
        ids = self._groups.get(group_id)
        if ids is not None:
            ids.discard(trajectory_id)
            if not ids:
                del self._groups[group_id]

    # ------------------------------------------------------------------ members
    async def members(self, group_id: str, parked: Sequence[ParkedMember]) -> list[SessionResult]:
        """The parked members as verdict sessions, scored ones with their token turns."""
        wanted = [p for p in parked if p.result.status == "scored" and not p.result.turns and p.partition >= 0
                  and (group_id, p.result.trajectory_id) not in self._cache]
        if wanted:
            await self._read_back(group_id, wanted)
        out = []
        for p in parked:
            r = p.result
            if r.status == "scored" and not r.turns and p.partition >= 0:
                turns = self._cache.get((group_id, r.trajectory_id))
                if turns is None:
                    r = msgspec.structs.replace(r, status="failed", branches=[], turn_results=[], stats={},
                                                error=f"tokens_unavailable: record {self.cfg.topics.trajectories}:"
                                                      f"{p.partition}@{p.offset} could not be read back")
                else:
                    r = msgspec.structs.replace(r, turns=turns)
            out.append(r)
        return out

    async def _read_back(self, group_id: str, wanted: Sequence[ParkedMember]) -> None:
        """Read members' records at their parked coordinates (one read at a time: the reader is shared)."""
        topic = self.cfg.topics.trajectories
        async with self._lock:
            if self._reader is None:
                self._reader = make_consumer(self.cfg.kafka, group_id=None, enable_auto_commit=False)
                await self._reader.start()
            reader = self._reader
            tps = sorted({TopicPartition(topic, p.partition) for p in wanted}, key=lambda tp: tp.partition)
            reader.assign(tps)
            reader.resume(*tps)  # paused after the previous read
            try:
                await self._read_each(reader, group_id, wanted)
            finally:  # no background fetching between reads
                reader.pause(*reader.assignment())

    async def _read_each(self, reader: AIOKafkaConsumer, group_id: str, wanted: Sequence[ParkedMember]) -> None:
        topic = self.cfg.topics.trajectories
        timeout_s = self.cfg.kafka.request_timeout_ms / 1000
        for p in sorted(wanted, key=lambda m: (m.partition, m.offset)):
            tp = TopicPartition(topic, p.partition)
            reader.seek(tp, p.offset)
            async with asyncio.timeout(timeout_s):  # a broker outage: transient, retried by the caller
                record = await reader.getone(tp)
            self.log_reads += 1
            if record.offset != p.offset:
                log.error("group=%s traj=%s: record %s:%d@%d is gone (next is @%d)", group_id,
                          p.result.trajectory_id, topic, p.partition, p.offset, record.offset)
                continue
            try:
                message = decode_message(record.value, record.headers)
                if isinstance(message, TrajectoryChunk):
                    async with asyncio.timeout(timeout_s):
                        message = await self._read_chunks(reader, tp, record.offset, message)
            except SchemaError as exc:
                log.error("group=%s: record %s:%d@%d no longer decodes: %s", group_id, topic, p.partition,
                          p.offset, exc)
                continue
            if not isinstance(message, ReadyTrajectory) or message.trajectory_id != p.result.trajectory_id:
                log.error("group=%s: record %s:%d@%d is not trajectory %s", group_id, topic, p.partition,
                          p.offset, p.result.trajectory_id)
                continue
            self.remember(group_id, message.trajectory_id, compact_turns(message.interactions))

    async def _read_chunks(self, reader: AIOKafkaConsumer, tp: TopicPartition, offset: int,
                           first: TrajectoryChunk) -> TrajectoryMessage:
        """Read on from a trajectory's first chunk until it is whole; decode it."""
        assembler: ChunkAssembler[int] = ChunkAssembler()
        done = assembler.add(None, first, offset)
        while True:
            finished = [d for d in done if d.coords[-1] == offset]  # not a superseded partial one
            if finished:
                return reassembled(finished[0])
            record = await reader.getone(tp)
            self.log_reads += 1
            offset = record.offset
            try:
                chunk = decode_message(record.value, record.headers)
            except SchemaError:
                done = []
                continue
            same = isinstance(chunk, TrajectoryChunk) and (chunk.group_id, chunk.trajectory_id) == \
                (first.group_id, first.trajectory_id)
            done = assembler.add(None, chunk, offset) if same else []  # type: ignore[arg-type]

    async def aclose(self) -> None:
        if self._reader is not None:
            await self._reader.stop()
            self._reader = None
