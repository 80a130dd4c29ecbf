-- renew: extend the leases of claims still held. ARGV[12..] = sid, token pairs. Returns how many.
local c = 0
for j = 12, #ARGV, 2 do
  local sid = ARGV[j]
  if redis.call('HGET', skey(sid), 'claim') == ARGV[j + 1] then
    redis.call('ZADD', k('leases'), 'XX', NOW + LEASE_MS, sid)
    c = c + 1
  end
end
return c
