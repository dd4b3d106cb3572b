-- cancel: ARGV 13 ticket, 14 release (0/1). Leaves the queue; a grant that raced in is handed
-- over (release = 0: the caller takes it) or freed (release = 1: the caller is gone).
-- Returns {'cancelled', remaining, effective, rpmRemaining} | {'granted', grant} | {'released'}
-- | {'gone', remaining, effective, rpmRemaining}.
local m, release = ARGV[13], ARGV[14] == '1'
heartbeat()
local meta = redis.call('HGET', K_WAITERS, m)
if meta then
  forget(m)
  local h = headers()
  return { 'cancelled', h[1], h[2], h[3] }
end
local g = collect_grant(m)
if not g then
  local h = headers()
  return { 'gone', h[1], h[2], h[3] }
end
if not release then return { 'granted', g } end
local slot = string.match(g, '^(%x+):')
if slot then free(slot) end
settle()
publish()
return { 'released' }
