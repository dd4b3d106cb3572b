//! The single-node implementation of the coordination seam: every pool's state lives in this
//! process.
//!
//! Owns the async shell around one [`Governor`] per pool: the lock, the hand-off of grants to
//! parked callers, wait budgets, and a background ticker per pool that reclaims expired leases
//! and admits waiters when a pause or the RPM window ends. The admission *rules* are the
//! governor's; this module must not re-decide them, and it must not know about HTTP.
//!
//! Architecture invariants:
//! - no lock is shared across pools: each gate has its own `parking_lot::Mutex`, never held
//!   across an `.await`;
//! - a grant is handed to its waiter under the gate's lock, so "cancel returned false" always
//!   means the grant is already in the waiter's channel (or the pool closed);
//! - no slot leaks: a waiter that gives up (timeout or dropped future) either leaves the queue
//!   or releases the grant that raced in;
//! - all time comes from the injected [`Clock`], so tests drive it with a `ManualClock`;
//! - the governor runs on the clock's *monotonic* reading, so a wall-clock step reclaims no
//!   lease and stretches no pause; epoch ms appear only in what the gate hands out (a grant's
//!   deadlines, a renewed lease, the snapshot), converted at the moment they are handed out.

// foldhash for the waiters by (random) slot id, as the governor's own maps.
use foldhash::{HashMap, HashMapExt};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use nthbouncer_governor::{Adjustment, Admitted, Governor, Ticket, TryAcquire};
use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};

use crate::clock::monotonic_to_epoch;
use crate::{
    AcquireRequest, Clock, Coordination, GateHeaders, Grant, Outcome, PoolGate, PoolSettings,
    Refusal, RenewError, SlotId, SlotKind, Snapshot, SystemClock,
};

/// Both readings of one moment: `mono` for the governor, `epoch` for what is shown.
#[derive(Clone, Copy, Debug)]
struct Now {
    mono: u64,
    epoch: u64,
}

impl Now {
    fn read(clock: &dyn Clock) -> Now {
        Now {
            mono: clock.monotonic_ms(),
            epoch: clock.now_ms(),
        }
    }

    /// Monotonic instant `t` as epoch ms.
    fn epoch_of(self, t: u64) -> u64 {
        monotonic_to_epoch(t, self.mono, self.epoch)
    }

    /// A grant with its deadlines as epoch ms, for the caller.
    fn shown(self, admitted: Admitted) -> Admitted {
        Admitted {
            lease_deadline: self.epoch_of(admitted.lease_deadline),
            request_deadline: self.epoch_of(admitted.request_deadline),
            ..admitted
        }
    }
}

/// In-process [`Coordination`]: each opened pool gets an independent [`InProcessGate`].
pub struct InProcessCoordination {
    clock: Arc<dyn Clock>,
}

impl InProcessCoordination {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        InProcessCoordination { clock }
    }

    /// On the system clock.
    pub fn system() -> Self {
        Self::new(Arc::new(SystemClock::new()))
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }
}

impl Coordination for InProcessCoordination {
    fn open(&self, pool: &str, settings: PoolSettings) -> Arc<dyn PoolGate> {
        Arc::new(InProcessGate::new(pool, settings, Arc::clone(&self.clock)))
    }
}

/// What a parked caller receives: the grant plus the lease terms in force when it was made.
#[derive(Debug)]
struct Dispatched {
    /// Deadlines already in epoch ms (converted under the lock, when granted).
    admitted: Admitted,
    term_ms: u64,
    renew_interval_ms: u64,
}

struct State {
    gov: Governor,
    /// Parked callers, by ticket id.
    waiters: HashMap<u128, oneshot::Sender<Dispatched>>,
    closed: bool,
}

/// Shared between a gate and its ticker without keeping the gate alive.
struct TickerSignal {
    notify: Notify,
    /// The ticker's next planned wake-up (monotonic ms, `u64::MAX` for none). Read and written under
    /// the gate's lock, so a change that needs an earlier wake-up is never missed.
    scheduled: AtomicU64,
    stop: AtomicBool,
}

struct Inner {
    pool: String,
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
    signal: Arc<TickerSignal>,
    ticker_started: AtomicBool,
    /// Epoch minus monotonic ms, as this gate shows times: fixed, so a deadline shown at the
    /// grant and the same deadline shown at a renew are the same number; moved only when the
    /// wall clock steps by more than [`OFFSET_SLACK_MS`] (`i64::MIN` until first read).
    epoch_offset: AtomicI64,
}

/// How far the wall clock may drift from the shown times before they follow it.
const OFFSET_SLACK_MS: i64 = 1_000;

/// One pool's gate. Dropping it (or [`PoolGate::close`]) stops its ticker.
pub struct InProcessGate {
    inner: Arc<Inner>,
}

impl InProcessGate {
    /// Creates the gate; its ticker starts at once when called inside a tokio runtime, else on
    /// first use.
    pub fn new(pool: &str, settings: PoolSettings, clock: Arc<dyn Clock>) -> Self {
        let inner = Arc::new(Inner {
            pool: pool.to_owned(),
            clock,
            epoch_offset: AtomicI64::new(i64::MIN),
            state: Mutex::new(State {
                gov: Governor::new(settings),
                waiters: HashMap::new(),
                closed: false,
            }),
            signal: Arc::new(TickerSignal {
                notify: Notify::new(),
                scheduled: AtomicU64::new(u64::MAX),
                stop: AtomicBool::new(false),
            }),
            ticker_started: AtomicBool::new(false),
        });
        let gate = InProcessGate { inner };
        gate.ensure_ticker();
        gate
    }

    fn ensure_ticker(&self) {
        let inner = &self.inner;
        if inner.ticker_started.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if inner.ticker_started.swap(true, Ordering::AcqRel) {
            return;
        }
        runtime.spawn(run_ticker(
            Arc::downgrade(inner),
            Arc::clone(&inner.signal),
            Arc::clone(&inner.clock),
        ));
    }
}

impl Drop for InProcessGate {
    fn drop(&mut self) {
        self.inner.stop_ticker();
    }
}

/// Sleeps until the governor's next wake-up or a change, then reclaims and dispatches. Holds the
/// gate only while it works, so a dropped gate is freed and the loop ends.
async fn run_ticker(gate: Weak<Inner>, signal: Arc<TickerSignal>, clock: Arc<dyn Clock>) {
    loop {
        if signal.stop.load(Ordering::Acquire) {
            return;
        }
        let next = match gate.upgrade() {
            Some(inner) => inner.tick(),
            None => return,
        };
        // A notification sent since `tick` is kept as a permit, so it is not lost here.
        let changed = signal.notify.notified();
        match next {
            Some(at) => {
                tokio::select! {
                    () = changed => {}
                    () = clock.sleep_until_monotonic(at) => {}
                }
            }
            None => changed.await,
        }
        // Never spin, even if a wake-up time turned out to be already due.
        tokio::task::yield_now().await;
    }
}

impl Inner {
    /// One ticker round: reclaim expired leases, admit waiters, plan the next wake-up.
    fn tick(&self) -> Option<u64> {
        let mut st = self.state.lock();
        let now = self.now();
        while let Some(id) = st.gov.reclaim_expired(now.mono) {
            tracing::debug!(pool = %self.pool, slot = %SlotId(id), "lease expired; slot reclaimed");
        }
        self.drain(&mut st, now);
        let next = st.gov.next_wakeup(now.mono);
        self.signal
            .scheduled
            .store(next.unwrap_or(u64::MAX), Ordering::Release);
        next
    }

    /// Hands every admissible waiter its grant, then makes sure the ticker will wake in time for
    /// whatever comes next. Call after anything that may free capacity or change timing.
    fn settle(&self, st: &mut State, now: Now) {
        self.drain(st, now);
        if let Some(at) = st.gov.next_wakeup(now.mono) {
            if at < self.signal.scheduled.load(Ordering::Acquire) {
                // Recorded here too, so a burst of changes wakes the ticker once.
                self.signal.scheduled.store(at, Ordering::Release);
                self.signal.notify.notify_one();
            }
        }
    }

    fn drain(&self, st: &mut State, now: Now) {
        let term_ms = st.gov.settings().lease_term_ms;
        let renew_interval_ms = st.gov.settings().renew_interval_ms;
        while let Some(admitted) = st.gov.dispatch(now.mono) {
            let delivered = match st.waiters.remove(&admitted.id) {
                Some(tx) => tx
                    .send(Dispatched {
                        admitted: now.shown(admitted),
                        term_ms,
                        renew_interval_ms,
                    })
                    .is_ok(),
                None => false,
            };
            if !delivered {
                // The waiter is gone without having cancelled: free the slot for the next one.
                st.gov.release(now.mono, admitted.id);
            }
        }
    }

    fn headers(st: &State, now: Now, queued_ms: u64) -> GateHeaders {
        let (remaining_slots, effective_limit, rpm_remaining) = st.gov.headers(now.mono);
        GateHeaders {
            remaining_slots,
            effective_limit,
            rpm_remaining,
            queued_ms,
        }
    }

    /// One line per change of what the pool has learned (the governor already filters out
    /// repeats and jitter), so an operator can follow the limit, the pace and every pause.
    fn log_adjustment(&self, adjustment: Option<Adjustment>, now: Now) {
        let Some(a) = adjustment else {
            return;
        };
        tracing::info!(
            pool = %self.pool,
            effective_limit = a.effective_limit,
            learned_limit = ?a.learned_limit,
            learned_rpm = ?a.learned_rpm,
            pause_ms = a.paused_until.map_or(0, |until| until.saturating_sub(now.mono)),
            "adaptive: {}",
            a.what
        );
    }

    fn now(&self) -> Now {
        let read = Now::read(&*self.clock);
        let observed = (read.epoch as i64).wrapping_sub(read.mono as i64);
        let mut offset = self.epoch_offset.load(Ordering::Relaxed);
        if offset == i64::MIN || (observed - offset).abs() > OFFSET_SLACK_MS {
            offset = observed;
            self.epoch_offset.store(offset, Ordering::Relaxed);
        }
        Now {
            mono: read.mono,
            epoch: (read.mono as i64).wrapping_add(offset).max(0) as u64,
        }
    }

    fn stop_ticker(&self) {
        self.signal.stop.store(true, Ordering::Release);
        self.signal.notify.notify_one();
    }
}

fn grant(d: Dispatched, queued_ms: u64) -> Grant {
    let a = d.admitted;
    Grant {
        slot_id: SlotId(a.id),
        lease_deadline: a.lease_deadline,
        request_deadline: a.request_deadline,
        term_ms: d.term_ms,
        renew_interval_ms: d.renew_interval_ms,
        headers: GateHeaders {
            remaining_slots: a.remaining_slots,
            effective_limit: a.effective_limit,
            rpm_remaining: a.rpm_remaining,
            queued_ms,
        },
    }
}

/// Leaves the queue if the acquire future is dropped while parked; releases the grant if one
/// raced in. Disarmed once the outcome has been handed to the caller.
struct QueueGuard<'a> {
    inner: &'a Inner,
    id: u128,
    armed: bool,
}

impl Drop for QueueGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut st = self.inner.state.lock();
        st.waiters.remove(&self.id);
        if !st.gov.cancel(self.id) {
            // Already dispatched: the grant sits unread in the channel being dropped with us.
            let now = self.inner.now();
            if st.gov.release(now.mono, self.id) {
                self.inner.settle(&mut st, now);
            }
        }
    }
}

/// What an acquire found on arrival: a slot at once, or a place in the queue (id, the
/// monotonic time it queued at, and where its grant will come).
enum Entered {
    Admitted(Grant),
    Queued(u128, u64, oneshot::Receiver<Dispatched>),
}

impl Inner {
    /// The arrival of an acquire, under the pool's lock: admitted, refused or queued.
    fn enter(&self, req: &AcquireRequest) -> Result<Entered, Refusal> {
        let mut st = self.state.lock();
        if st.closed {
            return Err(Refusal::PoolClosed);
        }
        let now = self.now();
        // 128 random bits collide practically never; the check keeps the governor's "ids are
        // unique" precondition true regardless.
        let id = loop {
            let candidate = SlotId::random().0;
            if !st.gov.holds(candidate) && !st.gov.is_queued(candidate) {
                break candidate;
            }
        };
        let settings = st.gov.settings();
        let (lease_ms, grace_ms) = match req.kind {
            SlotKind::Exchange => (
                settings
                    .request_timeout_ms
                    .saturating_add(crate::EXCHANGE_GRACE_MS),
                crate::EXCHANGE_GRACE_MS,
            ),
            SlotKind::Lease => (settings.lease_term_ms, 0),
        };
        let dispatched_terms = (settings.lease_term_ms, settings.renew_interval_ms);
        let ticket = Ticket {
            id,
            fairness_key: req.fairness_key,
            priority: req.priority,
            lease_ms,
            grace_ms,
        };
        match st.gov.try_acquire(now.mono, ticket, req.wait_ms > 0) {
            TryAcquire::Admitted(admitted) => {
                self.settle(&mut st, now);
                let (term_ms, renew_interval_ms) = dispatched_terms;
                Ok(Entered::Admitted(grant(
                    Dispatched {
                        admitted: now.shown(admitted),
                        term_ms,
                        renew_interval_ms,
                    },
                    0,
                )))
            }
            TryAcquire::Refused {
                reason,
                retry_after_ms,
            } => {
                let headers = Inner::headers(&st, now, 0);
                Err(Refusal::TooManyRequests {
                    reason,
                    retry_after_ms,
                    headers,
                })
            }
            TryAcquire::Queued => {
                let (tx, rx) = oneshot::channel();
                st.waiters.insert(id, tx);
                self.settle(&mut st, now);
                Ok(Entered::Queued(id, now.mono, rx))
            }
        }
    }
}

#[async_trait::async_trait]
impl PoolGate for InProcessGate {
    async fn acquire(&self, req: AcquireRequest) -> Result<Grant, Refusal> {
        self.ensure_ticker();
        let inner = &*self.inner;
        let (id, start, mut rx) = match inner.enter(&req)? {
            Entered::Admitted(grant) => return Ok(grant),
            Entered::Queued(id, start, rx) => (id, start, rx),
        };

        let mut guard = QueueGuard {
            inner,
            id,
            armed: true,
        };
        let deadline = start.saturating_add(req.wait_ms);
        let received = tokio::select! {
            biased;
            received = &mut rx => Some(received),
            () = inner.clock.sleep_until_monotonic(deadline) => None,
        };
        let received = match received {
            Some(received) => received.ok(),
            None => {
                let mut st = inner.state.lock();
                let now = inner.now();
                if st.gov.cancel(id) {
                    st.waiters.remove(&id);
                    guard.armed = false;
                    return Err(Refusal::QueueTimeout {
                        headers: Inner::headers(&st, now, now.mono.saturating_sub(start)),
                    });
                }
                // Not queued any more, and grants are sent under the lock we now hold: either
                // the grant is already in the channel, or the pool closed. Take the grant.
                drop(st);
                rx.try_recv().ok()
            }
        };
        match received {
            Some(dispatched) => {
                guard.armed = false;
                let queued_ms = inner.clock.monotonic_ms().saturating_sub(start);
                Ok(grant(dispatched, queued_ms))
            }
            // The sender was dropped without a grant: only `close` does that. The armed guard
            // double-checks on the way out that nothing is left queued or held for this id.
            None => Err(Refusal::PoolClosed),
        }
    }

    async fn renew(&self, slot: SlotId) -> Result<u64, RenewError> {
        self.ensure_ticker();
        let mut st = self.inner.state.lock();
        let now = self.inner.now();
        let renewed = st.gov.renew(now.mono, slot.0);
        if renewed.is_err() {
            // A renew that found its lease expired reclaimed the slot: hand it on.
            self.inner.settle(&mut st, now);
        }
        renewed
            .map(|deadline| now.epoch_of(deadline))
            .map_err(|refusal| match refusal {
                nthbouncer_governor::RenewRefusal::NotFound => RenewError::NotFound,
                nthbouncer_governor::RenewRefusal::Capped => RenewError::Capped,
            })
    }

    async fn release(&self, slot: SlotId, outcome: Option<Outcome>) -> bool {
        self.ensure_ticker();
        let mut st = self.inner.state.lock();
        let now = self.inner.now();
        // Only the release that frees a held slot teaches: an unknown id or a repeat must not
        // pause or shrink the pool (any key holder can name a slot id). The governor learns
        // before freeing, so a throttle pauses admission before the slot is handed on.
        let (released, adjustment) = st.gov.release_observed(now.mono, slot.0, outcome.as_ref());
        self.inner.log_adjustment(adjustment, now);
        self.inner.settle(&mut st, now);
        released
    }

    async fn report(&self, outcome: Outcome) {
        self.ensure_ticker();
        let mut st = self.inner.state.lock();
        let now = self.inner.now();
        let adjustment = st.gov.observe(now.mono, &outcome);
        self.inner.log_adjustment(adjustment, now);
        self.inner.settle(&mut st, now);
    }

    async fn reconfigure(&self, settings: PoolSettings) {
        self.ensure_ticker();
        let mut st = self.inner.state.lock();
        let now = self.inner.now();
        st.gov.reconfigure(settings, now.mono);
        self.inner.settle(&mut st, now);
    }

    async fn snapshot(&self) -> Snapshot {
        let st = self.inner.state.lock();
        let now = self.inner.now();
        let mut s = st.gov.snapshot(now.mono);
        s.paused_until = s.paused_until.map(|t| now.epoch_of(t));
        s.paced_until = s.paced_until.map(|t| now.epoch_of(t));
        if let Some(throttle) = s.last_throttle.as_mut() {
            throttle.at = now.epoch_of(throttle.at);
        }
        s
    }

    async fn close(&self) {
        {
            let mut st = self.inner.state.lock();
            st.closed = true;
            let State { gov, waiters, .. } = &mut *st;
            for (id, sender) in waiters.drain() {
                gov.cancel(id);
                // Dropping the sender wakes the waiter with a closed channel: `PoolClosed`.
                drop(sender);
            }
        }
        self.inner.stop_ticker();
        tracing::debug!(pool = %self.inner.pool, "pool gate closed");
    }
}
