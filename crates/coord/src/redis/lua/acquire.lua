-- acquire: ARGV 13 slot, 14 fairness key, 15 class (1 high .. 3 low), 16 lease_ms, 17 may_wait,
-- 18 wait_ms, 19 grace_ms (a ticket's), 20 hold_grace_ms (a slot's, past its request deadline).
-- Returns {'admitted', now, leaseDeadline, requestDeadline, remaining, effective, rpmRemaining}
-- or {'queued', now, ticket, nextWakeupMs} or {'refused', now, reason, retryMs, remaining,
-- effective, rpmRemaining}.
local slot, fkey, class = ARGV[13], ARGV[14], tonumber(ARGV[15])
local lease_ms, may_wait, wait_ms = tonumber(ARGV[16]), ARGV[17] == '1', tonumber(ARGV[18])
local grace, hold_grace = tonumber(ARGV[19]), tonumber(ARGV[20])

settle()
if redis.call('ZSCORE', K_LEASES, slot) then
  -- A reused id would corrupt the books; refusing is the only safe answer.
  local h = headers()
  return { 'refused', now, 'no_slot', -1, h[1], h[2], h[3] }
end
local b = blocker()
if b == 'no_slot' then redis.call('HSET', K_META, 'last_full', fmt(now)) end
-- Admitted at once only if nobody waits (no overtaking).
if not b and queued() == 0 then
  local g = admit(slot, lease_ms, hold_grace)
  publish()
  return { 'admitted', now, g[1], g[2], g[3], g[4], g[5] }
end
if may_wait and queued() < cfg_queue then
  heartbeat()
  if cfg_fair and queued() == 0 then
    -- A queue that emptied starts its rounds afresh.
    redis.call('DEL', K_ROUNDS)
    redis.call('HDEL', K_META, 'r1', 'r2', 'r3')
  end
  local seq = redis.call('HINCRBY', K_META, 'seq', 1)
  local m = string.format('%016d', seq)
  local round = 0
  if cfg_fair then
    -- Start-time fair queuing: a key's next waiter goes one round after its previous one, and
    -- never before the round being served, so keys take turns within the class.
    local current = tonumber(redis.call('HGET', K_META, 'r' .. class)) or 0
    local field = class .. ':' .. fkey
    local last = tonumber(redis.call('HGET', K_ROUNDS, field)) or 0
    round = math.max(current, last + 1)
    redis.call('HSET', K_ROUNDS, field, fmt(round))
  end
  redis.call('ZADD', K_QUEUES[class], round, m)
  queue_changed(1)
  redis.call('HSET', K_WAITERS, m, class .. ':' .. fkey .. ':' .. fmt(lease_ms) .. ':' .. fmt(hold_grace) .. ':' .. node .. ':' .. slot)
  redis.call('ZADD', K_DEADLINES, now + wait_ms + grace, m)
  publish()
  return { 'queued', now, m, next_wakeup() }
end
redis.call('HINCRBY', K_META, 'refused', 1)
local blocking = b or 'no_slot'
local reason, retry = blocking, retry_after(blocking)
if may_wait then
  reason = 'queue_full'
  local full = retry_after('queue_full')
  if full >= 0 and retry >= 0 then retry = math.max(full, retry) elseif full >= 0 then retry = full end
end
local h = headers()
publish()
return { 'refused', now, reason, retry, h[1], h[2], h[3] }
