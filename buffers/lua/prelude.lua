-- Shared prelude of every asyncrl buffer script (concatenated in front of each body).
-- KEYS[1] = <prefix>schema; ARGV[1] = key prefix "asyncrl:{<run>}:"; ARGV[2] = schema version.
-- Every key of the run shares the prefix (one hash slot). Scripts validate before they write:
-- an error reply means nothing was changed by that step.
local P = ARGV[1]
local function k(name) return P .. name end
local function err(code, msg) return redis.error_reply('ASYNCRL_' .. code .. ' ' .. msg) end
local _schema = redis.call('GET', KEYS[1])
if _schema ~= ARGV[2] then
  if not _schema then
    return err('SCHEMA', 'keyspace ' .. P .. ' has no schema key (drained, or never opened): open the buffer first')
  end
  return err('SCHEMA', 'keyspace ' .. P .. ' has schema ' .. tostring(_schema) .. ', this code expects ' .. ARGV[2])
end
local _t = redis.call('TIME')
local NOW = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
local function clock() return tonumber(redis.call('GET', k('version')) or '0') end
local function lineage() return tonumber(redis.call('GET', k('lineage')) or '0') end
local function stat(field, by) redis.call('HINCRBY', k('stats'), field, by or 1) end
