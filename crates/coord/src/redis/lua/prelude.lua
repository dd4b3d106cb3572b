-- The shared part of every gate script: one pool's admission rules over its keys in Redis.
-- Every script is this prelude followed by one operation; all of it runs atomically, so a
-- script sees and changes the pool as one step, whichever node calls it. Time is the server's
-- (`TIME`): no node clock decides a deadline. Mirrors `nthbouncer-governor`'s rules; see
-- `redis/mod.rs` for the key layout and what differs.
--
-- KEYS: 1 leases (zset slot -> lease deadline), 2 held (hash slot -> "requestDeadline:grantedAt";
-- not for an exchange admitted at once, whose node keeps both and passes them back, see `admit`),
-- 3 waiters (hash ticket -> "class:fairnessKey:leaseMs:holdGraceMs:node:slot"), 4 deadlines (zset ticket ->
-- when its queue entry or unclaimed grant is forgotten), 5 queue (zset ticket -> class and
-- round, see `queue_score`), 6 meta (hash), 7 rounds (hash "class:fairnessKey" -> last round),
-- 8 grants (hash ticket -> grant), 9 learned (hash), 10 rpm (zset slot -> admission time),
-- 11 nodes (zset node -> alive until).
-- ARGV: 1 limit, 2 queue_size, 3 rpm, 4 request_timeout_ms, 5 lease_term_ms, 6 min_limit,
-- 7 fair_share (0/1), 8 node, 9 node_ttl_ms, 10 wake channel prefix, 11 pool, 12 the pool's
-- generation as the caller last saw it ('' for none); the operation's own arguments from 13.
-- Every reply ends with the pool's current generation (appended after the operation returns).

-- The prelude defines its functions once and `begin` sets each call's state: as a Redis
-- function library (Redis 7) the definitions run once, when the library is loaded, and every
-- call runs only `begin` and its operation; as a script (`EVAL`, older Redis) all of it runs
-- per call. Everything a call reads from its keys and arguments, and everything it keeps while
-- it runs, is one of the variables below, assigned by `begin`: nothing carries over from one
-- call to the next.
local KEYS, ARGV
local K_LEASES, K_HELD, K_WAITERS, K_DEADLINES
local K_QUEUE, K_META, K_ROUNDS, K_GRANTS
local K_LEARNED, K_RPM, K_NODES

-- Every class's waiters are in one sorted set (one count, one pop): a waiter's score is its
-- round plus its class's base, so a higher class (1 high .. 3 low) always comes first, and
-- within a class the lower round, then the lower ticket (ties go by member, and tickets are
-- zero-padded). Rounds count one fairness key's waiters; they stay far below the span, and the
-- scores below 2^53, where doubles are exact.
local CLASS_SPAN = 1099511627776 -- 2^40
local function queue_score(class, round)
  return (class - 1) * CLASS_SPAN + round
end

local cfg_limit, cfg_queue, cfg_rpm, cfg_request_ms, cfg_term_ms, cfg_min, cfg_fair
local node, node_ttl, wake_prefix, pool, known_gen

local WINDOW_MS = 60000

local clock, now

-- Integers as decimal strings: Lua numbers are doubles, and the default conversion may use an
-- exponent for large values.
local function fmt(n)
  return string.format('%d', n)
end

-- A node with waiters calls at least every poll interval (its ticker collects their grants);
-- those calls, and queueing itself, are its heartbeat: waiters of a node that stopped calling
-- are skipped at dispatch. Calls of a node without waiters need none.
local beat
local function heartbeat()
  if beat then return end
  beat = true
  redis.call('ZADD', K_NODES, now + node_ttl, node)
end

-- The pool's generation: made by the first call that finds none, so it changes when Redis lost
-- the pool's keys (FLUSHDB, a restart without persistence). A caller that saw an older one comes
-- from before the loss: nodes may still run calls on leases Redis no longer has. The pool then
-- grants nothing new for one lease term (`quiet_until`, enforced as a pause): every lease alive
-- at the loss ends within a term of its last renewal, and a renewal in that time re-asserts its
-- slot (see `renew`), so the running calls count again before anyone new gets in. A pool nobody
-- has seen before (the caller has no generation) starts at once.
-- With the fields of `meta` most calls read, in the same command (see `finish`).
local gen, gen_id, quiet_until
local function read_generation()
  gen = redis.call('HMGET', K_META, 'gen', 'gen_at', 'quiet_until', 'hold', 'last_full',
    'kept_until')
  gen_id, quiet_until = gen[1], tonumber(gen[3]) or 0
  if not gen_id then
    gen_id = clock[1] .. string.format('%06d', tonumber(clock[2]))
    quiet_until = 0
    if known_gen ~= '' then quiet_until = now + cfg_term_ms end
    -- Tickets keep rising across the loss (a node may still wait on an old one of the same number).
    redis.call('HSET', K_META, 'gen', gen_id, 'gen_at', fmt(now), 'quiet_until', fmt(quiet_until),
      'seq', fmt(now * 1000))
  elseif known_gen ~= '' and known_gen ~= gen_id then
    -- The first caller after the loss had not seen the pool before: the quiet period starts with
    -- the first one that had (grants made in between could not be stopped).
    local q = (tonumber(gen[2]) or now) + cfg_term_ms
    if q > quiet_until and q > now then
      quiet_until = q
      redis.call('HSET', K_META, 'quiet_until', fmt(q))
    end
  end
end

local eff, l_limit, l_pace, l_rpm, rpm_limit, paused_until

-- What learning imposes (written by the node that observed; see `apply_learned`).
local function load_learned()
  local l = redis.call('HMGET', K_LEARNED, 'limit', 'pace_us', 'pace_until', 'rpm', 'paused_until')
  l_limit = tonumber(l[1])
  l_pace = tonumber(l[2])
  l_rpm = tonumber(l[4])
  if l_pace and (tonumber(l[3]) or 0) <= now then
    l_pace = nil
    l_rpm = nil
  end
  paused_until = tonumber(l[5]) or 0
  if quiet_until > paused_until then paused_until = quiet_until end
  eff = cfg_limit
  if l_limit and l_limit < eff then eff = l_limit end
  if eff < cfg_min then eff = cfg_min end
  rpm_limit = nil
  if cfg_rpm > 0 then rpm_limit = cfg_rpm end
  if l_rpm and (not rpm_limit or l_rpm < rpm_limit) then rpm_limit = l_rpm end
end

-- The number of leases, read once per call and kept up to date by this call's own changes
-- (every change to `leases` goes through `lease_set` or `lease_del`).
local n_leases

local function in_flight()
  if not n_leases then n_leases = redis.call('ZCARD', K_LEASES) end
  return n_leases
end

-- `ZADD` (with its flags) that keeps the count: true iff the slot was new.
local function lease_set(score, slot, flag)
  local added
  if flag then
    added = redis.call('ZADD', K_LEASES, flag, score, slot)
  else
    added = redis.call('ZADD', K_LEASES, score, slot)
  end
  if n_leases then n_leases = n_leases + added end
  return added == 1
end

-- `ZREM` that keeps the count: true iff the slot was leased.
local function lease_del(slot)
  local removed = redis.call('ZREM', K_LEASES, slot)
  if n_leases then n_leases = n_leases - removed end
  return removed == 1
end

-- Meta fields the operations of one call read or change, read with the generation and written
-- once when the call ends (`finish`): the mean hold time (nil: none yet), the last time the pool
-- was full (-1: never), until when some node keeps idle slots (nil: none; see `reclaim_kept`),
-- and the admissions counted.
local hold_mean, hold_dirty
local last_full, full_dirty
local kept_until
local admitted_n

local function hold_get()
  return hold_mean
end

local function last_full_get()
  return last_full
end

local function set_full()
  last_full, full_dirty = now, true
end

-- Writes what the call kept in memory; every script runs it after its operation.
local function finish()
  if hold_dirty or full_dirty then
    local fields = {}
    if hold_dirty then
      table.insert(fields, 'hold')
      table.insert(fields, fmt(hold_mean))
    end
    if full_dirty then
      table.insert(fields, 'last_full')
      table.insert(fields, fmt(last_full))
    end
    redis.call('HSET', K_META, unpack(fields))
    hold_dirty, full_dirty = false, false
  end
  if admitted_n > 0 then redis.call('HINCRBY', K_META, 'admitted', admitted_n) end
end

-- The number of waiters, read once per script and kept up to date by what changes the queue
-- (`queue_changed`), since every operation asks for it at least once.
local n_queued
-- Whether this call took a waiter out of the queue (the fair-share rounds are reset once empty).
local left_queue

local function queued()
  if not n_queued then n_queued = redis.call('ZCARD', K_QUEUE) end
  return n_queued
end

-- The queue gained (+1) or lost (-1) a waiter.
local function queue_changed(delta)
  if n_queued then n_queued = n_queued + delta end
  if delta < 0 then left_queue = true end
end

-- Admissions inside the rolling minute (an admission at t leaves it at t + WINDOW_MS).
local function rpm_used()
  redis.call('ZREMRANGEBYSCORE', K_RPM, '-inf', now - WINDOW_MS)
  return redis.call('ZCARD', K_RPM)
end

local function rpm_remaining()
  if not rpm_limit then return -1 end
  return math.max(0, rpm_limit - rpm_used())
end

-- When enough admissions have left the window for one more, if not now.
local function rpm_free_at()
  if not rpm_limit then return nil end
  local live = rpm_used()
  if live < rpm_limit then return nil end
  local e = redis.call('ZRANGE', K_RPM, live - rpm_limit, live - rpm_limit, 'WITHSCORES')
  return tonumber(e[2]) + WINDOW_MS
end

-- The learned pace (a generic cell rate algorithm, burst 2, as the governor's `pace`): when
-- the next admission is allowed, if not now.
local function paced_until()
  if not l_pace then return nil end
  local tat = tonumber(redis.call('HGET', K_META, 'tat')) or 0
  local tolerance = math.max(l_pace, 1000)
  local at = math.ceil((tat - tolerance) / 1000)
  if at > now then return at end
  return nil
end

-- What stops an admission now, most fundamental first (as `Governor::blocker`).
local function blocker()
  if paused_until > now then return 'paused' end
  if rpm_limit and rpm_used() >= rpm_limit then return 'rpm' end
  if paced_until() then return 'rpm' end
  if in_flight() >= eff then return 'no_slot' end
  return nil
end

-- `hold_grace` keeps the slot past its request deadline for a holder that ends the exchange
-- itself (see `EXCHANGE_GRACE_MS`); the holder is told the request deadline without it.
-- `untracked`: no `held` entry; only the node that asked renews and releases the slot, and it
-- passes the grant time and the cap back itself (an exchange admitted at once: two commands
-- and a read fewer per proxied request). A lock lease, which any node may renew or release,
-- and a waiter's grant are tracked.
-- Nil (nothing changed) if the slot id is leased already.
local function admit(slot, lease_ms, hold_grace, untracked)
  local rd = now + cfg_request_ms
  local held_until = rd + hold_grace
  local ld = math.min(now + lease_ms, held_until)
  if not lease_set(ld, slot, 'NX') then return nil end
  if not untracked then redis.call('HSET', K_HELD, slot, fmt(held_until) .. ':' .. fmt(now)) end
  if rpm_limit then redis.call('ZADD', K_RPM, now, slot) end
  if l_pace then
    local tat = tonumber(redis.call('HGET', K_META, 'tat')) or 0
    redis.call('HSET', K_META, 'tat', fmt(math.max(tat, now * 1000) + l_pace))
  end
  admitted_n = admitted_n + 1
  local n = in_flight()
  if n >= eff then set_full() end
  return { ld, rd, math.max(0, eff - n), eff, rpm_remaining() }
end

-- Frees a held slot; true iff it was held. The hold time feeds the `Retry-After` estimate.
-- `held`: the slot's `held` entry if the caller read it already (false: read, absent).
-- `granted`: the grant time of an untracked slot (see `admit`), given by its node; nil else.
local function free(slot, held, granted)
  if not lease_del(slot) then return false end
  local granted_at = granted
  if not granted_at then
    local h = held
    if h == nil then h = redis.call('HGET', K_HELD, slot) end
    redis.call('HDEL', K_HELD, slot)
    granted_at = h and tonumber(string.match(h, ':(%d+)$'))
  end
  if granted_at then
    local sample = math.max(0, now - granted_at)
    local mean = hold_get()
    if mean then mean = mean - math.floor(mean / 4) + math.floor(sample / 4) else mean = sample end
    hold_mean, hold_dirty = mean, true
  end
  return true
end

local function parse_waiter(meta)
  local c, fkey, lease_ms, hold_grace, wnode, slot =
    string.match(meta, '^(%d):(%d+):(%d+):(%d+):([^:]+):(%x+)$')
  return tonumber(c), fkey, tonumber(lease_ms), wnode, slot, tonumber(hold_grace)
end

-- Forgets a ticket: a waiter whose budget (plus grace) ran out, or a grant nobody collected.
local function forget(m)
  if redis.call('HDEL', K_WAITERS, m) == 1 and redis.call('ZREM', K_QUEUE, m) == 1 then
    queue_changed(-1)
  end
  redis.call('HDEL', K_GRANTS, m)
  redis.call('ZREM', K_DEADLINES, m)
end

local woken
-- With `collect_own` set (by the operation, before `settle`), grants to this node's own
-- waiters are not recorded for its ticker to collect but returned by this call: ticket, grant,
-- ticket, grant, ... (no wake-up, no second round trip).
local collect_own
local own_grants

-- Publishes the wake-ups decided so far, once each (an operation publishes before it returns;
-- several in one call publish each their own).
local function publish()
  for n in pairs(woken) do
    redis.call('PUBLISH', wake_prefix .. n, pool)
  end
  woken = {}
end

-- The oldest waiter of the highest class present (within a class, lowest round first: with
-- fair share on, rounds rotate across fairness keys; ties go by ticket, i.e. FIFO).
local function pop_waiter()
  if queued() == 0 then return nil end
  local head = redis.call('ZPOPMIN', K_QUEUE)
  if not head[1] then return nil end
  queue_changed(-1)
  if cfg_fair then
    local score = tonumber(head[2])
    local c = math.floor(score / CLASS_SPAN) + 1
    redis.call('HSET', K_META, 'r' .. c, fmt(score - (c - 1) * CLASS_SPAN))
  end
  return head[1]
end

-- Admits waiters while nothing blocks. A grant is recorded for the waiter's node to collect
-- and that node is woken (or returned at once, see `collect_own`); a waiter whose node stopped
-- calling is dropped, not granted.
local function dispatch()
  if queued() == 0 then return end
  while not blocker() do
    local m = pop_waiter()
    if not m then return end
    local meta = redis.call('HGET', K_WAITERS, m)
    redis.call('HDEL', K_WAITERS, m)
    redis.call('ZREM', K_DEADLINES, m)
    if meta then
      local _, _, lease_ms, wnode, slot, hold_grace = parse_waiter(meta)
      local alive = tonumber(redis.call('ZSCORE', K_NODES, wnode))
      local g = nil
      if slot and alive and alive >= now then g = admit(slot, lease_ms, hold_grace or 0, false) end
      if g then
        local rest = ':' .. fmt(g[2]) .. ':' .. fmt(g[3]) .. ':' .. fmt(g[4]) .. ':' .. fmt(g[5])
        if collect_own and wnode == node then
          table.insert(own_grants, m)
          table.insert(own_grants, slot .. ':' .. fmt(g[1]) .. rest)
        else
          -- Until its node collects it (within a poll: the node is woken, and polls while it
          -- has waiters), the slot is leased for at most `node_ttl`, after which a silent node
          -- counts as dead: a grant to a node that died with waiters queued comes back within
          -- that, not a lease term later. Collecting extends the lease (`collect_grant`).
          local uncollected = math.min(g[1], now + node_ttl)
          lease_set(uncollected, slot)
          redis.call('HSET', K_GRANTS, m, slot .. ':' .. fmt(uncollected) .. rest .. '|' .. fmt(g[1]))
          -- An uncollected grant is forgotten with its lease (the slot itself expires then too).
          redis.call('ZADD', K_DEADLINES, uncollected, m)
          woken[wnode] = true
        end
      end
    end
  end
end

-- Takes the grant recorded for ticket `m` (nil if none): its slot's lease becomes the one
-- `admit` gave (`dispatch` leased it only until collected). A grant still recorded has its
-- slot still leased: the two expire together, and `settle` reclaims both at once.
local function collect_grant(m)
  local g = redis.call('HGET', K_GRANTS, m)
  if not g then return nil end
  redis.call('HDEL', K_GRANTS, m)
  redis.call('ZREM', K_DEADLINES, m)
  local slot, rest, leased = string.match(g, '^(%x+):%d+(:[^|]*)|(%d+)$')
  if not slot then return g end
  lease_set(leased, slot, 'XX')
  return slot .. ':' .. leased .. rest
end

-- Reclaims expired leases, forgets stale tickets, admits whoever can go. `full` (the periodic
-- and rare calls: tick, snapshot) also tidies what no admission depends on: dead nodes, the
-- admission times of an RPM gate no longer in force, the fair-share rounds of an empty queue.
-- Expiry is swept once per call: the time does not move within a call, and nothing a call
-- writes expires at that same time (leases and deadlines are set into the future), so a second
-- sweep by a later operation of the same call would find nothing.
local swept
local function settle(full)
  if not swept then
    swept = true
    local expired = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now)
    for _, slot in ipairs(expired) do
      lease_del(slot)
      redis.call('HDEL', K_HELD, slot)
    end
    local stale = redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', now)
    for _, m in ipairs(stale) do forget(m) end
  end
  if full then
    redis.call('ZREMRANGEBYSCORE', K_NODES, '-inf', '(' .. fmt(now))
    if not rpm_limit then redis.call('DEL', K_RPM) end
  end
  dispatch()
  -- Rounds are written only with fair share (a tick or snapshot tidies what an earlier setting left).
  if (full or (left_queue and cfg_fair)) and queued() == 0 then
    redis.call('DEL', K_ROUNDS)
    redis.call('HDEL', K_META, 'r1', 'r2', 'r3')
  end
end

-- Milliseconds until state can change without a call (a lease expiry, a forgotten ticket, the
-- end of a pause or of the RPM/pace hold while waiters exist); -1 for never.
local function next_wakeup()
  local best = nil
  local function consider(t)
    if t and (not best or t < best) then best = t end
  end
  local first = redis.call('ZRANGE', K_LEASES, 0, 0, 'WITHSCORES')
  if first[2] then consider(tonumber(first[2])) end
  local d = redis.call('ZRANGE', K_DEADLINES, 0, 0, 'WITHSCORES')
  if d[2] then consider(tonumber(d[2])) end
  if queued() > 0 then
    local b = blocker()
    if b == 'paused' then
      consider(paused_until)
    elseif b == 'rpm' then
      local w, p = rpm_free_at(), paced_until()
      if w and p then consider(math.max(w, p)) else consider(w or p) end
    elseif not b then
      consider(now)
    end
  end
  if not best then return -1 end
  return math.max(0, best - now)
end

-- How long until retrying could plausibly succeed; -1 when unknown.
local function retry_after(reason)
  if reason == 'paused' then return paused_until - now end
  if reason == 'rpm' then
    local w, p = rpm_free_at(), paced_until()
    local t = w or p
    if w and p then t = math.max(w, p) end
    if not t then return -1 end
    return math.max(0, t - now)
  end
  local mean = hold_get()
  if not mean then return -1 end
  return math.max(1, math.ceil(mean * (queued() + 1) / math.max(eff, 1)))
end

-- Kept slots (see the gate's `Keeping`): a node may keep an exchange slot leased after its call
-- ended, to lend to its next call without a round trip, while the pool has room to spare. A
-- keeper writes `kept_until` in `meta` at each of its checks. When a slot is short (an
-- acquire is queued or refused for want of one) or learning changes what is admitted, every
-- keeper is told at once on the pool-wide channel `{wake prefix}reclaim` to free what it keeps
-- idle and stop keeping; once per keeping period (a lost message is made up by the keepers'
-- own checks, which see the queue within a poll interval).
local function reclaim_kept()
  if kept_until and kept_until > now then
    kept_until = nil
    redis.call('HDEL', K_META, 'kept_until')
    redis.call('PUBLISH', wake_prefix .. 'reclaim', pool)
  end
end

-- Stores what a node's learner concluded (ARGV from index i: limit, pace_us, pace_until, rpm,
-- paused_until, throttle_at, throttle_cause; -1 = none). A pause only ever lengthens here: two
-- nodes that saw throttles both get their pause.
local function apply_learned(i)
  local limit, pace, pace_until = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local rpm, pause, throttle_at = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5])
  if limit >= 0 then
    redis.call('HSET', K_LEARNED, 'limit', fmt(limit))
  else
    redis.call('HDEL', K_LEARNED, 'limit')
  end
  if pace > 0 then
    redis.call('HSET', K_LEARNED, 'pace_us', fmt(pace), 'pace_until', fmt(pace_until), 'rpm', fmt(rpm))
  else
    redis.call('HDEL', K_LEARNED, 'pace_us', 'pace_until', 'rpm')
  end
  if pause > now then
    local old = tonumber(redis.call('HGET', K_LEARNED, 'paused_until')) or 0
    if pause > old then redis.call('HSET', K_LEARNED, 'paused_until', fmt(pause)) end
  end
  if throttle_at >= 0 then
    redis.call('HSET', K_LEARNED, 'throttle_at', fmt(throttle_at), 'throttle_cause', ARGV[i + 6])
  end
  -- Learning nobody refreshes fades: a pool whose learners all went away returns to its
  -- configuration within ten minutes.
  redis.call('PEXPIRE', K_LEARNED, 600000)
  load_learned()
  reclaim_kept()
end

local function headers()
  return { math.max(0, eff - in_flight()), eff, rpm_remaining() }
end

-- A call's state, from its keys and arguments (see the top of this file), before its operation.
local function begin(keys, args)
  KEYS, ARGV = keys, args
  K_LEASES, K_HELD, K_WAITERS, K_DEADLINES = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  K_QUEUE, K_META, K_ROUNDS, K_GRANTS = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
  K_LEARNED, K_RPM, K_NODES = KEYS[9], KEYS[10], KEYS[11]
  cfg_limit = tonumber(ARGV[1])
  cfg_queue = tonumber(ARGV[2])
  cfg_rpm = tonumber(ARGV[3])
  cfg_request_ms = tonumber(ARGV[4])
  cfg_term_ms = tonumber(ARGV[5])
  cfg_min = math.min(tonumber(ARGV[6]), cfg_limit)
  cfg_fair = ARGV[7] == '1'
  node = ARGV[8]
  node_ttl = tonumber(ARGV[9])
  wake_prefix = ARGV[10]
  pool = ARGV[11]
  known_gen = ARGV[12]
  clock = redis.call('TIME')
  now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  beat = false
  read_generation()
  load_learned()
  n_leases = nil
  hold_mean, hold_dirty = tonumber(gen[4]), false
  last_full, full_dirty = tonumber(gen[5]) or -1, false
  kept_until = tonumber(gen[6])
  admitted_n = 0
  n_queued = nil
  left_queue = false
  woken = {}
  collect_own = false
  own_grants = {}
  swept = false
end
