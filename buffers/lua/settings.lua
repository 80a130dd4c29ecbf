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

-- Restart a sample from its pristine prompt (stale policy `restart`); fixes its group's counters.
local function reset_sample(sid, reason)
  local sk = skey(sid)
  local f = redis.call('HMGET', sk, 'status', 'gid', 'idx', 'restarts')
  local gk = gkey(f[2])
  if f[1] == 'scored' then redis.call('HINCRBY', gk, 'n_scored', -1) end
  if f[1] == 'failed' then redis.call('HINCRBY', gk, 'n_failed', -1) end
  unqueue(sid)
  redis.call('HDEL', sk, 'reward', 'error', 'adv', 'adv_kind', 'info', 'traj')
  redis.call('HSET', sk, 'status', 'pending', 'ids', '', 'lps', '', 'vers', '', 'segs', '',
    'minv', -1, 'maxv', -1, 'bver', -1, 'bused', 0, 'claim', '', 'seg_start', 0, 'finish', '',
    'restarts', tonumber(f[4] or '0') + 1, 'updated', NOW, 'completed', 0)
  local seq = tonumber(redis.call('HGET', gk, 'seq') or '0')
  redis.call('ZADD', k('fresh'), seq * 2048 + tonumber(f[3]), sid)
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
  stat('restarted_groups:' .. reason)
end

-- Drop a group with a counted reason; its keys are deleted, the reason is kept in `dropped`.
local function drop_group(gid, reason)
  local gk = gkey(gid)
  local n = tonumber(redis.call('HGET', gk, 'n') or '0')
  local was_ready = redis.call('HGET', gk, 'state') == 'ready'  -- only READY groups wait in `replay`
  for i = 0, n - 1 do
    local sid = gid .. '/' .. i
    unqueue(sid)
    redis.call('DEL', skey(sid))
  end
  redis.call('DEL', gk)
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
    else
      redis.call('HSET', sk, 'status', 'partial', 'finish', 'abort', 'claim', '', 'updated', NOW)
      make_resumable(sid, tonumber(f[5]))
    end
  elseif f[1] == 'complete' then
    redis.call('ZREM', k('leases'), sid)
    redis.call('HSET', sk, 'claim', '', 'updated', NOW)
    redis.call('ZADD', k('unscored'), NOW, sid)
  else
    redis.call('ZREM', k('leases'), sid)
  end
end
