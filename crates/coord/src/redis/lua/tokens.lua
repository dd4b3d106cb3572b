-- One pool's token budget shared by every node (SPEC §12): the ledger of charges and the
-- origin's last announcement, and the rules that admit against them. Mirrors the pure
-- `nthbouncer_governor::TokenBudget` (see its module docs for why each charge counts where it
-- does) except that waiters stay parked on their own node (it retries `admit` for them) and
-- one of them at a time may hold the budget (`holder`). Runs atomically; time is the server's
-- (`TIME`, never taken to run backwards: `clock`), so no node clock decides a window or a
-- refill.
--
-- Split budgets (Anthropic's input and output tokens): a charge's cost is its input and its
-- output; the origin's announcement of each budget ('t' total, 'i' input, 'o' output) is kept
-- apart, and a charge fits when its total fits the total and each part fits its own.
--
-- A call reads only the charges its answer depends on, never the whole window: the sums the
-- rules need are kept as running sums by the calls that change them.
-- - `win_t`: the total of the charges still in the configured window, those from `win_seq` on
--   (charges enter it in sequence order and leave it in the same order, since `at` never
--   decreases). A call first walks the charges that left it since the last call.
-- - per part p, `p_aft`: the part of the charges admitted after the announcement's `p_basis`
--   (the charges it does not know). Set by `observe` (from `blocks`, below);
--   kept by admit, finish and refund.
-- - `ends` orders the charges by when they ended (their `finishedSeq`); those in flight come
--   after every ended one, by admission time (OPEN + at): the stale ones are a range of it.
-- - An announcement needs the charges admitted after its request (`aft`) and those admitted
--   before it whose answers came back after it was admitted (`ift`). Both are sums over the
--   charges admitted at or after a sequence number, or ended at or after one, less the
--   running sum of those in flight (`fl_i`, `fl_o`): `blocks` keeps such sums per block of
--   BLOCK sequence numbers and per block of BLOCK blocks, by admission and by end, so `observe`
--   reads the charges of one block and a few dozen sums, not every charge since its request.
-- A ledger written by an earlier version (no `v`), read with another window (nodes should
-- share one), or with an index changed behind it or lost (a count differs from the charges'),
-- is indexed again from the charges: one call reads them all, as every call once did.
--
-- KEYS: 1 charges (hash id -> "seq:at:input:output:finishedSeq", finishedSeq -1 while in
-- flight), 2 meta (hash: seq, admitted, clock, v, win_ms, win_seq, win_t, fl_i, fl_o, per part
-- p the announcement p_limit/p_rem/p_at/p_full/p_basis/p_ift and its running sum p_aft,
-- hold_id/hold_until), 3 order (sorted set: id by seq), 4 ends (sorted set: id by
-- finishedSeq, or OPEN + at while in flight), 5 blocks (hash: 's1:k:i', 's1:k:o' the input
-- and output of the charges admitted with seq in block k, 'f1:k:i', 'f1:k:o' of those ended
-- there; 's2:k:…', 'f2:k:…' the same per block of BLOCK blocks; 'n' the number of charges).
-- ARGV: 1 operation, 2 tpm (0 = none configured), 3 window_ms, 4 hold_ttl_ms, 5 charge id
-- ('' for none), then the operation's own:
--   admit   6 input, 7 output, 8 holder (0/1: the caller's waiter has waited its hold)
--   finish  6 actual total (-1: not reported), 7 its input and 8 its output (-1: not apart)
--   observe 6 part ('t', 'i', 'o'), 7 limit, 8 remaining, 9 reset_ms (-1: not said)
--   refund, unhold, peek: none
--   batch   from 6 on, per report: its operation (finish, refund, unhold, observe), its charge
--           id, and its arguments padded to four
-- Reply: {verdict, remaining, budget, source, admittedTokens, retryMs, held, inputRemaining,
-- outputRemaining}; -1 for none; verdict 'admitted' | 'refused' | 'exceeds' | 'ok'; source
-- 0 none, 1 configured, 2 announced, 3 both; held 1 when another charge holds the budget.

local K_CHARGES, K_META, K_ORDER, K_ENDS, K_BLOCKS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local op = ARGV[1]
local tpm, window, hold_ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local id = ARGV[5]
-- A charge in flight this long is taken as ended at its estimate: its node went away without
-- saying (a live node always ends its charges).
local STALE_MS = 600000
-- The keys of a pool nobody uses for this long are forgotten.
local IDLE_MS = 600000
-- Where charges in flight start in `ends`: above any sequence number, below 2^53 (exact).
local OPEN = 2251799813685248
-- Charges read per step of a walk after its first (which reads one: most calls stop there).
local PAGE = 8
-- Sequence numbers per block of `blocks` (and blocks per block of the second level): an
-- announcement reads fewer charges than this, and fewer sums than twice this plus one per
-- BLOCK * BLOCK admissions since its request.
local BLOCK = 32
local VERSION = '3'

local function fmt(n)
  return string.format('%d', n)
end

local PARTS = { 't', 'i', 'o' }
-- The meta fields every call reads: its counters and sums, then each part's announcement
-- (ANN_FIELDS of them, in this order), spelled out (building them is a tenth of a short call).
local fields = { 'seq', 'admitted', 'hold_id', 'hold_until', 'clock', 'v', 'win_ms', 'win_seq',
  'win_t', 'fl_i', 'fl_o',
  't_limit', 't_rem', 't_at', 't_full', 't_basis', 't_ift', 't_aft',
  'i_limit', 'i_rem', 'i_at', 'i_full', 'i_basis', 'i_ift', 'i_aft',
  'o_limit', 'o_rem', 'o_at', 'o_full', 'o_basis', 'o_ift', 'o_aft' }
local BASE, ANN_FIELDS = 11, 7
local m = redis.call('HMGET', K_META, unpack(fields))

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
now = math.max(now, tonumber(m[5]) or 0)

local seq = tonumber(m[1]) or 0
local admitted = tonumber(m[2]) or 0
local hold_id = m[3]
if not hold_id or (tonumber(m[4]) or 0) <= now then hold_id = nil end
local indexed = m[6] == VERSION and tonumber(m[7]) == window
local win_seq = tonumber(m[8]) or 1
local win_t = tonumber(m[9]) or 0
-- The input and output of the charges in flight.
local flying = { inp = tonumber(m[10]) or 0, out = tonumber(m[11]) or 0 }
-- The origin's last announcement of each budget, with its running sum.
local ann = {}
for k, p in ipairs(PARTS) do
  local o = BASE + (k - 1) * ANN_FIELDS
  if tonumber(m[o + 3]) then
    ann[p] = { limit = tonumber(m[o + 1]), rem = tonumber(m[o + 2]), at = tonumber(m[o + 3]),
      full = tonumber(m[o + 4]), basis = tonumber(m[o + 5]) or 0, ift = tonumber(m[o + 6]) or 0,
      aft = tonumber(m[o + 7]) or 0 }
  end
end

local function parse(cid, v)
  if not v then return nil end
  local s, at, inp, out, fin = string.match(v, '^(%d+):(%d+):(%d+):(%d+):(-?%d+)$')
  if not s then return nil end
  return { id = cid, seq = tonumber(s), at = tonumber(at), inp = tonumber(inp),
    out = tonumber(out), fin = tonumber(fin) }
end

local function get(cid)
  return parse(cid, redis.call('HGET', K_CHARGES, cid))
end

-- The stored values of `ids` (false where none), read in chunks (`unpack`'s stack is small).
local function values(ids)
  local vals = {}
  local i = 1
  while i <= #ids do
    local last = math.min(#ids, i + 499)
    local got = redis.call('HMGET', K_CHARGES, unpack(ids, i, last))
    for j = 1, #got do vals[i + j - 1] = got[j] end
    i = last + 1
  end
  return vals
end

-- A charge's (or a cost's) part: 't' its total, 'i' its input, 'o' its output.
local function part_of(c, p)
  if p == 'i' then return c.inp end
  if p == 'o' then return c.out end
  return c.inp + c.out
end

local function end_score(c)
  if c.fin < 0 then return OPEN + c.at end
  return c.fin
end

local function save(c)
  redis.call('HSET', K_CHARGES, c.id, fmt(c.seq) .. ':' .. fmt(c.at) .. ':' .. fmt(c.inp) .. ':'
    .. fmt(c.out) .. ':' .. fmt(c.fin))
  redis.call('ZADD', K_ENDS, fmt(end_score(c)), c.id)
end

-- What this call moved in `blocks`, written by `flush`; 'n' is the number of charges, by
-- which a call sees that `blocks` is not there any more.
local moved = {}

local function forget(cid)
  if redis.call('HDEL', K_CHARGES, cid) == 1 then moved.n = (moved.n or 0) - 1 end
  redis.call('ZREM', K_ORDER, cid)
  redis.call('ZREM', K_ENDS, cid)
end

-- Moves the running sums by a change of `c`'s cost: `d` (a cost, parts possibly negative).
local function account(c, d)
  if c.seq >= win_seq then win_t = math.max(0, win_t + part_of(d, 't')) end
  for p, a in pairs(ann) do
    if c.seq > a.basis then a.aft = math.max(0, a.aft + part_of(d, p)) end
  end
end

local SPANS = { BLOCK, BLOCK * BLOCK }
-- A block's field. Block numbers are integers well below 1e14, which Lua's `..` writes in
-- full (as `suffix` does when it reads them).
local function block_field(kind, level, key, part)
  return kind .. level .. ':' .. math.floor(key / SPANS[level]) .. ':' .. part
end

-- Counts `c` (sign 1) in, or takes it (sign -1) out of, the sums by admission and by end (or in
-- flight). A change of a charge is its old self out, then its new self in.
local function index(c, sign)
  for _, part in ipairs({ 'i', 'o' }) do
    local v = sign * part_of(c, part)
    for level = 1, 2 do
      local f = block_field('s', level, c.seq, part)
      moved[f] = (moved[f] or 0) + v
      if c.fin >= 0 then
        f = block_field('f', level, c.fin, part)
        moved[f] = (moved[f] or 0) + v
      end
    end
    if c.fin < 0 and part == 'i' then
      flying.inp = flying.inp + v
    elseif c.fin < 0 then
      flying.out = flying.out + v
    end
  end
end

-- Indexes the charges again, from the hash alone.
local function reindex()
  redis.call('DEL', K_ORDER, K_ENDS, K_BLOCKS)
  moved, flying = {}, { inp = 0, out = 0 }
  local flat = redis.call('HGETALL', K_CHARGES)
  local all = {}
  for i = 1, #flat, 2 do
    local c = parse(flat[i], flat[i + 1])
    if c then table.insert(all, c) else redis.call('HDEL', K_CHARGES, flat[i]) end
  end
  table.sort(all, function(a, b) return a.seq < b.seq end)
  moved.n = #all
  -- Were the meta lost, sequence numbers go on after the charges'.
  if #all > 0 then seq = math.max(seq, all[#all].seq) end
  win_seq, win_t = seq + 1, 0
  for p, a in pairs(ann) do a.aft = 0 end
  local in_window = false
  for _, c in ipairs(all) do
    redis.call('ZADD', K_ORDER, fmt(c.seq), c.id)
    redis.call('ZADD', K_ENDS, fmt(end_score(c)), c.id)
    index(c, 1)
    if not in_window and c.at + window > now then
      in_window = true
      win_seq = c.seq
    end
    if in_window then win_t = win_t + part_of(c, 't') end
    for p, a in pairs(ann) do
      if c.seq > a.basis then a.aft = a.aft + part_of(c, p) end
    end
  end
end

-- Indexed by this version with this window, and none of the indexes lost (Redis may evict any
-- one key of a pool when it runs out of memory with an evicting policy).
local n_charges = redis.call('HLEN', K_CHARGES)
if not indexed or n_charges ~= redis.call('ZCARD', K_ORDER)
    or n_charges ~= redis.call('ZCARD', K_ENDS)
    or n_charges ~= (tonumber(redis.call('HGET', K_BLOCKS, 'n')) or 0) then
  reindex()
end

-- Charges in flight for too long end now (their node went away).
while true do
  local stale = redis.call('ZRANGEBYSCORE', K_ENDS, fmt(OPEN), fmt(OPEN + now - STALE_MS),
    'LIMIT', 0, PAGE)
  if #stale == 0 then break end
  local vals = values(stale)
  for k, cid in ipairs(stale) do
    local c = parse(cid, vals[k])
    if c then
      index(c, -1)
      c.fin = seq
      index(c, 1)
      save(c)
    else
      forget(cid)
    end
  end
end

-- The charges `from` (a `ZRANGEBYSCORE` bound) on in admission order, a page at a time, to
-- `each(c)` until it returns false. `each` must not remove charges.
local function walk(from, each)
  local offset, size = 0, 1
  while true do
    local page = redis.call('ZRANGEBYSCORE', K_ORDER, from, '+inf', 'LIMIT', offset, size)
    local vals = values(page)
    for k, cid in ipairs(page) do
      local c = parse(cid, vals[k])
      if c and not each(c) then return end
    end
    if #page < size then return end
    offset, size = offset + size, PAGE
  end
end

-- Charges that left the configured window since the last call.
do
  local first = nil
  walk(fmt(win_seq), function(c)
    if c.at + window > now then
      first = c.seq
      return false
    end
    win_t = math.max(0, win_t - part_of(c, 't'))
    return true
  end)
  win_seq = first or (seq + 1)
  if not first then win_t = 0 end
end

-- Drops charges neither budget counts any more (as `TokenBudget::prune`): from the oldest,
-- while out of the window and settled.
local function prune()
  -- The oldest announcement in force decides: a charge it does not know must stay.
  local basis = nil
  for _, a in pairs(ann) do
    if not basis or a.basis < basis then basis = a.basis end
  end
  local size = 1
  while true do
    local page = redis.call('ZRANGE', K_ORDER, 0, size - 1)
    if #page == 0 then return end
    size = PAGE
    local vals = values(page)
    for k, cid in ipairs(page) do
      local c = parse(cid, vals[k])
      if c then
        local out_of_window = c.seq < win_seq and c.at + window <= now
        local settled = c.fin >= 0 and (not basis or c.fin < basis)
        if not (out_of_window and settled) then return end
        index(c, -1)
      end
      forget(cid)
    end
  end
end
prune()

local function configured_remaining()
  if tpm <= 0 then return nil end
  return math.max(0, tpm - win_t)
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
  return math.max(0, level - a.aft - a.ift)
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
  local need = cost + a.aft + a.ift
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
    -- The window's oldest charges, until enough of them have left.
    local spent = win_t
    walk(fmt(win_seq), function(c)
      if tpm - spent >= total then return false end
      spent = spent - part_of(c, 't')
      at = math.max(at, c.at + window)
      return true
    end)
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

-- The pool's keys are used: they expire IDLE_MS after the last use (set once per call, by
-- `flush`).
local touched = false
local function touch()
  touched = true
end

-- Writes what the call changed of the meta hash's sums and counters.
local function flush()
  -- One read and one write for every sum moved (a finish moves up to eight).
  local names = {}
  for f, d in pairs(moved) do
    if d ~= 0 then table.insert(names, f) end
  end
  local i = 1
  while i <= #names do
    local upto = math.min(#names, i + 499)
    local got = redis.call('HMGET', K_BLOCKS, unpack(names, i, upto))
    local set, gone = {}, {}
    for j = 1, #got do
      local f = names[i + j - 1]
      local v = (tonumber(got[j]) or 0) + moved[f]
      if v == 0 then
        table.insert(gone, f)
      else
        table.insert(set, f)
        table.insert(set, fmt(v))
      end
    end
    if #set > 0 then redis.call('HSET', K_BLOCKS, unpack(set)) end
    if #gone > 0 then redis.call('HDEL', K_BLOCKS, unpack(gone)) end
    i = upto + 1
  end
  moved = {}
  local out = { 'seq', fmt(seq), 'admitted', fmt(admitted), 'clock', fmt(now), 'v', VERSION,
    'win_ms', fmt(window), 'win_seq', fmt(win_seq), 'win_t', fmt(win_t), 'fl_i',
    fmt(flying.inp), 'fl_o', fmt(flying.out) }
  for p, a in pairs(ann) do
    table.insert(out, p .. '_aft')
    table.insert(out, fmt(a.aft))
  end
  redis.call('HSET', K_META, unpack(out))
  if touched then
    for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, IDLE_MS + window) end
    touched = false
  end
end

local function reply(verdict, retry)
  flush()
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

-- The input and output of the charges admitted (kind 's') or ended ('f') at sequence `x` or
-- later: the rest of `x`'s block from the charges themselves, the rest of its second-level
-- block from the first level's sums, the later ones from the second level's.
local function suffix(kind, x)
  local sum = { inp = 0, out = 0 }
  local last = (math.floor(x / BLOCK) + 1) * BLOCK - 1
  local ids
  if kind == 's' then
    ids = redis.call('ZRANGEBYSCORE', K_ORDER, fmt(x), fmt(last))
  else
    ids = redis.call('ZRANGEBYSCORE', K_ENDS, fmt(x), fmt(last))
  end
  local vals = values(ids)
  for k = 1, #ids do
    -- Only the input and output of each.
    local inp, out = string.match(vals[k] or '', '^%d+:%d+:(%d+):(%d+):')
    if inp then
      sum.inp = sum.inp + tonumber(inp)
      sum.out = sum.out + tonumber(out)
    end
  end
  local names = {}
  local function blocks(level, from, to)
    local pre = kind .. level .. ':'
    for b = from, to do
      names[#names + 1] = pre .. b .. ':i'
      names[#names + 1] = pre .. b .. ':o'
    end
  end
  local first = math.floor(x / BLOCK) + 1
  local top = math.floor(x / SPANS[2])
  blocks(1, first, math.min((top + 1) * BLOCK - 1, math.floor(seq / BLOCK)))
  blocks(2, top + 1, math.floor(seq / SPANS[2]))
  -- In chunks, as `values` (pairs of fields: a chunk's length is even).
  local i = 1
  while i <= #names do
    local upto = math.min(#names, i + 499)
    local got = redis.call('HMGET', K_BLOCKS, unpack(names, i, upto))
    for j = 1, #got, 2 do
      local f = i + j - 1
      sum.inp = sum.inp + (tonumber(got[j]) or 0) + (moved[names[f]] or 0)
      sum.out = sum.out + (tonumber(got[j + 1]) or 0) + (moved[names[f + 1]] or 0)
    end
    i = upto + 1
  end
  return sum
end

-- One operation on charge `id` (the file's head says each one's arguments, `a`). Returns the
-- reply of an admission; the others reply with the view after them.
local function apply(op, a)
  if op == 'admit' then
    local cost = { inp = tonumber(a[1]), out = tonumber(a[2]) }
    local holder = a[3] == '1'
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
    if redis.call('HEXISTS', K_CHARGES, id) == 1 then return reply('refused') end
    if (not hold_id or hold_id == id) and fits(cost) then
      seq = seq + 1
      local c = { id = id, seq = seq, at = now, inp = cost.inp, out = cost.out, fin = -1 }
      save(c)
      redis.call('ZADD', K_ORDER, fmt(seq), id)
      moved.n = (moved.n or 0) + 1
      index(c, 1)
      account(c, c)
      admitted = admitted + part_of(c, 't')
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
    local c = get(id)
    local actual, inp, out = tonumber(a[1]), tonumber(a[2]), tonumber(a[3])
    if c then
      index(c, -1)
      if c.fin < 0 then c.fin = seq end
      if actual >= 0 then
        if inp < 0 or out < 0 then
          -- Not apart: the output estimate stands as far as the total allows.
          out = math.min(c.out, actual)
          inp = actual - out
        end
        admitted = math.max(0, admitted - part_of(c, 't')) + inp + out
        account(c, { inp = inp - c.inp, out = out - c.out })
        c.inp, c.out = inp, out
      end
      index(c, 1)
      save(c)
      touch()
    end
  elseif op == 'refund' then
    local c = get(id)
    if c then
      forget(id)
      index(c, -1)
      account(c, { inp = -c.inp, out = -c.out })
      admitted = math.max(0, admitted - part_of(c, 't'))
    end
    if hold_id == id then set_hold(nil) end
  elseif op == 'unhold' then
    if hold_id == id then set_hold(nil) end
  elseif op == 'observe' then
    local p = a[1]
    local limit, rem, reset = tonumber(a[2]), tonumber(a[3]), tonumber(a[4])
    if limit < 0 then limit = nil end
    if rem < 0 then rem = nil end
    if reset < 0 then reset = nil end
    local answered = nil
    if id ~= '' then answered = get(id) end
    local basis = seq
    if answered then basis = answered.seq end
    if (limit or rem) and not (ann[p] and ann[p].basis > basis) then
      -- Charges admitted before it whose answers had not come back when it was admitted may
      -- have reached the origin after it (`ift`); those admitted after it are not in it (`aft`).
      -- Without it: every charge in flight now, and none after.
      local ift, aft = part_of(flying, p), 0
      if answered then
        -- `ift`: in flight now, less those admitted from it on, plus those ended since it was
        -- admitted (the ones of these admitted from it on cancel out). `aft`: admitted from it
        -- on, less itself.
        local from = suffix('s', basis)
        aft = part_of(from, p) - part_of(answered, p)
        ift = ift - part_of(from, p) + part_of(suffix('f', basis), p)
      end
      local at = now + 1
      local full = nil
      if reset then full = at + reset end
      ann[p] = { limit = limit, rem = rem, at = at, full = full, basis = basis, ift = ift,
        aft = aft }
      redis.call('HSET', K_META, p .. '_limit', limit and fmt(limit) or '', p .. '_rem',
        rem and fmt(rem) or '', p .. '_at', fmt(at), p .. '_full', full and fmt(full) or '',
        p .. '_basis', fmt(basis), p .. '_ift', fmt(ift))
      prune()
      touch()
    end
  end
end

-- Reports (`batch`): finish, refund, unhold and observe, each of a charge, in order, as one
-- call; ARGV from 6 on: op, charge id, then its arguments padded to four, for each.
if op == 'batch' then
  for n = 6, #ARGV, 6 do
    local o = ARGV[n]
    if o ~= 'finish' and o ~= 'refund' and o ~= 'unhold' and o ~= 'observe' then
      return redis.error_reply('a token batch takes reports only, not ' .. tostring(o))
    end
  end
  for n = 6, #ARGV, 6 do
    id = ARGV[n + 1]
    apply(ARGV[n], { ARGV[n + 2], ARGV[n + 3], ARGV[n + 4], ARGV[n + 5] })
  end
  id = ''
  return reply('ok')
end
return apply(op, { ARGV[6], ARGV[7], ARGV[8], ARGV[9] }) or reply('ok')
