-- append: for each of ARGV[12] items, write one chunk at `offset` (exactly once) and optionally
-- end the segment. Items are independent (a client coalesces concurrent appends into one call);
-- each is validated before it writes and gets its own result or error.
-- Per item, 7 args: sid, claim token, offset (tokens), ids, logprobs, versions (packed
-- little-endian int32/float32/int32), finish reason ('' = the segment continues).
-- Episodes (multi-turn workflows, docs/agents.md) use three more finish reasons: 'turn' ends a
-- model call (the segment closes with code turn, the sample stays running under its lease);
-- 'obs' appends environment tokens as their own segment (code obs; they are not model tokens:
-- no budget, no staleness; only allowed at a segment boundary); 'restart' sends the sample back
-- to its pristine prompt (counted restarted_samples:nondeterministic; a complete unscored sample
-- may be restarted too). 'ctx' appends the prompt of a further trajectory of the episode (like
-- 'obs'); any finish may carry '@<k>', the trajectory (0-15) the chunk belongs to.
-- Result per item: an integer length * 8 + status code (0 running, 1 complete, 2 partial,
-- 3 pending), or the error string '<CODE> <message>' (compact replies parse fast in the client).
local function fail(code, msg) return code .. ' ' .. msg end
local ST = {running = 0, complete = 1, partial = 2, pending = 3}
local function ok(len, status) return len * 8 + ST[status] end
local v = clock()
local appended = 0
local state = {writing = false}
local function int_field(x) local n = tonumber(x); return n and n == math.floor(n) and n end
local function one(sid, token, offset, cids, clps, cvers, finish)
  if not int_field(offset) or offset < 0 then
    return fail('BAD_REQUEST', 'offset must be an integer >= 0, got ' .. tostring(offset))
  end
  local sk = skey(sid)
  local f = redis.call('HMGET', sk, 'status', 'claim', 'ids', 'lps', 'vers', 'bver', 'bused', 'minv', 'maxv', 'seg_start', 'segs')
  if not f[1] then return fail('UNKNOWN', 'sample ' .. sid .. ' does not exist (committed, dropped or drained)') end
  if finish == 'restart' and f[2] == token and (f[1] == 'running' or f[1] == 'complete') then
    state.writing = true
    reset_sample(sid, 'nondeterministic')
    return ok(0, 'pending')
  end
  if f[2] ~= token or f[1] ~= 'running' then
    return fail('LEASE_LOST', 'claim ' .. token .. ' on sample ' .. sid .. ' is no longer valid (status ' .. f[1] .. '): the lease was reclaimed or revoked; drop this request')
  end
  if not f[3] or not f[4] or not f[5] or #f[3] % 4 ~= 0 or #f[3] ~= #f[4] or #f[3] ~= #f[5]
      or not int_field(f[6]) or not int_field(f[7]) or not int_field(f[8]) or not int_field(f[9])
      or not int_field(f[10]) or #(f[11] or '') % 12 ~= 0 then
    return fail('MALFORMED', 'sample ' .. sid .. ' has inconsistent packed arrays or counters')
  end
  if #cids % 4 ~= 0 or #clps ~= #cids or #cvers ~= #cids then
    return fail('BAD_REQUEST', 'chunk arrays must be packed int32/float32 of equal length')
  end
  -- an episode's chunks carry their trajectory: '<finish>@<k>' (k in 0..15; docs/agents.md)
  local traj = nil
  local fbase, ftraj = string.match(finish, '^(%a*)@(%d+)$')
  if fbase then
    traj = tonumber(ftraj)
    if traj > 15 then return fail('BAD_REQUEST', 'trajectory index ' .. traj .. ' > 15') end
    finish = fbase
  end
  if finish ~= '' and (not FINISH_CODE[finish] or finish == 'lease') then
    return fail('BAD_REQUEST', 'finish reason must be stop, length, abort, budget, turn, obs, ctx or restart, got ' .. finish)
  end
  local cur = #f[3] / 4
  local nnew = #cids / 4
  local ids, lps, vers = f[3], f[4], f[5]
  if offset ~= cur then
    if nnew > 0 and offset + nnew == cur and string.sub(ids, offset * 4 + 1) == cids then
      nnew = 0  -- a retry of a chunk that was applied: nothing to append
      if finish == '' then return ok(cur, 'running') end
    else
      return fail('BAD_OFFSET', 'chunk at offset ' .. offset .. ' but sample ' .. sid .. ' holds ' .. cur .. ' tokens')
    end
  end
  if cur + nnew > L then
    return fail('BAD_REQUEST', 'sample ' .. sid .. ' would hold ' .. (cur + nnew) .. ' tokens > max_response_len ' .. L)
  end
  local bver, bused = tonumber(f[6]), tonumber(f[7])
  local minv, maxv = tonumber(f[8]), tonumber(f[9])
  local seg_start = tonumber(f[10])
  if traj ~= nil then
    -- the trajectory of the chunk: an open call of another trajectory must be ended first
    local cur_traj = tonumber(redis.call('HGET', sk, 'traj') or '0') or 0
    if traj ~= cur_traj and seg_start ~= cur then
      return fail('BAD_REQUEST', 'sample ' .. sid .. ' has an open call of trajectory ' .. cur_traj .. '; end it before writing trajectory ' .. traj)
    end
  end
  if finish == 'obs' or finish == 'ctx' then
    -- environment tokens: validated, written as their own segment, outside budget and staleness
    if nnew == 0 then return fail('BAD_REQUEST', 'an observation (or trajectory prompt) of sample ' .. sid .. ' has no tokens') end
    if seg_start ~= cur then
      return fail('BAD_REQUEST', 'sample ' .. sid .. ' has model tokens since offset ' .. seg_start .. ' in an open call: end the call (turn) before an observation')
    end
    for j = 0, nnew - 1 do
      local tv = struct.unpack('<i4', cvers, 4 * j + 1)
      if tv < 0 or tv > v then return fail('BAD_REQUEST', 'observation token version ' .. tv .. ' outside [0, clock ' .. v .. ']') end
    end
    local len = cur + nnew
    state.writing = true
    if traj ~= nil then redis.call('HSET', sk, 'traj', traj) end
    redis.call('HSET', sk, 'ids', ids .. cids, 'lps', lps .. clps, 'vers', vers .. cvers, 'seg_start', len, 'updated', NOW)
    close_segment(sk, f[11], cur, len, FINISH_CODE[finish])
    redis.call('ZADD', k('leases'), 'XX', NOW + LEASE_MS, sid)
    stat(finish == 'ctx' and 'trajectory_prompt_tokens' or 'observation_tokens', nnew)
    return ok(len, 'running')
  end
  for j = 0, nnew - 1 do
    local tv = struct.unpack('<i4', cvers, 4 * j + 1)
    if tv > v then
      return fail('VERSION_AHEAD', 'token version ' .. tv .. ' is newer than the clock ' .. v .. ': the engine holds weights of an abandoned lineage; reload the announced weights')
    end
    if tv < 0 then return fail('BAD_REQUEST', 'token version ' .. tv .. ' is negative') end
    if tv > bver then bver = tv; bused = 0 end
    if tv == bver then bused = bused + 1 end
    if minv < 0 or tv < minv then minv = tv end
    if tv > maxv then maxv = tv end
  end
  -- validated: from here on every step writes
  state.writing = true
  if traj ~= nil then redis.call('HSET', sk, 'traj', traj) end
  local len = cur + nnew
  if TL and nnew > 0 and cur == seg_start then tl(sk, 'gen', 'len=' .. cur) end  -- the segment's first tokens arrived
  if nnew > 0 then
    redis.call('HSET', sk, 'ids', ids .. cids, 'lps', lps .. clps, 'vers', vers .. cvers,
      'bver', bver, 'bused', bused, 'minv', minv, 'maxv', maxv, 'updated', NOW)
    appended = appended + nnew
  end
  if finish == '' then
    redis.call('ZADD', k('leases'), 'XX', NOW + LEASE_MS, sid)
    return ok(len, 'running')
  end
  if finish == 'stop' or len >= L then
    if finish ~= 'stop' then finish = 'length' end
    close_segment(sk, f[11], seg_start, len, FINISH_CODE[finish])
    redis.call('HSET', sk, 'status', 'complete', 'finish', finish, 'completed', NOW, 'updated', NOW)
    tl(sk, 'complete', 'reason=' .. finish .. ' len=' .. len)
    redis.call('ZADD', k('leases'), NOW + LEASE_MS, sid)
    stat('completed_samples')
    return ok(len, 'complete')
  end
  if finish == 'turn' then
    -- a model call of an episode ended; the episode goes on under the same lease
    close_segment(sk, f[11], seg_start, len, FINISH_CODE.turn)
    redis.call('HSET', sk, 'seg_start', len, 'updated', NOW)
    redis.call('ZADD', k('leases'), 'XX', NOW + LEASE_MS, sid)
    tl(sk, 'turn', 'len=' .. len)
    stat('episode_turns')
    return ok(len, 'running')
  end
  if finish == 'length' or finish == 'budget' or bused >= M then
    close_segment(sk, f[11], seg_start, len, FINISH_CODE.budget)
    redis.call('HSET', sk, 'status', 'partial', 'finish', 'budget', 'claim', '', 'updated', NOW)
    redis.call('ZREM', k('leases'), sid)
    redis.call('ZADD', k('parked'), bver, sid)
    tl(sk, 'park', 'reason=budget len=' .. len .. ' v=' .. bver)
    stat('parked_budget')
    return ok(len, 'partial')
  end
  -- abort
  close_segment(sk, f[11], seg_start, len, FINISH_CODE.abort)
  redis.call('ZREM', k('leases'), sid)
  stat('parked_abort')
  if len == 0 then
    local gk = gkey(redis.call('HGET', sk, 'gid'))
    local seq = tonumber(redis.call('HGET', gk, 'seq') or '0')
    redis.call('HSET', sk, 'status', 'pending', 'claim', '', 'updated', NOW)
    redis.call('ZADD', k('fresh'), seq * 2048 + tonumber(redis.call('HGET', sk, 'idx')), sid)
    tl(sk, 'requeue', 'reason=abort len=0')
    return ok(len, 'pending')
  end
  redis.call('HSET', sk, 'status', 'partial', 'finish', 'abort', 'claim', '', 'updated', NOW)
  make_resumable(sid, minv)
  tl(sk, 'park', 'reason=abort len=' .. len)
  return ok(len, 'partial')
end
local out = {}
for j = 0, tonumber(ARGV[12]) - 1 do
  local b = 13 + 7 * j
  local res, e = isolated(state, one, ARGV[b], ARGV[b + 1], tonumber(ARGV[b + 2]), ARGV[b + 3], ARGV[b + 4], ARGV[b + 5], ARGV[b + 6])
  out[#out + 1] = res or e
end
if appended > 0 then stat('appended_tokens', appended) end
return out
