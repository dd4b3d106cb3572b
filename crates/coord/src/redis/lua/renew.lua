-- renew: ARGV 12.. slots. Extends each lease by one term from now, never past its request
-- deadline. An expired lease was reclaimed by `settle` first, so it is not found.
-- Returns {now, status, deadline, status, deadline, ...} with status 1 renewed, 2 capped (at
-- its request deadline already), 0 not found.
settle()
local out = { now }
for i = 12, #ARGV do
  local slot = ARGV[i]
  local d = tonumber(redis.call('ZSCORE', K_LEASES, slot))
  local h = redis.call('HGET', K_HELD, slot)
  local rd = h and tonumber(string.match(h, '^(%d+):'))
  if not d or not rd then
    table.insert(out, 0)
    table.insert(out, 0)
  elseif d >= rd then
    table.insert(out, 2)
    table.insert(out, d)
  else
    local nd = math.min(now + cfg_term_ms, rd)
    redis.call('ZADD', K_LEASES, 'XX', nd, slot)
    table.insert(out, 1)
    table.insert(out, nd)
  end
end
publish()
return out
