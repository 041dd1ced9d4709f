"""Open streamed sessions in Redis: their parked turns and turn results, and when each went idle.

A streamed session's turns are acknowledged (their offsets committed) once parked here,
so a worker killed between two turns loses nothing: the worker that takes the partition
over finds them and continues the session (:class:`scoring_workers.open_sessions.OpenSession`
rebuilds it). Per session ``S`` of group ``G`` (its scoped group key, so Redis Cluster
keeps the session in the group's slot), one hash ``<prefix>:{G}:s:<trajectory_id>``:

* ``n`` — turns parked; ``i:<interaction_id>`` -> its arrival number ``k`` (1, 2, ...);
  ``t:<k>`` -> the turn's ``Interaction`` as received (msgpack, compact);
* ``r:<interaction_id>:<child_id>`` -> the streamable scorers' results for the turn, as
  computed when that child brought its next state (:mod:`scoring_workers.prm.streamed`);
* ``last`` — epoch ms of the last record; ``sid`` and ``size`` — the session id and its
  group's size (to answer the group if the session goes idle);
* ``at`` — ``<partition>:<offset>`` of the session's first ``turn`` record in the
  trajectories topic, set when that turn is parked: the coordinates its member is parked
  at, from which any worker or verdict reader reads the session back
  (:mod:`infra.readback`) — so the hash can go once the member is parked, and Redis holds
  no token turns of ended sessions.

A repeated turn (same id, same bytes: a producer retry, a replay) is a duplicate and
changes nothing; the same id with other bytes is a conflict (the session is not one
session: the caller dead-letters it). At most ``worker.session_max_turns`` turns are
parked per session.

Memory per open session: its compact turns (the session's content as sent) plus about
100 bytes per streamed scorer result, bounded in time by the idle timeout: the hash
expires ``worker.session_idle_s`` + ``redis.ttl_s`` after its last record. One global
sorted set, ``<prefix>:sessions``, indexes open sessions by when they go idle; a
sweeper answers an idle session's group (the member fails ``session_idle``) before its
turns expire. Like the ledger's deadlines index it is only an index: whether a session
is still idle is read from its own hash.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from infra.config import RedisConfig
from infra.redis import RedisClient, reply_bytes, reply_hash, reply_members, reply_text
from infra.schema import Interaction
from scoring_workers.prm.streamed import StreamedResult, decode_results

__all__ = ["SessionStore", "TurnOutcome", "ParkedSession", "Coords", "session_key"]

_INTERACTION = msgspec.msgpack.Decoder(Interaction)
_ENCODER = msgspec.msgpack.Encoder()
_INDEX_MEMBER = msgspec.msgpack.Decoder(tuple[str, str])

# park a turn: KEYS[1] = the session hash; ARGV = interaction_id, bytes, now_ms, ttl_s, max_turns,
# session_id, group_size, the turn record's "<partition>:<offset>" ('' when unknown)
_PARK_TURN = """
local S = KEYS[1]
local iid, raw = ARGV[1], ARGV[2]
local k = redis.call('HGET', S, 'i:' .. iid)
if k then
  if redis.call('HGET', S, 't:' .. k) == raw then return {'duplicate', tonumber(k)} end
  return {'conflict', tonumber(k)}
end
local n = tonumber(redis.call('HGET', S, 'n') or '0')
if n >= tonumber(ARGV[5]) then return {'full', n} end
n = n + 1
redis.call('HSET', S, 'n', n, 'i:' .. iid, n, 't:' .. n, raw, 'last', ARGV[3], 'sid', ARGV[6], 'size', ARGV[7])
if n == 1 and ARGV[8] ~= '' then redis.call('HSET', S, 'at', ARGV[8]) end
redis.call('EXPIRE', S, ARGV[4])
return {'parked', n}
"""


Coords = tuple[int, int]
"""A record's ``(partition, offset)`` in the trajectories topic."""


class TurnOutcome(StrEnum):
    PARKED = "parked"  # new: the k-th turn of the session
    DUPLICATE = "duplicate"  # parked before, same bytes
    CONFLICT = "conflict"  # parked before with other bytes: not one session
    FULL = "full"  # worker.session_max_turns reached


def session_key(prefix: str, group: str, trajectory_id: str) -> str:
    """The session's hash, in its group's hash slot (``group`` is the scoped group key)."""
    return f"{prefix}:{{{group}}}:s:{trajectory_id}"


@dataclass(slots=True)
class ParkedSession:
    """What Redis holds of an open session: its turns in arrival order, its streamed results."""

    turns: list[Interaction] = field(default_factory=list)
    results: list[StreamedResult] = field(default_factory=list)
    judged: set[tuple[str, str]] = field(default_factory=set)  # (turn, child) pairs with parked results
    at: Coords | None = None  # the first turn's record (None: parked without its coordinates)


class SessionStore:
    """Parked turns of open streamed sessions (one instance per worker process)."""

    def __init__(self, client: RedisClient, cfg: RedisConfig, *, idle_s: float, max_turns: int) -> None:
        self.redis = client
        self.prefix = cfg.key_prefix
        self.index_key = f"{self.prefix}:sessions"
        self.idle_s = idle_s
        self.max_turns = max_turns
        self.ttl_s = int(idle_s) + cfg.ttl_s
        self._park = client.register_script(_PARK_TURN)

    def key(self, group: str, trajectory_id: str) -> str:
        return session_key(self.prefix, group, trajectory_id)

    async def park_turn(
        self,
        group: str,
        trajectory_id: str,
        turn: Interaction,
        *,
        session_id: str,
        group_size: int,
        at: Coords | None = None,
    ) -> tuple[TurnOutcome, int]:
        """Park ``turn`` (as received) unless it is there; ``(outcome, its arrival number)``.
        ``at``: the turn record's coordinates, kept when it is the session's first turn."""
        now = _now_ms()
        where = "" if at is None else f"{at[0]}:{at[1]}"
        outcome, k = await self._park(
            keys=[self.key(group, trajectory_id)],
            args=[
                turn.interaction_id,
                _ENCODER.encode(turn),
                now,
                self.ttl_s,
                self.max_turns,
                session_id,
                group_size,
                where,
            ],
        )
        result = TurnOutcome(outcome.decode() if isinstance(outcome, bytes) else outcome)
        if result is TurnOutcome.PARKED:
            await self._index(group, trajectory_id, now)
        return result, int(k)

    async def park_results(
        self, group: str, trajectory_id: str, interaction_id: str, child_id: str, results: Sequence[StreamedResult]
    ) -> None:
        """Park the streamed results of ``interaction_id`` computed when ``child_id`` arrived."""
        key = self.key(group, trajectory_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, f"r:{interaction_id}:{child_id}", _ENCODER.encode(list(results)))
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def load(self, group: str, trajectory_id: str) -> ParkedSession:
        """The session's parked turns (arrival order) and streamed results."""
        raw = reply_hash(await self.redis.hgetall(self.key(group, trajectory_id)))
        turns: dict[int, Interaction] = {}
        session = ParkedSession()
        for field_name, value in raw.items():
            name = field_name.decode()
            if name.startswith("t:"):
                turns[int(name[2:])] = _INTERACTION.decode(value)
            elif name.startswith("r:"):
                session.results += decode_results(value)
                turn, _, child = name[2:].partition(":")
                session.judged.add((turn, child))
            elif name == "at":
                session.at = _coords(value)
        session.turns = [turns[k] for k in sorted(turns)]
        return session

    async def first_record(self, group: str, trajectory_id: str) -> Coords | None:
        """Where the session's first turn is in the trajectories topic (None: not known)."""
        raw = await self.redis.hget(self.key(group, trajectory_id), "at")
        return None if raw is None else _coords(reply_bytes(raw))

    async def drop(self, group: str, trajectory_id: str) -> None:
        """Forget a session whose member is parked (its end was scored or it was answered idle)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.key(group, trajectory_id))
            pipe.zrem(self.index_key, _ENCODER.encode((group, trajectory_id)))
            await pipe.execute()

    async def due(self, limit: int = 64) -> list[tuple[str, str]]:
        """Sessions whose idle deadline passed per the index: ``(group, trajectory_id)``."""
        raw = await self.redis.zrangebyscore(self.index_key, "-inf", _now_ms(), start=0, num=limit)
        return [_INDEX_MEMBER.decode(m) for m in reply_members(raw)]

    async def idle(self, group: str, trajectory_id: str) -> tuple[float, str, int] | None:
        """``(seconds since the session's last record, its session id, its group's size)``;
        None when it holds nothing (closed, or expired)."""
        last, sid, size = await self.redis.hmget(self.key(group, trajectory_id), ["last", "sid", "size"])
        if last is None:
            return None
        return max(0.0, (_now_ms() - int(last)) / 1000), reply_text(sid or b""), int(size or 1)

    async def forget(self, group: str, trajectory_id: str) -> None:
        """Drop a stale index entry (its session was closed or expired)."""
        await self.redis.zrem(self.index_key, _ENCODER.encode((group, trajectory_id)))

    async def postpone(self, group: str, trajectory_id: str, idle_s: float) -> None:
        """Move the session's index entry to when it goes idle, ``idle_s`` having passed already."""
        at = _now_ms() + int((self.idle_s - idle_s) * 1000)
        await self.redis.zadd(self.index_key, {_ENCODER.encode((group, trajectory_id)): at})

    async def _index(self, group: str, trajectory_id: str, now_ms: int) -> None:
        await self.redis.zadd(
            self.index_key, {_ENCODER.encode((group, trajectory_id)): now_ms + int(self.idle_s * 1000)}
        )


def _coords(raw: bytes | None) -> Coords | None:
    """``b"<partition>:<offset>"`` as written by the park script (None when absent)."""
    if not raw:
        return None
    partition, _, offset = raw.decode().partition(":")
    return int(partition), int(offset)


def _now_ms() -> int:
    return int(time.time() * 1000)
