-- tick: ARGV 13.. tickets this node waits on. Settles the pool and hands back the grants of
-- those tickets (each collected once).
-- Grants this call makes to this node's waiters are returned too (`collect_own`).
-- Returns {now, nextWakeupMs, ticket, grant, ticket, grant, ...}.
heartbeat()
collect_own = true
settle(true)
local out = { now, next_wakeup() }
for i = 13, #ARGV do
  local g = collect_grant(ARGV[i])
  if g then
    table.insert(out, ARGV[i])
    table.insert(out, g)
  end
end
for _, v in ipairs(own_grants) do table.insert(out, v) end
publish()
return out
