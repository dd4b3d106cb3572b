-- The operations a caller's request runs (acquire, release), as functions that `batch.lua` runs,
-- several per call. Several in one call behave as the same operations run one call after another
-- with nothing in between: each settles the pool, decides and publishes its own wake-ups as it
-- would alone; only the prelude's reads (the time, the pool's generation, what learning
-- imposes) and the sweep of what expired are shared, and they are the same for every operation
-- of the call.

-- acquire: slot, fairness key, class (1 high .. 3 low), lease_ms, may_wait, wait_ms, grace_ms (a
-- ticket's), hold_grace_ms (a slot's, past its request deadline), untracked (an exchange: if
-- admitted at once, no `held` entry, see `admit`; a waiter's grant is tracked).
-- Returns {'admitted', now, leaseDeadline, requestDeadline, remaining, effective, rpmRemaining}
-- or {'queued', now, ticket, nextWakeupMs} or {'refused', now, reason, retryMs, remaining,
-- effective, rpmRemaining}.
local function op_acquire(slot, fkey, class, lease_ms, may_wait, wait_ms, grace, hold_grace,
    untracked)
  collect_own = false
  settle()
  -- A reused id would corrupt the books; refusing is the only safe answer (ids are random, so
  -- this never happens in practice). `admit` refuses one itself; a waiter is checked here.
  local function reused()
    local h = headers()
    return { 'refused', now, 'no_slot', -1, h[1], h[2], h[3] }
  end
  local b = blocker()
  -- Admitted at once only if nobody waits (no overtaking).
  if not b and queued() == 0 then
    local g = admit(slot, lease_ms, hold_grace, untracked)
    if not g then return reused() end
    publish()
    return { 'admitted', now, g[1], g[2], g[3], g[4], g[5] }
  end
  if redis.call('ZSCORE', K_LEASES, slot) then return reused() end
  if b == 'no_slot' then set_full() end
  if not b or b == 'no_slot' then reclaim_kept() end
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
    redis.call('ZADD', K_QUEUE, fmt(queue_score(class, round)), m)
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
end

-- release: slot, learn, peek, collect_own, granted (an untracked slot's grant time, from its
-- node; nil for a tracked one, see `admit`), and the ARGV index of what was learned (limit,
-- pace_us, pace_until, rpm, paused_until, throttle_at, throttle_cause; see `apply_learned`; read
-- only with learn).
-- Idempotent: frees the slot the first time; only a release that freed a slot teaches, and it
-- teaches before the slot is handed on (a throttle pauses admission first). `peek` reads, before
-- freeing, what a learner needs about the slot to learn from its outcome afterwards (an outcome
-- that cannot stop admission need not be learned first: one round trip instead of two).
-- Returns {freed (0/1), now, held (0/1), grantedAt, bound (0/1), ticket, grant, ...}: `held` and
-- after only with peek (else 0); the (ticket, grant) pairs are this node's waiters served by the
-- freed slot, with collect_own (see the prelude).
local function op_release(slot, learn, peek, collect, granted, learned_at)
  collect_own = collect
  own_grants = {}
  local out = { 0, now, 0, 0, 0 }
  local held = nil
  if peek then
    local granted_at = granted
    if not granted then
      held = redis.call('HGET', K_HELD, slot)
      granted_at = held and (tonumber(string.match(held, ':(%d+)$')) or now)
    end
    local d = tonumber(redis.call('ZSCORE', K_LEASES, slot))
    if granted_at and d and d > now then
      out[3], out[4] = 1, granted_at
      if in_flight() >= eff or last_full_get() >= granted_at then out[5] = 1 end
    end
  end
  if learn and redis.call('ZSCORE', K_LEASES, slot) then apply_learned(learned_at) end
  if free(slot, held, granted) then out[1] = 1 end
  settle()
  for _, v in ipairs(own_grants) do table.insert(out, v) end
  publish()
  return out
end
