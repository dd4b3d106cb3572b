-- tick: ARGV 12.. tickets this node waits on. Settles the pool and hands back the grants of
-- those tickets (each collected once).
-- Returns {now, nextWakeupMs, ticket, grant, ticket, grant, ...}.
settle()
local out = { now, next_wakeup() }
for i = 12, #ARGV do
  local g = redis.call('HGET', K_GRANTS, ARGV[i])
  if g then
    redis.call('HDEL', K_GRANTS, ARGV[i])
    redis.call('ZREM', K_DEADLINES, ARGV[i])
    table.insert(out, ARGV[i])
    table.insert(out, g)
  end
end
publish()
return out
