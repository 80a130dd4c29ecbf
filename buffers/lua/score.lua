-- score: reward (or reward-function failure) of a COMPLETE sample; the group becomes READY when
-- all its samples are scored or failed (>= min(2, n) scored), else it is dropped (reward_error).
-- ARGV[12] sid, [13] claim token, [14] 'reward'|'error', [15] value, [16] adv kind ('', 'scalar', 'tokens'), [17] adv.
local sid, token, kind, value, advk, adv = ARGV[12], ARGV[13], ARGV[14], ARGV[15], ARGV[16], ARGV[17]
local sk = skey(sid)
local f = redis.call('HMGET', sk, 'status', 'claim', 'gid', 'ids')
if not f[1] then return err('UNKNOWN', 'sample ' .. sid .. ' does not exist (committed, dropped or drained)') end
if f[2] ~= token then
  return err('LEASE_LOST', 'claim ' .. token .. ' on sample ' .. sid .. ' is no longer valid: the lease was reclaimed or revoked')
end
if f[1] ~= 'complete' then
  return err('INVALID', 'sample ' .. sid .. ' is ' .. f[1] .. '; only a complete sample can be scored')
end
if advk == 'tokens' and #adv ~= #(f[4] or '') then
  return err('BAD_REQUEST', 'per-token advantages must have one value per response token')
end
local gk = gkey(f[3])
local g = redis.call('HMGET', gk, 'n', 'n_scored', 'n_failed', 'state')
if not g[1] then return err('MALFORMED', 'group ' .. tostring(f[3]) .. ' of sample ' .. sid .. ' is missing') end
if kind == 'reward' then
  redis.call('HSET', sk, 'status', 'scored', 'reward', value, 'claim', '', 'updated', NOW)
  redis.call('HINCRBY', gk, 'n_scored', 1)
  stat('scored_samples')
else
  redis.call('HSET', sk, 'status', 'failed', 'error', value, 'claim', '', 'updated', NOW)
  redis.call('HINCRBY', gk, 'n_failed', 1)
  stat('failed_samples')
end
if advk ~= '' then redis.call('HSET', sk, 'adv_kind', advk, 'adv', adv) end
redis.call('ZREM', k('leases'), sid)
local n = tonumber(g[1])
local ns = tonumber(redis.call('HGET', gk, 'n_scored'))
local nf = tonumber(redis.call('HGET', gk, 'n_failed'))
if ns + nf == n then
  if ns >= math.min(2, n) then
    redis.call('HSET', gk, 'state', 'ready', 'ready_ms', NOW)
    redis.call('ZADD', k('ready'), tonumber(redis.call('HGET', gk, 'seq')), f[3])
    stat('ready_groups')
    return 'ready'
  end
  drop_group(f[3], 'reward_error')
  admit()
  return 'dropped'
end
return 'generating'
