-- snapshot: live state. Returns {now, inFlight, queuedHigh, queuedNormal, queuedLow, effective,
-- learnedLimit, learnedRpm, rpmRemaining, pausedUntil, pacedUntil, throttleAt, throttleCause,
-- admitted, refused}, -1 for what is absent.
settle(true)
publish()
finish()
admitted_n = 0
local t = redis.call('HMGET', K_LEARNED, 'throttle_at', 'throttle_cause')
local m = redis.call('HMGET', K_META, 'admitted', 'refused')
-- Waiters of class `c`: those whose score is in its span.
local function queued_in(c)
  local base = queue_score(c, 0)
  return redis.call('ZCOUNT', K_QUEUE, fmt(base), '(' .. fmt(base + CLASS_SPAN))
end
local pu = -1
if paused_until > now then pu = paused_until end
local learned_limit = -1
if l_limit and l_limit < cfg_limit then learned_limit = math.max(l_limit, cfg_min) end
return {
  now, in_flight(),
  queued_in(1), queued_in(2), queued_in(3),
  eff, learned_limit, l_rpm or -1, rpm_remaining(), pu, paced_until() or -1,
  tonumber(t[1]) or -1, t[2] or '', tonumber(m[1]) or 0, tonumber(m[2]) or 0,
}
