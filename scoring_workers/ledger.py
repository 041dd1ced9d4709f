"""The group ledger: the only code that talks to Redis.

Per group ``G`` (all keys share the ``{G}`` hash tag, so Redis Cluster keeps them in one
slot and every transition is one atomic Lua call):

* ``<prefix>:{G}:state``   hash — ``status`` (``open`` | ``decided``), ``group_size``,
  ``first_seen``/``deadline`` (ms), ``size_mismatch``; once decided also ``decision``
  (``complete`` | ``deadline`` | ``discard`` | ``invalid``), ``discard_reason`` (the
  reason of a discard or of an ``invalid`` decision), ``decided_at``,
  ``decided_by``, ``scorers``.
* ``<prefix>:{G}:members`` hash — ``trajectory_id`` -> msgpack ``SessionResult`` (the
  parked result of a scored member; a failed member is parked too, without stats).
* ``<prefix>:{G}:done``    string — tombstone written after the verdict is published;
  late members and redeliveries of a finished group are acknowledged without work.

One global sorted set, ``<prefix>:deadlines``, lists unfinished groups by the time a
sweeper must look at them (deadline, or a re-publish grace for decided groups). It is
only an index: every decision is re-checked atomically on the group's own keys.

Every key has a TTL. The decision fields are stored so that any worker can rebuild the
*identical* verdict from Redis alone; that is what makes redelivered work converge on
the same ``(group_id, verdict_version)``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from infra.config import RedisConfig
from infra.redis import make_redis
from infra.schema import SessionResult

_PROBE = """
if redis.call('EXISTS', KEYS[3]) == 1 then return 'done' end
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'decided' then return 'decided' end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 'duplicate' end
return 'new'
"""

# Shared by PARK (kind 'complete', when the last member lands) and DECIDE.
# kind: complete (all members parked) | deadline (sweeper) | discard (DiscardGroup)
#       | invalid (a member was dead-lettered; ``reason`` names it)
_DECIDE_FN = """
local function decide(kind, now, worker, scorers, reason, ttl)
  if redis.call('EXISTS', KEYS[3]) == 1 then return {'done'} end
  local st = redis.call('HGET', KEYS[1], 'status')
  local outcome = 'decided_now'
  if st == 'decided' then
    outcome = 'already_decided'
  else
    if kind == 'deadline' then
      if not st then return {'gone'} end
      if tonumber(now) < tonumber(redis.call('HGET', KEYS[1], 'deadline')) then return {'not_due'} end
    elseif kind == 'complete' then
      if not st then return {'gone'} end
      local size = tonumber(redis.call('HGET', KEYS[1], 'group_size'))
      if not redis.call('HGET', KEYS[1], 'size_mismatch') and redis.call('HLEN', KEYS[2]) < size then
        return {'incomplete'}
      end
    end
    if not st then
      redis.call('HSET', KEYS[1], 'group_size', '0', 'first_seen', now, 'deadline', now)
    end
    redis.call('HSET', KEYS[1], 'status', 'decided', 'decision', kind, 'decided_at', now,
               'decided_by', worker, 'scorers', scorers, 'discard_reason', reason)
    redis.call('EXPIRE', KEYS[1], ttl)
    redis.call('EXPIRE', KEYS[2], ttl)
  end
  return {outcome, redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2])}
end
"""

# KEYS: state, members, done.
# ARGV: trajectory_id, blob, group_size, now_ms, deadline_ms, ttl_s, worker_id, scorers_blob
# Returns {outcome, complete, decision...}: the member that completes the group also
# decides it in the same atomic step (one round trip for park + decide).
_PARK = _DECIDE_FN + """
if redis.call('EXISTS', KEYS[3]) == 1 then return {'done', 0} end
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'decided' then return {'decided', 0} end
local function complete()
  local size = tonumber(redis.call('HGET', KEYS[1], 'group_size'))
  local mismatch = redis.call('HGET', KEYS[1], 'size_mismatch')
  if mismatch or redis.call('HLEN', KEYS[2]) >= size then return 1 end
  return 0
end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  if complete() == 1 then return {'duplicate', 1, decide('complete', ARGV[4], ARGV[7], ARGV[8], '', ARGV[6])} end
  return {'duplicate', 0}
end
if not st then
  redis.call('HSET', KEYS[1], 'status', 'open', 'group_size', ARGV[3], 'first_seen', ARGV[4], 'deadline', ARGV[5])
elseif redis.call('HGET', KEYS[1], 'group_size') ~= ARGV[3] then
  redis.call('HSET', KEYS[1], 'size_mismatch', ARGV[3])
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
if complete() == 1 then return {'parked', 1, decide('complete', ARGV[4], ARGV[7], ARGV[8], '', ARGV[6])} end
return {'parked', 0}
"""

# KEYS: state, members, done. ARGV: kind, now_ms, worker_id, scorers_blob, discard_reason, ttl_s
_DECIDE = _DECIDE_FN + """
return decide(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
"""

# KEYS: state, members, done. ARGV: verdict status, ttl_s
_FINISH = """
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[2])
return 1
"""

Probe = Literal["new", "duplicate", "decided", "done"]
ParkOutcome = Literal["parked", "duplicate", "decided", "done"]
DecideOutcome = Literal["decided_now", "already_decided", "done", "gone", "not_due", "incomplete"]

_MEMBER_DECODER = msgspec.msgpack.Decoder(SessionResult)
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Decision:
    """A group's stored decision and its parked members: all a verdict is built from."""

    outcome: DecideOutcome
    group_id: str
    state: dict[str, str]
    members: list[SessionResult]

    @property
    def decided_at_ms(self) -> int:
        return int(self.state.get("decided_at", "0"))


def _now_ms() -> int:
    return int(time.time() * 1000)


class GroupLedger:
    """Atomic, TTL'd group state in Redis. One instance per worker process.

    Scripts are loaded once (``SCRIPT LOAD``) and called with ``EVALSHA`` inside
    pipelines; after a Redis restart (``NOSCRIPT``) they are reloaded and the call is
    repeated — every script is safe to repeat.
    """

    _SCRIPTS = {"probe": _PROBE, "park": _PARK, "decide": _DECIDE, "finish": _FINISH}

    def __init__(self, client: aioredis.Redis, cfg: RedisConfig) -> None:
        self.redis = client
        self.cfg = cfg
        self.prefix = cfg.key_prefix
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError("redis.key_prefix must not contain '{' or '}' (they select the cluster hash slot)")
        self.deadlines_key = f"{self.prefix}:deadlines"
        self.cluster = cfg.cluster
        self._sha: dict[str, str] = {}

    @classmethod
    def from_config(cls, cfg: RedisConfig) -> GroupLedger:
        return cls(make_redis(cfg), cfg)

    async def aclose(self) -> None:
        await self.redis.aclose()

    def keys(self, group_id: str) -> list[str]:
        tag = f"{self.prefix}:{{{group_id}}}"
        return [f"{tag}:state", f"{tag}:members", f"{tag}:done"]

    def _state_ttl(self, group_timeout_s: float) -> int:
        return int(group_timeout_s) + self.cfg.ttl_s

    async def _load_scripts(self) -> None:
        for name, body in self._SCRIPTS.items():
            self._sha[name] = await self.redis.script_load(body)

    async def _execute(self, ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """Run ``(command, args, kwargs)`` ops in one round trip; reload scripts once on NOSCRIPT.

        Standalone Redis: one pipeline. Redis Cluster (whose client refuses scripts in
        pipelines): the ops run concurrently, each routed to its key's slot.
        """
        if not self._sha:
            await self._load_scripts()
        for attempt in (1, 2):
            try:
                resolved = [self._resolve(op) for op in ops]
                if self.cluster:
                    return list(await asyncio.gather(*(getattr(self.redis, n)(*a, **kw) for n, a, kw in resolved)))
                async with self.redis.pipeline(transaction=False) as pipe:
                    for name, args, kw in resolved:
                        getattr(pipe, name)(*args, **kw)
                    return await pipe.execute()
            except NoScriptError:
                if attempt == 2:
                    raise
                await self._load_scripts()  # Redis restarted and lost its script cache
        raise AssertionError("unreachable")

    def _script(self, script: str, group_id: str, *args: Any) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        keys = self.keys(group_id)
        return ("script:" + script, (len(keys), *keys, *args), {})

    def _resolve(self, op: tuple[str, tuple[Any, ...], dict[str, Any]]) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        name, args, kw = op
        if name.startswith("script:"):
            return "evalsha", (self._sha[name[len("script:"):]], *args), kw
        return op

    # ---------------------------------------------------------------- reads
    async def probe_many(self, items: Sequence[tuple[str, str]]) -> list[Probe]:
        """Batched pre-check for one poll: ``(group_id, trajectory_id)`` -> what is known.

        One pipeline round trip for the whole poll, so duplicates and members of
        decided groups are acknowledged without scoring.
        """
        if not items:
            return []

        ops = [self._script("probe", group_id, trajectory_id) for group_id, trajectory_id in items]
        return [r.decode() if isinstance(r, bytes) else r for r in await self._execute(ops)]

    # ---------------------------------------------------------------- transitions
    async def park(self, result: SessionResult, *, group_id: str, group_size: int, group_timeout_s: float,
                   worker_id: str, scorers: bytes, republish_grace_s: float) -> tuple[ParkOutcome, Decision | None]:
        """Store a member's result; if it completes the group, decide the group too.

        Returns ``(outcome, decision)``; ``decision`` is set when the group is complete
        (``decided_now`` for the caller that must publish). The deadline index entry is
        added in the same round trip (``ZADD NX``).
        """
        now = _now_ms()
        deadline = now + int(group_timeout_s * 1000)
        ttl = self._state_ttl(group_timeout_s)

        raw, *_ = await self._execute([
            self._script("park", group_id, result.trajectory_id, _ENCODER.encode(result), group_size, now,
                         deadline, ttl, worker_id, scorers),
            ("zadd", (self.deadlines_key, {group_id: deadline}), {"nx": True}),
            ("expire", (self.deadlines_key, ttl), {}),
        ])
        outcome = raw[0].decode()
        if len(raw) < 3:
            return outcome, None
        return outcome, await self._decision(group_id, raw[2], now, republish_grace_s)

    async def decide(self, group_id: str, kind: Literal["complete", "deadline", "discard", "invalid"], *,
                     worker_id: str, scorers: bytes, discard_reason: str = "",
                     group_timeout_s: float, republish_grace_s: float) -> Decision:
        """Record the group's decision unless one exists; return the stored one either way."""
        now = _now_ms()
        (raw,) = await self._execute([self._script(
            "decide", group_id, kind, now, worker_id, scorers, discard_reason, self._state_ttl(group_timeout_s))])
        return await self._decision(group_id, raw, now, republish_grace_s)

    async def _decision(self, group_id: str, raw: list[Any], now: int, republish_grace_s: float) -> Decision:
        outcome = raw[0].decode()
        if outcome not in ("decided_now", "already_decided"):
            return Decision(outcome, group_id, {}, [])
        flat_state, flat_members = raw[1], raw[2]
        # latin-1 maps bytes 1:1, so the binary ``scorers`` blob survives the str round trip
        state = {flat_state[i].decode(): flat_state[i + 1].decode("latin-1") for i in range(0, len(flat_state), 2)}
        members = [_MEMBER_DECODER.decode(flat_members[i + 1]) for i in range(0, len(flat_members), 2)]
        if outcome == "decided_now":
            # Until finish() removes it, the sweeper re-publishes after the grace period
            # in case this worker dies between deciding and publishing.
            await self.redis.zadd(self.deadlines_key, {group_id: now + int(republish_grace_s * 1000)})
        return Decision(outcome, group_id, state, members)

    async def finish(self, group_id: str, status: str, *, ttl_s: int | None = None) -> None:
        """After the verdict is acknowledged by Kafka: drop the group's state, leave a tombstone."""

        await self._execute([
            self._script("finish", group_id, status, ttl_s or self.cfg.ttl_s),
            ("zrem", (self.deadlines_key, group_id), {}),
        ])

    async def nudge(self, group_id: str, republish_grace_s: float) -> None:
        """Bring a decided group's sweep forward to ``now + grace`` (never later, never re-adding).

        Called whenever a worker finds a group decided but not finished: if its decider
        died between deciding and moving the index entry, the sweeper would otherwise
        wait for the group deadline before re-publishing.
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
