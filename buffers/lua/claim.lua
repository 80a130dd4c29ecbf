-- claim: reclaim expired leases, admit groups, then lease up to max_items work items:
-- unscored complete samples, resumable partials (oldest version first), fresh samples, and,
-- only when nothing else is admissible, budget-parked samples under the same version.
-- ARGV[12] = number of requests (a client coalesces concurrent claims), then per request:
-- worker id, max items. Returns one list of work rows per request, or, for a request that hit an
-- error before it leased anything, the string '!<CODE> <message>' (requests are independent: one
-- request's failure never fails, or hides the leases of, another).
local worker = ''
local v = clock()
local lin = lineage()
-- 1. reclaim expired leases (the worker died or stalled)
local expired = redis.call('ZRANGEBYSCORE', k('leases'), '-inf', NOW, 'LIMIT', 0, 256)
for _, sid in ipairs(expired) do release_running(sid) end
if #expired > 0 then stat('reclaimed_leases', #expired) end
-- 2. budget-parked samples become resumable once a newer version is announced
local promote = redis.call('ZRANGEBYSCORE', k('parked'), '-inf', '(' .. v)
for _, sid in ipairs(promote) do
  redis.call('ZREM', k('parked'), sid)
  make_resumable(sid, tonumber(redis.call('HGET', skey(sid), 'minv')))
  tl(skey(sid), 'promote', 'v=' .. v)
end
-- 3. admission control
admit()
local out = {}
local state = {writing = false}  -- set once a request has begun to lease (see isolated() in the prelude)
local function take(sid, kind, from, idle)
  local sk = skey(sid)
  local f = redis.call('HMGET', sk, 'gid', 'idx', 'ids', 'bver', 'bused', 'resumes', 'status')
  if not f[1] or not f[3] or not f[2] then
    return 'MALFORMED sample ' .. sid .. ' lacks gid/idx/ids'
  end
  if #f[3] % 4 ~= 0 then return 'MALFORMED sample ' .. sid .. ' has a token array of ' .. #f[3] .. ' bytes' end
  if not tonumber(f[2]) or not tonumber(f[4]) or not tonumber(f[5]) or not tonumber(f[6]) then
    return 'MALFORMED sample ' .. sid .. ' has non-numeric idx/bver/bused/resumes'
  end
  local gk = gkey(f[1])
  local g = redis.call('HMGET', gk, 'prompt', 'meta')
  if not g[1] then return 'MALFORMED group ' .. f[1] .. ' of sample ' .. sid .. ' is missing' end
  state.writing = true
  redis.call('ZREM', k(from), sid)
  local len = #f[3] / 4
  local bver = tonumber(f[4])
  local bused = tonumber(f[5])
  if idle then bver = v; bused = 0; stat('idle_resumes') end
  local used = 0
  if bver == v then used = bused end
  local token = tostring(redis.call('INCR', k('claimseq')))
  local resumes = tonumber(f[6])
  if kind == 'generate' then
    if len > 0 then resumes = resumes + 1 end
    redis.call('HSET', sk, 'status', 'running', 'claim', token, 'owner', worker, 'seg_start', len,
      'resumes', resumes, 'bver', bver, 'bused', bused, 'updated', NOW)
  else
    redis.call('HSET', sk, 'claim', token, 'owner', worker, 'updated', NOW)
  end
  redis.call('ZADD', k('leases'), NOW + LEASE_MS, sid)
  local max_new = math.min(M - used, L - len)
  if max_new < 0 then max_new = 0 end
  if TL then
    local ev = 'claim'
    if kind == 'score' then ev = 'claim_score' elseif len > 0 then ev = 'resume' end
    tl(sk, ev, 'w=' .. string.gsub(worker, '%s', '_') .. ' v=' .. v .. ' len=' .. len .. ' max_new=' .. max_new
      .. ' from=' .. from .. (idle and ' idle=1' or ''))
  end
  out[#out + 1] = {kind, sid, f[1], f[2], token, g[1], f[3], g[2] or '{}', max_new, used, v, lin, resumes}
  return nil
end
-- staleness check of a partial about to resume (per sample)
local function stale_ok(sid)
  local minv = tonumber(redis.call('HGET', skey(sid), 'minv') or '-1')
  if minv < 0 or v - minv <= ETA or POLICY == 'keep' then return true end
  if POLICY == 'restart' then
    reset_sample(sid, 'stale_resume')
  else
    drop_group(redis.call('HGET', skey(sid), 'gid'), 'stale_resume')
    admit()
  end
  return false
end
local replies = {}
local total = 0
local function serve(maxn)
local guard = 0
while #out < maxn and guard < 10000 do
  guard = guard + 1
  local e
  local sid = redis.call('ZRANGE', k('unscored'), 0, 0)[1]
  if sid then
    e = take(sid, 'score', 'unscored', false)
  else
    sid = redis.call('ZRANGE', k('resumable'), 0, 0)[1]
    if sid then
      local f = redis.call('HMGET', skey(sid), 'bver', 'bused')
      if tonumber(f[1]) == v and tonumber(f[2]) >= M then
        -- its budget under this version is spent (aborted at the budget): park it
        redis.call('ZREM', k('resumable'), sid)
        redis.call('ZADD', k('parked'), v, sid)
        redis.call('HSET', skey(sid), 'finish', 'budget')
        tl(skey(sid), 'park', 'reason=budget v=' .. v)
      elseif stale_ok(sid) then
        e = take(sid, 'generate', 'resumable', false)
      end
    else
      sid = redis.call('ZRANGE', k('fresh'), 0, 0)[1]
      if sid then
        e = take(sid, 'generate', 'fresh', false)
      else
        sid = redis.call('ZRANGE', k('parked'), 0, 0)[1]
        if not sid then break end
        if stale_ok(sid) then e = take(sid, 'generate', 'parked', true) end
      end
    end
  end
  if e then return e end
end
return nil
end
for r = 0, tonumber(ARGV[12]) - 1 do
  worker = ARGV[13 + 2 * r]
  local maxn = tonumber(ARGV[14 + 2 * r])
  out = {}
  local e, crash
  if not maxn or maxn < 1 or maxn ~= math.floor(maxn) or not worker or worker == '' then
    e = 'BAD_REQUEST a claim needs a worker id and max_items >= 1'
  else
    e, crash = isolated(state, serve, maxn)
    e = e or crash
  end
  -- leases already taken are real: the request gets them; an error is reported only when it got none
  if e and #out == 0 then replies[#replies + 1] = '!' .. e else replies[#replies + 1] = out end
  total = total + #out
end
if total > 0 then stat('claims', total) end
return replies
