-- Buffer settings (validated equal to the stored ones when the client opened the run).
local R = tonumber(ARGV[3])          -- rollout_batch_size: cap on groups in flight
local B = tonumber(ARGV[4])          -- train_batch_groups = ceil(p * R)
local NSAMP = tonumber(ARGV[5])      -- n_samples_per_prompt (default; groups carry their own n)
local M = tonumber(ARGV[6])          -- max_budget: new tokens per sample per policy version
local L = tonumber(ARGV[7])          -- max_response_len
local ETA = tonumber(ARGV[8])        -- max_staleness
local POLICY = ARGV[9]               -- stale policy: restart | drop | keep
local LEASE_MS = tonumber(ARGV[10])  -- lease of a claim, milliseconds
local BPV = tonumber(ARGV[11])       -- train batches per published version (weight_sync.interval)
-- The timeline of a sample's life (docs/buffer.md#timeline): ARGV[12] is the caller's origin,
-- 'role@host' ('' records nothing). It is taken out of ARGV here, so every script body reads its
-- own arguments from ARGV[12] on as before (the local shadows the global for the rest of the chunk).
local ORIGIN = ARGV[12] or ''
local TL = ORIGIN ~= ''
local ARGV = (function(a)
  local t = {}
  for i = 1, #a do if i ~= 12 then t[#t + 1] = a[i] end end
  return t
end)(ARGV)
-- records kept per sample or group: a timeline past TL_MAX bytes keeps its first events and counts the rest
local TL_MAX = 16384
-- Append one event `<name> <server time ms> <origin>[ <key=value ...>]` to the timeline of the sample or
-- group whose hash is `key`: the string `<key>|tl` ('|' is in no group or sample id, so it never names
-- another hash; APPEND costs the new line only, in memory and in the AOF). The time is the script's NOW
-- (Redis TIME, server clock): no round trip.
local function tl(key, ev, extra)
  if not TL then return end
  local tk = key .. '|tl'
  local line = ev .. ' ' .. NOW .. ' ' .. ORIGIN .. (extra and (' ' .. extra) or '') .. '\n'
  local n = redis.call('APPEND', tk, line)  -- one call on the common path
  if n > TL_MAX then  -- past the cap: take the line back (rare: a very long episode)
    local prev = n - #line
    if prev > 0 then redis.call('SET', tk, redis.call('GETRANGE', tk, 0, prev - 1)) else redis.call('DEL', tk) end
    stat('timeline_events_truncated')
  end
end
-- Records leave Redis through the list `timeline` (committed and dropped groups, batches, publishes,
-- recoveries); the trainer exports it to <run_dir>/trace/ after each commit. Bounded: past TL_OUT_MAX
-- records the oldest are dropped and counted (timeline_records_dropped).
local TL_OUT_MAX = 100000
local function tl_out(record)
  if not TL then return end
  local n = redis.call('RPUSH', k('timeline'), cjson.encode(record))
  if n > TL_OUT_MAX then
    redis.call('LTRIM', k('timeline'), n - TL_OUT_MAX, -1)
    stat('timeline_records_dropped', n - TL_OUT_MAX)
  end
end
-- The record of a group leaving Redis (committed or dropped): its timeline and its samples'.
local function tl_group_record(gid, how, extra)
  if not TL then return end
  local gk = k('group:' .. gid)
  local g = redis.call('HMGET', gk, 'n', 'batch', 'step', 'feed_index')
  local samples = {}
  for i = 0, (tonumber(g[1]) or 0) - 1 do
    local sk = k('sample:' .. gid .. '/' .. i)
    local f = redis.call('HMGET', sk, 'status', 'minv', 'maxv', 'reward', 'finish', 'resumes', 'restarts')
    samples[#samples + 1] = {i = i, tl = redis.call('GET', sk .. '|tl') or '', status = f[1] or '',
      minv = tonumber(f[2] or '-1'), maxv = tonumber(f[3] or '-1'), reward = tonumber(f[4] or ''),
      tokens = redis.call('HSTRLEN', sk, 'ids') / 4, finish = f[5] or '', resumes = tonumber(f[6] or '0'),
      restarts = tonumber(f[7] or '0')}
  end
  local rec = {kind = 'group', gid = gid, how = how, t = NOW, origin = ORIGIN, tl = redis.call('GET', gk .. '|tl') or '',
    batch = g[2] or '', step = tonumber(g[3] or ''), feed_index = tonumber(g[4] or ''), samples = samples}
  for key, val in pairs(extra or {}) do rec[key] = val end
  tl_out(rec)
end
-- turn: a model call of an episode ended, the episode goes on; obs: environment tokens of an episode
-- ctx: the prompt of an episode's further trajectory (docs/agents.md). A segment's stored code is
-- FINISH_CODE + 16 * the trajectory it belongs to (the sample's `traj` field when it closed).
local FINISH_CODE = {stop = 1, length = 2, abort = 3, budget = 4, lease = 5, turn = 6, obs = 7, ctx = 8}

local function skey(sid) return k('sample:' .. sid) end
local function gkey(gid) return k('group:' .. gid) end

-- Groups being generated: admitted, not READY (READY groups wait for the trainer and do not
-- hold a rollout slot; groups of a recovered batch wait in `replay`, READY too).
local function generating_groups()
  return redis.call('ZCARD', k('inflight')) - redis.call('ZCARD', k('ready')) - redis.call('LLEN', k('replay'))
end

-- Admission control (AReaL eq. 3 / staleness_manager): admit the next pending group only while
-- fewer than R groups are in flight and admitted < (ETA + v + 1) * B * BPV.
local function admit()
  local v = clock()
  local admitted = tonumber(redis.call('GET', k('admitted')) or '0')
  local limit = (ETA + v + 1) * B * BPV
  local count = 0
  while admitted < limit and generating_groups() < R do
    local gid = redis.call('LPOP', k('pending'))
    if not gid then break end
    local gk = gkey(gid)
    local n = tonumber(redis.call('HGET', gk, 'n') or '0')
    local seq = redis.call('INCR', k('seq'))
    redis.call('HSET', gk, 'state', 'generating', 'seq', seq, 'admit_version', v, 'admitted_ms', NOW,
      'n_scored', 0, 'n_failed', 0)
    tl(gk, 'admit', 'v=' .. v)
    for i = 0, n - 1 do
      local sid = gid .. '/' .. i
      redis.call('HSET', skey(sid), 'sid', sid, 'gid', gid, 'idx', i, 'status', 'pending',
        'ids', '', 'lps', '', 'vers', '', 'segs', '', 'resumes', 0, 'restarts', 0,
        'created', NOW, 'updated', NOW, 'completed', 0, 'minv', -1, 'maxv', -1,
        'bver', -1, 'bused', 0, 'claim', '', 'seg_start', 0, 'finish', '')
      redis.call('ZADD', k('fresh'), seq * 2048 + i, sid)
    end
    redis.call('ZADD', k('inflight'), seq, gid)
    redis.call('ZADD', k('groups'), seq, gid)
    admitted = admitted + 1
    count = count + 1
  end
  if count > 0 then
    redis.call('SET', k('admitted'), admitted)
    stat('admitted', count)
  end
  return count
end

local function unqueue(sid)
  redis.call('ZREM', k('fresh'), sid)
  redis.call('ZREM', k('resumable'), sid)
  redis.call('ZREM', k('parked'), sid)
  redis.call('ZREM', k('unscored'), sid)
  redis.call('ZREM', k('leases'), sid)
end

-- Put a sample with tokens into the resumable queue: oldest policy version first, then FIFO.
local function make_resumable(sid, minv)
  local pseq = redis.call('INCR', k('pseq')) % 4294967296
  redis.call('ZADD', k('resumable'), minv * 4294967296 + pseq, sid)
end

-- The model tokens sample key `sk` holds: its tokens (HSTRLEN, as the group records count them,
-- without copying the array) less the environment segments (obs, ctx) of an episode, which are
-- not generated and not in `appended_tokens`.
local function model_tokens(sk, segs)
  local n = redis.call('HSTRLEN', sk, 'ids') / 4
  segs = segs or ''
  for j = 0, #segs / 12 - 1 do
    local s, e, code = struct.unpack('<i4<i4<i4', segs, 12 * j + 1)
    local c = code % 16
    if c == FINISH_CODE.obs or c == FINISH_CODE.ctx then n = n - (e - s) end
  end
  return n
end

-- Restart a sample from its pristine prompt (stale policy `restart`); fixes its group's counters.
-- The model tokens it held are thrown away: counted in `restart_discarded_tokens` (the same unit
-- as `appended_tokens`, so their ratio is the share of the rollout's work lost to restarts).
local function reset_sample(sid, reason)
  local sk = skey(sid)
  local f = redis.call('HMGET', sk, 'status', 'gid', 'idx', 'restarts', 'segs')
  local gk = gkey(f[2])
  local discarded = model_tokens(sk, f[5])
  if discarded > 0 then stat('restart_discarded_tokens', discarded) end
  if f[1] == 'scored' then redis.call('HINCRBY', gk, 'n_scored', -1) end
  if f[1] == 'failed' then redis.call('HINCRBY', gk, 'n_failed', -1) end
  unqueue(sid)
  redis.call('HDEL', sk, 'reward', 'error', 'adv', 'adv_kind', 'info', 'traj')
  redis.call('HSET', sk, 'status', 'pending', 'ids', '', 'lps', '', 'vers', '', 'segs', '',
    'minv', -1, 'maxv', -1, 'bver', -1, 'bused', 0, 'claim', '', 'seg_start', 0, 'finish', '',
    'restarts', tonumber(f[4] or '0') + 1, 'updated', NOW, 'completed', 0)
  local seq = tonumber(redis.call('HGET', gk, 'seq') or '0')
  redis.call('ZADD', k('fresh'), seq * 2048 + tonumber(f[3]), sid)
  tl(sk, 'restart', 'reason=' .. reason)
  stat('restarted_samples:' .. reason)
end

-- Send a whole group back to be generated again (a stale READY group under `restart`).
local function restart_group(gid, reason)
  local gk = gkey(gid)
  local n = tonumber(redis.call('HGET', gk, 'n') or '0')
  for i = 0, n - 1 do reset_sample(gid .. '/' .. i, reason) end
  redis.call('HSET', gk, 'state', 'generating', 'n_scored', 0, 'n_failed', 0, 'n_discarded', 0, 'batch', '', 'step', '')
  redis.call('ZREM', k('ready'), gid)
  redis.call('LREM', k('replay'), 0, gid)
  redis.call('ZADD', k('inflight'), tonumber(redis.call('HGET', gk, 'seq') or '0'), gid)
  tl(gk, 'restart', 'reason=' .. reason)
  stat('restarted_groups:' .. reason)
end

-- Drop a group with a counted reason; its keys are deleted, the reason is kept in `dropped`.
local function drop_group(gid, reason)
  local gk = gkey(gid)
  local n = tonumber(redis.call('HGET', gk, 'n') or '0')
  local was_ready = redis.call('HGET', gk, 'state') == 'ready'  -- only READY groups wait in `replay`
  if TL then
    tl(gk, 'drop', 'reason=' .. reason)
    tl_group_record(gid, 'dropped', {reason = reason})
  end
  for i = 0, n - 1 do
    local sid = gid .. '/' .. i
    unqueue(sid)
    redis.call('DEL', skey(sid), skey(sid) .. '|tl')
  end
  redis.call('DEL', gk, gk .. '|tl')
  redis.call('ZREM', k('inflight'), gid)
  redis.call('ZREM', k('ready'), gid)
  redis.call('ZREM', k('groups'), gid)
  if was_ready then redis.call('LREM', k('replay'), 0, gid) end
  redis.call('HSET', k('dropped'), gid, reason)
  redis.call('DECR', k('admitted'))
  stat('dropped_groups:' .. reason)
end

-- Close the open segment of a running sample [seg_start, len) with a finish code.
local function close_segment(sk, f_segs, seg_start, len, code)
  if len > seg_start then
    local traj = tonumber(redis.call('HGET', sk, 'traj') or '0') or 0
    redis.call('HSET', sk, 'segs', (f_segs or '') .. struct.pack('<i4<i4<i4', seg_start, len, code + 16 * traj))
  end
end

-- A running sample loses its worker (lease expiry or recovery): keep its tokens, make it resumable.
local function release_running(sid)
  local sk = skey(sid)
  local f = redis.call('HMGET', sk, 'status', 'ids', 'segs', 'seg_start', 'minv')
  if f[1] == 'running' then
    local len = #(f[2] or '') / 4
    close_segment(sk, f[3], tonumber(f[4] or '0'), len, FINISH_CODE.lease)
    redis.call('ZREM', k('leases'), sid)
    if len == 0 then
      local gk = gkey(redis.call('HGET', sk, 'gid'))
      local seq = tonumber(redis.call('HGET', gk, 'seq') or '0')
      redis.call('HSET', sk, 'status', 'pending', 'claim', '', 'updated', NOW)
      redis.call('ZADD', k('fresh'), seq * 2048 + tonumber(redis.call('HGET', sk, 'idx')), sid)
      tl(sk, 'requeue', 'reason=lease len=0')
    else
      redis.call('HSET', sk, 'status', 'partial', 'finish', 'abort', 'claim', '', 'updated', NOW)
      make_resumable(sid, tonumber(f[5]))
      tl(sk, 'park', 'reason=lease len=' .. len)
    end
  elseif f[1] == 'complete' then
    redis.call('ZREM', k('leases'), sid)
    redis.call('HSET', sk, 'claim', '', 'updated', NOW)
    redis.call('ZADD', k('unscored'), NOW, sid)
    tl(sk, 'unscored', 'reason=lease')
  else
    redis.call('ZREM', k('leases'), sid)
  end
end
