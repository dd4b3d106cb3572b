-- One pool's token budget shared by every node (SPEC §12): the ledger of charges and the
-- origin's last announcement, and the rules that admit against them. Mirrors the pure
-- `nthbouncer_governor::TokenBudget` (see its module docs for why each charge counts where it
-- does) except that waiters stay parked on their own node (it retries `admit` for them) and
-- one of them at a time may hold the budget (`holder`). Runs atomically; time is the server's
-- (`TIME`), so no node clock decides a window or a refill.
--
-- KEYS: 1 charges (hash id -> "seq:at:cost:finishedSeq", finishedSeq -1 while in flight),
-- 2 meta (hash: seq, admitted, the announcement a_limit/a_rem/a_at/a_full/a_basis/a_ift,
-- hold_id/hold_until).
-- ARGV: 1 operation, 2 tpm (0 = none configured), 3 window_ms, 4 hold_ttl_ms, 5 charge id
-- ('' for none), then the operation's own:
--   admit   6 cost, 7 holder (0/1: the caller's waiter has waited its hold)
--   finish  6 actual usage (-1: not reported)
--   observe 6 limit, 7 remaining, 8 reset_ms (-1: not said)
--   refund, unhold, peek: none
-- Reply: {verdict, remaining, budget, source, admittedTokens, retryMs, held}; -1 for none;
-- verdict 'admitted' | 'refused' | 'exceeds' | 'ok'; source 0 none, 1 configured,
-- 2 announced, 3 both; held 1 when another charge holds the budget.

local K_CHARGES, K_META = KEYS[1], KEYS[2]
local op = ARGV[1]
local tpm, window, hold_ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local id = ARGV[5]
-- A charge in flight this long is taken as ended at its estimate: its node went away without
-- saying (a live node always ends its charges).
local STALE_MS = 600000
-- The keys of a pool nobody uses for this long are forgotten.
local IDLE_MS = 600000

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local function fmt(n)
  return string.format('%d', n)
end

local m = redis.call('HMGET', K_META, 'seq', 'admitted', 'a_limit', 'a_rem', 'a_at', 'a_full',
  'a_basis', 'a_ift', 'hold_id', 'hold_until')
local seq = tonumber(m[1]) or 0
local admitted = tonumber(m[2]) or 0
local ann = nil
if tonumber(m[5]) then
  ann = { limit = tonumber(m[3]), rem = tonumber(m[4]), at = tonumber(m[5]), full = tonumber(m[6]),
    basis = tonumber(m[7]) or 0, ift = tonumber(m[8]) or 0 }
end
local hold_id = m[9]
if not hold_id or (tonumber(m[10]) or 0) <= now then hold_id = nil end

-- The ledger, in admission order.
local charges, by_id = {}, {}
local flat = redis.call('HGETALL', K_CHARGES)
for i = 1, #flat, 2 do
  local s, at, cost, fin = string.match(flat[i + 1], '^(%d+):(%d+):(%d+):(-?%d+)$')
  if s then
    local c = { id = flat[i], seq = tonumber(s), at = tonumber(at), cost = tonumber(cost),
      fin = tonumber(fin) }
    table.insert(charges, c)
    by_id[c.id] = c
  end
end
table.sort(charges, function(a, b) return a.seq < b.seq end)

local function save(c)
  redis.call('HSET', K_CHARGES, c.id, fmt(c.seq) .. ':' .. fmt(c.at) .. ':' .. fmt(c.cost) .. ':'
    .. fmt(c.fin))
end

for _, c in ipairs(charges) do
  if c.fin < 0 and c.at + STALE_MS <= now then
    c.fin = seq
    save(c)
  end
end

-- Drops charges neither budget counts any more (as `TokenBudget::prune`).
local function prune()
  local basis = ann and ann.basis
  local first = 1
  while charges[first] do
    local c = charges[first]
    local out_of_window = c.at + window <= now
    local settled = c.fin >= 0 and (not basis or c.fin < basis)
    if not (out_of_window and settled) then break end
    redis.call('HDEL', K_CHARGES, c.id)
    by_id[c.id] = nil
    first = first + 1
  end
  if first > 1 then
    local rest = {}
    for i = first, #charges do table.insert(rest, charges[i]) end
    charges = rest
  end
end
prune()

local function spent_in_window()
  local s = 0
  for _, c in ipairs(charges) do
    if c.at + window > now then s = s + c.cost end
  end
  return s
end

local function spent_after(basis)
  local s = 0
  for _, c in ipairs(charges) do
    if c.seq > basis then s = s + c.cost end
  end
  return s
end

local function configured_remaining()
  if tpm <= 0 then return nil end
  return math.max(0, tpm - spent_in_window())
end

-- The announced budget's level before the charges it does not know (`announced_level`).
local function announced_level()
  if not ann then return nil end
  local r, limit, full = ann.rem, ann.limit, ann.full
  if r and limit and full and full > ann.at and limit > r then
    if now >= full then return limit end
    return r + math.floor((limit - r) * math.max(0, now - ann.at) / (full - ann.at))
  elseif r and full then
    if now < full then return r end
    return limit
  elseif r then
    if now < ann.at + window then return r end
    return limit
  end
  return limit
end

local function announced_remaining()
  if not ann then return nil end
  local level = announced_level()
  if not level then return nil end
  return math.max(0, level - spent_after(ann.basis) - ann.ift)
end

local function remaining()
  local c, a = configured_remaining(), announced_remaining()
  if c and a then return math.min(c, a) end
  return c or a
end

local function budget()
  local c = nil
  if tpm > 0 then c = tpm end
  local a = nil
  if ann and announced_remaining() then a = ann.limit end
  if c and a then return math.min(c, a) end
  return c or a
end

local function source()
  local s = 0
  if tpm > 0 then s = 1 end
  if announced_remaining() then s = s + 2 end
  return s
end

local function fits(cost)
  local r = remaining()
  return not r or cost <= r
end

-- When the announced budget will have refilled enough for `cost` (`announced_fits_at`).
local function announced_fits_at(cost)
  local need = cost + spent_after(ann.basis) + ann.ift
  local full = ann.full or (ann.at + window)
  local r, limit = ann.rem, ann.limit
  if r and limit and limit > r and full > ann.at then
    if need > limit then return nil end
    return ann.at + math.ceil(math.max(0, need - r) * (full - ann.at) / (limit - r))
  end
  return math.max(full, now + 1)
end

-- The earliest time `cost` fits, if the budget alone will ever let it (`fits_at`).
local function fits_at(cost)
  if fits(cost) then return now end
  local configured = now
  if tpm > 0 then
    if cost > tpm then return nil end
    local spent = spent_in_window()
    for _, c in ipairs(charges) do
      if tpm - spent >= cost then break end
      if c.at + window > now then
        spent = spent - c.cost
        configured = c.at + window
      end
    end
    if tpm - spent < cost then return nil end
  end
  local announced = now
  if ann then
    local a = announced_remaining()
    if a and a < cost then
      announced = announced_fits_at(cost)
      if not announced then return nil end
    end
  end
  return math.max(configured, announced, now + 1)
end

local function touch()
  redis.call('PEXPIRE', K_CHARGES, IDLE_MS + window)
  redis.call('PEXPIRE', K_META, IDLE_MS + window)
end

local function reply(verdict, retry)
  local held = 0
  if hold_id and hold_id ~= id then held = 1 end
  return { verdict, remaining() or -1, budget() or -1, source(), fmt(admitted), retry or -1, held }
end

local function set_hold(h)
  hold_id = h
  if h then
    redis.call('HSET', K_META, 'hold_id', h, 'hold_until', fmt(now + hold_ttl))
  else
    redis.call('HDEL', K_META, 'hold_id', 'hold_until')
  end
end

if op == 'admit' then
  local cost, holder = tonumber(ARGV[6]), ARGV[7] == '1'
  local b = budget()
  if b and cost > b then return reply('exceeds') end
  if by_id[id] then return reply('refused') end
  if (not hold_id or hold_id == id) and fits(cost) then
    seq = seq + 1
    local c = { id = id, seq = seq, at = now, cost = cost, fin = -1 }
    table.insert(charges, c)
    by_id[id] = c
    save(c)
    admitted = admitted + cost
    redis.call('HSET', K_META, 'seq', fmt(seq), 'admitted', fmt(admitted))
    if hold_id == id then set_hold(nil) end
    touch()
    return reply('admitted')
  end
  if holder and (not hold_id or hold_id == id) then set_hold(id) end
  touch()
  local at = fits_at(cost)
  local retry = nil
  if at then retry = math.max(1, at - now) end
  return reply('refused', retry)
elseif op == 'finish' then
  local c = by_id[id]
  local actual = tonumber(ARGV[6])
  if c then
    if c.fin < 0 then c.fin = seq end
    if actual >= 0 then
      admitted = math.max(0, admitted - c.cost) + actual
      c.cost = actual
      redis.call('HSET', K_META, 'admitted', fmt(admitted))
    end
    save(c)
    touch()
  end
elseif op == 'refund' then
  local c = by_id[id]
  if c then
    redis.call('HDEL', K_CHARGES, id)
    by_id[id] = nil
    for i, x in ipairs(charges) do
      if x.id == id then table.remove(charges, i) break end
    end
    admitted = math.max(0, admitted - c.cost)
    redis.call('HSET', K_META, 'admitted', fmt(admitted))
  end
  if hold_id == id then set_hold(nil) end
elseif op == 'unhold' then
  if hold_id == id then set_hold(nil) end
elseif op == 'observe' then
  local limit, rem, reset = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
  if limit < 0 then limit = nil end
  if rem < 0 then rem = nil end
  if reset < 0 then reset = nil end
  local answered = nil
  if id ~= '' then answered = by_id[id] end
  local basis = seq
  local settled_before = seq + 1
  if answered then
    basis = answered.seq
    settled_before = answered.seq
  end
  -- Charges admitted up to it whose answers had not come back when it was admitted may have
  -- reached the origin after it.
  local ift = 0
  for _, c in ipairs(charges) do
    if c.seq <= basis and c.id ~= id and (c.fin < 0 or c.fin >= settled_before) then
      ift = ift + c.cost
    end
  end
  if (limit or rem) and not (ann and ann.basis > basis) then
    local at = now + 1
    local full = nil
    if reset then full = at + reset end
    ann = { limit = limit, rem = rem, at = at, full = full, basis = basis, ift = ift }
    redis.call('HSET', K_META, 'a_limit', limit and fmt(limit) or '', 'a_rem',
      rem and fmt(rem) or '', 'a_at', fmt(at), 'a_full', full and fmt(full) or '', 'a_basis',
      fmt(basis), 'a_ift', fmt(ift))
    prune()
    touch()
  end
end
return reply('ok')
