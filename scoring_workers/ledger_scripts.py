"""The group ledger's Lua scripts (see :mod:`scoring_workers.ledger` for the keys they use).

Kept apart so that the ledger module reads as Python; each script is atomic on one
group's keys (one cluster slot) and safe to repeat.
"""

# Every script takes items of the same shape: KEYS = per item (state, members, done...),
# ARGV[1] = done keys per item, then per item its ARGV group. They loop over the items
# and return one result per item, so a batch is one call. A group with a state hash is
# not finished (finishing deletes it in the same step that records the group as done),
# so the done sets are only consulted for groups without one.
HEAD = """
local nd = tonumber(ARGV[1])
local nk = 2 + nd
local function is_done(k0, fp)
  for i = 1, nd do
    if redis.call('SISMEMBER', KEYS[k0 + 2 + i], fp) == 1 then return true end
  end
  return false
end
"""

# per item ARGV: trajectory_id, fingerprint
PROBE = HEAD + """
local out = {}
local n = (#KEYS) / nk
for j = 0, n - 1 do
  local k0, a0 = j * nk, 1 + j * 2
  local r = 'new'
  local st = redis.call('HGET', KEYS[k0 + 1], 'status')
  if st == 'decided' then r = 'decided'
  elseif st then
    if redis.call('HEXISTS', KEYS[k0 + 2], ARGV[a0 + 1]) == 1 then r = 'duplicate' end
  elseif is_done(k0, ARGV[a0 + 2]) then r = 'done' end
  out[#out + 1] = r
end
return out
"""

# Shared by PARK (kind 'complete' when the last member lands, 'failed' when a failed member
# lands) and DECIDE.
# kind: complete (all members parked) | failed (a member failed: the group is rejected
#       anyway) | deadline (sweeper) | discard (DiscardGroup) | invalid (a member was
#       dead-lettered; ``reason`` names it)
# ``known`` (from PARK, which has just read and written the state): {status, size, mismatch};
# the state's TTL was set with the group's first member and outlives the deadline by
# redis.ttl_s, so a decision made by a park does not touch it (one EXPIRE per key per group).
DECIDE_FN = """
local function decide(k0, fp, kind, now, worker, scorers, reason, ttl, known)
  local S, M = KEYS[k0 + 1], KEYS[k0 + 2]
  local st, size, mismatch, deadline
  if known then
    st, size, mismatch = known[1], known[2], known[3]
  else
    st, size, mismatch, deadline = unpack(redis.call('HMGET', S, 'status', 'group_size', 'size_mismatch', 'deadline'))
  end
  if not st and is_done(k0, fp) then return {'done'} end
  local outcome = 'decided_now'
  if st == 'decided' then
    outcome = 'already_decided'
  else
    if kind == 'deadline' then
      if not st then return {'gone'} end
      if tonumber(now) < tonumber(deadline) then return {'not_due'} end
    elseif kind == 'complete' and not known then  -- PARK decides only a complete (or mismatched) group
      if not st then return {'gone'} end
      if not mismatch and redis.call('HLEN', M) < tonumber(size) then
        return {'incomplete'}
      end
    end
    if not st then
      redis.call('HSET', S, 'group_size', '0', 'first_seen', now, 'deadline', now)
    end
    redis.call('HSET', S, 'status', 'decided', 'decision', kind, 'decided_at', now,
               'decided_by', worker, 'scorers', scorers, 'discard_reason', reason)
    if not known then  -- the sweeper, a discard or a dead letter: the decision lives ttl from now
      redis.call('EXPIRE', S, ttl)
      redis.call('EXPIRE', M, ttl)
    end
  end
  return {outcome, redis.call('HGETALL', S), redis.call('HGETALL', M)}
end
"""

# per item ARGV: fingerprint, trajectory_id, blob, group_size, now_ms, deadline_ms, ttl_s, worker_id, scorers,
# kind ('complete', or 'failed' for a failed member)
# per item result: {outcome, decided[, decision]} — the member that completes the group,
# or a failed member, also decides it in the same atomic step.
PARK = HEAD + DECIDE_FN + """
local function park(k0, a)
  local S, M, fp = KEYS[k0 + 1], KEYS[k0 + 2], ARGV[a + 1]
  local st, size, mismatch = unpack(redis.call('HMGET', S, 'status', 'group_size', 'size_mismatch'))
  if st == 'decided' then return {'decided', 0} end
  if not st and is_done(k0, fp) then return {'done', 0} end
  local outcome = 'parked'
  if not st then  -- the group's first member: its keys live until its deadline + redis.ttl_s
    size = ARGV[a + 4]
    redis.call('HSET', S, 'status', 'open', 'group_size', size, 'first_seen', ARGV[a + 5],
               'deadline', ARGV[a + 6])
    redis.call('HSET', M, ARGV[a + 2], ARGV[a + 3])
    redis.call('EXPIRE', S, ARGV[a + 7])
    redis.call('EXPIRE', M, ARGV[a + 7])
    st = 'open'
  elseif redis.call('HSETNX', M, ARGV[a + 2], ARGV[a + 3]) == 0 then  -- keys got their TTL with the first member
    outcome = 'duplicate'
  elseif size ~= ARGV[a + 4] then
    mismatch = ARGV[a + 4]
    redis.call('HSET', S, 'size_mismatch', mismatch)
  end
  local kind = ARGV[a + 10]
  if outcome ~= 'parked' then kind = 'complete' end  -- a duplicate: the member parked first stands
  if kind == 'failed' or mismatch or redis.call('HLEN', M) >= tonumber(size) then
    return {outcome, 1, decide(k0, fp, kind, ARGV[a + 5], ARGV[a + 8], ARGV[a + 9], '', ARGV[a + 7],
                               {st, size, mismatch})}
  end
  return {outcome, 0}
end
local out = {}
local n = (#KEYS) / nk
for j = 0, n - 1 do out[#out + 1] = park(j * nk, 1 + j * 10) end
return out
"""

# per item ARGV: fingerprint, kind, now_ms, worker_id, scorers_blob, reason, ttl_s (one item)
DECIDE = HEAD + DECIDE_FN + """
return {decide(0, ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8])}
"""

# per item ARGV: fingerprint, done-set ttl_s (0: the caller set it recently). Drops the
# group's state, remembers the group in the newest bucket (the first done key).
FINISH = HEAD + """
local out = {}
local n = (#KEYS) / nk
for j = 0, n - 1 do
  local k0, a0 = j * nk, 1 + j * 2
  redis.call('DEL', KEYS[k0 + 1], KEYS[k0 + 2])
  redis.call('SADD', KEYS[k0 + 3], ARGV[a0 + 1])
  if ARGV[a0 + 2] ~= '0' then redis.call('EXPIRE', KEYS[k0 + 3], ARGV[a0 + 2]) end
  out[#out + 1] = 1
end
return out
"""
