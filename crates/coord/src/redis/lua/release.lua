-- release: ARGV 13 slot, 14 learn (0/1), 15 peek (0/1), 16 collect_own (0/1), 17..23 what was
-- learned (see `apply_learned`).
-- Idempotent: frees the slot the first time; only a release that freed a slot teaches, and it
-- teaches before the slot is handed on (a throttle pauses admission first). `peek` reads, before
-- freeing, what a learner needs about the slot to learn from its outcome afterwards (an outcome
-- that cannot stop admission need not be learned first: one round trip instead of two).
-- Returns {freed (0/1), now, held (0/1), grantedAt, bound (0/1), ticket, grant, ...}: `held` and
-- after only with peek (else 0); the (ticket, grant) pairs are this node's waiters served by the
-- freed slot, with collect_own (see the prelude).
local slot, learn, peek = ARGV[13], ARGV[14] == '1', ARGV[15] == '1'
collect_own = ARGV[16] == '1'
local out = { 0, now, 0, 0, 0 }
if peek then
  local h = redis.call('HGET', K_HELD, slot)
  local d = tonumber(redis.call('ZSCORE', K_LEASES, slot))
  if h and d and d > now then
    local granted_at = tonumber(string.match(h, ':(%d+)$')) or now
    local last_full = tonumber(redis.call('HGET', K_META, 'last_full')) or -1
    out[3], out[4] = 1, granted_at
    if in_flight() >= eff or last_full >= granted_at then out[5] = 1 end
  end
end
if learn and redis.call('ZSCORE', K_LEASES, slot) then apply_learned(17) end
if free(slot) then out[1] = 1 end
settle()
for _, v in ipairs(own_grants) do table.insert(out, v) end
publish()
return out
