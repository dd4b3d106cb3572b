-- One pool's token budget shared by every node (SPEC §12): the ledger of charges and the
-- origin's last announcement, and the rules that admit against them. Mirrors the pure
-- `nthbouncer_governor::TokenBudget` (see its module docs for why each charge counts where it
-- does) except that waiters stay parked on their own node (it retries `admit` for them) and
-- one of them at a time may hold the budget (`holder`). Runs atomically; time is the server's
-- (`TIME`), so no node clock decides a window or a refill.
--
-- Split budgets (Anthropic's input and output tokens): a charge's cost is its input and its
-- output; the origin's announcement of each budget ('t' total, 'i' input, 'o' output) is kept
-- apart, and a charge fits when its total fits the total and each part fits its own.
--
-- KEYS: 1 charges (hash id -> "seq:at:input:output:finishedSeq", finishedSeq -1 while in
-- flight), 2 meta (hash: seq, admitted, per part p the announcement p_limit/p_rem/p_at/p_full/
-- p_basis/p_ift, hold_id/hold_until).
-- ARGV: 1 operation, 2 tpm (0 = none configured), 3 window_ms, 4 hold_ttl_ms, 5 charge id
-- ('' for none), then the operation's own:
--   admit   6 input, 7 output, 8 holder (0/1: the caller's waiter has waited its hold)
--   finish  6 actual total (-1: not reported), 7 its input and 8 its output (-1: not apart)
--   observe 6 part ('t', 'i', 'o'), 7 limit, 8 remaining, 9 reset_ms (-1: not said)
--   refund, unhold, peek: none
-- Reply: {verdict, remaining, budget, source, admittedTokens, retryMs, held, inputRemaining,
-- outputRemaining}; -1 for none; verdict 'admitted' | 'refused' | 'exceeds' | 'ok'; source
-- 0 none, 1 configured, 2 announced, 3 both; held 1 when another charge holds the budget.

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

local PARTS = { 't', 'i', 'o' }
local m = redis.call('HMGET', K_META, 'seq', 'admitted', 'hold_id', 'hold_until')
local seq = tonumber(m[1]) or 0
local admitted = tonumber(m[2]) or 0
local hold_id = m[3]
if not hold_id or (tonumber(m[4]) or 0) <= now then hold_id = nil end
-- The origin's last announcement of each budget.
local ann = {}
for _, p in ipairs(PARTS) do
  local a = redis.call('HMGET', K_META, p .. '_limit', p .. '_rem', p .. '_at', p .. '_full',
    p .. '_basis', p .. '_ift')
  if tonumber(a[3]) then
    ann[p] = { limit = tonumber(a[1]), rem = tonumber(a[2]), at = tonumber(a[3]),
      full = tonumber(a[4]), basis = tonumber(a[5]) or 0, ift = tonumber(a[6]) or 0 }
  end
end

-- The ledger, in admission order.
local charges, by_id = {}, {}
local flat = redis.call('HGETALL', K_CHARGES)
for i = 1, #flat, 2 do
  local s, at, inp, out, fin = string.match(flat[i + 1], '^(%d+):(%d+):(%d+):(%d+):(-?%d+)$')
  if s then
    local c = { id = flat[i], seq = tonumber(s), at = tonumber(at), inp = tonumber(inp),
      out = tonumber(out), fin = tonumber(fin) }
    table.insert(charges, c)
    by_id[c.id] = c
  end
end
table.sort(charges, function(a, b) return a.seq < b.seq end)

local function save(c)
  redis.call('HSET', K_CHARGES, c.id, fmt(c.seq) .. ':' .. fmt(c.at) .. ':' .. fmt(c.inp) .. ':'
    .. fmt(c.out) .. ':' .. fmt(c.fin))
end

-- A charge's (or a cost's) part: 't' its total, 'i' its input, 'o' its output.
local function part_of(c, p)
  if p == 'i' then return c.inp end
  if p == 'o' then return c.out end
  return c.inp + c.out
end

for _, c in ipairs(charges) do
  if c.fin < 0 and c.at + STALE_MS <= now then
    c.fin = seq
    save(c)
  end
end

-- Drops charges neither budget counts any more (as `TokenBudget::prune`).
local function prune()
  -- The oldest announcement in force decides: a charge it does not know must stay.
  local basis = nil
  for _, a in pairs(ann) do
    if not basis or a.basis < basis then basis = a.basis end
  end
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
    if c.at + window > now then s = s + part_of(c, 't') end
  end
  return s
end

local function spent_after(p, basis)
  local s = 0
  for _, c in ipairs(charges) do
    if c.seq > basis then s = s + part_of(c, p) end
  end
  return s
end

local function configured_remaining()
  if tpm <= 0 then return nil end
  return math.max(0, tpm - spent_in_window())
end

-- The announced budget's level before the charges it does not know (`announced_level`).
local function announced_level(a)
  local r, limit, full = a.rem, a.limit, a.full
  if r and limit and full and full > a.at and limit > r then
    if now >= full then return limit end
    return r + math.floor((limit - r) * math.max(0, now - a.at) / (full - a.at))
  elseif r and full then
    if now < full then return r end
    return limit
  elseif r then
    if now < a.at + window then return r end
    return limit
  end
  return limit
end

-- What the announced budget of part `p` has left, if one is in force.
local function announced_remaining(p)
  local a = ann[p]
  if not a then return nil end
  local level = announced_level(a)
  if not level then return nil end
  return math.max(0, level - spent_after(p, a.basis) - a.ift)
end

local function remaining()
  local c, a = configured_remaining(), announced_remaining('t')
  if c and a then return math.min(c, a) end
  return c or a
end

local function announced_limit(p)
  if ann[p] and announced_remaining(p) then return ann[p].limit end
  return nil
end

local function budget()
  local c = nil
  if tpm > 0 then c = tpm end
  local a = announced_limit('t')
  if c and a then return math.min(c, a) end
  return c or a
end

local function source()
  local s = 0
  if tpm > 0 then s = 1 end
  for _, p in ipairs(PARTS) do
    if announced_remaining(p) then
      s = s + 2
      break
    end
  end
  return s
end

local function fits(cost)
  local r = remaining()
  if r and part_of(cost, 't') > r then return false end
  for _, p in ipairs({ 'i', 'o' }) do
    local a = announced_remaining(p)
    if a and part_of(cost, p) > a then return false end
  end
  return true
end

-- When the announced budget of part `p` will have refilled enough for `need` more
-- (`announced_fits_at`).
local function announced_fits_at(p, cost)
  local a = ann[p]
  local need = cost + spent_after(p, a.basis) + a.ift
  local full = a.full or (a.at + window)
  local r, limit = a.rem, a.limit
  if r and limit and limit > r and full > a.at then
    if need > limit then return nil end
    return a.at + math.ceil(math.max(0, need - r) * (full - a.at) / (limit - r))
  end
  return math.max(full, now + 1)
end

-- The earliest time `cost` fits, if the budget alone will ever let it (`fits_at`).
local function fits_at(cost)
  if fits(cost) then return now end
  local total = part_of(cost, 't')
  local at = now + 1
  if tpm > 0 then
    if total > tpm then return nil end
    local spent = spent_in_window()
    for _, c in ipairs(charges) do
      if tpm - spent >= total then break end
      if c.at + window > now then
        spent = spent - part_of(c, 't')
        at = math.max(at, c.at + window)
      end
    end
    if tpm - spent < total then return nil end
  end
  for _, p in ipairs(PARTS) do
    local a = announced_remaining(p)
    if a and a < part_of(cost, p) then
      local t = announced_fits_at(p, part_of(cost, p))
      if not t then return nil end
      at = math.max(at, t)
    end
  end
  return at
end

local function touch()
  redis.call('PEXPIRE', K_CHARGES, IDLE_MS + window)
  redis.call('PEXPIRE', K_META, IDLE_MS + window)
end

local function reply(verdict, retry)
  local held = 0
  if hold_id and hold_id ~= id then held = 1 end
  return { verdict, remaining() or -1, budget() or -1, source(), fmt(admitted), retry or -1, held,
    announced_remaining('i') or -1, announced_remaining('o') or -1 }
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
  local cost = { inp = tonumber(ARGV[6]), out = tonumber(ARGV[7]) }
  local holder = ARGV[8] == '1'
  -- Larger than a whole budget: {'exceeds', estimate, budget}.
  local whole = { { part_of(cost, 't'), budget() }, { cost.inp, announced_limit('i') },
    { cost.out, announced_limit('o') } }
  for _, w in ipairs(whole) do
    if w[2] and w[1] > w[2] then
      local r = reply('exceeds')
      r[2], r[3] = w[1], w[2]
      return r
    end
  end
  if by_id[id] then return reply('refused') end
  if (not hold_id or hold_id == id) and fits(cost) then
    seq = seq + 1
    local c = { id = id, seq = seq, at = now, inp = cost.inp, out = cost.out, fin = -1 }
    table.insert(charges, c)
    by_id[id] = c
    save(c)
    admitted = admitted + part_of(c, 't')
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
  local actual, inp, out = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
  if c then
    if c.fin < 0 then c.fin = seq end
    if actual >= 0 then
      if inp < 0 or out < 0 then
        -- Not apart: the output estimate stands as far as the total allows.
        out = math.min(c.out, actual)
        inp = actual - out
      end
      admitted = math.max(0, admitted - part_of(c, 't')) + inp + out
      c.inp, c.out = inp, out
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
    admitted = math.max(0, admitted - part_of(c, 't'))
    redis.call('HSET', K_META, 'admitted', fmt(admitted))
  end
  if hold_id == id then set_hold(nil) end
elseif op == 'unhold' then
  if hold_id == id then set_hold(nil) end
elseif op == 'observe' then
  local p = ARGV[6]
  local limit, rem, reset = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
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
      ift = ift + part_of(c, p)
    end
  end
  if (limit or rem) and not (ann[p] and ann[p].basis > basis) then
    local at = now + 1
    local full = nil
    if reset then full = at + reset end
    ann[p] = { limit = limit, rem = rem, at = at, full = full, basis = basis, ift = ift }
    redis.call('HSET', K_META, p .. '_limit', limit and fmt(limit) or '', p .. '_rem',
      rem and fmt(rem) or '', p .. '_at', fmt(at), p .. '_full', full and fmt(full) or '',
      p .. '_basis', fmt(basis), p .. '_ift', fmt(ift))
    prune()
    touch()
  end
end
return reply('ok')
