//! One pool's gate on Redis, as one node sees it.
//!
//! Owns the node-local half of a shared pool: the callers of this node parked in the shared
//! queue (each on a oneshot channel, by ticket), the ticker that collects their grants (woken
//! by pub/sub, polling as a fallback and a heartbeat), the keep-alive and self-fencing of the
//! exchange slots this node holds, the adaptive learner (the governor's pure code, fed outcomes
//! seen here, its conclusions written to Redis), and the fail-open fallback gate. The admission
//! rules are the scripts'; this module must not re-decide them, and must not know about HTTP.
//!
//! Invariants (as in process): a caller that gives up (timeout or dropped future) either leaves
//! the queue or frees the grant that raced in; a grant is handed to its waiter under the
//! waiters' lock, so a waiter that finds its entry gone knows the grant is in its channel.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{ready, Context, Poll};

use nthbouncer_governor::{Governor, Learned};
use parking_lot::Mutex;
use tokio::sync::{oneshot, watch, Notify};

use super::batch::{self, Op, Queued};
use super::script::{self, CallError, Caller, Reply};
use super::Node;
use crate::in_process::InProcessGate;
use crate::{
    AcquireRequest, GateHeaders, Grant, LeaseWatch, Outcome, PoolGate, PoolSettings, Priority,
    Refusal, RefusalReason, RenewError, SlotId, SlotKind, Snapshot, Throttle,
};

/// How long past its wait budget a queue entry stays in Redis: its own node cancels it at the
/// budget's end, and only an entry whose node never did (it died) is forgotten by the others.
const GRACE_MS: u64 = 2_000;

/// Shortest sleep of the ticker, so a schedule that is already due cannot make it spin.
const MIN_TICK_MS: u64 = 5;

/// The smallest effective limit at which a node keeps slots (see [`Keeping`]): below it, one
/// slot kept idle is too large a part of the pool to hold back from the other nodes.
const KEEP_MIN_LIMIT: u32 = 16;

/// A slot kept leased in Redis after its exchange ended, for this node's next exchange.
struct Kept {
    /// Its id in Redis.
    slot: u128,
    /// Monotonic ms until which its lease is confirmed.
    confirmed_until: u64,
    /// Monotonic ms since which it is idle.
    idle_since: u64,
}

/// Kept slots. While the pool has room to spare (nobody queued, a quarter of its slots free,
/// no pause, RPM gate or pace), an exchange slot admitted at once is not freed in Redis when its
/// call ends: this node keeps it leased, renews it like a running one, and lends it to its next
/// exchange, which then costs no Redis call at all. The slot stays counted against the limit
/// all along, so the limit holds as before; only who may use it changes. A slot idle for a poll
/// interval is freed, and so is every idle one, at once, when a slot is short elsewhere or
/// learning changes what is admitted (a reclaim: see `reclaim_kept` in `lua/prelude.lua`).
/// Keeping stops then, until a check of the pool's state (`renew.lua`) allows it again.
#[derive(Default)]
struct Keeping {
    /// Whether a slot whose exchange ends may be kept (and an idle one lent).
    allowed: bool,
    /// A check was asked for (an admission saw room to spare while keeping was not allowed).
    wanted: bool,
    /// Counts the reclaims: a check whose call overlapped one does not allow keeping.
    reclaims: u64,
    idle: Vec<Kept>,
    /// Slots lent since the last check (counted as admissions in Redis by the next one).
    lent: u64,
    /// The pool as last seen: its free slots and effective limit (a lent grant's headers).
    remaining: u32,
    effective: u32,
}

impl Keeping {
    /// Whether the ticker checks the pool's state every poll interval.
    fn active(&self) -> bool {
        self.allowed || self.wanted || self.lent > 0 || !self.idle.is_empty()
    }

    /// Whether a view of the pool leaves room enough to keep slots.
    fn roomy(remaining: u32, effective: u32) -> bool {
        effective >= KEEP_MIN_LIMIT && remaining >= effective / 4
    }
}

/// A grant as the scripts record it, with the moment it was read on both clocks.
#[derive(Clone, Debug)]
struct Granted {
    slot: SlotId,
    lease_deadline: u64,
    request_deadline: u64,
    remaining: u32,
    effective: u32,
    rpm_remaining: Option<u32>,
    /// Server time of the call that read it, and this node's monotonic time when it was made.
    server_now: u64,
    mono: u64,
}

impl Granted {
    /// Parses `slot:leaseDeadline:requestDeadline:remaining:effective:rpmRemaining`.
    fn parse(s: &str, server_now: u64, mono: u64) -> Option<Granted> {
        let mut parts = s.split(':');
        let slot = SlotId::parse(parts.next()?)?;
        let mut num = || parts.next().and_then(|p| p.parse::<i64>().ok());
        let lease_deadline = u64::try_from(num()?).ok()?;
        let request_deadline = u64::try_from(num()?).ok()?;
        let remaining = u32::try_from(num()?.max(0)).ok()?;
        let effective = u32::try_from(num()?.max(0)).ok()?;
        let rpm_remaining = u32::try_from(num()?).ok();
        Some(Granted {
            slot,
            lease_deadline,
            request_deadline,
            remaining,
            effective,
            rpm_remaining,
            server_now,
            mono,
        })
    }

    /// The grant of an `admitted` acquire reply.
    fn admitted(
        reply: &Reply,
        slot: SlotId,
        server_now: u64,
        mono: u64,
    ) -> Result<Granted, CallError> {
        Ok(Granted {
            slot,
            lease_deadline: reply.u64(2)?,
            request_deadline: reply.u64(3)?,
            remaining: reply.u32(4)?,
            effective: reply.u32(5)?,
            rpm_remaining: u32::try_from(reply.int(6)?).ok(),
            server_now,
            mono,
        })
    }

    /// This node's monotonic time until which the lease is confirmed.
    fn confirmed_until(&self) -> u64 {
        self.mono
            .saturating_add(self.lease_deadline.saturating_sub(self.server_now))
    }
}

/// An exchange slot this node holds and keeps alive.
struct Hold {
    /// Monotonic ms until which the lease is confirmed in Redis.
    confirmed_until: u64,
    lost: watch::Sender<bool>,
    /// Admitted at once, the slot has no `held` entry in Redis (see the prelude's `admit`):
    /// this node passes its grant time and its cap back on release, peek and renewal.
    untracked: Option<Untracked>,
    /// The slot's id in Redis: the holder's own, or that of the kept slot lent to it (a lent
    /// slot gets a fresh id for its holder, so a late release by its previous holder cannot
    /// free it).
    in_redis: u128,
}

/// What Redis keeps in `held` for other slots, kept here for an untracked exchange slot.
#[derive(Clone, Copy)]
struct Untracked {
    /// Server ms at which the slot was granted (for the hold-time mean and the learner).
    granted_at: u64,
    /// Server ms past which the lease is never renewed: its request deadline plus the
    /// exchange's hold grace.
    cap: u64,
}

impl Untracked {
    fn granted_arg(this: Option<Untracked>) -> String {
        this.map(|u| u.granted_at.to_string()).unwrap_or_default()
    }

    fn cap_arg(this: Option<Untracked>) -> String {
        this.map(|u| u.cap.to_string()).unwrap_or_default()
    }
}

/// What a learner concluded, as the scripts store it (`-1` for none).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Wire {
    limit: i64,
    pace_us: i64,
    pace_until: i64,
    rpm: i64,
    paused_until: i64,
    throttle_at: i64,
    cause: String,
}

fn wire_num(v: Option<u64>) -> i64 {
    v.and_then(|v| i64::try_from(v).ok()).unwrap_or(-1)
}

impl Wire {
    fn of(l: &Learned) -> Wire {
        Wire {
            limit: wire_num(l.learned_limit.map(u64::from)),
            pace_us: wire_num(l.pace_us),
            pace_until: wire_num(l.pace_until),
            rpm: wire_num(l.learned_rpm.map(u64::from)),
            paused_until: wire_num(l.paused_until),
            throttle_at: wire_num(l.last_throttle.as_ref().map(|t| t.at)),
            cause: l
                .last_throttle
                .as_ref()
                .map(|t| t.cause.clone())
                .unwrap_or_default(),
        }
    }

    fn args(&self) -> [String; 7] {
        [
            self.limit.to_string(),
            self.pace_us.to_string(),
            self.pace_until.to_string(),
            self.rpm.to_string(),
            self.paused_until.to_string(),
            self.throttle_at.to_string(),
            self.cause.clone(),
        ]
    }
}

/// The node's adaptive learner for one pool: a governor that admits nothing and only learns,
/// on the server's clock. `written` is what it last stored in Redis; it writes again only when
/// its conclusion changes, and only once it has learned something (a node that never saw an
/// outcome must not overwrite what others learned).
struct Learner {
    gov: Governor,
    written: Option<Wire>,
}

impl Learner {
    /// What to store after learning at `now`, if it differs from what was stored.
    fn conclusion_to_store(&mut self, now: u64, changed: bool) -> Option<Wire> {
        let wire = Wire::of(&self.gov.learned(now));
        let fresh = self.written.as_ref() != Some(&wire);
        if (changed || self.written.is_some()) && fresh {
            self.written = Some(wire.clone());
            return Some(wire);
        }
        None
    }
}

pub(crate) struct Shared {
    node: Arc<Node>,
    pool: String,
    keys: Vec<String>,
    settings: Mutex<PoolSettings>,
    /// Callers of this node parked in the shared queue, by ticket.
    waiters: Mutex<HashMap<String, oneshot::Sender<Granted>>>,
    /// Acquires of this node whose script call is under way, by slot id, with the grant that
    /// reached this node before the caller could park under its ticket (a slot freed by another
    /// call of this node goes to its own waiters in that call's reply): the caller takes it
    /// instead of parking. Locked after `waiters`.
    early: Mutex<HashMap<u128, Option<Granted>>>,
    /// Exchange slots this node holds, by slot id.
    holds: Mutex<HashMap<u128, Hold>>,
    /// Monotonic ms at which the holds are next renewed.
    renew_at: AtomicU64,
    /// Slots kept for this node's next exchanges (see [`Keeping`]). Locked after `holds`.
    keeping: Mutex<Keeping>,
    /// Monotonic ms at which the pool's state is next checked, while keeping is active.
    check_at: AtomicU64,
    /// Monotonic ms at which the ticker next collects grants for this node's waiters (0: now;
    /// `u64::MAX` until the first waiter parks).
    poll_at: AtomicU64,
    learner: Mutex<Learner>,
    /// Server ms minus this node's monotonic ms, as of the last answer (for the learner's clock
    /// between calls).
    offset: AtomicI64,
    signal: Arc<Notify>,
    closed: AtomicBool,
    /// Turns `true` at `close`: a parked waiter watches it too, so it is refused `PoolClosed`
    /// even if its sender escaped the waiters' map when `close` cleared it (being handed over
    /// by a ticker, say) and would otherwise wait its whole budget.
    closing: tokio::sync::watch::Sender<bool>,
    ticker_started: AtomicBool,
    /// Fail open: until this monotonic ms, admission skips Redis (it just failed).
    down_until: AtomicU64,
    fallback: Mutex<Option<Arc<InProcessGate>>>,
    /// Slots granted by the fallback gate (they are released there, not in Redis).
    local_slots: Mutex<HashSet<u128>>,
    /// Fail open: fallback slots taken on behalf of this node's exchange slots that were
    /// granted by Redis and were still running when Redis went away (Redis slot → fallback
    /// slot), so the node's share counts them: the origin sees no more than the share from
    /// this node once they end.
    carried: Mutex<HashMap<u128, SlotId>>,
    /// Fail open: fallback slots registered in Redis once it answered again (`adopt`), with
    /// the monotonic ms until which each lease is confirmed. They are renewed with the holds
    /// and released in both places.
    adopted: Mutex<HashMap<u128, u64>>,
    /// Fail open: this node went on its own since Redis last answered.
    outage_seen: AtomicBool,
    /// Fail open, back on Redis: until this monotonic ms, an admission must also fit this
    /// node's share (see [`Shared::recover`]).
    recover_until: AtomicU64,
    /// The pool's generation in Redis as last seen (`""`: none yet). It changes when Redis lost
    /// the pool's keys; sent with every call so the scripts see that this node comes from before
    /// (see `lua/prelude.lua`).
    generation: Mutex<String>,
    /// This node's acquires and releases for the pool, on their way into a batch (`batch`).
    batch: tokio::sync::mpsc::UnboundedSender<Queued>,
    /// Releases Redis did not confirm (Redis away, the connection cut mid-call), by slot id,
    /// with the monotonic ms after which the slot's lease has surely ended anyway: the ticker
    /// makes them again until Redis answers (a release is idempotent by slot id), so a blip
    /// costs the pool its slots for as long as Redis is away, not for a lease term after.
    unconfirmed: Mutex<HashMap<u128, u64>>,
    /// Monotonic ms at which the ticker next tries the `unconfirmed` releases.
    unconfirmed_at: AtomicU64,
}

/// One pool's gate on Redis. Dropping it (or [`PoolGate::close`]) stops its ticker.
pub struct RedisGate {
    shared: Arc<Shared>,
}

fn class(p: Priority) -> u8 {
    match p {
        Priority::High => 1,
        Priority::Normal => 2,
        Priority::Low => 3,
    }
}

fn reason(s: &str) -> RefusalReason {
    match s {
        "queue_full" => RefusalReason::QueueFull,
        "rpm" => RefusalReason::Rpm,
        "paused" => RefusalReason::Paused,
        _ => RefusalReason::NoSlot,
    }
}

/// The fail-open share of one node: `limit / expected_nodes`, at least one slot.
fn share(settings: &PoolSettings, expected_nodes: u32) -> PoolSettings {
    let limit = (settings.limit / expected_nodes.max(1)).max(1);
    PoolSettings {
        limit,
        min_limit: settings.min_limit.min(limit),
        rpm: if settings.rpm == 0 {
            0
        } else {
            (settings.rpm / expected_nodes.max(1)).max(1)
        },
        ..settings.clone()
    }
}

impl RedisGate {
    pub(crate) fn new(node: Arc<Node>, pool: &str, settings: PoolSettings) -> Self {
        let keys = script::pool_keys(&node.options.key_prefix, pool);
        let (batch, batched) = tokio::sync::mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            pool: pool.to_owned(),
            keys,
            learner: Mutex::new(Learner {
                gov: Governor::new(settings.clone()),
                written: None,
            }),
            settings: Mutex::new(settings),
            waiters: Mutex::new(HashMap::new()),
            early: Mutex::new(HashMap::new()),
            holds: Mutex::new(HashMap::new()),
            renew_at: AtomicU64::new(0),
            keeping: Mutex::new(Keeping::default()),
            check_at: AtomicU64::new(0),
            poll_at: AtomicU64::new(u64::MAX),
            offset: AtomicI64::new(0),
            signal: Arc::new(Notify::new()),
            closed: AtomicBool::new(false),
            closing: tokio::sync::watch::channel(false).0,
            ticker_started: AtomicBool::new(false),
            down_until: AtomicU64::new(0),
            fallback: Mutex::new(None),
            local_slots: Mutex::new(HashSet::new()),
            carried: Mutex::new(HashMap::new()),
            adopted: Mutex::new(HashMap::new()),
            outage_seen: AtomicBool::new(false),
            recover_until: AtomicU64::new(0),
            generation: Mutex::new(String::new()),
            batch,
            unconfirmed: Mutex::new(HashMap::new()),
            unconfirmed_at: AtomicU64::new(0),
            node: Arc::clone(&node),
        });
        node.runtime
            .spawn(batch::run(Arc::downgrade(&shared), batched));
        {
            let mut gates = node.gates.lock();
            let list = gates.entry(pool.to_owned()).or_default();
            list.retain(|g| g.strong_count() > 0);
            list.push(Arc::downgrade(&shared));
        }
        shared.ensure_ticker();
        RedisGate { shared }
    }
}

impl Drop for RedisGate {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.signal.notify_one();
        // What it keeps idle goes back now rather than when its leases end.
        self.shared.reclaim();
    }
}

impl Shared {
    /// Runs the ticker now, its grant collection included (a wake-up arrived).
    pub(crate) fn wake(&self) {
        self.poll_at.store(0, Ordering::Release);
        self.signal.notify_one();
    }

    /// A waiter parked: the ticker collects grants by monotonic ms `due` at the latest. For
    /// the `first_waiter` (nobody else waited here), a time left from an earlier wait is not a
    /// collection due now (the waiter's own call just found no slot; a grant for it comes with
    /// a wake-up) and is replaced, unless it is a wake-up's 0.
    fn collect_by(&self, due: u64, first_waiter: bool) {
        if first_waiter {
            let left = self.poll_at.load(Ordering::Acquire);
            if left != 0
                && self
                    .poll_at
                    .compare_exchange(left, due, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return;
            }
        }
        self.poll_at.fetch_min(due, Ordering::AcqRel);
    }

    /// Lets the ticker reschedule (a hold or waiter came), without collecting grants before
    /// they are due.
    fn nudge(&self) {
        self.signal.notify_one();
    }

    fn settings(&self) -> PoolSettings {
        self.settings.lock().clone()
    }

    fn mono(&self) -> u64 {
        self.node.clock.monotonic_ms()
    }

    /// The server's time as this node last saw it, moved on by this node's monotonic clock.
    fn server_now_estimate(&self) -> u64 {
        let offset = self.offset.load(Ordering::Acquire);
        u64::try_from(i128::from(self.mono()) + i128::from(offset)).unwrap_or(0)
    }

    fn note_server_now(&self, server_now: u64, mono: u64) {
        let offset = i128::from(server_now) - i128::from(mono);
        self.offset
            .store(i64::try_from(offset).unwrap_or_default(), Ordering::Release);
    }

    fn ensure_ticker(self: &Arc<Self>) {
        if self.ticker_started.load(Ordering::Acquire) {
            return;
        }
        if self.ticker_started.swap(true, Ordering::AcqRel) {
            return;
        }
        // On the node's runtime, not the opener's: a gate opened while serving a request (a
        // pool the admin API added) would otherwise lose its ticker with a connection thread.
        self.node.runtime.spawn(run_ticker(
            Arc::downgrade(self),
            Arc::clone(&self.signal),
            Arc::clone(&self.node.clock),
        ));
    }

    pub(crate) fn node(&self) -> &Node {
        &self.node
    }

    /// Runs an acquire or a release in the pool's next batch (see [`batch`]); its reply is the
    /// one its own script would give.
    async fn call_op(&self, op: Op, args: Vec<String>) -> Result<Reply, CallError> {
        let (reply, replied) = oneshot::channel();
        self.batch
            .send(Queued { op, args, reply })
            .map_err(|_| CallError::Stopped)?;
        replied.await.unwrap_or(Err(CallError::Stopped))
    }

    pub(crate) async fn call(
        &self,
        which: &script::GateScript,
        extra: &[String],
    ) -> Result<Reply, CallError> {
        let settings = self.settings();
        let generation = self.generation.lock().clone();
        let caller = Caller {
            node: &self.node.id,
            node_ttl_ms: u64::try_from(self.node.options.node_ttl.as_millis()).unwrap_or(u64::MAX),
            wake_prefix: &self.node.wake_prefix,
            pool: &self.pool,
            generation: &generation,
        };
        let reply = script::call(
            &self.node.conn,
            &self.node.runtime,
            &self.node.scripts,
            which,
            &self.keys,
            &settings,
            &caller,
            extra,
            self.node.options.command_timeout,
        )
        .await;
        match &reply {
            Ok(r) if r.1 != generation => {
                if !generation.is_empty() {
                    tracing::warn!(pool = %self.pool, "redis lost this pool's state; running calls re-assert their slots, nothing new is admitted for one lease term");
                }
                *self.generation.lock() = r.1.clone();
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(pool = %self.pool, error = %e, "redis gate call failed"),
        }
        reply
    }

    /// How often this node renews its exchange slots: the advised renew interval, and at least
    /// three times a term so one lost call does not lose a lease.
    fn renew_every(&self) -> u64 {
        let settings = self.settings();
        settings
            .renew_interval_ms
            .min(settings.lease_term_ms / 3)
            .max(MIN_TICK_MS)
    }

    fn fail_open(&self) -> Option<u32> {
        self.node.options.fail_open
    }

    fn retry_redis_ms(&self) -> u64 {
        u64::try_from(self.node.options.retry_redis_after.as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether admission skips Redis for now (fail open, and Redis failed a moment ago).
    fn on_own(&self) -> bool {
        self.fail_open().is_some() && self.mono() < self.down_until.load(Ordering::Acquire)
    }

    fn fallback_gate(&self) -> Option<Arc<InProcessGate>> {
        let expected = self.fail_open()?;
        let mut fallback = self.fallback.lock();
        let gate = fallback.get_or_insert_with(|| {
            Arc::new(InProcessGate::new(
                &self.pool,
                share(&self.settings(), expected),
                Arc::clone(&self.node.clock),
            ))
        });
        Some(Arc::clone(gate))
    }

    /// Redis could not answer an acquire: admit on this node's share (fail open) or refuse.
    async fn unavailable(&self, e: &CallError, req: AcquireRequest) -> Result<Grant, Refusal> {
        let retry_after_ms = self.retry_redis_ms();
        self.down_until.store(
            self.mono().saturating_add(retry_after_ms),
            Ordering::Release,
        );
        match self.fallback_gate() {
            Some(gate) => {
                self.outage_seen.store(true, Ordering::Release);
                tracing::warn!(pool = %self.pool, error = %e, "redis unreachable; admitting on this node's share (fail open)");
                self.carry_holds(&gate).await;
                self.acquire_on_own(&gate, req).await
            }
            None => {
                tracing::warn!(pool = %self.pool, error = %e, "redis unreachable; refusing admission (fail closed)");
                Err(Refusal::CoordinationUnavailable { retry_after_ms })
            }
        }
    }

    /// Counts the exchange slots Redis granted this node, still running, against its share:
    /// one fallback slot each, as far as the share goes (a hold left without one gets the slot
    /// of the next carried hold to end, see [`Shared::uncarry`]).
    async fn carry_holds(&self, gate: &Arc<InProcessGate>) {
        let uncarried: Vec<u128> = {
            let carried = self.carried.lock();
            self.holds
                .lock()
                .keys()
                .filter(|slot| !carried.contains_key(slot))
                .copied()
                .collect()
        };
        for slot in uncarried {
            let req = AcquireRequest {
                fairness_key: 0,
                priority: Priority::Normal,
                wait_ms: 0,
                kind: SlotKind::Exchange,
            };
            let Ok(grant) = gate.acquire(req).await else {
                break;
            };
            self.carried.lock().insert(slot, grant.slot_id);
        }
    }

    /// A Redis-granted exchange slot ended: the fallback slot it carried passes to a running
    /// hold that has none (so the node stays within its share while they run), or is freed.
    async fn uncarry(&self, slot: u128) {
        let passed_on = {
            let mut carried = self.carried.lock();
            let Some(local) = carried.remove(&slot) else {
                return;
            };
            let heir = self
                .holds
                .lock()
                .keys()
                .find(|s| **s != slot && !carried.contains_key(s))
                .copied();
            match heir {
                Some(heir) => {
                    carried.insert(heir, local);
                    None
                }
                None => Some(local),
            }
        };
        let gate = self.fallback.lock().clone();
        if let (Some(local), Some(gate)) = (passed_on, gate) {
            gate.release(local, None).await;
        }
    }

    async fn acquire_on_own(
        &self,
        gate: &Arc<InProcessGate>,
        req: AcquireRequest,
    ) -> Result<Grant, Refusal> {
        let grant = gate.acquire(req).await?;
        self.local_slots.lock().insert(grant.slot_id.0);
        // The ticker tries Redis again to register it (see `recover`).
        self.nudge();
        Ok(grant)
    }

    /// Fail open: whether Redis must be told about this node's time on its own before it
    /// admits through Redis again.
    fn needs_recovery(&self) -> bool {
        self.fail_open().is_some()
            && (self.outage_seen.load(Ordering::Acquire)
                || self.local_slots.lock().len() > self.adopted.lock().len())
    }

    /// Whether admissions are still held to this node's share after an outage.
    fn recovering(&self) -> bool {
        self.fail_open().is_some() && self.mono() < self.recover_until.load(Ordering::Acquire)
    }

    /// Back from an outage (fail open): registers the calls this node admitted on its own and
    /// that still run in Redis (`adopt`), so the shared limit counts them until they end. Then,
    /// for two retry periods, admissions through Redis must also fit this node's share: the
    /// other nodes register theirs within a retry period of Redis answering (their tickers try
    /// it while they have any), and until they have, Redis alone would not count them.
    async fn recover(&self) -> Result<(), CallError> {
        let pending: Vec<u128> = {
            let local = self.local_slots.lock();
            let adopted = self.adopted.lock();
            local
                .iter()
                .filter(|slot| !adopted.contains_key(slot))
                .copied()
                .collect()
        };
        let settings = self.settings();
        let mut extra = vec![
            settings.lease_term_ms.to_string(),
            crate::EXCHANGE_GRACE_MS.to_string(),
        ];
        extra.extend(pending.iter().map(|slot| SlotId(*slot).to_string()));
        let mono = self.mono();
        let reply = match self.call(&self.node.scripts.adopt, &extra).await {
            Ok(reply) => reply,
            Err(e) => {
                self.down_until.store(
                    self.mono().saturating_add(self.retry_redis_ms()),
                    Ordering::Release,
                );
                return Err(e);
            }
        };
        let server_now = reply.u64(0)?;
        self.note_server_now(server_now, mono);
        {
            let local = self.local_slots.lock();
            let mut adopted = self.adopted.lock();
            for (i, slot) in pending.iter().enumerate() {
                let deadline = reply.u64(1 + i)?;
                // A slot released meanwhile was freed in the fallback only: free it here too.
                if local.contains(slot) {
                    adopted.insert(
                        *slot,
                        mono.saturating_add(deadline.saturating_sub(server_now)),
                    );
                }
            }
        }
        for slot in pending {
            if !self.local_slots.lock().contains(&slot) {
                self.free(SlotId(slot)).await;
            }
        }
        if self.outage_seen.swap(false, Ordering::AcqRel) {
            let period = self.retry_redis_ms().max(self.poll_ms());
            self.recover_until.store(
                self.mono().saturating_add(period.saturating_mul(2)),
                Ordering::Release,
            );
            tracing::info!(pool = %self.pool, "redis answers again; this node's own admissions are registered there");
        }
        if self.renew_at.load(Ordering::Acquire) < mono {
            self.renew_at
                .store(mono.saturating_add(self.renew_every()), Ordering::Release);
        }
        Ok(())
    }

    fn poll_ms(&self) -> u64 {
        u64::try_from(self.node.options.poll_interval.as_millis()).unwrap_or(500)
    }

    /// `untracked`: admitted at once as an exchange, so without a `held` entry in Redis.
    fn grant(&self, g: &Granted, kind: SlotKind, queued_ms: u64, untracked: bool) -> Grant {
        let settings = self.settings();
        if kind == SlotKind::Exchange {
            let untracked = untracked.then(|| Untracked {
                granted_at: g.server_now,
                cap: g.request_deadline.saturating_add(crate::EXCHANGE_GRACE_MS),
            });
            // The first renewal is due one interval from now, not at once.
            let now = self.mono();
            if self.renew_at.load(Ordering::Acquire) < now {
                self.renew_at
                    .store(now.saturating_add(self.renew_every()), Ordering::Release);
            }
            let (tx, _) = watch::channel(false);
            let first = {
                let mut holds = self.holds.lock();
                let first = holds.is_empty();
                holds.insert(
                    g.slot.0,
                    Hold {
                        confirmed_until: g.confirmed_until(),
                        lost: tx,
                        untracked,
                        in_redis: g.slot.0,
                    },
                );
                first
            };
            // A ticker that renews holds already has this one's renewal scheduled; one with
            // none may be asleep until woken.
            if first {
                self.nudge();
            }
        }
        Grant {
            slot_id: g.slot,
            lease_deadline: g.lease_deadline,
            request_deadline: g.request_deadline,
            term_ms: settings.lease_term_ms,
            renew_interval_ms: settings.renew_interval_ms,
            headers: GateHeaders {
                remaining_slots: g.remaining,
                effective_limit: g.effective,
                rpm_remaining: g.rpm_remaining,
                queued_ms,
            },
        }
    }

    fn headers(reply: &Reply, from: usize, queued_ms: u64) -> Result<GateHeaders, CallError> {
        Ok(GateHeaders {
            remaining_slots: reply.u32(from)?,
            effective_limit: reply.u32(from + 1)?,
            rpm_remaining: u32::try_from(reply.int(from + 2)?).ok(),
            queued_ms,
        })
    }

    /// Frees `slot` in Redis (no learning), e.g. for a grant nobody is left to take. A grant
    /// it makes to a waiter of this node is collected by the ticker (not here: this is how
    /// [`Shared::deliver`] frees orphans).
    async fn free(&self, slot: SlotId) {
        if let Err(e) = self.call_op(Op::Release, Self::free_args(slot)).await {
            self.release_later(slot, &e);
        }
    }

    /// A release of `slot` that neither learns nor collects grants for waiters.
    fn free_args(slot: SlotId) -> Vec<String> {
        vec![
            slot.to_string(),
            "0".to_owned(),
            "0".to_owned(),
            "0".to_owned(),
            // As tracked: an orphaned grant (a waiter's) and an adopted slot are; an exchange
            // admitted at once whose caller left before the reply is not, and then the read and
            // delete of its absent `held` entry are no-ops (it frees the lease all the same).
            String::new(),
        ]
    }

    /// A release of `slot` failed with `e`: it is made again from the ticker until Redis
    /// confirms it, or until the slot's lease has surely ended (its last renewal was before
    /// this release, so within one lease term from now). Not when the gate stopped (its ticker
    /// is gone with it) or the reply was unreadable (the release ran).
    fn release_later(&self, slot: SlotId, e: &CallError) {
        if matches!(e, CallError::Stopped | CallError::Reply(_)) {
            tracing::warn!(pool = %self.pool, slot = %slot, error = %e, "release not confirmed in redis; the lease will expire");
            return;
        }
        tracing::warn!(pool = %self.pool, slot = %slot, error = %e, "release not confirmed in redis; trying again until it answers");
        let until = self.mono().saturating_add(self.settings().lease_term_ms);
        self.unconfirmed.lock().insert(slot.0, until);
        self.nudge();
    }

    /// Makes the releases Redis did not confirm again, once they are due; drops those whose
    /// lease has ended meanwhile. The ms until the next try while any is left.
    async fn retry_releases(&self) -> Option<u64> {
        let now = self.mono();
        let slots: Vec<u128> = {
            let mut unconfirmed = self.unconfirmed.lock();
            unconfirmed.retain(|_, until| *until > now);
            if unconfirmed.is_empty() {
                return None;
            }
            let due = self.unconfirmed_at.load(Ordering::Acquire);
            if now < due {
                return Some(due - now);
            }
            unconfirmed.keys().copied().collect()
        };
        let calls = slots.iter().map(|&slot| async move {
            let confirmed = self
                .call_op(Op::Release, Self::free_args(SlotId(slot)))
                .await
                .is_ok();
            (slot, confirmed)
        });
        let results = futures_util::future::join_all(calls).await;
        let mut unconfirmed = self.unconfirmed.lock();
        for (slot, confirmed) in results {
            if confirmed {
                unconfirmed.remove(&slot);
            }
        }
        if unconfirmed.is_empty() {
            tracing::info!(pool = %self.pool, "releases redis had missed are confirmed");
            return None;
        }
        let retry = self.retry_redis_ms().max(MIN_TICK_MS);
        self.unconfirmed_at
            .store(self.mono().saturating_add(retry), Ordering::Release);
        Some(retry)
    }

    /// The waiter of `ticket` on this gate with its grant (`Ok(Some)`), or the grant kept for
    /// the caller whose acquire is still under way (`Ok(None)`), or the grant back (`Err`):
    /// one step under the waiters' lock, so the caller cannot park in between.
    #[allow(clippy::type_complexity)]
    fn park_or_take(
        &self,
        ticket: &str,
        g: Granted,
    ) -> Result<Option<(oneshot::Sender<Granted>, Granted)>, Granted> {
        let mut waiters = self.waiters.lock();
        if let Some(tx) = waiters.remove(ticket) {
            return Ok(Some((tx, g)));
        }
        let mut early = self.early.lock();
        match early.get_mut(&g.slot.0) {
            Some(slot @ None) => {
                *slot = Some(g);
                Ok(None)
            }
            _ => Err(g),
        }
    }

    /// Takes the waiter of `ticket` out of this gate, or out of another open gate of the same
    /// pool on this node (a pool reopened while the old gate still drains): grants are made
    /// per node, so any of its gates may collect one.
    fn take_waiter(&self, ticket: &str) -> Option<oneshot::Sender<Granted>> {
        if let Some(tx) = self.waiters.lock().remove(ticket) {
            return Some(tx);
        }
        let others: Vec<Arc<Shared>> = self
            .node
            .gates
            .lock()
            .get(&self.pool)
            .map(|gates| gates.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default();
        others
            .iter()
            .filter(|g| !std::ptr::eq(Arc::as_ptr(g), self))
            .find_map(|g| g.waiters.lock().remove(ticket))
    }

    /// Releases `slot` in one call that also reads what its outcome's learning needs (when
    /// there is one) and collects the grants it makes to this node's waiters; learns after,
    /// and writes the conclusion only if it changed. For outcomes that cannot stop admission.
    async fn release_then_learn(
        &self,
        slot: SlotId,
        outcome: Option<&Outcome>,
        untracked: Option<Untracked>,
    ) -> bool {
        let peek = if outcome.is_some() { "1" } else { "0" };
        let args = vec![
            slot.to_string(),
            "0".to_owned(),
            peek.to_owned(),
            "1".to_owned(),
            Untracked::granted_arg(untracked),
        ];
        let mono = self.mono();
        let reply = match self.call_op(Op::Release, args).await {
            Ok(reply) => reply,
            Err(e) => {
                self.release_later(slot, &e);
                return false;
            }
        };
        if let Err(e) = self.deliver(&reply, 5, mono, 1).await {
            tracing::warn!(pool = %self.pool, error = %e, "bad release reply");
        }
        let freed = reply.int(0).unwrap_or(0) == 1;
        let held = reply.int(2).unwrap_or(0) == 1;
        if let (Some(outcome), true, Ok(now), Ok(granted_at)) =
            (outcome, held, reply.u64(1), reply.u64(3))
        {
            self.note_server_now(now, mono);
            let bound = reply.int(4).unwrap_or(0) == 1;
            if let Some(wire) = self.learn_from(now, outcome, bound, granted_at) {
                self.store_learned(&wire).await;
            }
        }
        freed
    }

    /// Learns from an outcome that may stop admission (a throttle, a spent budget) before the
    /// slot is handed on: reads the slot first, then releases it with the conclusion.
    async fn learn_then_release(
        &self,
        slot: SlotId,
        outcome: &Outcome,
        untracked: Option<Untracked>,
    ) -> bool {
        let granted = Untracked::granted_arg(untracked);
        let mut extra = vec![
            slot.to_string(),
            "0".to_owned(),
            "0".to_owned(),
            "1".to_owned(),
            granted.clone(),
        ];
        let mono = self.mono();
        if let Ok(peek) = self
            .call(&self.node.scripts.peek, &[slot.to_string(), granted])
            .await
        {
            let held = peek.int(1).unwrap_or(0) == 1;
            if let (true, Ok(now), Ok(granted_at)) = (held, peek.u64(0), peek.u64(2)) {
                self.note_server_now(now, mono);
                let bound = peek.int(3).unwrap_or(0) == 1;
                if let Some(wire) = self.learn_from(now, outcome, bound, granted_at) {
                    extra[1] = "1".to_owned();
                    extra.extend(wire.args());
                }
            }
        }
        let mono = self.mono();
        match self.call_op(Op::Release, extra).await {
            Ok(reply) => {
                if let Err(e) = self.deliver(&reply, 5, mono, 1).await {
                    tracing::warn!(pool = %self.pool, error = %e, "bad release reply");
                }
                reply.int(0).unwrap_or(0) == 1
            }
            Err(e) => {
                self.release_later(slot, &e);
                false
            }
        }
    }

    /// Feeds the learner the outcome of a slot granted at `granted_at`; what to store, if the
    /// conclusion changed.
    fn learn_from(
        &self,
        now: u64,
        outcome: &Outcome,
        bound: bool,
        granted_at: u64,
    ) -> Option<Wire> {
        let mut learner = self.learner.lock();
        let adjustment = learner
            .gov
            .observe_external(now, outcome, bound, Some(granted_at));
        log_adjustment(&self.pool, adjustment.as_ref(), now);
        learner.conclusion_to_store(now, adjustment.is_some())
    }

    /// Hands collected grants to their waiters; a grant whose waiter is gone is freed.
    async fn deliver(
        &self,
        reply: &Reply,
        from: usize,
        mono: u64,
        now_at: usize,
    ) -> Result<(), CallError> {
        let server_now = reply.u64(now_at)?;
        let mut orphans = Vec::new();
        let mut i = from;
        while i + 1 < reply.len() {
            let ticket = reply.str(i)?;
            let g = Granted::parse(&reply.str(i + 1)?, server_now, mono)
                .ok_or(CallError::Reply("malformed grant"))?;
            let undelivered = match self.park_or_take(&ticket, g) {
                Ok(None) => None,
                Ok(Some((tx, g))) => tx.send(g).err(),
                Err(g) => match self.take_waiter(&ticket) {
                    Some(tx) => tx.send(g).err(),
                    None => Some(g),
                },
            };
            if let Some(g) = undelivered {
                orphans.push(g.slot);
            }
            i += 2;
        }
        for slot in orphans {
            self.free(slot).await;
        }
        Ok(())
    }

    /// One ticker round: collect this node's grants, renew its exchange slots, write decayed
    /// learning. Returns how long to sleep (`None`: until woken).
    async fn tick(&self) -> Option<u64> {
        let poll = u64::try_from(self.node.options.poll_interval.as_millis()).unwrap_or(500);
        let mut sleep: Option<u64> = None;
        let mut at_most = |ms: u64| sleep = Some(sleep.map_or(ms, |s: u64| s.min(ms)));

        if self.generation.lock().is_empty() && !self.on_own() {
            // Learn the pool's generation once at the start (a probe), so that if Redis loses
            // the pool's keys before this node's first admission, this node's first call after
            // that still counts as one from before (see `lua/prelude.lua`).
            let settings = self.settings();
            let probe = [
                settings.lease_term_ms.to_string(),
                crate::EXCHANGE_GRACE_MS.to_string(),
            ];
            let _ = self.call(&self.node.scripts.adopt, &probe).await;
        }

        let tickets: Vec<String> = self.waiters.lock().keys().cloned().collect();
        let due = self.poll_at.load(Ordering::Acquire);
        if !tickets.is_empty() && self.mono() < due {
            at_most(due.saturating_sub(self.mono()));
        } else if !tickets.is_empty() {
            let mono = self.mono();
            self.poll_at
                .store(mono.saturating_add(poll), Ordering::Release);
            if let Ok(reply) = self.call(&self.node.scripts.tick, &tickets).await {
                if let Ok(now) = reply.u64(0) {
                    self.note_server_now(now, mono);
                }
                if let Err(e) = self.deliver(&reply, 2, mono, 0).await {
                    tracing::warn!(pool = %self.pool, error = %e, "bad tick reply");
                }
                if let Ok(Some(next)) = reply.opt(1) {
                    at_most(next);
                    self.poll_at
                        .fetch_min(mono.saturating_add(next), Ordering::AcqRel);
                }
            }
            // The polling fallback (pub/sub is at most once), and the node's heartbeat.
            at_most(poll);
        }

        if self.needs_recovery() {
            // Fail open: try Redis again while anything admitted on this node's own is not
            // registered there yet.
            at_most(poll);
            if !self.on_own() {
                let _ = self.recover().await;
            }
        }

        let keeping = self.keeping.lock().active();
        if !self.holds.lock().is_empty() || !self.adopted.lock().is_empty() || keeping {
            let now = self.mono();
            let renew_due = now >= self.renew_at.load(Ordering::Acquire);
            let check_due = keeping && now >= self.check_at.load(Ordering::Acquire);
            if renew_due || check_due {
                self.free_idle().await;
                self.renew_holds(keeping).await;
                let now = self.mono();
                self.renew_at
                    .store(now.saturating_add(self.renew_every()), Ordering::Release);
                self.check_at
                    .store(now.saturating_add(poll), Ordering::Release);
                // A check that stopped keeping frees what is idle at once.
                self.free_idle().await;
            }
            self.fence_expired();
            let now = self.mono();
            let next_renew = self.renew_at.load(Ordering::Acquire).saturating_sub(now);
            at_most(next_renew);
            if self.keeping.lock().active() {
                at_most(self.check_at.load(Ordering::Acquire).saturating_sub(now));
            }
            if let Some(until) = self.holds.lock().values().map(|h| h.confirmed_until).min() {
                at_most(until.saturating_sub(now));
            }
        }

        if let Some(ms) = self.retry_releases().await {
            at_most(ms);
        }

        if sleep.is_some() {
            self.write_decay().await;
        }
        sleep.map(|s| s.max(MIN_TICK_MS))
    }

    /// Renews every exchange slot this node holds or keeps in one call; a slot Redis no longer
    /// has is lost (self-fencing). With `keeping`, the call is also the check of the pool's
    /// state that allows or stops keeping (see [`Keeping`]).
    async fn renew_holds(&self, keeping: bool) {
        // Each slot by its id in Redis, with its cap: an untracked hold's, or '' (Redis reads it
        // from `held`); an idle kept slot is renewed as if lent now.
        let mut slots: Vec<(u128, Option<Untracked>)> = self
            .holds
            .lock()
            .iter()
            .map(|(slot, h)| (*slot, h.untracked))
            .collect();
        slots.extend(self.adopted.lock().keys().map(|slot| (*slot, None)));
        let settings = self.settings();
        let server_now = self.server_now_estimate();
        let idle_cap = Untracked {
            granted_at: server_now,
            cap: server_now
                .saturating_add(settings.request_timeout_ms)
                .saturating_add(crate::EXCHANGE_GRACE_MS),
        };
        let (lent, reclaims, allowed) = {
            let mut k = self.keeping.lock();
            slots.extend(k.idle.iter().map(|kept| (kept.slot, Some(idle_cap))));
            (
                std::mem::take(&mut k.lent),
                k.reclaims,
                k.allowed || k.wanted,
            )
        };
        if slots.is_empty() && !keeping {
            return;
        }
        let in_redis: Vec<u128> = {
            let holds = self.holds.lock();
            slots
                .iter()
                .map(|(slot, _)| holds.get(slot).map_or(*slot, |h| h.in_redis))
                .collect()
        };
        let mut extra: Vec<String> = if keeping {
            // Keeping lasts three polls past this check unless the next check renews it.
            let keep_for = if allowed {
                self.poll_ms().saturating_mul(3)
            } else {
                0
            };
            vec![lent.to_string(), keep_for.to_string()]
        } else {
            vec![String::new(), String::new()]
        };
        extra.extend(
            slots
                .iter()
                .zip(&in_redis)
                .flat_map(|((_, untracked), slot)| {
                    [SlotId(*slot).to_string(), Untracked::cap_arg(*untracked)]
                }),
        );
        let mono = self.mono();
        let answer = match self.call(&self.node.scripts.renew, &extra).await {
            Ok(reply) => reply.u64(0).map(|now| (reply, now)),
            Err(e) => Err(e),
        };
        let Ok((reply, server_now)) = answer else {
            // Counted by the next check.
            self.keeping.lock().lent += lent;
            return;
        };
        self.note_server_now(server_now, mono);
        if keeping {
            let view = (|| {
                Ok::<_, CallError>((reply.u32(1)?, reply.u32(2)?, reply.u32(3)?, reply.int(4)?))
            })();
            let mut k = self.keeping.lock();
            k.wanted = false;
            match view {
                Ok((queued, remaining, effective, blocked)) => {
                    k.remaining = remaining;
                    k.effective = effective;
                    // A node that holds nothing any more stops keeping (and checking): its
                    // next admission asks for a check again.
                    let busy = !slots.is_empty() || lent > 0;
                    k.allowed = busy
                        && queued == 0
                        && blocked == 0
                        && Keeping::roomy(remaining, effective)
                        && k.reclaims == reclaims
                        && !self.closed.load(Ordering::Acquire);
                }
                Err(_) => k.allowed = false,
            }
        }
        let mut holds = self.holds.lock();
        let mut adopted = self.adopted.lock();
        let mut kept = self.keeping.lock();
        for (i, (slot, _)) in slots.iter().enumerate() {
            let status = reply.int(5 + 2 * i).unwrap_or(0);
            let deadline = reply.u64(6 + 2 * i).unwrap_or(0);
            let until = mono.saturating_add(deadline.saturating_sub(server_now));
            if let Some(idle) = kept.idle.iter_mut().find(|idle| idle.slot == *slot) {
                idle.confirmed_until = if status == 0 { 0 } else { until };
            } else if adopted.contains_key(slot) {
                // Nothing to fence: the call runs on the node's own share either way (a lost
                // registration is made again, see `needs_recovery`).
                if status == 0 {
                    adopted.remove(slot);
                } else {
                    adopted.insert(*slot, until);
                }
            } else if status == 0 {
                if let Some(h) = holds.remove(slot) {
                    tracing::warn!(pool = %self.pool, slot = %SlotId(*slot), "lease lost in redis; the holder is told to stop");
                    h.lost.send_replace(true);
                }
            } else if let Some(h) = holds.get_mut(slot) {
                h.confirmed_until = until;
            }
        }
    }

    /// Holds whose lease could not be confirmed in time are lost: Redis may have reclaimed them.
    fn fence_expired(&self) {
        let now = self.mono();
        self.holds.lock().retain(|slot, h| {
            if h.confirmed_until > now {
                return true;
            }
            tracing::warn!(pool = %self.pool, slot = %SlotId(*slot), "lease could not be confirmed before its deadline; the holder is told to stop");
            h.lost.send_replace(true);
            false
        });
    }

    /// How long a kept slot's lease must still be confirmed for to be kept or lent: the ticker
    /// renews it well before then.
    fn keep_margin(settings: &PoolSettings) -> u64 {
        settings.lease_term_ms / 2
    }

    /// An admission through Redis showed the pool's state: with room to spare and keeping not
    /// allowed yet, an exchange's admission asks for a check (it allows keeping); without room,
    /// keeping stops. A lock lease's admission never asks: only exchange slots are kept, and a
    /// node admitting nothing else would hold none, so its check would stop keeping again at
    /// once, and every lock grant would cost one more script call (bench/RESULTS.md).
    fn saw_admission(&self, g: &Granted, kind: SlotKind) {
        let roomy = g.rpm_remaining.is_none() && Keeping::roomy(g.remaining, g.effective);
        let check = {
            let mut k = self.keeping.lock();
            k.remaining = g.remaining;
            k.effective = g.effective;
            if !roomy {
                k.allowed = false;
                !k.idle.is_empty()
            } else if kind == SlotKind::Exchange && !k.allowed && !k.wanted {
                k.wanted = true;
                true
            } else {
                false
            }
        };
        if check {
            self.check_at.store(0, Ordering::Release);
            self.nudge();
        }
    }

    /// An acquire was queued or refused: keeping stops, and what is kept idle goes back.
    fn saw_shortage(&self) {
        let idle = {
            let mut k = self.keeping.lock();
            k.allowed = false;
            !k.idle.is_empty()
        };
        if idle {
            self.check_at.store(0, Ordering::Release);
            self.nudge();
        }
    }

    /// Keeps the slot of `hold`, whose exchange ended, for this node's next exchange, if it
    /// may (see [`Keeping`]); false: it is to be released in Redis.
    fn keep(&self, hold: &Hold) -> bool {
        if hold.untracked.is_none()
            || self.closed.load(Ordering::Acquire)
            || self.on_own()
            || self.recovering()
            || self.needs_recovery()
            || !self.waiters.lock().is_empty()
        {
            return false;
        }
        let now = self.mono();
        if hold.confirmed_until <= now.saturating_add(Self::keep_margin(&self.settings())) {
            return false;
        }
        let mut k = self.keeping.lock();
        // At most a quarter of the pool idle on one node (a slot short elsewhere reclaims them
        // anyway). An eighth was measured too small: at 64 concurrent calls on a pool of 256,
        // a quarter of the calls still went through Redis.
        let most = usize::try_from((k.effective / 4).max(1)).unwrap_or(1);
        if !k.allowed || k.idle.len() >= most {
            return false;
        }
        k.idle.push(Kept {
            slot: hold.in_redis,
            confirmed_until: hold.confirmed_until,
            idle_since: now,
        });
        true
    }

    /// Lends an idle kept slot to an exchange, without a call to Redis, if keeping allows.
    fn lend(&self) -> Option<Grant> {
        if !self.waiters.lock().is_empty() {
            return None;
        }
        let now = self.mono();
        let settings = self.settings();
        let margin = now.saturating_add(Self::keep_margin(&settings));
        let (kept, remaining, effective) = {
            let mut k = self.keeping.lock();
            if !k.allowed {
                return None;
            }
            let i = k
                .idle
                .iter()
                .rposition(|kept| kept.confirmed_until > margin)?;
            k.lent += 1;
            (k.idle.swap_remove(i), k.remaining, k.effective)
        };
        let server_now = self.server_now_estimate();
        let request_deadline = server_now.saturating_add(settings.request_timeout_ms);
        let slot = SlotId::random();
        let (lost, _) = watch::channel(false);
        self.holds.lock().insert(
            slot.0,
            Hold {
                confirmed_until: kept.confirmed_until,
                lost,
                untracked: Some(Untracked {
                    granted_at: server_now,
                    cap: request_deadline.saturating_add(crate::EXCHANGE_GRACE_MS),
                }),
                in_redis: kept.slot,
            },
        );
        Some(Grant {
            slot_id: slot,
            lease_deadline: server_now.saturating_add(kept.confirmed_until.saturating_sub(now)),
            request_deadline,
            term_ms: settings.lease_term_ms,
            renew_interval_ms: settings.renew_interval_ms,
            headers: GateHeaders {
                remaining_slots: remaining,
                effective_limit: effective,
                rpm_remaining: None,
                queued_ms: 0,
            },
        })
    }

    /// Learns from the outcome of an exchange whose slot was kept (the pool had room to spare,
    /// so the limit did not bind), and stores the conclusion if it changed.
    async fn learn_kept(&self, outcome: &Outcome, granted_at: u64) {
        let now = self.server_now_estimate();
        if let Some(wire) = self.learn_from(now, outcome, false, granted_at) {
            self.store_learned(&wire).await;
        }
    }

    /// Stores what this node's learner concluded, for every node's scripts (`apply_learned`).
    async fn store_learned(&self, wire: &Wire) {
        let mut extra = vec!["1".to_owned()];
        extra.extend(wire.args());
        let _ = self.call(&self.node.scripts.learn, &extra).await;
    }

    /// Frees the idle kept slots that waited a poll interval, or whose lease runs short, or all
    /// of them when keeping is not allowed.
    async fn free_idle(&self) {
        let now = self.mono();
        let poll = self.poll_ms();
        let margin = now.saturating_add(Self::keep_margin(&self.settings()));
        let freed: Vec<u128> = {
            let mut k = self.keeping.lock();
            let all = !k.allowed || self.closed.load(Ordering::Acquire);
            let mut freed = Vec::new();
            k.idle.retain(|kept| {
                let stays = !all
                    && now.saturating_sub(kept.idle_since) < poll
                    && kept.confirmed_until > margin;
                if !stays {
                    freed.push(kept.slot);
                }
                stays
            });
            freed
        };
        futures_util::future::join_all(freed.into_iter().map(|slot| self.free(SlotId(slot)))).await;
    }

    /// A slot is short somewhere (see `reclaim_kept` in `lua/prelude.lua`): keeping stops and
    /// every idle kept slot is freed now.
    pub(crate) fn reclaim(self: &Arc<Self>) {
        let idle = {
            let mut k = self.keeping.lock();
            k.allowed = false;
            k.reclaims += 1;
            std::mem::take(&mut k.idle)
        };
        if idle.is_empty() {
            return;
        }
        let shared = Arc::clone(self);
        self.node.runtime.spawn(async move {
            let frees = idle.iter().map(|kept| shared.free(SlotId(kept.slot)));
            futures_util::future::join_all(frees).await;
        });
    }

    /// Stores what the learner concluded, if it changed (decay moves it without any outcome).
    async fn write_decay(&self) {
        let wire = {
            let mut learner = self.learner.lock();
            if learner.written.is_none() {
                return;
            }
            learner.conclusion_to_store(self.server_now_estimate(), false)
        };
        if let Some(wire) = wire {
            self.store_learned(&wire).await;
        }
    }
}

/// Sleeps until the next round is due or the gate is woken; holds the gate only while it works.
async fn run_ticker(gate: Weak<Shared>, signal: Arc<Notify>, clock: Arc<dyn crate::Clock>) {
    loop {
        let next = match gate.upgrade() {
            Some(shared) if !shared.closed.load(Ordering::Acquire) => shared.tick().await,
            _ => return,
        };
        let woken = signal.notified();
        match next {
            Some(ms) => {
                let at = clock.monotonic_ms().saturating_add(ms);
                tokio::select! {
                    () = woken => {}
                    () = clock.sleep_until_monotonic(at) => {}
                }
            }
            None => woken.await,
        }
    }
}

/// Leaves the shared queue if the acquire future is dropped while parked; frees the grant if
/// one raced in. Disarmed once the outcome has been handed to the caller.
type CallFuture = Pin<Box<dyn Future<Output = Result<Reply, CallError>> + Send>>;

/// The acquire script's call while it is in flight. If the caller goes away meanwhile (a client
/// that disconnects drops its acquire), the script may still run in Redis and admit or queue
/// it: the call is then finished in the background and undone (the slot freed, the ticket
/// cancelled), instead of leaving a slot nobody holds taken for a whole lease term.
struct PendingAcquire {
    call: Option<CallFuture>,
    shared: Arc<Shared>,
    slot: SlotId,
}

impl Future for PendingAcquire {
    type Output = Result<Reply, CallError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(call) = self.call.as_mut() else {
            return Poll::Ready(Err(CallError::Reply("acquire polled after it finished")));
        };
        let out = ready!(call.as_mut().poll(cx));
        self.call = None;
        Poll::Ready(out)
    }
}

impl Drop for PendingAcquire {
    fn drop(&mut self) {
        let Some(call) = self.call.take() else {
            return;
        };
        // On the node's runtime, which outlives a connection thread's (see `ensure_ticker`).
        let runtime = self.shared.node.runtime.clone();
        let (shared, slot) = (Arc::clone(&self.shared), self.slot);
        runtime.spawn(async move {
            let Ok(reply) = call.await else {
                return;
            };
            match reply.str(0).as_deref() {
                Ok("admitted") => shared.free(slot).await,
                Ok("queued") => {
                    if let Ok(ticket) = reply.str(2) {
                        let extra = [ticket, "1".to_owned()];
                        let _ = shared.call(&shared.node.scripts.cancel, &extra).await;
                    }
                }
                _ => {}
            }
        });
    }
}

/// Forgets an acquire's entry in `early` when the acquire ends; a grant parked there that no
/// caller took (the acquire was dropped) is freed.
struct EarlyGuard {
    shared: Arc<Shared>,
    slot: SlotId,
}

impl Drop for EarlyGuard {
    fn drop(&mut self) {
        let Some(g) = self.shared.early.lock().remove(&self.slot.0).flatten() else {
            return;
        };
        // On the node's runtime, which outlives a connection thread's (see `ensure_ticker`).
        let runtime = self.shared.node.runtime.clone();
        let shared = Arc::clone(&self.shared);
        runtime.spawn(async move { shared.free(g.slot).await });
    }
}

struct QueueGuard {
    shared: Arc<Shared>,
    ticket: String,
    rx: oneshot::Receiver<Granted>,
    armed: bool,
}

impl Drop for QueueGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let sender = self.shared.waiters.lock().remove(&self.ticket);
        // No sender left: the ticker delivered the grant into our channel (or the pool closed).
        let delivered = if sender.is_none() {
            self.rx.try_recv().ok()
        } else {
            None
        };
        // On the node's runtime, which outlives a connection thread's (see `ensure_ticker`).
        let runtime = self.shared.node.runtime.clone();
        let shared = Arc::clone(&self.shared);
        let ticket = std::mem::take(&mut self.ticket);
        runtime.spawn(async move {
            match delivered {
                Some(g) => shared.free(g.slot).await,
                None => {
                    let extra = [ticket, "1".to_owned()];
                    let _ = shared.call(&shared.node.scripts.cancel, &extra).await;
                }
            }
        });
    }
}

impl RedisGate {
    /// Fail open, just back on Redis (see [`Shared::recover`]): a slot of this node's share
    /// first, then the shared one. The share's slot is carried by the shared slot until it
    /// ends, as for a hold that was running when Redis went away.
    async fn acquire_within_share(&self, req: AcquireRequest) -> Result<Grant, Refusal> {
        let s = &self.shared;
        let Some(gate) = s.fallback_gate() else {
            return self.acquire_shared(req).await;
        };
        let start = s.mono();
        // The hold is a period, not a cap for good: a caller waiting for the share when it
        // ends goes on to Redis alone.
        let hold_left = s
            .recover_until
            .load(Ordering::Acquire)
            .saturating_sub(start);
        let within = AcquireRequest {
            wait_ms: req.wait_ms.min(hold_left),
            ..req.clone()
        };
        let local = gate.acquire(within).await;
        let waited = s.mono().saturating_sub(start);
        let rest = AcquireRequest {
            wait_ms: req.wait_ms.saturating_sub(waited),
            ..req
        };
        let local = match local {
            Ok(local) => local,
            Err(refusal) if s.recovering() => return Err(refusal),
            Err(_) => return self.acquire_shared(rest).await,
        };
        let answer = self.acquire_shared(rest).await;
        match &answer {
            // Admitted through Redis: its slot carries the share's.
            Ok(grant) if !s.local_slots.lock().contains(&grant.slot_id.0) => {
                s.carried.lock().insert(grant.slot_id.0, local.slot_id);
            }
            // Refused, or Redis went away again and the share admitted it a second time.
            _ => {
                gate.release(local.slot_id, None).await;
            }
        }
        answer
    }

    /// Admission through Redis (or, when it does not answer, on this node's own).
    async fn acquire_shared(&self, req: AcquireRequest) -> Result<Grant, Refusal> {
        let s = &self.shared;
        let settings = s.settings();
        let slot = SlotId::random();
        let start = s.mono();
        let args = vec![
            slot.to_string(),
            req.fairness_key.to_string(),
            class(req.priority).to_string(),
            // Both kinds are leased for one term: a lock holder renews its own lease, and this
            // node renews its exchanges' (so a dead node's slots come back within one term).
            settings.lease_term_ms.to_string(),
            u8::from(req.wait_ms > 0).to_string(),
            req.wait_ms.to_string(),
            GRACE_MS.to_string(),
            match req.kind {
                SlotKind::Exchange => crate::EXCHANGE_GRACE_MS,
                SlotKind::Lease => 0,
            }
            .to_string(),
            // An exchange admitted at once is untracked (this node keeps its grant time and
            // cap, see `Hold`); a lock lease is renewed and released by any node.
            u8::from(req.kind == SlotKind::Exchange).to_string(),
        ];
        s.early.lock().insert(slot.0, None);
        let _early = EarlyGuard {
            shared: Arc::clone(s),
            slot,
        };
        let call = {
            let shared = Arc::clone(s);
            Box::pin(async move { shared.call_op(Op::Acquire, args).await })
        };
        let pending = PendingAcquire {
            call: Some(call),
            shared: Arc::clone(s),
            slot,
        };
        let reply = match pending.await {
            Ok(reply) => reply,
            Err(e) => return s.unavailable(&e, req).await,
        };
        let head = reply.str(0).and_then(|answer| Ok((answer, reply.u64(1)?)));
        let (answer, server_now) = match head {
            Ok(head) => head,
            Err(e) => return s.unavailable(&e, req).await,
        };
        s.note_server_now(server_now, start);
        if answer != "admitted" {
            s.saw_shortage();
        }
        let kind = req.kind;
        let ticket = match answer.as_str() {
            "admitted" => {
                return match Granted::admitted(&reply, slot, server_now, start) {
                    Ok(g) => {
                        s.saw_admission(&g, kind);
                        Ok(s.grant(&g, kind, 0, true))
                    }
                    Err(e) => s.unavailable(&e, req).await,
                }
            }
            "refused" => {
                let refusal = (|| {
                    Ok::<_, CallError>(Refusal::TooManyRequests {
                        reason: reason(&reply.str(2)?),
                        retry_after_ms: reply.opt(3)?,
                        headers: Shared::headers(&reply, 4, 0)?,
                    })
                })();
                return match refusal {
                    Ok(refusal) => Err(refusal),
                    Err(e) => s.unavailable(&e, req).await,
                };
            }
            "queued" => match reply.str(2) {
                Ok(ticket) => ticket,
                Err(e) => return s.unavailable(&e, req).await,
            },
            _ => {
                let e = CallError::Reply("unknown acquire answer");
                return s.unavailable(&e, req).await;
            }
        };

        let (tx, rx) = oneshot::channel();
        let first_waiter = {
            let mut waiters = s.waiters.lock();
            let early = s.early.lock().remove(&slot.0).flatten();
            if let Some(g) = early {
                // Granted by a call of this node before we could park: no wait.
                let queued_ms = s.mono().saturating_sub(start);
                drop(waiters);
                return Ok(s.grant(&g, kind, queued_ms, false));
            }
            // `close` marks the gate closed before it drops the parked senders under this
            // lock: a waiter queued in Redis just before the close must not park after it (it
            // would wait its whole budget). Not parked, its sender is dropped here, so it is
            // refused `PoolClosed` below and its guard leaves the queue.
            let first_waiter = waiters.is_empty();
            if !s.closed.load(Ordering::Acquire) {
                waiters.insert(ticket.clone(), tx);
            }
            first_waiter
        };
        // The ticker collects this node's grants: when woken by a grant's wake-up, at the
        // script's next wake-up time, and at least every poll interval while anyone waits.
        let poll = reply.opt(3).ok().flatten().unwrap_or(u64::MAX);
        s.collect_by(s.mono().saturating_add(poll.min(s.poll_ms())), first_waiter);
        s.nudge();
        let mut guard = QueueGuard {
            shared: Arc::clone(s),
            ticket: ticket.clone(),
            rx,
            armed: true,
        };
        let deadline = start.saturating_add(req.wait_ms);
        let mut closing = s.closing.subscribe();
        let received = tokio::select! {
            biased;
            received = &mut guard.rx => Some(received),
            // Closed: refused like a waiter whose sender `close` dropped; the armed guard leaves
            // the queue (and frees a grant that raced in).
            _ = closing.wait_for(|closed| *closed) => return Err(Refusal::PoolClosed),
            () = s.node.clock.sleep_until_monotonic(deadline) => None,
        };
        let granted = match received {
            Some(Ok(g)) => g,
            // The sender was dropped without a grant: only `close` does that. The armed guard
            // leaves the queue in Redis on the way out.
            Some(Err(_)) => return Err(Refusal::PoolClosed),
            None => {
                let queued_ms = s.mono().saturating_sub(start);
                let sender = s.waiters.lock().remove(&ticket);
                if sender.is_none() {
                    // Delivered just now (grants are handed over under that lock): take it.
                    match guard.rx.try_recv() {
                        Ok(g) => g,
                        Err(_) => return Err(Refusal::PoolClosed),
                    }
                } else {
                    let extra = [ticket.clone(), "0".to_owned()];
                    let reply = match s.call(&s.node.scripts.cancel, &extra).await {
                        Ok(reply) => reply,
                        Err(_) => {
                            // The entry is forgotten in Redis after its grace; a grant that
                            // reaches it meanwhile expires with its lease.
                            guard.armed = false;
                            return Err(Refusal::CoordinationUnavailable {
                                retry_after_ms: s.retry_redis_ms(),
                            });
                        }
                    };
                    let answer = reply.str(0).unwrap_or_default();
                    if answer == "granted" {
                        let mono = s.mono();
                        let server_now = s.server_now_estimate();
                        match reply
                            .str(1)
                            .ok()
                            .and_then(|g| Granted::parse(&g, server_now, mono))
                        {
                            Some(g) => g,
                            None => {
                                guard.armed = false;
                                return Err(Refusal::CoordinationUnavailable {
                                    retry_after_ms: s.retry_redis_ms(),
                                });
                            }
                        }
                    } else {
                        guard.armed = false;
                        let headers =
                            Shared::headers(&reply, 1, queued_ms).unwrap_or(GateHeaders {
                                remaining_slots: 0,
                                effective_limit: settings.limit,
                                rpm_remaining: None,
                                queued_ms,
                            });
                        return Err(Refusal::QueueTimeout { headers });
                    }
                }
            }
        };
        guard.armed = false;
        let queued_ms = s.mono().saturating_sub(start);
        Ok(s.grant(&granted, kind, queued_ms, false))
    }
}

#[async_trait::async_trait]
impl PoolGate for RedisGate {
    async fn acquire(&self, req: AcquireRequest) -> Result<Grant, Refusal> {
        let s = &self.shared;
        if s.closed.load(Ordering::Acquire) {
            return Err(Refusal::PoolClosed);
        }
        s.ensure_ticker();
        if s.on_own() {
            if let Some(gate) = s.fallback_gate() {
                return s.acquire_on_own(&gate, req).await;
            }
        }
        if s.needs_recovery() {
            if let Err(e) = s.recover().await {
                return s.unavailable(&e, req).await;
            }
        }
        if s.recovering() {
            return self.acquire_within_share(req).await;
        }
        if req.kind == SlotKind::Exchange {
            if let Some(grant) = s.lend() {
                return Ok(grant);
            }
        }
        self.acquire_shared(req).await
    }

    async fn renew(&self, slot: SlotId) -> Result<u64, RenewError> {
        let s = &self.shared;
        if s.local_slots.lock().contains(&slot.0) {
            if let Some(gate) = s.fallback_gate() {
                return gate.renew(slot).await;
            }
        }
        let mono = s.mono();
        // A lease Redis cannot confirm is reported lost: the holder must stop rather than
        // assume it still holds a slot someone else may have been granted.
        let reply = s
            .call(
                &s.node.scripts.renew,
                &[
                    String::new(),
                    String::new(),
                    slot.to_string(),
                    String::new(),
                ],
            )
            .await
            .map_err(|_| RenewError::NotFound)?;
        let server_now = reply.u64(0).map_err(|_| RenewError::NotFound)?;
        s.note_server_now(server_now, mono);
        let deadline = reply.u64(6).map_err(|_| RenewError::NotFound)?;
        match reply.int(5) {
            Ok(1) => {
                if let Some(h) = s.holds.lock().get_mut(&slot.0) {
                    h.confirmed_until = mono.saturating_add(deadline.saturating_sub(server_now));
                }
                Ok(deadline)
            }
            Ok(2) => Err(RenewError::Capped),
            _ => Err(RenewError::NotFound),
        }
    }

    async fn release(&self, slot: SlotId, outcome: Option<Outcome>) -> bool {
        let s = &self.shared;
        if s.local_slots.lock().remove(&slot.0) {
            if s.adopted.lock().remove(&slot.0).is_some() {
                s.free(slot).await;
            }
            if let Some(gate) = s.fallback_gate() {
                return gate.release(slot, outcome).await;
            }
        }
        let hold = s.holds.lock().remove(&slot.0);
        s.uncarry(slot.0).await;
        let outcome = outcome.filter(|_| s.settings().adaptive);
        let stops = outcome.as_ref().is_some_and(may_stop_admission);
        if stops {
            // Learned before anything more is admitted here: keeping stops (the learning's
            // write reclaims what any node keeps).
            s.saw_shortage();
        } else if let Some(h) = hold.as_ref().filter(|h| s.keep(h)) {
            if let (Some(outcome), Some(u)) = (outcome.as_ref(), h.untracked) {
                s.learn_kept(outcome, u.granted_at).await;
            }
            return true;
        }
        let (slot, untracked) = hold.map_or((slot, None), |h| (SlotId(h.in_redis), h.untracked));
        match outcome {
            Some(outcome) if stops => s.learn_then_release(slot, &outcome, untracked).await,
            _ => {
                s.release_then_learn(slot, outcome.as_ref(), untracked)
                    .await
            }
        }
    }

    async fn report(&self, outcome: Outcome) {
        let s = &self.shared;
        if !s.settings().adaptive {
            return;
        }
        let mono = s.mono();
        let Ok(ctx) = s.call(&s.node.scripts.learn, &["0".to_owned()]).await else {
            return;
        };
        let (Ok(now), bound) = (ctx.u64(0), ctx.int(1).unwrap_or(0) == 1) else {
            return;
        };
        s.note_server_now(now, mono);
        let wire = {
            let mut learner = s.learner.lock();
            let adjustment = learner.gov.observe_external(now, &outcome, bound, None);
            log_adjustment(&s.pool, adjustment.as_ref(), now);
            learner.conclusion_to_store(now, adjustment.is_some())
        };
        if let Some(wire) = wire {
            s.store_learned(&wire).await;
        }
    }

    async fn reconfigure(&self, settings: PoolSettings) {
        let s = &self.shared;
        // What is kept was kept under the old settings.
        s.reclaim();
        *s.settings.lock() = settings.clone();
        s.learner
            .lock()
            .gov
            .reconfigure(settings.clone(), s.server_now_estimate());
        let fallback = s.fallback.lock().clone();
        if let (Some(gate), Some(expected)) = (fallback, s.fail_open()) {
            gate.reconfigure(share(&settings, expected)).await;
        }
        // Any call settles the pool: a higher limit admits waiters at once.
        let mono = s.mono();
        if let Ok(reply) = s.call(&s.node.scripts.tick, &[]).await {
            // Grants it makes to this node's waiters come back with it.
            if let Err(e) = s.deliver(&reply, 2, mono, 0).await {
                tracing::warn!(pool = %s.pool, error = %e, "bad tick reply");
            }
        }
        s.wake();
    }

    async fn snapshot(&self) -> Snapshot {
        let s = &self.shared;
        let settings = s.settings();
        let reply = match s.call(&s.node.scripts.snapshot, &[]).await {
            Ok(reply) => reply,
            Err(_) => {
                let fallback = s.fallback.lock().clone();
                return match fallback {
                    Some(gate) => gate.snapshot().await,
                    None => Snapshot {
                        configured_limit: settings.limit,
                        effective_limit: settings.limit,
                        ..Snapshot::default()
                    },
                };
            }
        };
        let read = || -> Result<Snapshot, CallError> {
            let (high, normal, low) = (reply.u32(2)?, reply.u32(3)?, reply.u32(4)?);
            let cause = reply.str(12)?;
            // This node's idle kept slots are leased in Redis but run nothing (another node's
            // show until it frees them, within a poll interval of their last use).
            let idle = u32::try_from(s.keeping.lock().idle.len()).unwrap_or(u32::MAX);
            Ok(Snapshot {
                in_flight: reply.u32(1)?.saturating_sub(idle),
                queued: high.saturating_add(normal).saturating_add(low),
                queued_high: high,
                queued_normal: normal,
                queued_low: low,
                effective_limit: reply.u32(5)?,
                configured_limit: settings.limit,
                learned_limit: reply.opt(6)?.and_then(|v| u32::try_from(v).ok()),
                learned_rpm: reply.opt(7)?.and_then(|v| u32::try_from(v).ok()),
                rpm_remaining: reply.opt(8)?.and_then(|v| u32::try_from(v).ok()),
                paused_until: reply.opt(9)?,
                paced_until: reply.opt(10)?,
                last_throttle: reply.opt(11)?.map(|at| Throttle { at, cause }),
                admitted_total: reply.u64(13)?,
                refused_total: reply.u64(14)?,
            })
        };
        read().unwrap_or_else(|e| {
            tracing::warn!(pool = %s.pool, error = %e, "bad snapshot reply");
            Snapshot {
                configured_limit: settings.limit,
                ..Snapshot::default()
            }
        })
    }

    async fn close(&self) {
        let s = &self.shared;
        s.closed.store(true, Ordering::Release);
        s.closing.send_replace(true);
        // Dropping the senders wakes each waiter with `PoolClosed`; their guards leave the
        // queue in Redis.
        s.waiters.lock().clear();
        s.free_idle().await;
        let fallback = s.fallback.lock().clone();
        if let Some(gate) = fallback {
            gate.close().await;
        }
        {
            let mut gates = s.node.gates.lock();
            if let Some(list) = gates.get_mut(&s.pool) {
                list.retain(|g| g.strong_count() > 0 && !std::ptr::eq(g.as_ptr(), Arc::as_ptr(s)));
                if list.is_empty() {
                    gates.remove(&s.pool);
                }
            }
        }
        s.wake();
        tracing::debug!(pool = %s.pool, "redis pool gate closed");
    }

    fn lease_watch(&self, slot: SlotId) -> Option<LeaseWatch> {
        self.shared
            .holds
            .lock()
            .get(&slot.0)
            .map(|h| LeaseWatch::new(h.lost.subscribe()))
    }
}

/// Whether learning from `outcome` may pause or slow admission (a throttle, a spent announced
/// budget): such an outcome is learned before its slot is handed on.
fn may_stop_admission(outcome: &Outcome) -> bool {
    outcome.throttled > 0
        || matches!(outcome.status, Some(429 | 503))
        || outcome.retry_after_ms.is_some()
        || outcome
            .rate
            .as_ref()
            .is_some_and(|r| r.remaining == Some(0) || r.token_remaining == Some(0))
}

/// One line per change of what this node learned (the governor filters repeats and jitter).
fn log_adjustment(pool: &str, adjustment: Option<&nthbouncer_governor::Adjustment>, now: u64) {
    let Some(a) = adjustment else {
        return;
    };
    tracing::info!(
        pool = %pool,
        effective_limit = a.effective_limit,
        learned_limit = ?a.learned_limit,
        learned_rpm = ?a.learned_rpm,
        pause_ms = a.paused_until.map_or(0, |until| until.saturating_sub(now)),
        "adaptive (shared through redis): {}",
        a.what
    );
}
