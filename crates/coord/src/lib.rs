//! The coordination seam: the async admission interface every caller of a pool goes through.
//!
//! This crate owns *where coordination state lives* (slots, leases, wait queues, RPM windows,
//! learned limits): [`PoolGate`] is the trait the HTTP layer talks to, [`in_process`] is the
//! single-node implementation, a thin async shell around the pure `nthbouncer-governor` core,
//! and [`redis`] implements the same traits for several nodes sharing one limit through Redis.
//! [`nonces`] holds the seen HMAC nonces behind [`NonceStore`], for the same reason (on Redis:
//! [`redis::RedisNonces`]).
//!
//! It must not know about HTTP, keys, or the durable store: callers hand it a fairness key id,
//! a priority and a wait budget, and get back a grant or a refusal.

#![forbid(unsafe_code)]

pub mod clock;
pub mod in_process;
pub mod nonces;
pub mod redis;

use std::sync::Arc;

use tokio::sync::watch;

pub use clock::{monotonic_to_epoch, Clock, ManualClock, SystemClock};
pub use nonces::{InProcessNonces, NonceKey, NonceStore, NonceVerdict};
pub use nthbouncer_governor::{
    Outcome, PoolSettings, Priority, RateInfo, RefusalReason, Snapshot, Throttle,
};

/// An opaque, unguessable slot identifier (128 random bits), rendered as 32 lowercase hex chars.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct SlotId(pub u128);

impl SlotId {
    pub fn random() -> Self {
        SlotId(rand::random::<u128>())
    }
    /// Parses the 32-hex-char form; anything else is `None` (and so simply "not found").
    pub fn parse(s: &str) -> Option<Self> {
        if s.len() != 32
            || !s
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return None;
        }
        u128::from_str_radix(s, 16).ok().map(SlotId)
    }
}

impl std::fmt::Display for SlotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// How long an [`SlotKind::Exchange`] slot outlives its request deadline when its holder has not
/// freed it yet. The holder ends the exchange at the deadline and frees the slot once the
/// upstream connection is closed (at most a second later); reclaiming it at the deadline
/// itself would hand it to the next caller while the origin still counts the cut call.
pub const EXCHANGE_GRACE_MS: u64 = 2_000;

/// What kind of holder a slot has: it decides the slot's lease.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SlotKind {
    /// Held by this process for one proxied exchange (or job fetch); freed by the holder's guard.
    /// Its lease runs to the request deadline plus [`EXCHANGE_GRACE_MS`], so a crashed holder
    /// cannot leak it for longer.
    Exchange,
    /// Held by a remote caller through the lock API; must be renewed every `lease_term_ms`.
    Lease,
}

/// One admission request.
#[derive(Clone, Debug)]
pub struct AcquireRequest {
    /// Fairness identity (the caller's key id); waiters of different keys are served round-robin.
    pub fairness_key: u64,
    pub priority: Priority,
    /// How long the caller may wait for a slot, in ms; 0 = fail fast. Already clamped by the caller
    /// to the pool's `queue_timeout_ms`.
    pub wait_ms: u64,
    pub kind: SlotKind,
}

/// The governor figures every admitted or refused answer carries (`x-nthpool-*` headers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateHeaders {
    pub remaining_slots: u32,
    pub effective_limit: u32,
    /// Present only when the pool has an RPM gate (configured or learned).
    pub rpm_remaining: Option<u32>,
    /// Time the caller spent waiting in the queue.
    pub queued_ms: u64,
}

/// A granted slot.
#[derive(Clone, Debug)]
pub struct Grant {
    pub slot_id: SlotId,
    /// Epoch ms.
    pub lease_deadline: u64,
    /// Epoch ms; the lease never extends past it.
    pub request_deadline: u64,
    pub term_ms: u64,
    pub renew_interval_ms: u64,
    pub headers: GateHeaders,
}

/// Why a slot was not granted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No slot and no wait budget, queue full, RPM spent or admission paused:
    /// `429 too_many_requests`, with `Retry-After` when `retry_after_ms` is known.
    TooManyRequests {
        reason: RefusalReason,
        retry_after_ms: Option<u64>,
        headers: GateHeaders,
    },
    /// The wait budget ran out: `504 queue_timeout`.
    QueueTimeout { headers: GateHeaders },
    /// The pool was removed while the caller waited.
    PoolClosed,
    /// The shared coordination store (Redis) could not be reached and the gate fails closed:
    /// `503 coordination_unavailable`, with `Retry-After`. Nothing was admitted.
    CoordinationUnavailable { retry_after_ms: u64 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenewError {
    /// Released or reclaimed: `404 not_found`.
    NotFound,
    /// Lease already at `requestDeadline`: `409 capped`.
    Capped,
}

/// Tells a holder that its slot could no longer be confirmed (see [`PoolGate::lease_watch`]).
#[derive(Clone, Debug)]
pub struct LeaseWatch {
    lost: watch::Receiver<bool>,
}

impl LeaseWatch {
    /// A watch fed by the gate: `true` once the lease is lost.
    pub fn new(lost: watch::Receiver<bool>) -> Self {
        LeaseWatch { lost }
    }

    /// Whether the lease is already known lost.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves once the lease is lost; never while it is confirmed. If the gate goes away
    /// first, nothing confirms the lease any more either, so that counts as lost.
    pub async fn lost(&mut self) {
        let _ = self.lost.wait_for(|lost| *lost).await;
    }
}

/// One pool's admission gate. All proxy, lock and job callers of a pool share one gate.
#[async_trait::async_trait]
pub trait PoolGate: Send + Sync + 'static {
    /// Waits (up to `req.wait_ms`) for a slot. Dropping the future leaves the queue at once.
    async fn acquire(&self, req: AcquireRequest) -> Result<Grant, Refusal>;
    /// Extends a lease by one term, never past its request deadline.
    async fn renew(&self, slot: SlotId) -> Result<u64, RenewError>;
    /// Frees a slot (idempotent: `true` only the first time) and, only when it freed one, feeds
    /// the outcome, if any, to adaptive learning: an unknown, reclaimed or already released slot
    /// teaches nothing, so a bogus report cannot pause the pool. No single outcome pauses
    /// admission for longer than the pool's `max_pause_ms`.
    async fn release(&self, slot: SlotId, outcome: Option<Outcome>) -> bool;
    /// Feeds an upstream outcome the gateway observed itself to adaptive learning without
    /// releasing anything (its pause capped at `max_pause_ms` like any other).
    async fn report(&self, outcome: Outcome);
    /// Applies new settings; raising the limit admits waiters at once.
    async fn reconfigure(&self, settings: PoolSettings);
    /// Live state.
    async fn snapshot(&self) -> Snapshot;
    /// Refuses every waiter with [`Refusal::PoolClosed`] and stops background work.
    async fn close(&self);
    /// Self-fencing: for a held [`SlotKind::Exchange`] slot whose lease this gate keeps alive
    /// behind the holder's back, a watch that fires if the lease could not be confirmed (it was
    /// reclaimed, or the coordination store stayed unreachable past its deadline). The slot
    /// may then be someone else's, so the holder should cut its call off. `None` when the gate
    /// never loses a held slot that way (the in-process gate) or does not know the slot.
    fn lease_watch(&self, _slot: SlotId) -> Option<LeaseWatch> {
        None
    }
}

/// Where pool gates come from.
pub trait Coordination: Send + Sync + 'static {
    /// Opens the gate of `pool` with `settings`.
    fn open(&self, pool: &str, settings: PoolSettings) -> Arc<dyn PoolGate>;
}
