-- recover: the trainer resumed from the checkpoint of `step` at `version`.
-- ARGV[12] step, [13] version, [14] uri, [15] checksum, [16] announcement channel.
-- Groups acknowledged after `step` (then an unacknowledged batch) are handed out again in their
-- original order; the clock rewinds (lineage + 1); every lease is revoked; samples carrying
-- tokens of abandoned versions (> version) get the stale policy (reason abandoned_version).
local step, version, uri, checksum = tonumber(ARGV[12]), tonumber(ARGV[13]), ARGV[14], ARGV[15]
local cur = clock()
if version > cur then
  return err('BAD_REQUEST', 'recover to version ' .. version .. ' is ahead of the clock ' .. cur .. ' (the clock moves forward only by publish)')
end
if version < cur and uri == '' and version > 0 then
  -- no uri given: announce the weights published for this version (weights:history)
  local h = redis.call('HGET', k('weights:history'), version)
  if not h then
    return err('BAD_REQUEST', 'rewinding the clock from ' .. cur .. ' to ' .. version .. ': no weights were published for version ' .. version .. '; pass the uri and checksum of the checkpoint weights')
  end
  local d = cjson.decode(h)
  uri, checksum = d.uri, d.checksum
end
local committed = tonumber(redis.call('GET', k('committed_step')) or '-1')
if step < committed then
  return err('BAD_REQUEST', 'step ' .. step .. ' is before the committed step ' .. committed .. ': those groups are deleted; recover from the newest checkpoint')
end
-- 1. revert batches acknowledged after `step`, and the open batch, in their original order
local replay = {}
local bids = redis.call('ZRANGEBYSCORE', k('acked_batches'), '(' .. step, '+inf')
local open = redis.call('GET', k('batch:open'))
if open then bids[#bids + 1] = open end
for _, bid in ipairs(bids) do
  local gids = redis.call('HGET', k('batch:' .. bid), 'groups') or ''
  for gid in string.gmatch(gids, '[^,]+') do
    replay[#replay + 1] = gid
    redis.call('HSET', gkey(gid), 'state', 'ready', 'batch', '', 'step', '')
    tl(gkey(gid), 'replay', 'step=' .. step)
    redis.call('ZADD', k('inflight'), tonumber(redis.call('HGET', gkey(gid), 'seq')), gid)
  end
  redis.call('DEL', k('batch:' .. bid))
  redis.call('ZREM', k('acked_batches'), bid)
end
redis.call('DEL', k('batch:open'))
for i = #replay, 1, -1 do redis.call('LPUSH', k('replay'), replay[i]) end
local last = tonumber(redis.call('GET', k('last_acked_step')) or '-1')
if last > step then redis.call('SET', k('last_acked_step'), step) end
stat('replayed_groups', #replay)
-- 2. rewind the clock
local lin = lineage()
if version < cur then
  redis.call('SET', k('version'), version)
  lin = redis.call('INCR', k('lineage'))
  redis.call('HSET', k('weights:latest'), 'version', version, 'uri', uri, 'checksum', checksum,
    'lineage', lin, 'published_ms', NOW)
  redis.call('PUBLISH', ARGV[16], cjson.encode({version = version, uri = uri, checksum = checksum, lineage = lin, published_ms = NOW}))
  stat('rewinds')
  for _, hv in ipairs(redis.call('HKEYS', k('weights:history'))) do
    if tonumber(hv) > version then redis.call('HDEL', k('weights:history'), hv) end
  end
end
-- 3. a new lineage: revoke every lease (claims of the old lineage are fenced), and parked
-- samples become resumable (their budget windows restart)
local leased = {}
if version < cur then
  leased = redis.call('ZRANGE', k('leases'), 0, -1)
  for _, sid in ipairs(leased) do release_running(sid) end
  stat('revoked_leases', #leased)
  local parked = redis.call('ZRANGE', k('parked'), 0, -1)
  for _, sid in ipairs(parked) do
    redis.call('ZREM', k('parked'), sid)
    make_resumable(sid, tonumber(redis.call('HGET', skey(sid), 'minv')))
  end
end
-- 5. stale policy for samples with tokens of abandoned versions
local restarted, dropped = 0, 0
if version < cur and POLICY ~= 'keep' then
  local live = redis.call('ZRANGE', k('groups'), 0, -1)
  for _, gid in ipairs(live) do
    local gk = gkey(gid)
    local g = redis.call('HMGET', gk, 'state', 'n')
    if g[1] == 'generating' or g[1] == 'ready' then
      local n = tonumber(g[2])
      local bad = {}
      for i = 0, n - 1 do
        local sid = gid .. '/' .. i
        if tonumber(redis.call('HGET', skey(sid), 'maxv') or '-1') > version then bad[#bad + 1] = sid end
      end
      if #bad > 0 then
        if POLICY == 'drop' then
          drop_group(gid, 'abandoned_version'); dropped = dropped + 1
        elseif g[1] == 'ready' then
          restart_group(gid, 'abandoned_version'); restarted = restarted + 1
        else
          for _, sid in ipairs(bad) do reset_sample(sid, 'abandoned_version') end
          restarted = restarted + 1
        end
      end
    end
  end
end
for _, sid in ipairs(redis.call('ZRANGE', k('resumable'), 0, -1)) do
  local sk = skey(sid)
  if tonumber(redis.call('HGET', sk, 'bver') or '-1') > version then redis.call('HSET', sk, 'bver', -1, 'bused', 0) end
end
tl_out({kind = 'recover', t = NOW, origin = ORIGIN, step = step, version = version, from_version = cur,
  lineage = lin, replayed = #replay, revoked = #leased})
admit()
return {#replay, restarted, dropped, lin, #leased}
