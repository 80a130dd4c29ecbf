-- next_batch: hand out the open batch again, or form one of B groups: replayed groups (recovery)
-- in their original order first, then READY groups oldest first; each checked for staleness.
-- ARGV[12] = trainer step, ARGV[13] = fewest groups to form a batch (B, or fewer at the end of
-- the dataset). Returns {'open'|'new', batch id} or {'none', groups available}.
local step = ARGV[12]
local min_groups = tonumber(ARGV[13])
local open = redis.call('GET', k('batch:open'))
if open then
  redis.call('HINCRBY', k('batch:' .. open), 'deliveries', 1)
  stat('redelivered_batches')
  return {'open', open}
end
local v = clock()
local chosen = {}
local function group_minv(gid)
  local n = tonumber(redis.call('HGET', gkey(gid), 'n') or '0')
  local mv = -1
  for i = 0, n - 1 do
    local f = redis.call('HMGET', skey(gid .. '/' .. i), 'status', 'minv')
    if f[1] == 'scored' then
      local x = tonumber(f[2])
      if x >= 0 and (mv < 0 or x < mv) then mv = x end
    end
  end
  return mv
end
local function consider(gid)
  local mv = group_minv(gid)
  if mv >= 0 and v - mv > ETA and POLICY ~= 'keep' then
    if POLICY == 'restart' then restart_group(gid, 'stale_batch') else drop_group(gid, 'stale_batch') end
    return
  end
  chosen[#chosen + 1] = gid
end
local replay = redis.call('LRANGE', k('replay'), 0, -1)
for _, gid in ipairs(replay) do
  if #chosen >= B then break end
  consider(gid)
end
if #chosen < B then
  local ready = redis.call('ZRANGE', k('ready'), 0, -1)
  for _, gid in ipairs(ready) do
    if #chosen >= B then break end
    consider(gid)
  end
end
if #chosen < min_groups or #chosen == 0 then
  admit()
  return {'none', #chosen}
end
local bid = 'b' .. redis.call('INCR', k('seq'))
redis.call('HSET', k('batch:' .. bid), 'groups', table.concat(chosen, ','), 'step', step, 'version', v,
  'lineage', lineage(), 'created', NOW, 'deliveries', 1)
redis.call('SET', k('batch:open'), bid)
for _, gid in ipairs(chosen) do
  redis.call('HSET', gkey(gid), 'state', 'batched', 'batch', bid)
  tl(gkey(gid), 'batch', 'batch=' .. bid .. ' step=' .. step .. ' v=' .. v)
  redis.call('ZREM', k('ready'), gid)
  redis.call('LREM', k('replay'), 0, gid)
  redis.call('ZREM', k('inflight'), gid)
end
stat('batches')
admit()
return {'new', bid}
