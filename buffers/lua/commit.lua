-- commit: a checkpoint covers `step`: delete every group acknowledged at a step <= step (only those).
-- ARGV[12] = step. Returns the number of groups deleted.
local step = tonumber(ARGV[12])
local bids = redis.call('ZRANGEBYSCORE', k('acked_batches'), '-inf', step)
local c = 0
for _, bid in ipairs(bids) do
  local b = redis.call('HMGET', k('batch:' .. bid), 'groups', 'step', 'version', 'lineage', 'created', 'acked_ms', 'deliveries')
  local gids = b[1] or ''
  if TL then
    tl_out({kind = 'batch', batch = bid, step = tonumber(b[2] or ''), version = tonumber(b[3] or ''),
      lineage = tonumber(b[4] or ''), created = tonumber(b[5] or ''), acked = tonumber(b[6] or ''),
      deliveries = tonumber(b[7] or ''), committed = NOW, commit_step = step, origin = ORIGIN})
  end
  for gid in string.gmatch(gids, '[^,]+') do
    if TL then
      tl(gkey(gid), 'commit', 'step=' .. step)
      tl_group_record(gid, 'committed', {version = tonumber(b[3] or ''), lineage = tonumber(b[4] or '')})
    end
    local n = tonumber(redis.call('HGET', gkey(gid), 'n') or '0')
    for i = 0, n - 1 do redis.call('DEL', skey(gid .. '/' .. i), skey(gid .. '/' .. i) .. '|tl') end
    redis.call('DEL', gkey(gid), gkey(gid) .. '|tl')
    redis.call('ZREM', k('groups'), gid)
    c = c + 1
  end
  redis.call('DEL', k('batch:' .. bid))
  redis.call('ZREM', k('acked_batches'), bid)
  redis.call('SADD', k('committed_batches'), bid)
end
local prev = tonumber(redis.call('GET', k('committed_step')) or '-1')
if step > prev then redis.call('SET', k('committed_step'), step) end
stat('committed_groups', c)
return c
