-- feed: append prompt groups and move the dataset cursor, atomically (compare-and-set on the cursor).
-- ARGV[12] = start_cursor, ARGV[13] = count, then per group 4 args: gid, prompt (packed int32), metadata JSON, n,
-- then `skip`: dataset positions after the groups that the pass-rate filter keeps out (the cursor
-- moves past them; counted skipped_prompts:pass_rate_filter).
local start = tonumber(ARGV[12])
local count = tonumber(ARGV[13])
local skip = tonumber(ARGV[14 + 4 * count] or '0') or 0
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
for j = 0, count - 1 do
  local b = 14 + 4 * j
  redis.call('HSET', gkey(ARGV[b]), 'gid', ARGV[b], 'prompt', ARGV[b + 1], 'meta', ARGV[b + 2], 'n', ARGV[b + 3],
    'state', 'pending', 'feed_index', start + j, 'seq', 0, 'created', NOW)
  redis.call('RPUSH', k('pending'), ARGV[b])
end
redis.call('SET', k('cursor'), start + count + skip)
stat('fed', count)
if skip > 0 then stat('skipped_prompts:pass_rate_filter', skip) end
admit()
return start + count
