-- score: for each of ARGV[12] items, the reward (or reward-function failure) of a COMPLETE
-- sample; a group becomes READY when all its samples are scored or failed (>= min(2, n)
-- scored), else it is dropped (reward_error). Items are independent and validated before writing.
-- When the group finishes (finish_group): best-of-n keeps the best NSAMP scored samples of a group
-- of n > NSAMP (the rest DISCARDED, counted discarded_best_of_n); a group whose kept rewards are
-- all equal is counted zero_variance_groups and, with dynamic sampling, dropped (zero_variance);
-- with record_pass_rates the group's mean reward over every scored sample goes to pass_rates;
-- with record_prompt_history the group's train problem (metadata problem_key) gets its zero-variance
-- streak updated in prompt_history and its consecutive skips cleared (selective rollout, GRESO).
-- A failed sample is counted in failed_samples and in failed_samples:<reason> (reward_timeout when
-- the error starts with 'RewardTimeout:', workflow_error when it starts with 'WorkflowError:' (an
-- episode's workflow raised, docs/agents.md), reward_model when it starts with 'RewardModelError:'
-- (a reward model could not score the sample, docs/reward_model.md), else reward_error).
-- Per item, 7 args: sid, claim token, 'reward'|'error', value, advantages kind ('', 'scalar', 'tokens'),
-- advantages, info (a JSON object of an episode's termination and counts, '' for none; <= 4096 bytes).
-- Result per item: the group state string, or the error string '!<CODE> <message>'.
local function fail(code, msg) return '!' .. code .. ' ' .. msg end
local _cfg
-- The stored settings (JSON, equal to the client's): generation_size, dynamic_sampling,
-- record_pass_rates and record_prompt_history are read here instead of being Lua arguments.
local function run_settings()
  if not _cfg then _cfg = cjson.decode(redis.call('GET', k('settings')) or '{}') end
  return _cfg
end
-- Selective rollout (GRESO, arXiv:2506.02177): the visit of train problem `meta.problem_key` at dataset
-- position `feed_index` finished, zero-variance (`zv`, common reward string `r`) or mixed. prompt_history
-- holds per problem "z r cursor base_z base_r": z = finished visits in a row, up to this one, whose groups
-- were zero-variance with the same common reward r (0: the latest was mixed), cursor = the latest
-- visit's dataset position, base_* = the streak before that visit (so a group finishing again for the
-- same visit — a restarted group — replaces its outcome instead of counting twice). An older visit
-- finishing after a newer one changes nothing. A finished visit clears the problem's prompt_skips.
local function record_history(gk, zv, r)
  local f = redis.call('HMGET', gk, 'meta', 'feed_index')
  local ok, meta = pcall(cjson.decode, f[1] or '')
  local problem = ok and type(meta) == 'table' and tonumber(meta.problem_key)
  local cursor = tonumber(f[2])
  if not problem or not cursor then return end  -- a group the feeder did not make (tests, tools)
  problem = tostring(math.floor(problem))
  local old = redis.call('HGET', k('prompt_history'), problem)
  local bz, br = 0, '-'
  if old then
    local oz, or_, oc, obz, obr = string.match(old, '^(%d+) (%S+) (%d+) (%d+) (%S+)$')
    if not oc then return end  -- damaged entry: leave it (the feeder treats it as no history)
    oc = tonumber(oc)
    if cursor < oc then return end
    if cursor == oc then bz, br = tonumber(obz), obr else bz, br = tonumber(oz), or_ end
  end
  local z = 0
  if zv then
    z = 1
    if bz > 0 and br == r then z = bz + 1 end
  else
    r = '-'
  end
  redis.call('HSET', k('prompt_history'), problem, z .. ' ' .. r .. ' ' .. cursor .. ' ' .. bz .. ' ' .. br)
  redis.call('HDEL', k('prompt_skips'), problem)
end
-- Every sample of group `gid` (n samples, ns scored) is scored or failed, ns >= min(2, n).
-- Returns 'ready' or 'dropped'.
local function finish_group(gid, gk, n, ns, seq)
  local cfg = run_settings()
  local scored = {}
  local total = 0
  for i = 0, n - 1 do
    local sid = gid .. '/' .. i
    local f = redis.call('HMGET', skey(sid), 'status', 'reward', 'ids')
    if f[1] == 'scored' then
      local r = tonumber(f[2])
      scored[#scored + 1] = {i = i, r = r, len = #(f[3] or '') / 4, sid = sid}
      total = total + r
    end
  end
  if cfg.record_pass_rates then
    redis.call('HSET', k('pass_rates'), gid, string.format('%.17g', total / #scored))
  end
  -- best-of-n (AReaL generation_size): reward descending, then longer response first (AReaL's
  -- topk key), then lower sample index (deterministic)
  local keep = #scored
  if (tonumber(cfg.generation_size) or 0) > NSAMP and #scored > NSAMP then
    table.sort(scored, function(a, b)
      if a.r ~= b.r then return a.r > b.r end
      if a.len ~= b.len then return a.len > b.len end
      return a.i < b.i
    end)
    keep = NSAMP
  end
  stat('finished_groups')
  local equal = keep >= 2
  for j = 2, keep do
    if scored[j].r ~= scored[1].r then equal = false break end
  end
  if cfg.record_prompt_history then
    record_history(gk, equal, equal and string.format('%.17g', scored[1].r) or '-')
  end
  if equal then
    stat('zero_variance_groups')
    if cfg.dynamic_sampling then
      drop_group(gid, 'zero_variance')  -- DAPO dynamic sampling: no GRPO signal, not trained
      return 'dropped'
    end
  end
  if keep < #scored then
    for j = keep + 1, #scored do
      redis.call('HSET', skey(scored[j].sid), 'status', 'discarded', 'updated', NOW)
      tl(skey(scored[j].sid), 'discard', 'reason=best_of_n')
    end
    redis.call('HSET', gk, 'n_scored', keep, 'n_discarded', #scored - keep)
    stat('discarded_best_of_n', #scored - keep)
  end
  redis.call('HSET', gk, 'state', 'ready', 'ready_ms', NOW)
  tl(gk, 'ready')
  redis.call('ZADD', k('ready'), seq, gid)
  stat('ready_groups')
  return 'ready'
end
local state = {writing = false}
local function one(sid, token, kind, value, advk, adv, info)
  if kind ~= 'reward' and kind ~= 'error' then return fail('BAD_REQUEST', 'kind must be reward or error') end
  if kind == 'reward' and not tonumber(value) then return fail('BAD_REQUEST', 'reward must be a number') end
  if advk ~= '' and advk ~= 'scalar' and advk ~= 'tokens' then
    return fail('BAD_REQUEST', 'advantages kind must be empty, scalar or tokens')
  end
  if advk == 'scalar' and not tonumber(adv) then return fail('BAD_REQUEST', 'a scalar advantage must be a number') end
  local sk = skey(sid)
  local f = redis.call('HMGET', sk, 'status', 'claim', 'gid', 'ids')
  if not f[1] then return fail('UNKNOWN', 'sample ' .. sid .. ' does not exist (committed, dropped or drained)') end
  if f[2] ~= token then
    return fail('LEASE_LOST', 'claim ' .. token .. ' on sample ' .. sid .. ' is no longer valid: the lease was reclaimed or revoked')
  end
  if f[1] ~= 'complete' then
    return fail('INVALID', 'sample ' .. sid .. ' is ' .. f[1] .. '; only a complete sample can be scored')
  end
  if advk == 'tokens' and #adv ~= #(f[4] or '') then
    return fail('BAD_REQUEST', 'per-token advantages must have one value per response token')
  end
  if #info > 4096 then return fail('BAD_REQUEST', 'episode info of sample ' .. sid .. ' is ' .. #info .. ' bytes > 4096') end
  local gk = gkey(f[3])
  local g = redis.call('HMGET', gk, 'n', 'n_scored', 'n_failed', 'seq')
  if not tonumber(g[1]) or not tonumber(g[2]) or not tonumber(g[3]) or not tonumber(g[4]) then
    return fail('MALFORMED', 'group ' .. tostring(f[3]) .. ' of sample ' .. sid .. ' is missing or damaged')
  end
  local ns, nf = tonumber(g[2]), tonumber(g[3])
  state.writing = true
  if kind == 'reward' then
    redis.call('HSET', sk, 'status', 'scored', 'reward', value, 'claim', '', 'updated', NOW)
    tl(sk, 'score', 'reward=' .. value)
    ns = ns + 1
    stat('scored_samples')
  else
    redis.call('HSET', sk, 'status', 'failed', 'error', value, 'claim', '', 'updated', NOW)
    tl(sk, 'fail', 'error=' .. (string.match(value, '^(%w+):') or 'error'))
    nf = nf + 1
    stat('failed_samples')
    -- by reason: a user reward function that timed out (asyncrl.tasks.rewards.RewardTimeout) or any other failure
    -- or a reward model that failed (asyncrl.reward_model.RewardModelError)
    if string.sub(value, 1, 14) == 'RewardTimeout:' then stat('failed_samples:reward_timeout')
    elseif string.sub(value, 1, 14) == 'WorkflowError:' then stat('failed_samples:workflow_error')
    elseif string.sub(value, 1, 17) == 'RewardModelError:' then stat('failed_samples:reward_model')
    else stat('failed_samples:reward_error') end
  end
  redis.call('HSET', gk, 'n_scored', ns, 'n_failed', nf)
  if advk ~= '' then redis.call('HSET', sk, 'adv_kind', advk, 'adv', adv) end
  if info ~= '' then redis.call('HSET', sk, 'info', info) end
  redis.call('ZREM', k('leases'), sid)
  local n = tonumber(g[1])
  if ns + nf == n then
    if ns >= math.min(2, n) then
      local gstate = finish_group(f[3], gk, n, ns, tonumber(g[4]))
      admit()  -- a READY (or dropped) group no longer holds a rollout slot: admit the next one now
      return gstate
    end
    drop_group(f[3], 'reward_error')
    admit()
    return 'dropped'
  end
  return 'generating'
end
local out = {}
for j = 0, tonumber(ARGV[12]) - 1 do
  local b = 13 + 7 * j
  local res, e = isolated(state, one, ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4], ARGV[b + 5], ARGV[b + 6])
  out[#out + 1] = res or ('!' .. e)
end
return out
