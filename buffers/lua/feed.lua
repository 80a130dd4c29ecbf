-- feed: append prompt groups and move the dataset cursor, atomically (compare-and-set on the cursor).
-- ARGV[12] = start_cursor, ARGV[13] = count, then per group 4 args: gid, prompt (packed int32), metadata JSON, n,
-- then `skip`: dataset positions after the groups that the pass-rate filter keeps out (counted
-- skipped_prompts:pass_rate_filter), then `npred` and per position 2 args (train problem key, 'easy'|'hard'):
-- positions after the groups that the selective-rollout rule skipped (GRESO: predicted zero-variance; counted
-- skipped_prompts:zero_variance_predicted and predicted_skips:<kind>, and prompt_skips[problem] += 1).
-- The cursor moves past the groups and every skipped position.
local start = tonumber(ARGV[12])
local count = tonumber(ARGV[13])
local skip = tonumber(ARGV[14 + 4 * count] or '0') or 0
local npred = tonumber(ARGV[15 + 4 * count] or '0') or 0
local pbase = 16 + 4 * count
local cur = tonumber(redis.call('GET', k('cursor')) or '0')
if cur ~= start then
  return err('CURSOR', 'dataset cursor is ' .. cur .. ', feed was for ' .. start .. ': re-read dataset_cursor() and feed from there')
end
for j = 0, count - 1 do
  local gid = ARGV[14 + 4 * j]
  if redis.call('EXISTS', gkey(gid)) == 1 or redis.call('HEXISTS', k('dropped'), gid) == 1 then
    return err('DUPLICATE', 'prompt group ' .. gid .. ' already exists in this run')
  end
end
for j = 0, npred - 1 do
  local problem, kind = ARGV[pbase + 2 * j], ARGV[pbase + 2 * j + 1]
  if not problem or not string.match(problem, '^%d+$') or (kind ~= 'easy' and kind ~= 'hard') then
    return err('BAD_REQUEST', 'predicted skip ' .. j .. ' needs a problem key >= 0 and kind easy or hard')
  end
end
for j = 0, count - 1 do
  local b = 14 + 4 * j
  redis.call('HSET', gkey(ARGV[b]), 'gid', ARGV[b], 'prompt', ARGV[b + 1], 'meta', ARGV[b + 2], 'n', ARGV[b + 3],
    'state', 'pending', 'feed_index', start + j, 'seq', 0, 'created', NOW)
  redis.call('RPUSH', k('pending'), ARGV[b])
  tl(gkey(ARGV[b]), 'fed', 'cursor=' .. (start + j))
end
redis.call('SET', k('cursor'), start + count + skip + npred)
stat('fed', count)
if skip > 0 then stat('skipped_prompts:pass_rate_filter', skip) end
if npred > 0 then
  stat('skipped_prompts:zero_variance_predicted', npred)
  for j = 0, npred - 1 do
    stat('predicted_skips:' .. ARGV[pbase + 2 * j + 1])
    redis.call('HINCRBY', k('prompt_skips'), ARGV[pbase + 2 * j], 1)
  end
end
admit()
return start + count
