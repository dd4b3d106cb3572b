//! The pure admission core of one pool: slots, leases, the wait queue, the RPM gate and adaptive
//! learning (SPEC §3).
//!
//! This crate owns the *rules* of admission and nothing else. It does no IO, spawns no threads
//! and never reads a clock: every time-dependent method takes `now` (milliseconds) from the
//! caller, so it is deterministic and tested without sleeping. `now` is the caller's
//! *monotonic* clock (the in-process gate passes `Clock::monotonic_ms`), and every time the
//! governor hands back (deadlines, `paused_until`, a throttle's `at`) is on that same clock: a
//! wall-clock step must not reclaim every lease at once. Converting to epoch ms for display is
//! the caller's job. It must not know about HTTP, async runtimes, keys or storage;
//! `nthbouncer-coord` wraps it in an async, locked shell and owns the wake-ups that
//! [`Governor::next_wakeup`] asks for.
//!
//! One [`Governor`] per pool. The caller drives it:
//! - [`Governor::try_acquire`] admits at once, parks the ticket, or refuses;
//! - after anything that may free capacity (release, reclaim, reconfigure, observe, a wake-up)
//!   the caller loops [`Governor::dispatch`] until it returns `None`, handing each grant to its
//!   waiter;
//! - [`Governor::reclaim_expired`] frees slots whose lease ran out, one per call.
//!
//! Invariants: no admission ever makes `in_flight` exceed the effective limit; the queue never
//! holds a waiter that could be admitted once the caller has drained `dispatch`; FIFO order holds
//! within one fairness key and priority class; accounting is exact (only admissions count
//! against RPM).
//!
//! Module map: `queue` (who is served next), `leases` (holders and expiry order), `rpm` (the
//! rolling window), `pace` (even spacing under a learned rate), `adaptive` (what upstream
//! answers teach), `tokens` (the token budget, beside the governor: a request's estimated cost
//! in tokens against a configured or announced tokens-per-minute budget). This file composes
//! them.

#![forbid(unsafe_code)]

mod adaptive;
mod leases;
mod pace;
mod queue;
mod rpm;
mod tokens;

use adaptive::{Adaptive, Bounds, Context};
use leases::{Held, Leases};
use pace::Pacer;
use queue::WaitQueue;
use rpm::RpmWindow;

pub use tokens::{
    BudgetSource, TokenAdmit, TokenBudget, TokenCost, TokenPart, TokenSettings, TokenSnapshot,
    TokenWindow, Usage, DEFAULT_TOKEN_HOLD_MS, DEFAULT_TOKEN_WINDOW_MS,
};

/// A waiter's class: a freed slot goes to the oldest waiter of the highest class present.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    /// Parses `high`, `normal` or `low`, ignoring ASCII case.
    pub fn parse(s: &str) -> Option<Self> {
        [Priority::High, Priority::Normal, Priority::Low]
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }
}

/// The governor's part of a pool's `concurrency.*` settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSettings {
    /// Most slots held at once (hard ceiling).
    pub limit: u32,
    /// Most callers waiting; 0 means nobody waits.
    pub queue_size: u32,
    /// Admissions per rolling minute; 0 = no RPM gate.
    pub rpm: u32,
    /// A slot's hard cap from grant (`requestDeadline`).
    pub request_timeout_ms: u64,
    /// Lease term for lock holders, and the extension one renew grants.
    pub lease_term_ms: u64,
    /// Advised renew period (reported to lock holders; the governor does not enforce it).
    pub renew_interval_ms: u64,
    /// Learn the limit and RPM from upstream outcomes.
    pub adaptive: bool,
    /// Floor for the learned limit (clamped to `limit`).
    pub min_limit: u32,
    /// Round-robin between fairness keys within a priority class.
    pub fair_share: bool,
    /// Longest pause (and slowest pace) any single outcome may impose, whatever its
    /// `Retry-After` or reset hint says: hints come from upstreams and from lock holders' release
    /// reports, and one bogus figure must not stop a pool for long. A real longer limit simply
    /// re-pauses on the next throttle.
    pub max_pause_ms: u64,
}

/// Default of [`PoolSettings::max_pause_ms`] (`concurrency.max_pause_ms`): five minutes.
pub const DEFAULT_MAX_PAUSE_MS: u64 = 300_000;

impl Default for PoolSettings {
    fn default() -> Self {
        PoolSettings {
            limit: 10,
            queue_size: 1000,
            rpm: 0,
            request_timeout_ms: 120_000,
            lease_term_ms: 30_000,
            renew_interval_ms: 10_000,
            adaptive: true,
            min_limit: 1,
            fair_share: true,
            max_pause_ms: DEFAULT_MAX_PAUSE_MS,
        }
    }
}

/// Pre-parsed upstream rate-limit figures (any header dialect), durations relative to the answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateInfo {
    pub limit: Option<u64>,
    pub remaining: Option<u64>,
    pub reset_ms: Option<u64>,
    /// Length of the window `limit` applies to, when known (stated by the origin, or implied by
    /// its dialect: OpenAI and Anthropic request limits are per minute). With it, the pace is
    /// `limit` per window; without it, `remaining` until `reset`.
    pub window_ms: Option<u64>,
    pub token_limit: Option<u64>,
    pub token_remaining: Option<u64>,
    pub token_reset_ms: Option<u64>,
}

/// One upstream outcome, observed by the proxy or reported on lock release.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Final upstream HTTP status.
    pub status: Option<u16>,
    /// Number of upstream 429s the caller saw.
    pub throttled: u32,
    pub retry_after_ms: Option<u64>,
    pub rate: Option<RateInfo>,
    /// Who saw the answer (`"proxy"`, `"lock release"`), for the throttle cause.
    pub via: Option<&'static str>,
    /// Which rate-limit header family spoke (`"openai"`, `"retry-after"`, ...), for the cause.
    pub dialect: Option<&'static str>,
}

/// Why a ticket was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefusalReason {
    /// No free slot and the caller may not wait.
    NoSlot,
    /// The caller may wait but the queue is full.
    QueueFull,
    /// The RPM budget of the rolling minute is spent.
    Rpm,
    /// Admission is paused after an upstream throttle.
    Paused,
}

impl RefusalReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::NoSlot => "no_slot",
            RefusalReason::QueueFull => "queue_full",
            RefusalReason::Rpm => "rpm",
            RefusalReason::Paused => "paused",
        }
    }
}

/// The last upstream throttle and why it counted as one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Throttle {
    /// On the caller's clock (the in-process gate shows it as epoch ms).
    pub at: u64,
    pub cause: String,
}

/// Live pool state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub in_flight: u32,
    pub queued: u32,
    pub queued_high: u32,
    pub queued_normal: u32,
    pub queued_low: u32,
    pub effective_limit: u32,
    pub configured_limit: u32,
    pub learned_limit: Option<u32>,
    /// The pace learned from an announced limit per window, as requests per minute; none while
    /// an announced budget is mirrored instead (see the `adaptive` module docs).
    pub learned_rpm: Option<u32>,
    /// Present only when an RPM gate is in force.
    pub rpm_remaining: Option<u32>,
    /// Present only while admission is paused.
    pub paused_until: Option<u64>,
    /// Present only while the learned pace, or a spent announced budget (until its reset), holds
    /// the next admission back.
    pub paced_until: Option<u64>,
    pub last_throttle: Option<Throttle>,
    pub admitted_total: u64,
    pub refused_total: u64,
}

/// What one observation changed in the learned state, for the log (see [`Governor::observe`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adjustment {
    pub effective_limit: u32,
    pub learned_limit: Option<u32>,
    pub learned_rpm: Option<u32>,
    pub paused_until: Option<u64>,
    /// What changed and why, e.g. `limit 8 -> 4 (throttled at 8: halved); paused for 2000ms;
    /// cause: status 429, retry-after 2000ms (proxy)`.
    pub what: String,
}

/// The learned state of a pool at one moment (see [`Governor::learned`]): everything admission
/// reads from adaptive learning, for an implementation that enforces it outside the governor.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Learned {
    pub effective_limit: u32,
    pub learned_limit: Option<u32>,
    /// Minimum spacing between admissions in microseconds (the learned pace), if one is in force.
    pub pace_us: Option<u64>,
    /// When that pace lapses unless announced again.
    pub pace_until: Option<u64>,
    pub learned_rpm: Option<u32>,
    /// The end of the pause, or of a spent announced budget's hold (until its reset).
    pub paused_until: Option<u64>,
    pub last_throttle: Option<Throttle>,
}

/// One admission request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    /// Chosen by the caller; must not be queued or held already.
    pub id: u128,
    pub fairness_key: u64,
    pub priority: Priority,
    /// Initial lease length from grant time (capped by the request deadline plus `grace_ms`).
    pub lease_ms: u64,
    /// How long past its request deadline the slot stays held if its holder has not freed it:
    /// a holder that ends its own exchange at the deadline needs a moment to finish ending it
    /// (to close the upstream connection), and the slot must not go to the next caller first.
    /// 0 for a lock lease, which the request deadline ends.
    pub grace_ms: u64,
}

/// A grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admitted {
    pub id: u128,
    pub lease_deadline: u64,
    pub request_deadline: u64,
    /// Free slots after this admission.
    pub remaining_slots: u32,
    pub effective_limit: u32,
    pub rpm_remaining: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TryAcquire {
    Admitted(Admitted),
    /// Parked; a later [`Governor::dispatch`] returns its grant.
    Queued,
    Refused {
        reason: RefusalReason,
        retry_after_ms: Option<u64>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenewRefusal {
    /// Not held (released, reclaimed, or its lease already ran out).
    NotFound,
    /// The lease already reaches the request deadline.
    Capped,
}

/// The admission state of one pool. See the crate docs for how a caller drives it.
#[derive(Clone, Debug)]
pub struct Governor {
    settings: PoolSettings,
    queue: WaitQueue,
    leases: Leases,
    rpm: RpmWindow,
    pacer: Pacer,
    adaptive: Adaptive,
    /// Exponentially weighted mean of slot hold times (release - grant), for `Retry-After`.
    hold_ewma_ms: Option<u64>,
    admitted_total: u64,
    refused_total: u64,
    /// Last time demand met the concurrency limit (an admission took the last slot, or a caller
    /// found none). Successes count towards growing the limit only if it bound while they ran.
    last_full_at: Option<u64>,
    /// Latest `now` seen. Time used internally never steps back, so the RPM window stays
    /// ordered even if a caller's clock does.
    clock: u64,
}

fn saturating_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Governor {
    pub fn new(settings: PoolSettings) -> Self {
        Governor {
            queue: WaitQueue::new(settings.fair_share),
            settings,
            leases: Leases::default(),
            rpm: RpmWindow::default(),
            pacer: Pacer::default(),
            adaptive: Adaptive::default(),
            hold_ewma_ms: None,
            admitted_total: 0,
            refused_total: 0,
            last_full_at: None,
            clock: 0,
        }
    }

    pub fn settings(&self) -> &PoolSettings {
        &self.settings
    }

    /// Applies new settings. Holders and waiters stay (a lower limit or queue size takes effect
    /// for new admissions; nobody is evicted). The caller then loops [`Governor::dispatch`], since
    /// a higher limit may admit waiters at once.
    pub fn reconfigure(&mut self, settings: PoolSettings, now: u64) {
        self.tick(now);
        self.queue.set_fair_share(settings.fair_share);
        self.settings = settings;
        if self.settings.adaptive {
            self.adaptive.rebound(self.bounds(), now);
        } else {
            self.adaptive.forget();
        }
        if self.rpm_limit(now).is_none() {
            // Timestamps are kept only while a gate is in force (memory stays bounded by it).
            self.rpm.clear();
        }
    }

    /// Admits at once only if nobody waits (no overtaking), a slot is free, the RPM gate allows
    /// and admission is not paused. Otherwise parks the ticket when `may_wait` and the queue has
    /// room, or refuses with the reason that blocks (paused, then RPM, then no slot).
    pub fn try_acquire(&mut self, now: u64, ticket: Ticket, may_wait: bool) -> TryAcquire {
        let now = self.tick(now);
        if self.queue.contains(ticket.id) || self.leases.contains(ticket.id) {
            // A reused id would corrupt the books; refusing is the only safe answer.
            self.refused_total += 1;
            return TryAcquire::Refused {
                reason: RefusalReason::NoSlot,
                retry_after_ms: None,
            };
        }
        let blocker = self.blocker(now);
        if blocker == Some(RefusalReason::NoSlot) {
            self.last_full_at = Some(now);
        }
        if blocker.is_none() && self.queue.is_empty() {
            return TryAcquire::Admitted(self.admit(
                now,
                ticket.id,
                ticket.lease_ms,
                ticket.grace_ms,
            ));
        }
        let room = u64::try_from(self.queue.len()).unwrap_or(u64::MAX)
            < u64::from(self.settings.queue_size);
        if may_wait && room {
            self.queue.push(
                ticket.id,
                ticket.fairness_key,
                ticket.priority,
                ticket.lease_ms,
                ticket.grace_ms,
            );
            return TryAcquire::Queued;
        }
        self.refused_total += 1;
        // With a non-empty queue and nothing else blocking, the waiters ahead are what blocks.
        let blocking = blocker.unwrap_or(RefusalReason::NoSlot);
        if may_wait {
            let retry = self.retry_estimate(now, RefusalReason::QueueFull);
            let retry = match (retry, self.retry_estimate(now, blocking)) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            TryAcquire::Refused {
                reason: RefusalReason::QueueFull,
                retry_after_ms: retry,
            }
        } else {
            TryAcquire::Refused {
                reason: blocking,
                retry_after_ms: self.retry_estimate(now, blocking),
            }
        }
    }

    /// Admits the next waiter if capacity, RPM and pause allow.
    pub fn dispatch(&mut self, now: u64) -> Option<Admitted> {
        let now = self.tick(now);
        if self.queue.is_empty() || self.blocker(now).is_some() {
            return None;
        }
        let waiter = self.queue.pop()?;
        Some(self.admit(now, waiter.id, waiter.lease_ms, waiter.grace_ms))
    }

    /// Removes a waiter; `true` iff it was queued.
    pub fn cancel(&mut self, id: u128) -> bool {
        self.queue.cancel(id)
    }

    /// Frees a slot; `true` iff `id` held one.
    pub fn release(&mut self, now: u64, id: u128) -> bool {
        let now = self.tick(now);
        let Some(held) = self.leases.release(id) else {
            return false;
        };
        let sample = now.saturating_sub(held.granted_at);
        // Weight 1/4 for the newest sample: follows a change of upstream latency within a few
        // requests without jumping on one outlier.
        self.hold_ewma_ms = Some(match self.hold_ewma_ms {
            None => sample,
            Some(mean) => mean - mean / 4 + sample / 4,
        });
        true
    }

    /// Extends a lease by `lease_term_ms` from `now`, never past the request deadline. A lease
    /// already at its request deadline is `Capped`; one whose deadline has passed is reclaimed
    /// here and `NotFound` (the caller should then dispatch, as after a release).
    pub fn renew(&mut self, now: u64, id: u128) -> Result<u64, RenewRefusal> {
        let now = self.tick(now);
        self.leases.renew(now, id, self.settings.lease_term_ms)
    }

    /// Frees one slot whose lease deadline is `<= now` and returns its id; call until `None`.
    /// Reclaimed holds do not feed the hold-time estimate: they measure an abandoned client, not
    /// the upstream.
    pub fn reclaim_expired(&mut self, now: u64) -> Option<u128> {
        let now = self.tick(now);
        self.leases.pop_expired(now)
    }

    /// Adaptive learning input; ignored unless `settings.adaptive`. Returns what changed when
    /// it is worth a log line (the effective limit, a new pause, the pace).
    pub fn observe(&mut self, now: u64, outcome: &Outcome) -> Option<Adjustment> {
        self.learn(now, outcome, None)
    }

    /// [`Governor::observe`] for the outcome of the request holding slot `id`; call it before
    /// releasing the slot. Knowing when the request was admitted lets a throttle of a request
    /// admitted before the last decrease count as part of the overshoot already answered, and
    /// not shrink the limit again.
    ///
    /// Teaches nothing unless `id` holds a slot: a report about a slot nobody holds (an unknown
    /// id, one already released or reclaimed) is not evidence about the upstream, and anyone who
    /// can name a slot id could otherwise pause the pool. Prefer [`Governor::release_observed`],
    /// which cannot be called in the wrong order.
    pub fn observe_held(&mut self, now: u64, id: u128, outcome: &Outcome) -> Option<Adjustment> {
        let admitted = self.leases.granted(id)?;
        self.learn(now, outcome, Some(admitted))
    }

    /// Frees slot `id` and, only if it was held, learns from the outcome of its request (learning
    /// first, so a throttle pauses admission before the slot is handed on). A repeated release
    /// frees nothing and so teaches nothing. Returns whether a slot was freed and what the
    /// outcome changed.
    pub fn release_observed(
        &mut self,
        now: u64,
        id: u128,
        outcome: Option<&Outcome>,
    ) -> (bool, Option<Adjustment>) {
        let adjustment = outcome.and_then(|outcome| self.observe_held(now, id, outcome));
        (self.release(now, id), adjustment)
    }

    /// [`Governor::observe`] for a learner whose slots are counted elsewhere (the Redis gate
    /// keeps the slots of several nodes in a shared store and runs only the learning here): the
    /// caller says whether the concurrency limit bound while the observed request ran and, for
    /// the outcome of a held slot, when that slot was granted (on this governor's clock).
    pub fn observe_external(
        &mut self,
        now: u64,
        outcome: &Outcome,
        limited: bool,
        admitted_at: Option<u64>,
    ) -> Option<Adjustment> {
        self.learn_with(now, outcome, limited, admitted_at.map(|at| (at, None)))
    }

    fn learn_with(
        &mut self,
        now: u64,
        outcome: &Outcome,
        limited: bool,
        admitted: Option<(u64, Option<u64>)>,
    ) -> Option<Adjustment> {
        let now = self.tick(now);
        if !self.settings.adaptive {
            return None;
        }
        let ctx = Context {
            limited,
            admitted_at: admitted.map(|(at, _)| at),
            admitted_seq: admitted.and_then(|(_, seq)| seq),
        };
        let bounds = self.bounds();
        let what = self.adaptive.observe(now, outcome, bounds, ctx)?;
        Some(Adjustment {
            effective_limit: self.effective_limit(now),
            learned_limit: self.adaptive.learned_limit(bounds, now),
            learned_rpm: self.adaptive.learned_rpm(bounds, now),
            paused_until: self.adaptive.paused_until(now),
            what,
        })
    }

    /// What this governor has learned, as of `now`, for a caller that enforces it elsewhere.
    pub fn learned(&self, now: u64) -> Learned {
        let now = self.at(now);
        let bounds = self.bounds();
        Learned {
            effective_limit: self.effective_limit(now),
            learned_limit: self.adaptive.learned_limit(bounds, now),
            pace_us: self.adaptive.pace_us(bounds, now),
            pace_until: self.adaptive.pace_lapses_at(bounds, now),
            learned_rpm: self.adaptive.learned_rpm(bounds, now),
            // A spent mirrored budget holds admission back until its reset like a pause does.
            // (A learner whose admissions happen elsewhere counts none: its estimate is what
            // the last answer announced.)
            paused_until: match (
                self.adaptive.paused_until(now),
                self.adaptive.budget_blocked_until(now),
            ) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            },
            last_throttle: self.adaptive.last_throttle().cloned(),
        }
    }

    /// `admitted`: when the observed request was granted and the admission count right after.
    fn learn(
        &mut self,
        now: u64,
        outcome: &Outcome,
        admitted: Option<(u64, u64)>,
    ) -> Option<Adjustment> {
        let now = self.tick(now);
        let limited = self.in_flight() >= self.effective_limit(now)
            || self
                .last_full_at
                .is_some_and(|full| admitted.is_some_and(|(at, _)| full >= at));
        self.learn_with(
            now,
            outcome,
            limited,
            admitted.map(|(at, seq)| (at, Some(seq))),
        )
    }

    /// The earliest time at which state can change without a call: a lease expiry, or — while
    /// waiters exist — the end of a pause, the moment the RPM window and the pace let the next
    /// one in, or the decay step that raises the learned limit.
    /// `Some(t <= now)` means "act now" (e.g. waiters are admissible and `dispatch` is due).
    pub fn next_wakeup(&self, now: u64) -> Option<u64> {
        let now = self.at(now);
        let lease = self.leases.next_expiry();
        let waiters = if self.queue.is_empty() {
            None
        } else {
            match self.blocker(now) {
                None => Some(now),
                Some(RefusalReason::Paused) => self.adaptive.paused_until(now),
                Some(RefusalReason::Rpm) => self.rpm_free_at(now),
                // A slot frees on release (a call) or on lease expiry (covered above), or the
                // learned limit decays upwards.
                Some(RefusalReason::NoSlot | RefusalReason::QueueFull) => {
                    self.adaptive.next_decay(self.bounds(), now)
                }
            }
        };
        match (lease, waiters) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// `(remaining slots, effective limit, rpm remaining)` for the `x-nthpool-*` headers.
    pub fn headers(&self, now: u64) -> (u32, u32, Option<u32>) {
        let now = self.at(now);
        let effective = self.effective_limit(now);
        (
            effective.saturating_sub(self.in_flight()),
            effective,
            self.rpm_remaining(now),
        )
    }

    pub fn snapshot(&self, now: u64) -> Snapshot {
        let now = self.at(now);
        Snapshot {
            in_flight: self.in_flight(),
            queued: self.queued(),
            queued_high: saturating_u32(self.queue.len_of(Priority::High)),
            queued_normal: saturating_u32(self.queue.len_of(Priority::Normal)),
            queued_low: saturating_u32(self.queue.len_of(Priority::Low)),
            effective_limit: self.effective_limit(now),
            configured_limit: self.settings.limit,
            learned_limit: self.adaptive.learned_limit(self.bounds(), now),
            learned_rpm: self.adaptive.learned_rpm(self.bounds(), now),
            rpm_remaining: self.rpm_remaining(now),
            paused_until: self.adaptive.paused_until(now),
            paced_until: self.paced_until(now),
            last_throttle: self.adaptive.last_throttle().cloned(),
            admitted_total: self.admitted_total,
            refused_total: self.refused_total,
        }
    }

    pub fn in_flight(&self) -> u32 {
        saturating_u32(self.leases.len())
    }

    pub fn queued(&self) -> u32 {
        saturating_u32(self.queue.len())
    }

    pub fn is_queued(&self, id: u128) -> bool {
        self.queue.contains(id)
    }

    pub fn holds(&self, id: u128) -> bool {
        self.leases.contains(id)
    }

    // ---- internals ----

    fn tick(&mut self, now: u64) -> u64 {
        self.clock = self.clock.max(now);
        self.clock
    }

    fn at(&self, now: u64) -> u64 {
        self.clock.max(now)
    }

    fn bounds(&self) -> Bounds {
        Bounds::of(&self.settings)
    }

    fn effective_limit(&self, now: u64) -> u32 {
        self.adaptive.effective_limit(self.bounds(), now)
    }

    /// The RPM in force: the smaller of the configured (if any) and the learned (if any).
    fn rpm_limit(&self, now: u64) -> Option<u32> {
        let configured = Some(self.settings.rpm).filter(|&r| r > 0);
        match (configured, self.adaptive.learned_rpm(self.bounds(), now)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn rpm_remaining(&self, now: u64) -> Option<u32> {
        self.rpm_limit(now).map(|rpm| self.rpm.remaining(now, rpm))
    }

    /// When a spent announced budget (until its reset) or the learned pace lets the next
    /// admission in, if not at `now`.
    fn paced_until(&self, now: u64) -> Option<u64> {
        if let Some(until) = self.adaptive.budget_blocked_until(now) {
            return Some(until);
        }
        self.adaptive
            .pace_us(self.bounds(), now)
            .and_then(|spacing| self.pacer.blocked_until(now, spacing))
    }

    /// When both the rolling window and the pace let the next admission in, if not at `now`.
    fn rpm_free_at(&self, now: u64) -> Option<u64> {
        let window = self
            .rpm_limit(now)
            .and_then(|rpm| self.rpm.next_free(now, rpm));
        match (window, self.paced_until(now)) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// What stops an admission at `now`, most fundamental first.
    fn blocker(&self, now: u64) -> Option<RefusalReason> {
        if self.adaptive.paused_until(now).is_some() {
            Some(RefusalReason::Paused)
        } else if self.rpm_remaining(now) == Some(0) || self.paced_until(now).is_some() {
            Some(RefusalReason::Rpm)
        } else if self.in_flight() >= self.effective_limit(now) {
            Some(RefusalReason::NoSlot)
        } else {
            None
        }
    }

    /// How long until retrying could plausibly succeed.
    fn retry_estimate(&self, now: u64, reason: RefusalReason) -> Option<u64> {
        match reason {
            RefusalReason::Paused => self.adaptive.paused_until(now).map(|until| until - now),
            RefusalReason::Rpm => self.rpm_free_at(now).map(|t| t.saturating_sub(now)),
            RefusalReason::NoSlot | RefusalReason::QueueFull => {
                // Slots free at about `effective / mean hold` per ms; the caller would stand
                // behind everyone queued.
                let mean = self.hold_ewma_ms?;
                let ahead = u64::from(self.queued()) + 1;
                let slots = u64::from(self.effective_limit(now).max(1));
                Some(mean.saturating_mul(ahead).div_ceil(slots).max(1))
            }
        }
    }

    fn admit(&mut self, now: u64, id: u128, lease_ms: u64, grace_ms: u64) -> Admitted {
        let request_deadline = now.saturating_add(self.settings.request_timeout_ms);
        // The holder is told the request deadline; the slot is reclaimed no later than that
        // plus its grace.
        let held_until = request_deadline.saturating_add(grace_ms);
        let lease_deadline = now.saturating_add(lease_ms).min(held_until);
        self.adaptive.admitted();
        self.leases.grant(
            id,
            Held {
                lease_deadline,
                request_deadline: held_until,
                granted_at: now,
                seq: self.adaptive.admissions(),
            },
        );
        if self.rpm_limit(now).is_some() {
            self.rpm.record(now);
        }
        if let Some(spacing) = self.adaptive.pace_us(self.bounds(), now) {
            self.pacer.record(now, spacing);
        }
        self.admitted_total += 1;
        if self.in_flight() >= self.effective_limit(now) {
            self.last_full_at = Some(now);
        }
        let (remaining_slots, effective_limit, rpm_remaining) = self.headers(now);
        Admitted {
            id,
            lease_deadline,
            request_deadline,
            remaining_slots,
            effective_limit,
            rpm_remaining,
        }
    }
}

#[cfg(test)]
mod tests;
