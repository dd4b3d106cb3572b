-- renew: ARGV 13 the number of slots this node lent from those it keeps since its last check
-- ('' when it keeps none: see `reclaim_kept`), 14 how long its keeping lasts from now without
-- another check (with 13 only); 15.. pairs of slot and cap: the cap is the latest lease deadline
-- an untracked slot may get (its request deadline plus its hold grace, from its node; see
-- `admit`), '' for a tracked slot, whose cap is in `held`. Extends each lease by one term from
-- now, never past its cap. An expired lease was reclaimed by `settle` first, so it is not found.
-- In the quiet period after Redis lost the pool's keys (see the prelude), a slot it does not know
-- is re-asserted instead, up to the limit: its holder was granted it before the loss and is
-- still running (slot ids are random, so only a holder can name one). A tracked slot's request
-- deadline, lost with the keys, restarts from now; an untracked one keeps the cap its node gave.
-- Returns {now, queued, remaining, effective, blocked (0/1: paused, an RPM gate or a pace in
-- force), status, deadline, status, deadline, ...} with status 1 renewed, 2 capped (at its
-- request deadline already), 0 not found.
settle()
if ARGV[13] ~= '' then
  -- Lent slots were admissions (counted here, not when lent).
  admitted_n = admitted_n + (tonumber(ARGV[13]) or 0)
  local until_ = now + (tonumber(ARGV[14]) or 0)
  if until_ > (kept_until or 0) then
    kept_until = until_
    redis.call('HSET', K_META, 'kept_until', fmt(until_))
  end
end
local blocked = 0
local b = blocker()
if (b and b ~= 'no_slot') or rpm_limit or l_pace then blocked = 1 end
local out = { now, queued(), math.max(0, eff - in_flight()), eff, blocked }
for i = 15, #ARGV, 2 do
  local slot = ARGV[i]
  local cap = tonumber(ARGV[i + 1])
  local d = tonumber(redis.call('ZSCORE', K_LEASES, slot))
  local h = nil
  local rd = cap
  if not cap then
    h = redis.call('HGET', K_HELD, slot)
    rd = h and tonumber(string.match(h, '^(%d+):'))
  end
  if not d and not h and quiet_until > now and in_flight() < eff and (not cap or cap > now) then
    if not cap then rd = now + cfg_request_ms end
    d = math.min(now + cfg_term_ms, rd)
    lease_set(d, slot)
    if not cap then redis.call('HSET', K_HELD, slot, fmt(rd) .. ':' .. fmt(now)) end
    table.insert(out, 1)
    table.insert(out, d)
  elseif not d or not rd then
    table.insert(out, 0)
    table.insert(out, 0)
  elseif d >= rd then
    table.insert(out, 2)
    table.insert(out, d)
  else
    local nd = math.min(now + cfg_term_ms, rd)
    lease_set(nd, slot, 'XX')
    table.insert(out, 1)
    table.insert(out, nd)
  end
end
publish()
return out
