"""The group ledger's Lua script (see :mod:`scoring_workers.ledger` for the keys it uses).

Kept apart so that the ledger module reads as Python. One script carries every group
transition — park, decide, finish — so the transitions that queue while a call is on
the wire, whatever their kind, go out together as one ``EVALSHA`` (probes are plain
reads beside it). Each item is atomic on one group's keys (one cluster slot) and safe to
repeat.

Call shape: ``KEYS`` = the deadlines index when ``ARGV[2]`` is ``1`` (standalone Redis;
on Redis Cluster it lives in another slot, so the caller pipelines its index commands
beside the call instead and ``ARGV[2]`` is ``0``), then per item the group's hash and its
``ARGV[1]`` dedupe buckets, newest first. ``ARGV[3]`` onwards: per item an op code and
its arguments (``ARGS`` per op): :class:`ParkArgs`, :class:`DecideArgs`,
:class:`FinishArgs`, in field order. One result per item, in order.

Why it is shaped this way (each ``redis.call`` is a command Redis counts and runs):

* a group is one hash — state fields plus one ``m:<trajectory_id>`` field per parked
  member and a member count ``n`` — so a park is one ``HMGET`` (state, count, and whether
  this member is parked) and one ``HSET`` (the member, the count and, when it completes
  or fails the group, the decision), a decision one ``HGETALL``, and the TTL one
  ``EXPIRE`` per group;
* a group with a hash is not finished (finishing deletes it in the same step that
  records the group as done), so the dedupe buckets are read only for a group without
  one, and a park reads only the buckets written since its own worker's probe found the
  group neither open nor done (``ndone`` per park item; the caller knows);
* the deadlines index entry is added when a park creates the group, moved by a decide
  and removed when the group finishes, inside the same atomic step (standalone).
"""

from __future__ import annotations

from enum import StrEnum

import msgspec


class Op(StrEnum):
    """A transition's op code in the script's ``ARGV`` (probes are plain reads, not in it)."""

    PARK = "k"
    DECIDE = "d"
    FINISH = "f"


class ParkArgs(msgspec.Struct, frozen=True, array_like=True):
    """A park's arguments, in the script's order (``ARGV[a + 1]`` onwards).

    ``kind`` is ``complete``, or ``failed`` for a failed member (it decides the group at
    once); ``ndone`` is how many of the newest dedupe buckets to read when the group has
    no hash; times are epoch milliseconds."""

    fingerprint: bytes
    trajectory_id: str
    blob: bytes
    group_size: int
    now_ms: int
    deadline_ms: int
    ttl_s: int
    worker_id: str
    scorers: bytes
    kind: str
    ndone: int
    group_id: str


class DecideArgs(msgspec.Struct, frozen=True, array_like=True):
    """A decision's arguments, in the script's order: ``kind`` is ``complete``,
    ``deadline``, ``discard`` or ``invalid`` (``reason`` names the discard or the dead
    letter); the group's index entry moves to ``republish_at_ms``."""

    fingerprint: bytes
    kind: str
    now_ms: int
    worker_id: str
    scorers: bytes
    reason: str
    ttl_s: int
    republish_at_ms: int
    group_id: str


class FinishArgs(msgspec.Struct, frozen=True, array_like=True):
    """A finish's arguments: ``done_ttl_s`` 0 when the caller set the newest done set's TTL lately."""

    fingerprint: bytes
    done_ttl_s: int
    group_id: str


TransitionArgs = ParkArgs | DecideArgs | FinishArgs

# op code -> number of ARGV values per item, the op code included (the script's table is built from it)
ARGS = {
    Op.PARK.value: 1 + len(ParkArgs.__struct_fields__),
    Op.DECIDE.value: 1 + len(DecideArgs.__struct_fields__),
    Op.FINISH.value: 1 + len(FinishArgs.__struct_fields__),
}


def argv(op: Op, args: TransitionArgs) -> list[object]:
    """One item's ``ARGV`` values: its op code, then its arguments in order."""
    return [op.value, *msgspec.structs.astuple(args)]


LEDGER = """
local nd = tonumber(ARGV[1])
local ix = tonumber(ARGV[2])
local D = KEYS[1]
local nk = 1 + nd
local ARGS = {__ARGS__}

-- the group's fingerprint in one of its `upto` newest dedupe buckets
local function is_done(k0, fp, upto)
  for i = 1, upto do
    if redis.call('SISMEMBER', KEYS[k0 + 1 + i], fp) == 1 then return true end
  end
  return false
end

-- the decision's fields, appended to `w` (an HSET argument list)
local function decision(w, kind, now, worker, scorers, reason)
  for _, v in ipairs({'status', 'decided', 'decision', kind, 'decided_at', now, 'decided_by', worker,
                      'scorers', scorers, 'discard_reason', reason}) do w[#w + 1] = v end
end

-- park: fingerprint, trajectory_id, blob, group_size, now_ms, deadline_ms, ttl_s, worker_id,
-- scorers, kind ('complete', or 'failed' for a failed member), ndone (buckets to read when
-- the group has no hash), group_id -> {outcome, 0} | {outcome, 1, HGETALL}: the member
-- that completes the group (all members parked, or members disagreeing on group_size), or
-- a failed member, decides it in the same atomic step.
local function park(k0, a)
  local S = KEYS[k0 + 1]
  local tid, size_arg, now = ARGV[a + 2], ARGV[a + 4], ARGV[a + 5]
  local st, size, mismatch, n, mine = unpack(redis.call('HMGET', S, 'status', 'group_size', 'size_mismatch', 'n',
                                                       'm:' .. tid))
  if st == 'decided' then return {'decided', 0} end
  local w = {}
  if not st then  -- the group's first member: its hash lives until its deadline + redis.ttl_s
    if is_done(k0, ARGV[a + 1], tonumber(ARGV[a + 11])) then return {'done', 0} end
    size, n = size_arg, 0
    w = {'group_size', size, 'first_seen', now, 'deadline', ARGV[a + 6]}
  end
  n = tonumber(n or 0)
  local outcome, kind = 'parked', ARGV[a + 10]
  if mine then
    outcome, kind = 'duplicate', 'complete'  -- the member parked first stands
  else
    n = n + 1
    w[#w + 1], w[#w + 2], w[#w + 3], w[#w + 4] = 'm:' .. tid, ARGV[a + 3], 'n', n
    if size ~= size_arg then
      mismatch = size_arg
      w[#w + 1], w[#w + 2] = 'size_mismatch', mismatch
    end
  end
  local decides = kind == 'failed' or mismatch or n >= tonumber(size)
  if decides then
    decision(w, kind, now, ARGV[a + 8], ARGV[a + 9], '')
  elseif not st then
    w[#w + 1], w[#w + 2] = 'status', 'open'
  end
  if #w > 0 then redis.call('HSET', S, unpack(w)) end
  if not st then
    redis.call('EXPIRE', S, ARGV[a + 7])
    if ix == 1 then redis.call('ZADD', D, 'NX', ARGV[a + 6], ARGV[a + 12]) end
  end
  if decides then return {outcome, 1, redis.call('HGETALL', S)} end
  return {outcome, 0}
end

-- decide: fingerprint, kind, now_ms, worker_id, scorers, reason, ttl_s, republish_at_ms,
-- group_id -> {outcome[, HGETALL]}
-- kind: complete (all members parked) | deadline (sweeper) | discard (DiscardGroup) |
--       invalid (a member was dead-lettered; ``reason`` names it)
local function decide(k0, a)
  local S = KEYS[k0 + 1]
  local kind, now = ARGV[a + 2], ARGV[a + 3]
  local st, size, mismatch, deadline, n = unpack(redis.call('HMGET', S, 'status', 'group_size', 'size_mismatch',
                                                            'deadline', 'n'))
  if not st and is_done(k0, ARGV[a + 1], nd) then return {'done'} end
  if st == 'decided' then return {'already_decided', redis.call('HGETALL', S)} end
  if kind == 'deadline' then
    if not st then return {'gone'} end
    if tonumber(now) < tonumber(deadline) then return {'not_due'} end
  elseif kind == 'complete' then
    if not st then return {'gone'} end
    if not mismatch and tonumber(n or 0) < tonumber(size) then return {'incomplete'} end
  end
  local w = {}
  if not st then w = {'group_size', '0', 'first_seen', now, 'deadline', now, 'n', 0} end
  decision(w, kind, now, ARGV[a + 4], ARGV[a + 5], ARGV[a + 6])
  redis.call('HSET', S, unpack(w))
  redis.call('EXPIRE', S, ARGV[a + 7])  -- the decision lives ttl from now
  -- until the verdict is out, a sweeper re-publishes after the grace period
  if ix == 1 then redis.call('ZADD', D, ARGV[a + 8], ARGV[a + 9]) end
  return {'decided_now', redis.call('HGETALL', S)}
end

-- finish: fingerprint, done-set ttl_s (0: the caller set it recently), group_id. Drops
-- the group's hash, remembers the group in the newest bucket.
local function finish(k0, a)
  local S = KEYS[k0 + 1]
  redis.call('DEL', S)
  redis.call('SADD', KEYS[k0 + 2], ARGV[a + 1])
  if ARGV[a + 2] ~= '0' then redis.call('EXPIRE', KEYS[k0 + 2], ARGV[a + 2]) end
  if ix == 1 then redis.call('ZREM', D, ARGV[a + 3]) end
  return 1
end

local OPS = {k = park, d = decide, f = finish}
local out = {}
local k0, a = ix, 3
while a <= #ARGV do
  local op = ARGV[a]
  out[#out + 1] = OPS[op](k0, a)
  k0, a = k0 + nk, a + ARGS[op]
end
return out
""".replace("__ARGS__", ", ".join(f"{k} = {n}" for k, n in ARGS.items()))
