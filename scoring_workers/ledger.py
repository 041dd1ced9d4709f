"""The group ledger: the only code that talks to Redis.

Redis carries scores, not tokens. Per group ``G`` (its keys share the ``{G}`` hash tag,
so Redis Cluster keeps them in one slot and every transition is one atomic Lua call):

* ``<prefix>:{G}:state``   hash — ``status`` (``open`` | ``decided``), ``group_size``,
  ``first_seen``/``deadline`` (ms), ``size_mismatch``; once decided also ``decision``
  (``complete`` | ``failed`` | ``deadline`` | ``discard`` | ``invalid``),
  ``discard_reason`` (the reason of a discard or of an ``invalid`` decision),
  ``decided_at``, ``decided_by``, ``scorers``. Read back as one typed
  :class:`GroupState`.
* ``<prefix>:{G}:members`` hash — ``trajectory_id`` -> msgpack :class:`ParkedMember`:
  what scoring produced (rewards — per turn when uniform, dense only when not —, turn
  results, stats, status, stage timestamps) and the member's record coordinates in the
  trajectories topic. Token ids and log-probs stay in Kafka: the deciding worker takes
  them from its own memory or reads them at those coordinates
  (:mod:`scoring_workers.tokens`), so any worker still builds the identical verdict.

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
trainer's dedupe on ``(group_id, verdict_version)`` — so the window must cover the
longest redelivery delay (consumer lag after an outage, producer retries), see
docs/architecture.md.

A member parked ``failed`` decides its group in the same atomic step (``failed``): the
group is rejected whatever its other members bring (AReaL rejects a group when any
member fails), so it does not wait for the rest or for the deadline.

One global sorted set, ``<prefix>:deadlines``, lists unfinished groups by the time a
sweeper must look at them (deadline, or a re-publish grace for decided groups). It is
only an index: every decision is re-checked atomically on the group's own keys.

Round trips: probes of one poll batch are one script call (per slot on Redis Cluster);
parks (which decide a group when its last member lands) and finishes are gathered from
all in-flight records into one call while the previous one is on the wire
(:class:`_GroupCommit`), so Redis sees one round trip per batch, not per record.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from infra.config import RedisConfig
from infra.redis import make_redis
from infra.schema import SessionResult
from scoring_workers.ledger_scripts import DECIDE, FINISH, PARK, PROBE

TTL_REFRESH_S = 60.0  # a TTL this instance set is not set again for this long (it is that much longer)
DONE_TTL_KEYS = 65_536  # bound of the done-set TTL memo (expired entries are dropped past it)
DEDUPE_BUCKETS = 2  # a window is this many buckets; a probe checks one more (the window's edge)
WORKERS_REMEMBERED_S = 3600.0  # a worker silent this long leaves the heartbeat set


Probe = Literal["new", "duplicate", "decided", "done"]
ParkOutcome = Literal["parked", "duplicate", "decided", "done"]
DecideOutcome = Literal["decided_now", "already_decided", "done", "gone", "not_due", "incomplete"]


class ParkedMember(msgspec.Struct, frozen=True, array_like=True):
    """A member as parked: its scoring result without token turns, and where its record is.

    ``partition``/``offset`` locate the member's ``ReadyTrajectory`` in the trajectories
    topic (-1 when unknown).
    """

    result: SessionResult
    partition: int = -1
    offset: int = -1


DecisionKind = Literal["complete", "failed", "deadline", "discard", "invalid"]


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


T = TypeVar("T")
R = TypeVar("R")


class _GroupCommit(Generic[T, R]):
    """Gathers items submitted by concurrent tasks into batches: while one batch is on the
    wire, new items queue; the next batch takes them all (one call, one round trip)."""

    def __init__(self, run: Callable[[list[T]], Awaitable[list[R]]]) -> None:
        self._run = run
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._task: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                results = await self._run([item for item, _ in batch])
            except BaseException as exc:  # every submitter sees the failure (and retries)
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
                if not isinstance(exc, Exception):
                    raise
                continue
            for (_, fut), result in zip(batch, results):
                if not fut.done():
                    fut.set_result(result)

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task


@dataclass(frozen=True)
class _Park:
    group_id: str
    trajectory_id: str
    blob: bytes
    group_size: int
    group_timeout_s: float
    worker_id: str
    scorers: bytes
    failed: bool


_SLOT_TAGS: list[str] | None = None


def _slot_tags() -> list[str]:
    """For each cluster slot, a short string whose hash slot it is (built once, ~0.5 s)."""
    global _SLOT_TAGS
    if _SLOT_TAGS is None:
        tags: list[str | None] = [None] * 16384
        missing, i = 16384, 0
        while missing:
            tag = format(i, "x")
            slot = key_slot(tag.encode())
            if tags[slot] is None:
                tags[slot] = tag
                missing -= 1
            i += 1
        _SLOT_TAGS = tags  # type: ignore[assignment]
    return _SLOT_TAGS  # type: ignore[return-value]


class GroupLedger:
    """Atomic, TTL'd group state in Redis. One instance per worker process.

    Scripts are loaded once (``SCRIPT LOAD``) and called with ``EVALSHA``; after a Redis
    restart (``NOSCRIPT``) they are reloaded and the call is repeated — every script is
    safe to repeat.
    """

    _SCRIPTS = {"probe": PROBE, "park": PARK, "decide": DECIDE, "finish": FINISH}

    def __init__(self, client: aioredis.Redis, cfg: RedisConfig, *, dedupe_window_s: float = 3600.0) -> None:
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
        self._sha: dict[str, str] = {}
        # TTLs this instance set lately (one EXPIRE per key per TTL_REFRESH_S, not per call):
        # the deadlines index, and each done set (its TTL covers the refresh interval too)
        self._deadlines_ttl_at = 0.0
        self._done_ttl_at: dict[str, float] = {}
        self._parks: _GroupCommit[_Park, tuple[str, list[Any] | None, int]] = _GroupCommit(self._park_batch)
        self._finishes: _GroupCommit[str, None] = _GroupCommit(self._finish_batch)

    @classmethod
    def from_config(cls, cfg: RedisConfig, *, dedupe_window_s: float = 3600.0) -> GroupLedger:
        return cls(make_redis(cfg), cfg, dedupe_window_s=dedupe_window_s)

    async def aclose(self) -> None:
        await self._parks.aclose()
        await self._finishes.aclose()
        await self.redis.aclose()

    def keys(self, group_id: str) -> list[str]:
        """The group's state and members keys, then its dedupe buckets (newest first)."""
        tag = f"{self.prefix}:{{{group_id}}}"
        slot = self._slot(group_id)
        bucket = int(time.time() // self.bucket_s)
        base = f"{self.prefix}:{{{_slot_tags()[slot]}}}:done" if self.cluster else f"{self.prefix}:done:{slot}"
        return [f"{tag}:state", f"{tag}:members", *(f"{base}:{bucket - i}" for i in range(DEDUPE_BUCKETS + 1))]

    def _slot(self, group_id: str) -> int:
        """The cluster slot of the group's keys (their hash tag decides it)."""
        return key_slot(f"{self.prefix}:{{{group_id}}}:state".encode())

    def _state_ttl(self, group_timeout_s: float) -> int:
        return int(group_timeout_s) + self.cfg.ttl_s

    async def _load_scripts(self) -> None:
        for name, body in self._SCRIPTS.items():
            self._sha[name] = await self.redis.script_load(body)

    async def _scripts(self, script: str, items: Sequence[tuple[str, list[Any]]],
                       extra: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]] = ()) -> tuple[list[Any], list[Any]]:
        """Run ``script`` over ``items`` (``(group_id, argv)``) in one call — one per slot on
        Redis Cluster — plus plain ``extra`` commands, in one round trip. Returns the
        per-item results in order and the extra commands' results."""
        if not self._sha:
            await self._load_scripts()
        if self.cluster:  # the cluster client refuses scripts in pipelines: one call per slot, concurrently
            by_slot: dict[int, list[int]] = {}
            for i, (group_id, _) in enumerate(items):
                by_slot.setdefault(self._slot(group_id), []).append(i)
            calls = [self._call([items[i] for i in idx]) for idx in by_slot.values()]
            for attempt in (1, 2):
                try:  # every command here is safe to repeat
                    done = await asyncio.gather(
                        *(self.redis.evalsha(self._sha[script], len(keys), *keys, *argv) for keys, argv in calls),
                        *(getattr(self.redis, n)(*a, **kw) for n, a, kw in extra))
                    break
                except NoScriptError:
                    if attempt == 2:
                        raise
                    await self._load_scripts()
            out: list[Any] = [None] * len(items)
            for idx, res in zip(by_slot.values(), done):
                for i, r in zip(idx, res):
                    out[i] = r
            return out, list(done[len(calls):])
        for attempt in (1, 2):
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    if items:
                        keys, argv = self._call(items)
                        pipe.evalsha(self._sha[script], len(keys), *keys, *argv)
                    for name, args, kw in extra:
                        getattr(pipe, name)(*args, **kw)
                    res = await pipe.execute()
                return (list(res[0]) if items else []), list(res[1:] if items else res)
            except NoScriptError:
                if attempt == 2:
                    raise
                await self._load_scripts()  # Redis restarted and lost its script cache
        raise AssertionError("unreachable")

    def _call(self, items: Sequence[tuple[str, list[Any]]]) -> tuple[list[str], list[Any]]:
        keys: list[str] = []
        argv: list[Any] = [DEDUPE_BUCKETS + 1]
        for group_id, args in items:
            keys += self.keys(group_id)
            argv += args
        return keys, argv

    # ---------------------------------------------------------------- reads
    async def probe_many(self, items: Sequence[tuple[str, str]]) -> list[Probe]:
        """Batched pre-check for one poll: ``(group_id, trajectory_id)`` -> what is known.

        One script call for the whole poll (per slot on Redis Cluster), so duplicates
        and members of decided groups are acknowledged without scoring.
        """
        if not items:
            return []
        res, _ = await self._scripts("probe", [(g, [t, fingerprint(g)]) for g, t in items])
        return [r.decode() if isinstance(r, bytes) else r for r in res]

    # ---------------------------------------------------------------- transitions
    async def park(self, result: SessionResult, *, group_id: str, group_size: int, group_timeout_s: float,
                   worker_id: str, scorers: bytes, partition: int = -1,
                   offset: int = -1) -> tuple[ParkOutcome, Decision | None]:
        """Store a member's result (its token turns stay in Kafka at ``partition``/``offset``);
        if it completes the group, or failed (the group is rejected either way), decide the
        group too.

        Returns ``(outcome, decision)``; ``decision`` is set when the group was decided in
        this step (``decided_now`` for the caller that must publish). Parks of concurrent
        records share one round trip, with the deadline index entries (``ZADD NX``).
        """
        member = ParkedMember(msgspec.structs.replace(result, turns=[]), partition, offset)
        outcome, raw, now = await self._parks.submit(_Park(
            group_id, result.trajectory_id, _ENCODER.encode(member), group_size, group_timeout_s, worker_id, scorers,
            result.status == "failed"))
        if raw is None:
            return outcome, None  # type: ignore[return-value]
        return outcome, self._decision(group_id, raw)  # type: ignore[return-value]

    async def _park_batch(self, parks: list[_Park]) -> list[tuple[str, list[Any] | None, int]]:
        now = _now_ms()
        items, index = [], {}
        for p in parks:
            deadline = now + int(p.group_timeout_s * 1000)
            ttl = self._state_ttl(p.group_timeout_s)
            items.append((p.group_id, [fingerprint(p.group_id), p.trajectory_id, p.blob, p.group_size, now, deadline,
                                       ttl, p.worker_id, p.scorers, "failed" if p.failed else "complete"]))
            index.setdefault(p.group_id, deadline)
        ttl = max(self._state_ttl(p.group_timeout_s) for p in parks)
        extra: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [("zadd", (self.deadlines_key, index), {"nx": True})]
        if time.monotonic() >= self._deadlines_ttl_at:
            extra.append(("expire", (self.deadlines_key, ttl + int(TTL_REFRESH_S)), {}))
            self._deadlines_ttl_at = time.monotonic() + TTL_REFRESH_S
        res, _ = await self._scripts("park", items, extra)
        return [(r[0].decode(), r[2] if len(r) >= 3 else None, now) for r in res]

    async def decide(self, group_id: str, kind: DecisionKind, *,
                     worker_id: str, scorers: bytes, discard_reason: str = "",
                     group_timeout_s: float, republish_grace_s: float) -> Decision:
        """Record the group's decision unless one exists; return the stored one either way."""
        now = _now_ms()
        (raw,), _ = await self._scripts("decide", [(group_id, [
            fingerprint(group_id), kind, now, worker_id, scorers, discard_reason, self._state_ttl(group_timeout_s)])])
        decision = self._decision(group_id, raw)
        if decision.outcome == "decided_now":
            # Until finish() removes it, the sweeper re-publishes after the grace period
            # in case this worker dies between deciding and publishing. (A decision made
            # by a park needs no such step: its last member stays uncommitted until the
            # verdict is out, and whoever gets it again nudges the group.)
            await self.redis.zadd(self.deadlines_key, {group_id: now + int(republish_grace_s * 1000)})
        return decision

    @staticmethod
    def _decision(group_id: str, raw: list[Any]) -> Decision:
        outcome = raw[0].decode()
        if outcome not in ("decided_now", "already_decided"):
            return Decision(outcome, group_id, GroupState(), [])  # type: ignore[arg-type]
        flat_members = raw[2]
        members = [decode_parked(flat_members[i + 1]) for i in range(0, len(flat_members), 2)]
        return Decision(outcome, group_id, decode_state(raw[1]), members)  # type: ignore[arg-type]

    async def finish(self, group_id: str) -> None:
        """After the verdict is acknowledged by Kafka: drop the group's state and remember
        it as finished for the dedupe window. Concurrent finishes share one round trip."""
        await self._finishes.submit(group_id)

    async def _finish_batch(self, groups: list[str]) -> list[None]:
        await self._scripts("finish", [(g, [fingerprint(g), self._done_ttl(g)]) for g in groups],
                            [("zrem", (self.deadlines_key, *groups), {})])
        return [None] * len(groups)

    def _done_ttl(self, group_id: str) -> int:
        """The TTL to set on the group's newest done set with this finish, or 0 when this
        instance set it less than ``ttl_refresh_s`` ago (the TTL covers that much more)."""
        key, now = self.keys(group_id)[2], time.monotonic()
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
        await self.redis.zadd(self.deadlines_key, {group_id: _now_ms() + int(republish_grace_s * 1000)},
                              xx=True, lt=True)

    async def postpone(self, group_id: str, delay_s: float) -> None:
        """Move a group's sweep to ``now + delay_s`` (only if it is still indexed)."""
        await self.redis.zadd(self.deadlines_key, {group_id: _now_ms() + int(delay_s * 1000)}, xx=True)

    async def forget(self, group_id: str) -> None:
        """Drop a stale index entry (the group's keys expired or were finished)."""
        await self.redis.zrem(self.deadlines_key, group_id)

    async def due_groups(self, limit: int = 64) -> list[str]:
        """Groups whose deadline (or re-publish grace) has passed."""
        raw = await self.redis.zrangebyscore(self.deadlines_key, "-inf", _now_ms(), start=0, num=limit)
        return [g.decode() for g in raw]

    # ---------------------------------------------------------------- worker heartbeats (prm-pipeline status)
    # One sorted set, ``<prefix>:workers``: worker id -> last beat (ms). Kept apart from
    # the group transitions; no group key is touched here.
    @property
    def workers_key(self) -> str:
        return f"{self.prefix}:workers"

    async def beat(self, worker_id: str, *, forget_after_s: float = WORKERS_REMEMBERED_S) -> None:
        """Record that ``worker_id`` is alive now; forget workers silent for ``forget_after_s``."""
        now = _now_ms()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.workers_key, {worker_id: now})
            pipe.zremrangebyscore(self.workers_key, "-inf", now - int(forget_after_s * 1000))
            pipe.expire(self.workers_key, int(forget_after_s))
            await pipe.execute()

    async def retire(self, worker_id: str) -> None:
        """A worker that stops cleanly leaves the heartbeat set at once."""
        await self.redis.zrem(self.workers_key, worker_id)

    # ---------------------------------------------------------------- operator reads (prm-pipeline status)
    # Read-only and separate from the transitions above: nothing here changes a key.
    async def heartbeats(self) -> list[tuple[str, int]]:
        """``(worker_id, last beat in epoch ms)`` of the workers seen within the remembered span."""
        return [(w.decode(), int(ms)) for w, ms in await self.redis.zrange(self.workers_key, 0, -1, withscores=True)]

    async def unfinished_groups(self, limit: int = 1000) -> tuple[int, list[UnfinishedGroup]]:
        """``(total, first)``: how many groups the deadlines index lists, and the state of
        the ``limit`` that are due soonest (decided groups waiting for their verdict come
        first: their index entry is the re-publish time). One round trip for the index,
        one pipelined read of the states (per slot on Redis Cluster)."""
        total = int(await self.redis.zcard(self.deadlines_key))
        entries = await self.redis.zrange(self.deadlines_key, 0, max(0, limit - 1), withscores=True)
        if not entries:
            return total, []
        async with self.redis.pipeline(transaction=False) as pipe:
            for group, _ in entries:
                pipe.hmget(f"{self.prefix}:{{{group.decode()}}}:state", "status", "first_seen", "deadline", "decided_at")
            states = await pipe.execute()
        out = []
        for (group, due), (status, first_seen, deadline, decided_at) in zip(entries, states):
            out.append(UnfinishedGroup(group.decode(), status.decode() if status else "gone", int(due),
                                       int(first_seen or 0), int(deadline or 0), int(decided_at or 0)))
        return total, out

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
