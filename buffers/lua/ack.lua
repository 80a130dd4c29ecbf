-- acknowledge: the batch was trained at `step` (idempotent: the same pair twice is harmless).
-- ARGV[12] batch id, ARGV[13] step. Returns 1 the first time, 0 for a repeat.
local bid, step = ARGV[12], tonumber(ARGV[13])
local bk = k('batch:' .. bid)
local f = redis.call('HMGET', bk, 'groups', 'acked_step', 'version')
if not f[1] then
  local committed = tonumber(redis.call('GET', k('committed_step')) or '-1')
  if redis.call('SISMEMBER', k('committed_batches'), bid) == 1 then return 0 end
  return err('UNKNOWN', 'batch ' .. bid .. ' does not exist (committed up to step ' .. committed .. ', or reverted by recover)')
end
if f[2] then
  if tonumber(f[2]) == step then return 0 end
  return err('INVALID', 'batch ' .. bid .. ' was acknowledged at step ' .. f[2] .. ', not ' .. step)
end
local last = tonumber(redis.call('GET', k('last_acked_step')) or '-1')
if step <= last then
  return err('INVALID', 'step ' .. step .. ' is not after the last acknowledged step ' .. last .. ' (recover() first after a restart)')
end
redis.call('HSET', bk, 'acked_step', step, 'acked_ms', NOW)
redis.call('ZADD', k('acked_batches'), step, bid)
local n = 0
for gid in string.gmatch(f[1], '[^,]+') do
  redis.call('HSET', gkey(gid), 'state', 'acked', 'step', step)
  tl(gkey(gid), 'ack', 'batch=' .. bid .. ' step=' .. step .. ' v=' .. tostring(f[3]))
  n = n + 1
end
if redis.call('GET', k('batch:open')) == bid then redis.call('DEL', k('batch:open')) end
redis.call('SET', k('last_acked_step'), step)
stat('acked_groups', n)
admit()
return 1
