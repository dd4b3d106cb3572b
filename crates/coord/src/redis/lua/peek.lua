-- peek: ARGV 13 slot, 14 granted (an untracked slot's grant time, from its node; '' for a
-- tracked one, see `admit`). What a learner needs about a held slot before its outcome is
-- learned.
-- Returns {now, held (0/1), grantedAt, bound (0/1): the limit bound while the slot was held}.
local slot = ARGV[13]
local granted_at = tonumber(ARGV[14])
if not granted_at then
  local h = redis.call('HGET', K_HELD, slot)
  granted_at = h and (tonumber(string.match(h, ':(%d+)$')) or now)
end
local d = tonumber(redis.call('ZSCORE', K_LEASES, slot))
if not granted_at or not d or d <= now then return { now, 0, 0, 0 } end
local bound = 0
if in_flight() >= eff or last_full_get() >= granted_at then bound = 1 end
return { now, 1, granted_at, bound }
