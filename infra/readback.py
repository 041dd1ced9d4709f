"""Reading members' token turns back from the trajectories topic: one code path for every reader.

A deciding worker reads back members it did not score itself (a rebalance or a crash
came between); for verdicts that name their members' records (``worker.verdict_tokens:
reference``, or ``auto`` for a verdict too large to carry the tokens) every verdict reader — the
trainer's :class:`~shaper.consumer.VerdictConsumer`, the verl adapter's
:class:`~shaper.reward_client.VerdictWaiter`, ``prm-pipeline verdicts``/``inspect`` and
the audit — reads the turns of each verdict's members from the records the verdict
names (:class:`infra.schema.TokenRef`). All of them use :class:`TrajectoryReader` and
the same rule, so a verdict means the same thing whoever turns it into rows:

* the turns are ``compact_turns`` of the record's (reassembled, expanded) trajectory — for
  a streamed session's member, of the ``ready`` form of its ``turn`` records and its
  ``end`` (:func:`infra.schema.streamed_trajectory`), exactly what the worker scored;
* a record that is gone (deleted by retention, topic recreated), no longer decodes, or
  is not the member's trajectory cannot be trained on: the member becomes ``failed``
  with ``tokens_unavailable`` (:func:`unavailable`), and an accepted group with such a
  member is ``rejected`` as the worker would have rejected it (:func:`resolve_verdict`).

Reading is a forward scan per partition from the lowest wanted offset (members of a
group share a partition and sit close together; consecutive verdicts name increasing
offsets), skipping ahead with a seek over gaps. A chunked trajectory is read on from its
first chunk until it is whole. A streamed session's member names its first ``turn``
record: the session is read on from there until its ``end`` (its records share the
group's key, so the partition), keeping only that session's turns — the first copy of
each turn id, at most ``worker.session_max_turns`` — and decoding only the ``turn`` and
``end`` records in between (the kind header says which, before the value is decoded).
Memory is bounded by the session; time by the records between its first turn and its
end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from infra import reasons
from infra.chunks import ChunkAssembler, reassembled
from infra.config import PipelineConfig
from infra.escape import printable
from infra.experiments import trajectories_topic
from infra.kafka import make_consumer
from infra.retry import RetryPolicy, is_retriable
from infra.schema import (
    ALL_KINDS,
    STREAM_KINDS,
    GroupVerdict,
    Interaction,
    InvalidMessage,
    NotConcatExport,
    ReadyTrajectory,
    SchemaError,
    SessionEnd,
    SessionResult,
    SessionTurn,
    TokenRef,
    TokenTurn,
    TrajectoryChunk,
    compact_turns,
    decode_message,
    streamed_trajectory,
)

__all__ = [
    "TOKENS_RETRY",
    "Wanted",
    "TrajectoryReader",
    "VerdictTokens",
    "unavailable",
    "failed_reason",
    "resolve_verdict",
    "needs_tokens",
    "reference",
]

log = logging.getLogger(__name__)

Turns = dict[tuple[int, int, str], list[TokenTurn]]
"""Compact turns read back, by ``(partition, offset, trajectory_id)``."""

FETCH_BYTES = 65_536
"""The reader's fetch limits (``fetch_max_bytes`` and ``max_partition_fetch_bytes``: the
embedded broker honours only the first). A read wants a few records, usually one
group's batch, at an offset the log has often moved well past: with the consumers' usual
limit (``kafka.max_message_bytes``, at least 1 MiB) every read fetched up to that much
from the wanted offset on, near peak six times the trajectory's own bytes. A broker
returns the first batch whole even when it is larger than the limit (Kafka since fetch
v3, KIP-74; the embedded broker too), so a small limit costs no correctness, only a
round trip more when the wanted records span batches."""


"""What a wanted record may be: a ``ready`` record, a chunked one's first chunk, or a
streamed session's first ``turn``."""


@dataclass(frozen=True)
class Wanted:
    """One member whose turns are wanted: its record, and whose it must be."""

    partition: int
    offset: int
    trajectory_id: str
    group_id: str = ""


@dataclass(slots=True)
class _Session:
    """A streamed session being read back: its first turn's offset, whose member it is,
    and the first copy of each of its turns read so far (log order)."""

    first: int
    wants: list[Wanted]
    turns: dict[str, Interaction] = field(default_factory=dict)


def unavailable(result: SessionResult, topic: str, partition: int, offset: int) -> SessionResult:
    """``result`` as a ``failed`` member whose record could not be read back (``tokens_unavailable``)."""
    r = result
    return SessionResult.failure(
        code=reasons.TOKENS_UNAVAILABLE,
        detail=f"record {topic}:{partition}@{offset} could not be read back",
        session_id=r.session_id,
        trajectory_id=r.trajectory_id,
        outcome_reward=r.outcome_reward,
        is_eval=r.is_eval,
        policy_version=r.policy_version,
        created_at=r.created_at,
        scored_at=r.scored_at,
        consumed_at=r.consumed_at,
        parked_at=r.parked_at,
    )


def failed_reason(failed: Sequence[SessionResult]) -> str:
    """A rejection's text for its failed members: the first one's (by trajectory id) code,
    trajectory and session, and why (its ``error_detail``, cut short: the member keeps the
    whole message), plus how many others failed. For people; programs read
    ``reason_code``."""
    first = failed[0]
    detail = printable(first.error_detail or "")  # a scorer's message may quote the record
    if len(detail) > 1000:
        detail = detail[:997] + "..."
    more = f"; {len(failed) - 1} more member(s) failed" if len(failed) > 1 else ""
    why = f": {detail}" if detail else " failed"
    return f"{first.failure_code}: member {first.trajectory_id!r} (session {first.session_id!r}){why}{more}"


def needs_tokens(verdict: GroupVerdict) -> bool:
    """Whether any member of ``verdict`` names its record instead of carrying turns."""
    return any(s.tokens_at is not None for s in verdict.sessions)


# Reasons that outrank a failed member in the worker's verdict rules (scoring_workers/verdicts.py).
_OUTRANKING = (reasons.INVALID_MEMBER, reasons.GROUP_SIZE_MISMATCH, reasons.VERDICT_TOO_LARGE)


def resolve_verdict(verdict: GroupVerdict, turns: Turns, topic: str) -> GroupVerdict:
    """``verdict`` with each referenced member's turns filled in from ``turns``, or the member failed
    ``tokens_unavailable`` when absent —
    then the group is rejected with the failed-member reason, as the worker rejects an
    inline verdict whose member could not be read back."""
    if not needs_tokens(verdict):
        return verdict
    sessions, lost = [], False
    for s in verdict.sessions:
        ref = s.tokens_at
        if ref is None:
            sessions.append(s)
            continue
        found = turns.get((ref.partition, ref.offset, s.trajectory_id))
        if found is None:
            sessions.append(unavailable(s, topic, ref.partition, ref.offset))
            lost = True
        else:
            sessions.append(msgspec.structs.replace(s, turns=found, tokens_at=None))
    status, code, reason = verdict.status, verdict.reason_code, verdict.reason
    if lost and status != "discarded" and code not in _OUTRANKING:
        failed = sorted((s for s in sessions if s.status == "failed"), key=lambda s: s.trajectory_id)
        status, code, reason = "rejected", failed[0].failure_code, failed_reason(failed)
    return msgspec.structs.replace(verdict, sessions=sessions, status=status, reason=reason, reason_code=code)


class TrajectoryReader:
    """Reads members back from the trajectories topic at record coordinates: a ``ready``
    record, a chunked one from its first chunk, a streamed session from its first ``turn``.

    One unassigned consumer (no group, no commits), created on first use and shared by
    sequential reads (a lock keeps them one at a time). Returns compact turns by
    ``(partition, offset, trajectory_id)``; a wanted record that could not be read is absent (the
    caller applies :func:`unavailable`). Broker outages surface as exceptions
    (``TimeoutError`` after ``kafka.request_timeout_ms``): transient for the caller.
    """

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.topic = cfg.topics.trajectories
        self._reader: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        self.records_read = 0  # records scanned (wanted or skipped over), for tests and benches
        self.bytes_fetched = 0  # value bytes of every record the reader's consumer handed over

    def topic_of(self, experiment_id: str) -> str:
        """The trajectories topic that holds ``experiment_id``'s records."""
        return trajectories_topic(self.topic, experiment_id)

    async def read(self, wanted: Iterable[Wanted], *, topic: str | None = None) -> Turns:
        """The turns of ``wanted`` records of ``topic`` (default: the default experiment's)."""
        topic = topic or self.topic
        by_partition: dict[int, dict[int, list[Wanted]]] = {}
        for w in wanted:
            if w.partition >= 0 and w.offset >= 0:
                by_partition.setdefault(w.partition, {}).setdefault(w.offset, []).append(w)
        out: Turns = {}
        if not by_partition:
            return out
        async with self._lock:
            if self._reader is None:
                self._reader = make_consumer(
                    self.cfg.kafka,
                    group_id=None,
                    enable_auto_commit=False,
                    fetch_max_bytes=FETCH_BYTES,
                    max_partition_fetch_bytes=FETCH_BYTES,
                )
                await self._reader.start()
            reader = self._reader
            tps = [TopicPartition(topic, p) for p in sorted(by_partition)]
            reader.assign(tps)
            reader.resume(*tps)  # paused after the previous read
            timeout_s = self.cfg.kafka.request_timeout_ms / 1000
            try:
                for tp in tps:
                    await self._scan(reader, tp, by_partition[tp.partition], out, timeout_s)
            finally:  # no background fetching between reads
                reader.pause(*reader.assignment())
        return out

    async def _scan(
        self,
        reader: AIOKafkaConsumer,
        tp: TopicPartition,
        wanted: dict[int, list[Wanted]],
        out: Turns,
        timeout_s: float,
    ) -> None:
        """Scan ``tp`` forward over the wanted offsets. The end of the log is the fetch's
        high watermark (``end_offsets`` is wrong on the embedded broker)."""
        todo = sorted(wanted)
        assembler: ChunkAssembler[int] = ChunkAssembler()
        chunked: dict[tuple[str, str], int] = {}  # (group, trajectory) -> first chunk's (wanted) offset
        streamed: dict[tuple[str, str], _Session] = {}  # (group, trajectory) -> the session read so far
        position = todo[0]
        reader.seek(tp, position)
        i = 0  # todo[i] is the next wanted offset not yet reached
        deadline = time.monotonic() + timeout_s
        fresh, empty_polls = False, 0  # the high watermark is this scan's once a fetch brought records
        while i < len(todo) or chunked or streamed:
            following = bool(chunked or streamed)  # trajectories whose later records are still to come
            high = reader.highwater(tp)
            if fresh and high is not None and not following and todo[i] >= high:
                self._gone(tp, [w for o in todo[i:] for w in wanted[o]], f"past the end of the log (@{high})")
                return
            # Every record a poll brought is read before the next poll, so records between
            # here and the next wanted one are not fetched yet: a seek skips them for free,
            # reading through costs a round trip per batch (fetches of at most FETCH_BYTES).
            if not following and todo[i] > position:
                position = todo[i]
                reader.seek(tp, position)
            batch = await reader.getmany(tp, timeout_ms=200, max_records=500)
            records = batch.get(tp, [])
            if not records:
                empty_polls += 1
                high = reader.highwater(tp)
                if high is not None and position >= high and (fresh or empty_polls >= 3):
                    self._gone(tp, [w for o in todo[i:] for w in wanted[o]], f"past the end of the log (@{high})")
                    for key, first in chunked.items():
                        log.error(
                            "trajectory %s: its chunks from %s:%d@%d end incomplete at the end of the log",
                            key[1],
                            tp.topic,
                            tp.partition,
                            first,
                        )
                    for key, session in streamed.items():
                        log.error(
                            "trajectory %s: its turns from %s:%d@%d have no end before the end of the log",
                            key[1],
                            tp.topic,
                            tp.partition,
                            session.first,
                        )
                    return
                if time.monotonic() > deadline:  # a broker outage: transient for the caller
                    raise TimeoutError(f"no record of {tp.topic}:{tp.partition} from @{position} in {timeout_s:g}s")
                continue
            deadline = time.monotonic() + timeout_s
            fresh, empty_polls = True, 0
            self.bytes_fetched += sum(len(r.value or b"") for r in records)
            for record in records:
                self.records_read += 1
                position = record.offset + 1
                gone = []
                while i < len(todo) and todo[i] < record.offset:  # passed over: deleted (retention)
                    gone += wanted[todo[i]]
                    i += 1
                if gone:
                    self._gone(tp, gone, f"not in the log (next is @{record.offset})")
                is_wanted = i < len(todo) and todo[i] == record.offset
                if is_wanted:
                    i += 1
                elif not (chunked or streamed):
                    continue
                # A record that is not wanted is decoded only if it is of a kind being
                # followed: the header says which before the value is decoded.
                followed = (("chunk",) if chunked else ()) + (STREAM_KINDS if streamed else ())
                kinds = ALL_KINDS if is_wanted else followed
                try:
                    message = decode_message(record.value, record.headers, kinds=kinds)
                except SchemaError as exc:
                    if is_wanted:
                        log.error("record %s:%d@%d no longer decodes: %s", tp.topic, tp.partition, record.offset, exc)
                    continue
                if isinstance(message, TrajectoryChunk):
                    self._add_chunk(tp, record.offset, message, is_wanted, chunked, assembler, wanted, out)
                elif isinstance(message, (SessionTurn, SessionEnd)):
                    self._add_streamed(tp, record.offset, message, is_wanted, streamed, wanted, out)
                elif is_wanted:
                    self._keep(tp, record.offset, wanted[record.offset], message, out)
                if i >= len(todo) and not (chunked or streamed):
                    break

    def _add_streamed(
        self,
        tp: TopicPartition,
        offset: int,
        message: SessionTurn | SessionEnd,
        is_wanted: bool,
        streamed: dict[tuple[str, str], _Session],
        wanted: dict[int, list[Wanted]],
        out: Turns,
    ) -> None:
        """Follow a streamed session whose first ``turn`` is wanted; keep it at its ``end``.

        ``streamed`` holds the sessions being followed. The session is what the worker that
        scored its end parked: the first copy of each turn id in log order (a later copy
        is a producer's retry; one with other content rejected the group), up to the
        session's first ``end`` — turned into the ``ready`` form by
        :func:`~infra.schema.streamed_trajectory`, the worker's own definition, so the
        turns are the scored member's. At most ``worker.session_max_turns`` turns are kept
        (the worker refuses more): past that, or when the turns and the end do not form a
        session, the member cannot be read back.
        """
        key = (message.group_id, message.trajectory_id)
        session = streamed.get(key)
        if is_wanted:
            wants = wanted[offset]
            mine = [w for w in wants if w.trajectory_id == message.trajectory_id]
            if isinstance(message, SessionTurn) and session is None and mine:
                session = streamed[key] = _Session(offset, mine)
                wants = [w for w in wants if w not in mine]
            for w in wants:  # an end, another trajectory's turn, or a later turn of a session followed
                log.error(
                    "group=%s: record %s:%d@%d is not the first turn of trajectory %s",
                    w.group_id,
                    tp.topic,
                    tp.partition,
                    offset,
                    w.trajectory_id,
                )
        if session is None:
            return
        if isinstance(message, SessionEnd):
            del streamed[key]
            try:
                whole = streamed_trajectory(list(session.turns.values()), message)
            except InvalidMessage as exc:
                log.error("session from %s:%d@%d does not read back: %s", tp.topic, tp.partition, session.first, exc)
                return
            self._keep(tp, session.first, session.wants, whole, out)
            return
        session.turns.setdefault(message.interaction.interaction_id, message.interaction)
        if len(session.turns) > self.cfg.worker.session_max_turns:
            del streamed[key]
            log.error(
                "session from %s:%d@%d has more than %d turns (worker.session_max_turns)",
                tp.topic,
                tp.partition,
                session.first,
                self.cfg.worker.session_max_turns,
            )

    def _add_chunk(
        self,
        tp: TopicPartition,
        offset: int,
        message: TrajectoryChunk,
        is_wanted: bool,
        chunked: dict[tuple[str, str], int],
        assembler: ChunkAssembler[int],
        wanted: dict[int, list[Wanted]],
        out: Turns,
    ) -> None:
        """Follow a chunked trajectory whose first chunk is wanted; keep it once its last chunk is read.

        ``chunked`` holds the trajectories being followed (key -> first chunk's offset).
        Chunks of other trajectories interleaved with them are skipped, and a copy that
        completes without starting at the followed first chunk is a superseded partial copy.
        """
        key = (message.group_id, message.trajectory_id)
        if is_wanted and key not in chunked:
            chunked[key] = offset
        elif key not in chunked:
            return
        first = chunked[key]
        for done in assembler.add(None, message, offset):
            if done.coords[0] != first:
                continue  # a superseded partial copy
            del chunked[key]
            try:
                whole = reassembled(done)
            except SchemaError as exc:
                log.error("record %s:%d@%d does not reassemble: %s", tp.topic, tp.partition, first, exc)
                continue
            self._keep(tp, first, wanted[first], whole, out)

    @staticmethod
    def _gone(tp: TopicPartition, gone: Sequence[Wanted], why: str) -> None:
        for w in gone:
            log.error(
                "group=%s traj=%s: record %s:%d@%d is %s",
                w.group_id,
                w.trajectory_id,
                tp.topic,
                tp.partition,
                w.offset,
                why,
            )

    def _keep(self, tp: TopicPartition, offset: int, wants: list[Wanted], message: object, out: Turns) -> None:
        turns: list[TokenTurn] | None = None
        for want in wants:
            if not isinstance(message, ReadyTrajectory) or message.trajectory_id != want.trajectory_id:
                log.error(
                    "group=%s: record %s:%d@%d is not trajectory %s",
                    want.group_id,
                    tp.topic,
                    tp.partition,
                    offset,
                    want.trajectory_id,
                )
                continue
            if turns is None:
                try:
                    turns = compact_turns(message.interactions)
                except NotConcatExport as exc:
                    log.error(
                        "group=%s: record %s:%d@%d is not concat export: %s",
                        want.group_id,
                        tp.topic,
                        tp.partition,
                        offset,
                        exc,
                    )
                    return
            out[(tp.partition, offset, want.trajectory_id)] = turns

    async def aclose(self) -> None:
        if self._reader is not None:
            await self._reader.stop()
            self._reader = None


# Reading members' tokens back (VerdictTokens.resolve, by the trainer's consumer and the
# reward client): a broker outage is waited out with jittered backoff.
TOKENS_RETRY = RetryPolicy(retryable=is_retriable)


class VerdictTokens:
    """A verdict reader's half: referenced members' turns read back with :class:`TrajectoryReader`."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.reader = TrajectoryReader(cfg)

    async def resolve(self, verdicts: Sequence[GroupVerdict]) -> list[GroupVerdict]:
        """``verdicts`` with every referenced member's turns in place (one read per experiment's topic)."""
        by_experiment: dict[str, list[Wanted]] = {}
        for v in verdicts:  # an experiment's records are in its own trajectories topic
            by_experiment.setdefault(v.experiment_id, []).extend(
                Wanted(s.tokens_at.partition, s.tokens_at.offset, s.trajectory_id, v.group_id)
                for s in v.sessions
                if s.tokens_at is not None
            )
        turns: dict[str, Turns] = {}
        for experiment_id, wanted in by_experiment.items():
            if wanted:
                turns[experiment_id] = await self.reader.read(wanted, topic=self.reader.topic_of(experiment_id))
        if not turns:
            return list(verdicts)
        return [
            resolve_verdict(v, turns.get(v.experiment_id, {}), self.reader.topic_of(v.experiment_id)) for v in verdicts
        ]

    async def resolve_one(self, verdict: GroupVerdict) -> GroupVerdict:
        return (await self.resolve([verdict]))[0]

    async def aclose(self) -> None:
        await self.reader.aclose()


def reference(result: SessionResult, partition: int, offset: int) -> SessionResult:
    """``result`` naming its record instead of carrying turns (``worker.verdict_tokens: reference``)."""
    return msgspec.structs.replace(result, turns=[], tokens_at=TokenRef(partition=partition, offset=offset))
