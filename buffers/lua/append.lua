-- append: write one chunk at `offset` (exactly once) and optionally end the segment.
-- ARGV[12] sid, [13] claim token, [14] offset (tokens), [15] ids, [16] logprobs, [17] versions
-- (packed little-endian int32/float32/int32), [18] finish reason ('' = segment continues).
local sid, token, offset = ARGV[12], ARGV[13], tonumber(ARGV[14])
local cids, clps, cvers, finish = ARGV[15], ARGV[16], ARGV[17], ARGV[18]
local sk = skey(sid)
local f = redis.call('HMGET', sk, 'status', 'claim', 'ids', 'lps', 'vers', 'bver', 'bused', 'minv', 'maxv', 'seg_start', 'segs')
if not f[1] then return err('UNKNOWN', 'sample ' .. sid .. ' does not exist (committed, dropped or drained)') end
if f[2] ~= token or f[1] ~= 'running' then
  return err('LEASE_LOST', 'claim ' .. token .. ' on sample ' .. sid .. ' is no longer valid (status ' .. f[1] .. '): the lease was reclaimed or revoked; drop this request')
end
if not f[3] or not f[4] or not f[5] or #f[3] % 4 ~= 0 or #f[3] ~= #f[4] or #f[3] ~= #f[5] then
  return err('MALFORMED', 'sample ' .. sid .. ' has inconsistent packed arrays')
end
if #cids % 4 ~= 0 or #clps ~= #cids or #cvers ~= #cids then
  return err('BAD_REQUEST', 'chunk arrays must be packed int32/float32 of equal length')
end
if finish ~= '' and not FINISH_CODE[finish] then
  return err('BAD_REQUEST', 'finish reason must be stop, length, abort or budget, got ' .. finish)
end
local cur = #f[3] / 4
local nnew = #cids / 4
local ids, lps, vers = f[3], f[4], f[5]
if offset ~= cur then
  if nnew > 0 and offset + nnew == cur and string.sub(ids, offset * 4 + 1) == cids then
    nnew = 0  -- a retry of a chunk that was applied: nothing to append
    if finish == '' then return {cur, 'running', 0} end
  else
    return err('BAD_OFFSET', 'chunk at offset ' .. offset .. ' but sample ' .. sid .. ' holds ' .. cur .. ' tokens')
  end
end
if cur + nnew > L then
  return err('BAD_REQUEST', 'sample ' .. sid .. ' would hold ' .. (cur + nnew) .. ' tokens > max_response_len ' .. L)
end
local v = clock()
local bver, bused = tonumber(f[6]), tonumber(f[7])
local minv, maxv = tonumber(f[8]), tonumber(f[9])
for j = 0, nnew - 1 do
  local tv = struct.unpack('<i4', cvers, 4 * j + 1)
  if tv > v then
    return err('VERSION_AHEAD', 'token version ' .. tv .. ' is newer than the clock ' .. v .. ': the engine holds weights of an abandoned lineage; reload the announced weights')
  end
  if tv < 0 then return err('BAD_REQUEST', 'token version ' .. tv .. ' is negative') end
  if tv > bver then bver = tv; bused = 0 end
  if tv == bver then bused = bused + 1 end
  if minv < 0 or tv < minv then minv = tv end
  if tv > maxv then maxv = tv end
end
local len = cur + nnew
if nnew > 0 then
  redis.call('HSET', sk, 'ids', ids .. cids, 'lps', lps .. clps, 'vers', vers .. cvers,
    'bver', bver, 'bused', bused, 'minv', minv, 'maxv', maxv, 'updated', NOW)
  stat('appended_tokens', nnew)
end
if finish == '' then
  redis.call('ZADD', k('leases'), 'XX', NOW + LEASE_MS, sid)
  return {len, 'running', nnew}
end
-- end of the segment
local seg_start = tonumber(f[10])
local status
if finish == 'stop' or len >= L then
  if finish ~= 'stop' then finish = 'length' end
  close_segment(sk, f[11], seg_start, len, FINISH_CODE[finish])
  redis.call('HSET', sk, 'status', 'complete', 'finish', finish, 'completed', NOW, 'updated', NOW)
  redis.call('ZADD', k('leases'), NOW + LEASE_MS, sid)
  stat('completed_samples')
  status = 'complete'
elseif finish == 'length' or finish == 'budget' or bused >= M then
  close_segment(sk, f[11], seg_start, len, FINISH_CODE.budget)
  redis.call('HSET', sk, 'status', 'partial', 'finish', 'budget', 'claim', '', 'updated', NOW)
  redis.call('ZREM', k('leases'), sid)
  redis.call('ZADD', k('parked'), bver, sid)
  stat('parked_budget')
  status = 'partial'
else -- abort
  close_segment(sk, f[11], seg_start, len, FINISH_CODE.abort)
  redis.call('ZREM', k('leases'), sid)
  if len == 0 then
    local gk = gkey(redis.call('HGET', sk, 'gid'))
    local seq = tonumber(redis.call('HGET', gk, 'seq') or '0')
    redis.call('HSET', sk, 'status', 'pending', 'claim', '', 'updated', NOW)
    redis.call('ZADD', k('fresh'), seq * 2048 + tonumber(redis.call('HGET', sk, 'idx')), sid)
    status = 'pending'
  else
    redis.call('HSET', sk, 'status', 'partial', 'finish', 'abort', 'claim', '', 'updated', NOW)
    make_resumable(sid, minv)
    status = 'partial'
  end
  stat('parked_abort')
end
return {len, status, nnew}
