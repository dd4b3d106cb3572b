-- release: ARGV 12 slot, 13 learn (0/1), 14..20 what was learned (see `apply_learned`).
-- Idempotent: frees the slot the first time; only a release that freed a slot teaches, and it
-- teaches before the slot is handed on (a throttle pauses admission first).
-- Returns {freed (0/1), now}.
local slot, learn = ARGV[12], ARGV[13] == '1'
local held = redis.call('ZSCORE', K_LEASES, slot)
local freed = 0
if held then
  if learn then apply_learned(14) end
  if free(slot) then freed = 1 end
end
settle()
publish()
return { freed, now }
