"""The group ledger: the only code that talks to Redis about groups (a streamed session's
parked turns have their own store, :mod:`scoring_workers.session_store`).

Three parts: the atomic transitions (the Lua script and its typed arguments,
:mod:`scoring_workers.ledger_scripts`, sent by :class:`GroupLedger`), the batching that
puts concurrent transitions into one call (:class:`~scoring_workers.batching.Batcher`),
and the read-only operator view with the workers' heartbeats (:class:`LedgerView`).

Redis carries scores, not tokens. Per group ``G``, one hash (its key carries the ``{G}``
hash tag, so Redis Cluster keeps it in one slot with the group's dedupe bucket and every
transition is one atomic Lua step), ``<prefix>:{G}:group``:

* state fields — ``status`` (``open`` | ``decided``), ``group_size``,
  ``first_seen``/``deadline`` (ms), ``size_mismatch``; once decided also ``decision``
  (``complete`` | ``failed`` | ``deadline`` | ``discard`` | ``invalid``),
  ``discard_reason`` (the reason of a discard or of an ``invalid`` decision),
  ``decided_at``, ``decided_by``, ``scorers``. Read back as one typed
  :class:`GroupState`;
* ``n``, the number of parked members, and per member ``m:<trajectory_id>`` -> msgpack
  :class:`ParkedMember`: what scoring produced (rewards — per turn when uniform, dense
  only when not —, turn results, stats, status, stage timestamps) and the member's record
  coordinates in the trajectories topic. Token ids and log-probs stay in Kafka: the
  deciding worker takes them from its own memory or reads them at those coordinates
  (:mod:`scoring_workers.tokens`), so any worker still builds the identical verdict.

One hash rather than a state and a members key, so that a park is one ``HMGET`` (the
state, the count and whether this member is parked) and one ``HSET`` (the member, the
count and, when it completes the group, the decision), a decision one ``HGETALL``, the
group's TTL one ``EXPIRE`` and finishing it one ``DEL``.

Finished groups are remembered for ``worker.dedupe_window_s`` in time-bucketed sets of
12-byte group fingerprints, ``<prefix>:done:<slot>:<bucket>`` (``<prefix>:{<tag>}:done:
<bucket>`` on Redis Cluster, where ``<tag>`` is a short string hashing to the group's own
slot, so the check stays inside the group's atomic scripts). A bucket spans half the
window (``DEDUPE_BUCKETS``); a probe checks the current bucket and the two before it, so a
finished group is recognised for at least one window, and each set expires a window and
two buckets (two windows) after its last write; about 18 bytes per
finished group while a set is small (listpack), 33–37 once it is large (hash table),
instead of a 24 h tombstone key per group. A duplicate or late member of a group finished
longer ago than the window re-opens it, and its second verdict is dropped by the
trainer's dedupe on ``(experiment_id, group_id, verdict_version)`` — so the window must cover the
longest redelivery delay (consumer lag after an outage, producer retries), see
docs/architecture.md.

A member parked ``failed`` decides its group in the same atomic step (``failed``): the
group is rejected whatever its other members bring (AReaL rejects a group when any
member fails), so it does not wait for the rest or for the deadline.

One global sorted set, ``<prefix>:deadlines``, lists unfinished groups by the time a
sweeper must look at them (deadline, or a re-publish grace for decided groups). It is
only an index: every decision is re-checked atomically on the group's own keys.

Round trips: every transition — park (which decides a group when its last member lands),
decide, finish — of all in-flight records goes into one script call while the previous
one is on the wire (:class:`~scoring_workers.batching.Batcher`; one call per slot on Redis Cluster), and the
probes of a poll go in the same round trip as plain reads (a probe is advice: the park
re-checks atomically). A park whose group has other members this worker probed (or
announced with :meth:`GroupLedger.expect`) and is still scoring waits briefly for them
(up to ``PARK_LINGER_S``; the park that decides never waits), so that the members share
a round trip, and a finish after a published verdict is cleanup that rides along with the
next call (:meth:`GroupLedger.finish_soon`, up to ``FINISH_LINGER_S``): at low rates
Redis's CPU goes mostly to waking up per round trip.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol

import msgspec
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from infra.config import RedisConfig
from infra.redis import RedisClient, make_redis, reply_hash, reply_scored, reply_text
from infra.retry import RetryPolicy, is_transient
from infra.schema import SessionResult
from scoring_workers.batching import Batcher
from scoring_workers.ledger_scripts import LEDGER, DecideArgs, FinishArgs, Op, ParkArgs, argv

log = logging.getLogger(__name__)

TTL_REFRESH_S = 60.0  # a TTL this instance set is not set again for this long (it is that much longer)
DONE_TTL_KEYS = 65_536  # bound of the done-set TTL memo (expired entries are dropped past it)
DEDUPE_BUCKETS = 2  # a window is this many buckets; a probe checks one more (the window's edge)
WORKERS_REMEMBERED_S = 3600.0  # a worker silent this long leaves the heartbeat set
DONE_SKEW_S = 10.0  # clocks of the workers agree within this (a finish may file its group this much earlier)
FRESH_GROUPS = 65_536  # bound of the probe memos (cleared past it: a park then reads every bucket, or lingers less)
PARK_LINGER_S = 0.01  # a park whose group has members this worker probed and has not parked waits this long for them
# A park whose group has members this worker has not seen yet waits this long for them: a
# group's members share a partition and a publisher sends them together, but a produce
# request in flight splits them (the first alone, the rest in the next), so the rest
# usually come one fetch later. The park that completes the group never waits.
PARK_UNSEEN_LINGER_S = 0.025
FINISH_LINGER_S = 0.25  # a finish after a published verdict waits this long for a call to ride along with
FINISH_BACKOFF_S = (0.05, 5.0)  # a finish that failed transiently is sent again after 50 ms, doubling up to 5 s
FINISH_RETRY = RetryPolicy(retryable=is_transient, base_s=FINISH_BACKOFF_S[0], cap_s=FINISH_BACKOFF_S[1])
FLUSH_TIMEOUT_S = 10.0  # at close, pending finishes get this long to land (then the sweeper covers them)


class ProbeOutcome(StrEnum):
    """What a probe (:meth:`GroupLedger.probe_many`) found: ``NEW`` (score it), ``DUPLICATE``
    (this member is parked already), ``DECIDED`` (its group is decided, not finished) or
    ``DONE`` (finished, in a dedupe bucket). Equal to the script's strings."""

    NEW = "new"
    DUPLICATE = "duplicate"
    DECIDED = "decided"
    DONE = "done"


class ParkOutcome(StrEnum):
    """What a park (:meth:`GroupLedger.park_many`) did: ``PARKED``, ``DUPLICATE`` (parked
    before), ``DECIDED`` (its group was decided meanwhile) or ``DONE`` (finished). A park that
    decided its group says so in its :class:`Decision` (``DECIDED_NOW``)."""

    PARKED = "parked"
    DUPLICATE = "duplicate"
    DECIDED = "decided"
    DONE = "done"


class DecideOutcome(StrEnum):
    """What a decision (:meth:`GroupLedger.decide`) found: ``DECIDED_NOW`` (this call decided:
    its caller publishes), ``ALREADY_DECIDED``, ``DONE``, ``GONE`` (no such group),
    ``NOT_DUE`` (a deadline not yet passed) or ``INCOMPLETE`` (a ``complete`` decision with
    members missing)."""

    DECIDED_NOW = "decided_now"
    ALREADY_DECIDED = "already_decided"
    DONE = "done"
    GONE = "gone"
    NOT_DUE = "not_due"
    INCOMPLETE = "incomplete"


STREAMED_PARTITION = -2
"""The ``partition`` of a streamed session's member whose first ``turn`` record is not known
(parked by a worker that did not record it): its turns come only from the memory of the
worker that scored its ``end``, unlike -1, a record not located. A streamed member is
otherwise parked at its first ``turn`` record (:mod:`scoring_workers.tokens`)."""


class ParkedMember(msgspec.Struct, frozen=True, array_like=True):
    """A member as parked: its scoring result without token turns, and where its record is.

    ``partition``/``offset`` locate the member's ``ReadyTrajectory`` in the trajectories
    topic (a chunked one's first chunk, a streamed session's first ``turn``; -1 when
    unknown; :data:`STREAMED_PARTITION` for a streamed member whose first turn is not known).
    """

    result: SessionResult
    partition: int = -1
    offset: int = -1


class DecisionKind(StrEnum):
    """Why a group was decided (the state's ``decision``; equal to the stored strings)."""

    COMPLETE = "complete"  # every member parked
    FAILED = "failed"  # a member failed
    DEADLINE = "deadline"  # the sweeper
    DISCARD = "discard"  # a DiscardGroup
    INVALID = "invalid"  # a member was dead-lettered


class GroupState(msgspec.Struct, frozen=True, kw_only=True):
    """A group's state hash, typed. Times are epoch milliseconds; ``scorers`` is the
    msgpack list of :class:`~infra.schema.ScorerInfo` the decider ran (raw bytes).

    ``decision`` says why the group was decided: ``complete`` (every member parked),
    ``failed`` (a member failed), ``deadline`` (the sweeper), ``discard`` (a
    ``DiscardGroup``) or ``invalid`` (a member was dead-lettered; ``discard_reason``
    names it, as it holds a discard's reason).
    """

    status: Literal["open", "decided"] = "open"
    group_size: int = 0
    first_seen: int = 0
    deadline: int = 0
    size_mismatch: int | None = None
    decision: DecisionKind | None = None
    discard_reason: str = ""
    decided_at: int = 0
    decided_by: str = ""
    scorers: bytes = b""


_INT_FIELDS = frozenset({"group_size", "first_seen", "deadline", "size_mismatch", "decided_at"})


def decode_state(flat: Sequence[bytes]) -> GroupState:
    """The state hash as ``HGETALL`` returns it (field, value, ...) -> :class:`GroupState`.

    Integers are stored as decimal strings, ``scorers`` stays bytes, other values are
    UTF-8; unknown fields are ignored. A value of the wrong shape raises ``ValueError``
    (or :class:`msgspec.ValidationError`, a subclass) naming it.
    """
    fields: dict[str, Any] = {}
    for raw_name, value in zip(flat[::2], flat[1::2]):
        name = raw_name.decode()
        if name == "scorers":
            fields[name] = bytes(value)
        elif name in _INT_FIELDS:
            fields[name] = int(value)
        elif name in GroupState.__struct_fields__:
            fields[name] = value.decode()
    return msgspec.convert(fields, GroupState)


_MEMBER_DECODER = msgspec.msgpack.Decoder(ParkedMember)
_ENCODER = msgspec.msgpack.Encoder()


def decode_parked(blob: bytes) -> ParkedMember:
    """A parked member's blob (as stored in the group's members hash)."""
    return _MEMBER_DECODER.decode(blob)


def fingerprint(group_id: str) -> bytes:
    """12 bytes naming a finished group in the dedupe sets (collisions: ~n / 2**96)."""
    return hashlib.blake2b(group_id.encode(), digest_size=12).digest()


@dataclass(frozen=True)
class Decision:
    """A group's stored decision and its parked members: all a verdict is built from.

    ``state`` is the default :class:`GroupState` when nothing was decided (``done``,
    ``gone``, ``not_due``, ``incomplete``)."""

    outcome: DecideOutcome
    group_id: str
    state: GroupState
    members: list[ParkedMember]

    @property
    def decided_at_ms(self) -> int:
        return self.state.decided_at


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class _Park:
    trajectory_id: str
    blob: bytes
    group_size: int
    group_timeout_s: float
    worker_id: str
    scorers: bytes
    failed: bool
    ttl_s: int
    since_bucket: int | None  # the oldest dedupe bucket a finish could have written since this worker's probe


@dataclass(frozen=True)
class _Probe:
    trajectory_id: str


@dataclass(frozen=True)
class _Due:
    limit: int


@dataclass(frozen=True)
class _Op:
    """One item of a ledger call on one group: a probe (plain reads beside the script), a
    park (its :class:`ParkArgs` are built when its batch goes out: they carry that
    moment's time), a decision or a finish (their typed arguments)."""

    group_id: str
    item: _Probe | _Due | _Park | DecideArgs | FinishArgs


@dataclass(frozen=True, slots=True)
class ParkRequest:
    """One member to park: its result (token turns are dropped: they stay in Kafka at
    ``partition``/``offset``) and its group's parameters."""

    result: SessionResult
    group_id: str
    group_size: int
    group_timeout_s: float
    worker_id: str
    scorers: bytes
    partition: int = -1
    offset: int = -1


class Ledger(Protocol):
    """What the worker asks of the group ledger: every decision it makes about a record rests
    on these answers. :class:`GroupLedger` is the one implementation (Redis); the unit tests
    hold an in-memory one, so the worker's decisions are tested without Redis or Kafka."""

    async def probe_many(self, items: Sequence[tuple[str, str]]) -> list[ProbeOutcome]: ...

    def expect(self, items: Sequence[tuple[str, str]]) -> None: ...

    async def park_many(self, requests: Sequence[ParkRequest]) -> list[tuple[ParkOutcome, Decision | None]]: ...

    async def decide(
        self,
        group_id: str,
        kind: DecisionKind,
        *,
        worker_id: str,
        scorers: bytes,
        discard_reason: str = "",
        group_timeout_s: float,
        republish_grace_s: float,
    ) -> Decision: ...

    def finish_soon(self, group_id: str) -> None: ...

    async def nudge(self, group_id: str, republish_grace_s: float) -> None: ...

    async def postpone(self, group_id: str, delay_s: float) -> None: ...

    async def forget(self, group_id: str) -> None: ...

    async def due_groups(self, limit: int = 64, *, linger_s: float = 0.0) -> list[str]: ...


_Command = tuple[str, tuple[Any, ...], dict[str, Any]]  # a plain Redis command: (method, args, kwargs)
_Call = tuple[list[int], list[str], list[Any]]  # a script call: (its ops' indexes, keys, argv)


def group_key(prefix: str, group_id: str) -> str:
    """The group's hash: its state, its parked members (``m:<trajectory_id>``) and their count."""
    return f"{prefix}:{{{group_id}}}:group"


_SLOT_TAGS: list[str] | None = None


def _slot_tags() -> list[str]:
    """For each cluster slot, a short string whose hash slot it is (built once, ~0.5 s)."""
    global _SLOT_TAGS
    if _SLOT_TAGS is None:
        tags: dict[int, str] = {}  # slot -> the first tag found in it
        i = 0
        while len(tags) < 16384:
            tag = format(i, "x")
            tags.setdefault(key_slot(tag.encode()), tag)
            i += 1
        _SLOT_TAGS = [tags[slot] for slot in range(16384)]
    return _SLOT_TAGS


class GroupLedger:
    """Atomic, TTL'd group state in Redis. One instance per worker process.

    The script is loaded once (``SCRIPT LOAD``) and called with ``EVALSHA``; after a Redis
    restart (``NOSCRIPT``) it is reloaded and the call is repeated — every transition is
    safe to repeat.
    """

    def __init__(self, client: RedisClient, cfg: RedisConfig, *, dedupe_window_s: float = 3600.0) -> None:
        self.redis = client
        self.cfg = cfg
        self.prefix = cfg.key_prefix
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError("redis.key_prefix must not contain '{' or '}' (they select the cluster hash slot)")
        if dedupe_window_s <= 0:
            raise ValueError(f"worker.dedupe_window_s must be > 0, got {dedupe_window_s}")
        self.deadlines_key = f"{self.prefix}:deadlines"
        self.cluster = cfg.cluster
        if self.cluster:
            _slot_tags()  # built now, not inside the first script call of a busy event loop
        self.bucket_s = dedupe_window_s / DEDUPE_BUCKETS
        self.done_ttl_s = int(dedupe_window_s + 2 * self.bucket_s) + 1
        # A done set's TTL is refreshed at most this often (it lives that much longer): never
        # more than a bucket, so a short dedupe window keeps its sets' lifetime (and key count).
        self.ttl_refresh_s = min(TTL_REFRESH_S, self.bucket_s)
        self._sha = ""
        # TTLs this instance set lately (one EXPIRE per key per TTL_REFRESH_S, not per call):
        # the deadlines index, and each done set (its TTL covers the refresh interval too)
        self._deadlines_ttl_at = 0.0
        self._done_ttl_at: dict[str, float] = {}
        # Groups this instance probed as neither open nor done: group -> the oldest bucket a
        # finish since the probe could have written (the probe read every bucket up to then).
        self._fresh: dict[str, int] = {}
        # Members this instance probed (not duplicates) and has not parked yet, per group: a
        # park of a member whose siblings are still being scored here lingers for them.
        self._awaited: dict[str, set[str]] = {}
        # Members of each open group this instance parked: while fewer than its size, a park
        # waits (up to PARK_UNSEEN_LINGER_S) for the rest, which usually come right after.
        self._parked_here: dict[str, int] = {}
        self._ops: Batcher[_Op, Any] = Batcher(self._run)
        # Finishes handed over by finish_soon() and not landed yet (each retries until it does).
        self._finishing: dict[str, asyncio.Task[None]] = {}
        self._finish_linger_s = FINISH_LINGER_S
        # Told of every failed finish attempt (the worker counts them); a failure is also logged.
        self.on_finish_error: Callable[[BaseException], None] | None = None
        # Heartbeats and operator reads, on the same client.
        self.view = LedgerView(client, cfg)

    @classmethod
    def from_config(cls, cfg: RedisConfig, *, dedupe_window_s: float = 3600.0) -> GroupLedger:
        return cls(make_redis(cfg), cfg, dedupe_window_s=dedupe_window_s)

    async def aclose(self, flush_timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Close, after the pending finishes landed (or ``flush_timeout_s`` passed: those
        left are logged; their groups stay decided and the sweeper finishes them)."""
        await self.flush(flush_timeout_s)
        for task in self._finishing.values():
            task.cancel()
        await asyncio.gather(*self._finishing.values(), return_exceptions=True)
        await self._ops.aclose()
        await self.redis.aclose()

    def group_key(self, group_id: str) -> str:
        return group_key(self.prefix, group_id)

    def keys(self, group_id: str, bucket: int | None = None) -> list[str]:
        """The group's hash, then its dedupe buckets (newest first)."""
        slot = self._slot(group_id)
        bucket = self._bucket() if bucket is None else bucket
        base = f"{self.prefix}:{{{_slot_tags()[slot]}}}:done" if self.cluster else f"{self.prefix}:done:{slot}"
        return [self.group_key(group_id), *(f"{base}:{bucket - i}" for i in range(DEDUPE_BUCKETS + 1))]

    def _bucket(self, at: float | None = None) -> int:
        return int((time.time() if at is None else at) // self.bucket_s)

    def _slot(self, group_id: str) -> int:
        """The cluster slot of the group's keys (their hash tag decides it)."""
        return key_slot(self.group_key(group_id).encode())

    def _state_ttl(self, group_timeout_s: float) -> int:
        return int(group_timeout_s) + self.cfg.ttl_s

    async def _load_script(self) -> None:
        self._sha = await self.redis.script_load(LEDGER)

    def _argv(self, op: _Op, now: int, bucket: int) -> list[Any]:
        p = op.item
        if isinstance(p, DecideArgs):
            return argv(Op.DECIDE, p)
        if isinstance(p, FinishArgs):
            return argv(Op.FINISH, p)
        assert isinstance(p, _Park)
        nd = DEDUPE_BUCKETS + 1
        ndone = nd if p.since_bucket is None else max(1, min(nd, bucket - p.since_bucket + 1))
        return argv(
            Op.PARK,
            ParkArgs(
                fingerprint(op.group_id),
                p.trajectory_id,
                p.blob,
                p.group_size,
                now,
                now + int(p.group_timeout_s * 1000),
                p.ttl_s,
                p.worker_id,
                p.scorers,
                "failed" if p.failed else "complete",
                ndone,
                op.group_id,
            ),
        )

    async def _run(self, ops: list[_Op]) -> list[Any]:
        """``ops`` in one round trip: the transitions as one ``EVALSHA`` (one per slot on
        Redis Cluster, concurrently), the probes as plain reads beside it (a probe is advice:
        every transition re-checks atomically), and the index commands that go with them.
        One result per op, in order."""
        if not self._sha:
            await self._load_script()
        now, bucket = _now_ms(), self._bucket()
        probed: dict[str, dict[int, str]] = {}  # group -> index of each of its probes -> its trajectory id
        sweeps: dict[int, int] = {}  # index of each sweeper's index read -> its limit
        for i, op in enumerate(ops):
            if isinstance(op.item, _Probe):
                probed.setdefault(op.group_id, {})[i] = op.item.trajectory_id
            elif isinstance(op.item, _Due):
                sweeps[i] = op.item.limit
        plain = self._reads(ops, probed, sweeps, bucket, now)
        calls = self._calls(ops, bucket, now, plain)
        results, read = await self._send(calls, plain)
        out: list[Any] = [None] * len(ops)
        for (idx, _, _), res in zip(calls, results):
            for i, r in zip(idx, res):
                out[i] = r
        pos, nd = 0, DEDUPE_BUCKETS + 1
        for probes in probed.values():
            status, *parked = read[pos]
            done = any(read[pos + 1 : pos + 1 + nd])
            pos += 1 + nd
            for i, member in zip(probes, parked):  # the probes' indexes, in the order they were read
                if status is None:
                    out[i] = "done" if done else "new"
                elif status == b"decided":
                    out[i] = "decided"
                else:
                    out[i] = "open" if member is None else "duplicate"
        for k, i in enumerate(sweeps):
            out[i] = read[pos + k]
        return out

    def _reads(
        self, ops: list[_Op], probed: dict[str, dict[int, str]], sweeps: dict[int, int], bucket: int, now: int
    ) -> list[_Command]:
        """The plain commands of a call, answers first: per probed group its status and whether
        each probed member is parked (one ``HMGET``) and whether it is in a dedupe bucket (one
        ``SISMEMBER`` per bucket); then the sweepers' index reads; then the deadline index's TTL
        refresh when it is due."""
        plain: list[_Command] = []
        for group_id, members in probed.items():
            keys = self.keys(group_id, bucket)
            plain.append(("hmget", (keys[0], "status", *(f"m:{t}" for t in members.values())), {}))
            fp = fingerprint(group_id)
            plain += (("sismember", (k, fp), {}) for k in keys[1:])
        plain += (
            ("zrangebyscore", (self.deadlines_key, "-inf", now), {"start": 0, "num": limit})
            for limit in sweeps.values()
        )
        parks = [op.item for op in ops if isinstance(op.item, _Park)]
        if parks and time.monotonic() >= self._deadlines_ttl_at:
            ttl = max(p.ttl_s for p in parks)
            plain.append(("expire", (self.deadlines_key, ttl + int(TTL_REFRESH_S)), {}))
            self._deadlines_ttl_at = time.monotonic() + TTL_REFRESH_S
        return plain

    def _calls(self, ops: list[_Op], bucket: int, now: int, plain: list[_Command]) -> list[_Call]:
        """The transitions of a call as script calls: one, or on Redis Cluster one per slot, whose
        deadline index commands (the index lives in another slot) join ``plain``."""
        scripted = [i for i, op in enumerate(ops) if not isinstance(op.item, (_Probe, _Due))]
        if self.cluster:
            index = {op.group_id: now + int(op.item.group_timeout_s * 1000) for op in ops if isinstance(op.item, _Park)}
            if index:
                plain.append(("zadd", (self.deadlines_key, index), {"nx": True}))
            if finished := [op.group_id for op in ops if isinstance(op.item, FinishArgs)]:
                plain.append(("zrem", (self.deadlines_key, *finished), {}))
            by_slot: dict[int, list[int]] = {}
            for i in scripted:
                by_slot.setdefault(self._slot(ops[i].group_id), []).append(i)
            groups = list(by_slot.values())
        else:
            groups = [scripted] if scripted else []
        head = [DEDUPE_BUCKETS + 1, 0 if self.cluster else 1]
        calls: list[_Call] = []
        for idx in groups:
            keys, argv = ([] if self.cluster else [self.deadlines_key]), list(head)
            for i in idx:
                keys += self.keys(ops[i].group_id, bucket)
                argv += self._argv(ops[i], now, bucket)
            calls.append((idx, keys, argv))
        return calls

    async def _send(self, calls: list[_Call], plain: list[_Command]) -> tuple[list[Any], list[Any]]:
        """One round trip: (each script call's result, each plain command's). Standalone, one
        pipeline; on Redis Cluster, whose client refuses scripts in pipelines, the script calls
        concurrently beside a pipeline of the plain commands. Every command here is safe to
        repeat: after a Redis restart (``NOSCRIPT``) the script is loaded and all is sent again."""
        for attempt in (1, 2):
            try:
                if self.cluster:

                    async def reads() -> list[Any]:
                        if not plain:
                            return []
                        async with self.redis.pipeline(transaction=False) as pipe:
                            for name, args, kw in plain:
                                getattr(pipe, name)(*args, **kw)
                            return list(await pipe.execute())

                    *results, read = await asyncio.gather(
                        *(self.redis.evalsha(self._sha, len(keys), *keys, *argv) for _, keys, argv in calls), reads()
                    )
                    return results, read
                async with self.redis.pipeline(transaction=False) as pipe:
                    for _, keys, argv in calls:
                        pipe.evalsha(self._sha, len(keys), *keys, *argv)
                    for name, args, kw in plain:
                        getattr(pipe, name)(*args, **kw)
                    res = await pipe.execute()
                return res[: len(calls)], res[len(calls) :]
            except NoScriptError:
                if attempt == 2:
                    raise
                await self._load_script()  # Redis restarted and lost its script cache
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- reads
    async def probe_many(self, items: Sequence[tuple[str, str]]) -> list[ProbeOutcome]:
        """Batched pre-check for one poll: ``(group_id, trajectory_id)`` -> what is known.

        One round trip for the whole poll (with whatever transitions queued meanwhile), so
        duplicates and members of decided groups are acknowledged without scoring: per
        group, one ``HMGET`` (its status and which of the probed members are parked) and
        one ``SISMEMBER`` per dedupe bucket, however many of its members the poll holds.
        """
        if not items:
            return []
        since = self._bucket(time.time() - DONE_SKEW_S)  # taken before Redis reads the buckets
        res = await self._ops.submit_many([_Op(g, _Probe(t)) for g, t in items])
        out: list[ProbeOutcome] = []
        for (group_id, trajectory_id), r in zip(items, res):
            probe = r.decode() if isinstance(r, bytes) else r
            if probe == "new":  # neither open nor done: the park need not read older buckets again
                if len(self._fresh) >= FRESH_GROUPS:
                    self._fresh.clear()  # forgetting only costs a park the full read
                self._fresh[group_id] = since
            if probe in ("new", "open"):
                if len(self._awaited) >= FRESH_GROUPS:
                    self._awaited.clear()  # forgetting only costs a park its company
                self._awaited.setdefault(group_id, set()).add(trajectory_id)
            out.append(ProbeOutcome.NEW if probe == "open" else ProbeOutcome(probe))
        return out

    def expect(self, items: Sequence[tuple[str, str]]) -> None:
        """``(group_id, trajectory_id)`` of records this worker will score without a probe
        (no one else can have seen them): what a probe that found them new would remember,
        without its round trip, so that a park waits for its groupmates here. Their parks
        read every dedupe bucket (nothing says which were read already) and re-check
        atomically, as always."""
        for group_id, trajectory_id in items:
            if len(self._awaited) >= FRESH_GROUPS:
                self._awaited.clear()  # forgetting only costs a park its company
            self._awaited.setdefault(group_id, set()).add(trajectory_id)

    # ---------------------------------------------------------------- transitions
    async def park(
        self,
        result: SessionResult,
        *,
        group_id: str,
        group_size: int,
        group_timeout_s: float,
        worker_id: str,
        scorers: bytes,
        partition: int = -1,
        offset: int = -1,
    ) -> tuple[ParkOutcome, Decision | None]:
        """Store a member's result (its token turns stay in Kafka at ``partition``/``offset``);
        if it completes the group, or failed (the group is rejected either way), decide the
        group too. One :meth:`park_many` of one member."""
        (answer,) = await self.park_many(
            [ParkRequest(result, group_id, group_size, group_timeout_s, worker_id, scorers, partition, offset)]
        )
        return answer

    async def park_many(self, requests: Sequence[ParkRequest]) -> list[tuple[ParkOutcome, Decision | None]]:
        """Park several members in one call, in order: a failed member parked after its
        groupmates of the same call finds them parked. (The worker parks one member at a
        time: concurrent parks share a call anyway.)

        Returns one ``(outcome, decision)`` per request; ``decision`` is set when the group
        was decided in this step (``decided_now`` for the caller that must publish). Parks
        of concurrent callers share one call; the park that creates the group adds its
        deadline index entry. While other members of a group that this worker probed are
        still unparked (being scored), or fewer of its members than its size have come
        here, the call waits up to ``PARK_LINGER_S`` (``PARK_UNSEEN_LINGER_S``) for them,
        so the group's members share a call; a call that decides a group (its last member,
        or a failed one) never waits.
        """
        for r in requests:  # parked together: company, not awaited
            awaited = self._awaited.get(r.group_id)
            if awaited is not None:
                awaited.discard(r.result.trajectory_id)
                if not awaited:
                    del self._awaited[r.group_id]
        ops: list[_Op] = []
        parked: dict[str, tuple[bytes, ParkedMember]] = {}  # what this call parks: not decoded again
        since: dict[str, int | None] = {}
        linger_s: float | None = None
        for r in requests:
            group_id, failed = r.group_id, r.result.status == "failed"
            if len(self._parked_here) >= FRESH_GROUPS:
                self._parked_here.clear()  # forgetting only costs a park its company
            here = self._parked_here[group_id] = self._parked_here.get(group_id, 0) + 1
            wait_s = (
                0.0
                if failed
                else PARK_LINGER_S
                if group_id in self._awaited
                else PARK_UNSEEN_LINGER_S
                if here < r.group_size
                else 0.0
            )
            linger_s = wait_s if linger_s is None else min(linger_s, wait_s)
            if group_id not in since:
                since[group_id] = self._fresh.pop(group_id, None)
            member = ParkedMember(msgspec.structs.replace(r.result, turns=[]), r.partition, r.offset)
            blob = _ENCODER.encode(member)
            parked[r.result.trajectory_id] = (blob, member)
            ops.append(
                _Op(
                    group_id,
                    _Park(
                        r.result.trajectory_id,
                        blob,
                        r.group_size,
                        r.group_timeout_s,
                        r.worker_id,
                        r.scorers,
                        failed,
                        self._state_ttl(r.group_timeout_s),
                        since[group_id],
                    ),
                )
            )
        raws = await self._ops.submit_many(ops, linger_s=linger_s or 0.0)
        return [self._parked(r.group_id, raw, parked) for r, raw in zip(requests, raws)]

    def _parked(
        self, group_id: str, raw: Sequence[Any], known: Mapping[str, tuple[bytes, ParkedMember]]
    ) -> tuple[ParkOutcome, Decision | None]:
        outcome = ParkOutcome(raw[0].decode())
        if len(raw) < 3:
            if outcome is not ParkOutcome.PARKED:  # decided or finished already: no company to wait for
                self._parked_here.pop(group_id, None)
            return outcome, None
        self._parked_here.pop(group_id, None)
        return outcome, self._decision(group_id, DecideOutcome.DECIDED_NOW, raw[2], known)

    async def decide(
        self,
        group_id: str,
        kind: DecisionKind,
        *,
        worker_id: str,
        scorers: bytes,
        discard_reason: str = "",
        group_timeout_s: float,
        republish_grace_s: float,
    ) -> Decision:
        """Record the group's decision unless one exists; return the stored one either way.

        A decision made here moves the group's index entry to ``now + republish_grace_s``:
        until finish() removes it, the sweeper re-publishes after the grace period in case
        this worker dies between deciding and publishing. (A decision made by a park needs
        no such step: its last member stays uncommitted until the verdict is out, and
        whoever gets it again nudges the group.)
        """
        self._awaited.pop(group_id, None)
        self._parked_here.pop(group_id, None)
        now = _now_ms()
        republish_at = now + int(republish_grace_s * 1000)
        raw = await self._ops.submit(
            _Op(
                group_id,
                DecideArgs(
                    fingerprint(group_id),
                    kind,
                    now,
                    worker_id,
                    scorers,
                    discard_reason,
                    self._state_ttl(group_timeout_s),
                    republish_at,
                    group_id,
                ),
            )
        )
        outcome = DecideOutcome(raw[0].decode())
        decision = self._decision(group_id, outcome, raw[1] if len(raw) > 1 else [])
        if outcome is DecideOutcome.DECIDED_NOW and self.cluster:  # standalone: the script moved the entry
            await self.redis.zadd(self.deadlines_key, {group_id: republish_at})
        return decision

    @staticmethod
    def _decision(
        group_id: str,
        outcome: DecideOutcome,
        flat: Sequence[bytes],
        known: Mapping[str, tuple[bytes, ParkedMember]] | None = None,
    ) -> Decision:
        """The group hash as ``HGETALL`` returned it -> its state and its parked members.

        ``known``: members this process just encoded, by trajectory id, with their blob. A
        stored blob equal (byte for byte) to one of them is that member, taken as it is
        instead of decoded again (a long
        session's member is megabytes of turn results and observations to decode and
        check, on the path from its group's last member to the verdict)."""
        if outcome not in (DecideOutcome.DECIDED_NOW, DecideOutcome.ALREADY_DECIDED):
            return Decision(outcome, group_id, GroupState(), [])
        state: list[bytes] = []
        members: list[ParkedMember] = []
        for name, value in zip(flat[::2], flat[1::2]):
            if name.startswith(b"m:"):
                hit = known.get(name[2:].decode()) if known else None
                members.append(hit[1] if hit is not None and hit[0] == value else decode_parked(value))
            else:
                state += (name, value)
        return Decision(outcome, group_id, decode_state(state), members)

    async def finish(self, group_id: str) -> None:
        """After the verdict is acknowledged by Kafka: drop the group's hash and its index
        entry, and remember the group as finished for the dedupe window. Concurrent
        finishes share one call (with whatever other transitions queued meanwhile).

        This one does not wait for company, and returns once it landed (for callers that
        need that); the worker uses :meth:`finish_soon`, which does not hold its record."""
        self._fresh.pop(group_id, None)
        self._awaited.pop(group_id, None)
        self._parked_here.pop(group_id, None)
        await self._ops.submit(_Op(group_id, FinishArgs(fingerprint(group_id), self._done_ttl(group_id), group_id)))

    def finish_soon(self, group_id: str) -> None:
        """:meth:`finish`, without waiting for it: once the verdict is acknowledged by Kafka
        the group's outcome is durable and finishing it is cleanup, so the caller releases
        its record now and the finish rides along with the next ledger call (waiting up to
        ``FINISH_LINGER_S`` for one) instead of costing a round trip of its own.

        A failed attempt is logged, told to ``on_finish_error`` and sent again with backoff
        (a transient error for as long as it lasts; any other error gives up: the group
        stays decided and the sweeper re-publishes and finishes it, its repeated verdict
        dropped by the trainer's dedupe). :meth:`flush` (and :meth:`aclose`) wait for them.
        """
        self._fresh.pop(group_id, None)
        self._awaited.pop(group_id, None)
        self._parked_here.pop(group_id, None)
        if group_id in self._finishing:  # already on its way (a re-published verdict)
            return
        task = asyncio.create_task(self._finish_until_landed(group_id))
        self._finishing[group_id] = task

        def landed(done: asyncio.Task[None]) -> None:
            if self._finishing.get(group_id) is done:
                del self._finishing[group_id]

        task.add_done_callback(landed)

    @property
    def lingering(self) -> bool:
        """Whether the ledger's next call is waiting for company (lingering work, no urgent call yet)."""
        return self._ops.lingering

    @property
    def pending_finishes(self) -> int:
        """Finishes handed to :meth:`finish_soon` that have not landed yet."""
        return len(self._finishing)

    async def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> int:
        """Send the pending finishes now and wait (up to ``timeout_s``) until they landed;
        from now on finishes do not linger. Returns how many are still pending (logged)."""
        self._finish_linger_s = 0.0
        self._ops.hurry()
        if self._finishing:
            await asyncio.wait(list(self._finishing.values()), timeout=timeout_s)
        if left := len(self._finishing):
            log.warning(
                "ledger: %d group finishes did not land within %.0fs; their groups stay decided and "
                "the sweeper re-publishes and finishes them",
                left,
                timeout_s,
            )
        return left

    async def _finish_until_landed(self, group_id: str) -> None:
        args = FinishArgs(fingerprint(group_id), self._done_ttl(group_id), group_id)

        async def send() -> None:  # reads args and the linger anew at each attempt
            await self._ops.submit(_Op(group_id, args), linger_s=self._finish_linger_s)

        def on_retry(exc: BaseException, attempt: int, delay: float) -> None:
            nonlocal args
            if self.on_finish_error is not None:
                self.on_finish_error(exc)
            log.warning(
                "ledger: finishing group %s failed (%s: %s, attempt %d); again in %.2fs",
                group_id,
                type(exc).__name__,
                exc,
                attempt,
                delay,
            )
            # the TTL this attempt carried may not have been set: the next one sets it again
            args = msgspec.structs.replace(args, done_ttl_s=self.done_ttl_s + int(math.ceil(self.ttl_refresh_s)))

        try:
            await FINISH_RETRY.run(send, what=f"finishing group {group_id}", on_retry=on_retry)
        except Exception as exc:  # noqa: BLE001 - logged, counted and handed to the sweeper
            if self.on_finish_error is not None:
                self.on_finish_error(exc)
            log.error(
                "ledger: finishing group %s failed (%s: %s); it stays decided and the sweeper "
                "re-publishes and finishes it",
                group_id,
                type(exc).__name__,
                exc,
            )

    def _done_ttl(self, group_id: str) -> int:
        """The TTL to set on the group's newest done set with this finish, or 0 when this
        instance set it less than ``ttl_refresh_s`` ago (the TTL covers that much more)."""
        key, now = self.keys(group_id)[1], time.monotonic()
        if self._done_ttl_at.get(key, 0.0) > now:
            return 0
        if len(self._done_ttl_at) > DONE_TTL_KEYS:
            self._done_ttl_at = {k: t for k, t in self._done_ttl_at.items() if t > now}
        self._done_ttl_at[key] = now + self.ttl_refresh_s
        return self.done_ttl_s + int(math.ceil(self.ttl_refresh_s))

    async def nudge(self, group_id: str, republish_grace_s: float) -> None:
        """Bring a decided group's sweep forward to ``now + grace`` (never later, never re-adding).

        Called whenever a worker finds a group decided but not finished: if its decider
        died before publishing, the sweeper would otherwise wait for the group deadline.
        """
        await self.redis.zadd(
            self.deadlines_key, {group_id: _now_ms() + int(republish_grace_s * 1000)}, xx=True, lt=True
        )

    async def postpone(self, group_id: str, delay_s: float) -> None:
        """Move a group's sweep to ``now + delay_s`` (only if it is still indexed)."""
        await self.redis.zadd(self.deadlines_key, {group_id: _now_ms() + int(delay_s * 1000)}, xx=True)

    async def forget(self, group_id: str) -> None:
        """Drop a stale index entry (the group's keys expired or were finished)."""
        await self.redis.zrem(self.deadlines_key, group_id)

    async def due_groups(self, limit: int = 64, *, linger_s: float = 0.0) -> list[str]:
        """Groups whose deadline (or re-publish grace) has passed, as of when the read goes out.

        A read of the index beside whatever transitions queue meanwhile; with ``linger_s``
        it waits up to that long for a call to ride along with (a sweep is not urgent), so
        that at low rates it costs Redis no wake-up of its own."""
        raw = await self._ops.submit(_Op("", _Due(limit)), linger_s=linger_s)
        return [g.decode() for g in raw]


class LedgerView:
    """The ledger as operators see it (``prm-pipeline status``), and the workers' heartbeats.

    Kept apart from the transitions (:class:`GroupLedger`): the reads change no key, and
    the heartbeats touch only ``<prefix>:workers``, never a group's keys.
    """

    def __init__(self, client: RedisClient, cfg: RedisConfig) -> None:
        self.redis = client
        self.prefix = cfg.key_prefix
        self.cluster = cfg.cluster
        self.deadlines_key = f"{self.prefix}:deadlines"

    @classmethod
    def from_config(cls, cfg: RedisConfig) -> LedgerView:
        return cls(make_redis(cfg), cfg)

    async def aclose(self) -> None:
        await self.redis.aclose()

    def group_key(self, group_id: str) -> str:
        return group_key(self.prefix, group_id)

    # ---------------------------------------------------------------- worker heartbeats (prm-pipeline status)
    # One sorted set, ``<prefix>:workers``: worker id -> last beat (ms). Kept apart from
    # the group transitions; no group key is touched here.
    @property
    def workers_key(self) -> str:
        return f"{self.prefix}:workers"

    async def beat(self, worker_id: str, *, forget_after_s: float = WORKERS_REMEMBERED_S) -> tuple[int, int | None]:
        """Record that ``worker_id`` is alive now; forget workers silent for ``forget_after_s``.

        Returns ``(this beat, the beat it replaced)`` in epoch ms (None: none remembered), in the
        same round trip: a replaced beat this worker did not write is another worker's with the same id.
        """
        now = _now_ms()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zscore(self.workers_key, worker_id)
            pipe.zadd(self.workers_key, {worker_id: now})
            pipe.zremrangebyscore(self.workers_key, "-inf", now - int(forget_after_s * 1000))
            pipe.expire(self.workers_key, int(forget_after_s))
            previous, *_ = await pipe.execute()
        return now, None if previous is None else int(previous)

    async def retire(self, worker_id: str) -> None:
        """A worker that stops cleanly leaves the heartbeat set at once."""
        await self.redis.zrem(self.workers_key, worker_id)

    # ---------------------------------------------------------------- operator reads (prm-pipeline status)
    # Read-only and separate from the transitions above: nothing here changes a key.
    async def heartbeats(self) -> list[tuple[str, int]]:
        """``(worker_id, last beat in epoch ms)`` of the workers seen within the remembered span."""
        beats = reply_scored(await self.redis.zrange(self.workers_key, 0, -1, withscores=True))
        return [(w.decode(), int(ms)) for w, ms in beats]

    async def unfinished_groups(self, limit: int = 1000) -> tuple[int, list[UnfinishedGroup]]:
        """``(total, first)``: how many groups the deadlines index lists, and the state of
        the ``limit`` that are due soonest (decided groups waiting for their verdict come
        first: their index entry is the re-publish time). One round trip for the index,
        one pipelined read of the states (per slot on Redis Cluster)."""
        total = int(await self.redis.zcard(self.deadlines_key))
        entries = reply_scored(await self.redis.zrange(self.deadlines_key, 0, max(0, limit - 1), withscores=True))
        if not entries:
            return total, []
        async with self.redis.pipeline(transaction=False) as pipe:
            for group, _ in entries:
                pipe.hmget(self.group_key(group.decode()), "status", "first_seen", "deadline", "decided_at")
            states = await pipe.execute()
        out = []
        for (group, due), (status, first_seen, deadline, decided_at) in zip(entries, states):
            out.append(
                UnfinishedGroup(
                    group.decode(),
                    reply_text(status) if status else "gone",
                    int(due),
                    int(first_seen or 0),
                    int(deadline or 0),
                    int(decided_at or 0),
                )
            )
        return total, out

    async def group_state(self, group_id: str) -> GroupSummary | None:
        """The state of one unfinished group (``prm-pipeline inspect --group``), None when the
        ledger does not hold it (never seen, or finished: its verdict is on the topic)."""
        status, size, deadline, parked = await self.redis.hmget(
            self.group_key(group_id), "status", "group_size", "deadline", "n"
        )
        if status is None:
            return None
        return GroupSummary(reply_text(status), int(size or 0), int(deadline or 0), int(parked or 0))

    async def parked_blobs(self, group_id: str) -> dict[str, bytes]:
        """``trajectory_id`` -> the parked member's stored blob (:func:`decode_parked`), of an open group."""
        flat = reply_hash(await self.redis.hgetall(self.group_key(group_id)))
        return {name[2:].decode(): blob for name, blob in flat.items() if name.startswith(b"m:")}

    async def memory(self) -> list[tuple[str, int, int]]:
        """``(node, used_memory, maxmemory)`` of each Redis node holding the ledger (one on a
        standalone Redis; every primary on Redis Cluster). ``maxmemory`` 0 means unlimited."""
        info = await self.redis.info("memory")
        per_node = info if self.cluster and all(isinstance(v, dict) for v in info.values()) else {"redis": info}
        return [(str(node), int(v.get("used_memory", 0)), int(v.get("maxmemory", 0))) for node, v in per_node.items()]

    async def command_calls(self) -> dict[str, int]:
        """Calls per command since each Redis node started (``INFO commandstats``), summed over nodes."""
        info = await self.redis.info("commandstats")
        per_node = info.values() if self.cluster and all(isinstance(v, dict) for v in info.values()) else [info]
        calls: dict[str, int] = {}
        for node in per_node:
            for name, stats in node.items():
                if isinstance(stats, dict) and "calls" in stats:
                    command = name.removeprefix("cmdstat_")
                    calls[command] = calls.get(command, 0) + int(stats["calls"])
        return calls


@dataclass(frozen=True)
class GroupSummary:
    """One group as :meth:`LedgerView.group_state` read it: ``open`` or ``decided``, its size,
    deadline (epoch ms) and how many members are parked."""

    status: str
    group_size: int
    deadline_ms: int
    parked: int


@dataclass(frozen=True)
class UnfinishedGroup:
    """A group the deadlines index lists, as :meth:`GroupLedger.unfinished_groups` read it.

    ``status`` is ``open``, ``decided`` (waiting for its verdict to be published) or
    ``gone`` (its keys expired or were finished since the index was read); times are
    epoch milliseconds, 0 when unknown."""

    group_id: str
    status: str
    due_ms: int
    first_seen_ms: int
    deadline_ms: int
    decided_at_ms: int
