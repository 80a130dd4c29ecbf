-- publish: compare-and-set of the version clock plus the weights announcement.
-- ARGV[3] version, [4] uri, [5] checksum, [6] expected current version ('' = any older), [7] channel,
-- [8] the caller's origin 'role@host' for the timeline ('' or absent: not recorded; docs/buffer.md#timeline).
local version = tonumber(ARGV[3])
local cur = clock()
if ARGV[6] ~= '' and tonumber(ARGV[6]) ~= cur then
  return err('VERSION_CONFLICT', 'clock is ' .. cur .. ', expected ' .. ARGV[6])
end
if version <= cur then
  return err('VERSION_CONFLICT', 'version ' .. version .. ' is not newer than the clock ' .. cur .. ' (the clock moves forward only)')
end
local lin = lineage()
redis.call('SET', k('version'), version)
redis.call('HSET', k('weights:latest'), 'version', version, 'uri', ARGV[4], 'checksum', ARGV[5],
  'lineage', lin, 'published_ms', NOW)
redis.call('HSET', k('weights:history'), version, cjson.encode({uri = ARGV[4], checksum = ARGV[5]}))
redis.call('PUBLISH', ARGV[7], cjson.encode({version = version, uri = ARGV[4], checksum = ARGV[5], lineage = lin, published_ms = NOW}))
stat('published_versions')
if (ARGV[8] or '') ~= '' then
  redis.call('RPUSH', k('timeline'), cjson.encode({kind = 'publish', t = NOW, origin = ARGV[8], version = version,
    from_version = cur, lineage = lin}))
end
return {version, lin, NOW}
