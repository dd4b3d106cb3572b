-- adopt: ARGV 13 lease_ms, 14 hold_grace_ms, 15.. slots. Registers slots this node admitted on
-- its own while Redis was away (fail open) and that are still running, so that once Redis
-- answers again they count against the shared limit until released: each is leased for one term
-- (renewed by its node like an exchange slot) and held at most one request timeout plus
-- hold_grace from now. Admits them whatever the limit (they are running already); nobody else is
-- admitted while they keep the pool full. A slot already leased is left as it is. With no
-- slots, a probe.
-- Returns {now, leaseDeadline, leaseDeadline, ...} (one per slot).
local lease_ms = tonumber(ARGV[13])
local out = { now }
local held_until = now + cfg_request_ms + tonumber(ARGV[14])
for i = 15, #ARGV do
  local slot = ARGV[i]
  local d = tonumber(redis.call('ZSCORE', K_LEASES, slot))
  if not d then
    d = math.min(now + lease_ms, held_until)
    lease_set(d, slot)
    redis.call('HSET', K_HELD, slot, fmt(held_until) .. ':' .. fmt(now))
  end
  table.insert(out, d)
end
return out
