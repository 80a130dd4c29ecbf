-- Shared prelude of every asyncrl buffer script (concatenated in front of each body).
-- KEYS[1] = <prefix>stats (a key every role may write: Redis ACLs treat a script's declared keys
-- as read-write, docs/security.md); ARGV[1] = key prefix "asyncrl:{<run>}:"; ARGV[2] = schema version.
-- Every key of the run shares the prefix (one hash slot). Scripts validate before they write:
-- an error reply means nothing was changed by that step.
local P = ARGV[1]
local function k(name) return P .. name end
local function err(code, msg) return redis.error_reply('ASYNCRL_' .. code .. ' ' .. msg) end
-- The message of an error caught by pcall (a Lua error string or a redis.call error table).
local function errmsg(e)
  if type(e) == 'table' then return tostring(e.err or e.message or '?') end
  return tostring(e)
end
-- Run one item of a multi-item script isolated from its neighbours: fn returns a reply or sets
-- state.writing once it has begun to write. A failure before any write is MALFORMED (nothing
-- changed); after, PARTIAL (the item may be partly applied; the caller is told so).
local function isolated(state, fn, ...)
  state.writing = false
  local ok, res = pcall(fn, ...)
  if ok then return res, nil end
  if state.writing then return nil, 'PARTIAL item failed after it began writing (it may be partly applied): ' .. errmsg(res) end
  return nil, 'MALFORMED item failed before writing (nothing changed): ' .. errmsg(res)
end
local _schema = redis.call('GET', P .. 'schema')
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
