//! `SlotGuard`: one held slot. It owns the background task that renews the lease every
//! `renewIntervalMs`, publishes the lease's fate ([`LeaseState`]) to the holder, and makes sure
//! the slot is released exactly once: by [`SlotGuard::release`] with an outcome, or on drop
//! without one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderMap;
use serde::Deserialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::client::{LockClient, RenewFailure};
use crate::error::LockError;
use crate::outcome::Outcome;

/// Shortest pause before retrying a renewal that failed for a passing reason.
const MIN_RETRY: Duration = Duration::from_millis(10);

/// The lock grant, as the gateway answered it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Grant {
    /// The slot's id. Hold it privately: whoever knows it can renew or release the slot.
    pub slot_id: String,
    /// Epoch ms: the lease lapses at this instant unless renewed (as granted; see
    /// [`SlotGuard::lease_deadline`] for the latest).
    pub lease_deadline: u64,
    /// Epoch ms: no renewal extends the lease past this instant.
    pub request_deadline: u64,
    /// Lease term: each renewal extends the lease this far (up to `request_deadline`).
    pub term_ms: u64,
    /// Advised renewal period.
    pub renew_interval_ms: u64,
    /// `x-nthpool-remaining-slots` at the grant.
    #[serde(skip)]
    pub remaining_slots: Option<u32>,
    /// `x-nthpool-effective-limit` at the grant.
    #[serde(skip)]
    pub effective_limit: Option<u32>,
    /// `x-nthpool-queued-ms`: time spent waiting for the slot.
    #[serde(skip)]
    pub queued_ms: Option<u64>,
    /// `x-nthpool-rpm-remaining`, when the pool has an RPM gate.
    #[serde(skip)]
    pub rpm_remaining: Option<u32>,
}

impl Grant {
    pub(crate) fn read_headers(&mut self, headers: &HeaderMap) {
        fn num<T: std::str::FromStr>(h: &HeaderMap, name: &str) -> Option<T> {
            h.get(name)?.to_str().ok()?.trim().parse().ok()
        }
        self.remaining_slots = num(headers, "x-nthpool-remaining-slots");
        self.effective_limit = num(headers, "x-nthpool-effective-limit");
        self.queued_ms = num(headers, "x-nthpool-queued-ms");
        self.rpm_remaining = num(headers, "x-nthpool-rpm-remaining");
    }
}

/// What became of the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// Held, and renewed in the background.
    Held,
    /// Gone: the gateway no longer knows the slot (renew answered `404`, typically because a
    /// renewal came too late and the lease was reclaimed), or no renewal succeeded before the
    /// lease must have lapsed (the gateway was unreachable). Another caller may hold the slot
    /// now: stop the work the slot was guarding, if you can.
    Lost,
    /// The lease reached `requestDeadline` (the pool's request timeout) and cannot be renewed.
    /// It is still held until that instant, then reclaimed. Finish up and release.
    Capped,
    /// Released by this guard (or its drop).
    Released,
}

/// The state shared by the guard and its renewal task.
#[derive(Debug)]
struct Shared {
    state: watch::Sender<LeaseState>,
    lease_deadline: AtomicU64,
}

impl Shared {
    /// Moves out of `Held` (once: a later end does not overwrite an earlier one, except that
    /// a release always wins, so that `lost()` futures see the guard is gone).
    fn end(&self, to: LeaseState) {
        self.state.send_if_modified(|s| {
            let change = *s == LeaseState::Held || (to == LeaseState::Released && *s != to);
            if change {
                *s = to;
            }
            change
        });
    }
}

/// A held slot. Renews its lease in the background (a tokio task) until released or dropped.
///
/// Release it with [`release`](Self::release) to report the upstream's outcome. Dropping it
/// releases it in the background with no outcome (best effort: it needs a running tokio
/// runtime; otherwise the gateway reclaims the slot within one lease term).
#[derive(Debug)]
#[must_use = "dropping the guard releases the slot"]
pub struct SlotGuard {
    client: LockClient,
    grant: Grant,
    shared: Arc<Shared>,
    renewer: Option<JoinHandle<()>>,
    /// Set once the slot was released (or its release handed off); drop does nothing then.
    done: bool,
}

impl SlotGuard {
    /// Starts holding `grant`; `started` is a lower bound of when the gateway stamped the lease.
    pub(crate) fn start(client: LockClient, grant: Grant, started: Instant) -> SlotGuard {
        // A lease granted already at its cap (term not shorter than the request timeout)
        // cannot be renewed at all.
        let initial = if grant.lease_deadline >= grant.request_deadline {
            LeaseState::Capped
        } else {
            LeaseState::Held
        };
        let shared = Arc::new(Shared {
            state: watch::Sender::new(initial),
            lease_deadline: AtomicU64::new(grant.lease_deadline),
        });
        let renewer = (initial == LeaseState::Held).then(|| {
            tokio::spawn(renew_loop(
                client.clone(),
                grant.clone(),
                shared.clone(),
                started,
            ))
        });
        SlotGuard {
            client,
            grant,
            shared,
            renewer,
            done: false,
        }
    }

    /// The slot's id.
    #[must_use]
    pub fn slot_id(&self) -> &str {
        &self.grant.slot_id
    }

    /// The grant as answered by the gateway.
    #[must_use]
    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    /// Epoch ms: the lease deadline after the latest successful renewal.
    #[must_use]
    pub fn lease_deadline(&self) -> u64 {
        self.shared.lease_deadline.load(Ordering::Relaxed)
    }

    /// Epoch ms: the lease never extends past this instant.
    #[must_use]
    pub fn request_deadline(&self) -> u64 {
        self.grant.request_deadline
    }

    /// The lease's state now.
    #[must_use]
    pub fn state(&self) -> LeaseState {
        *self.shared.state.borrow()
    }

    /// A receiver of every change of the lease's state.
    #[must_use]
    pub fn watch(&self) -> watch::Receiver<LeaseState> {
        self.shared.state.subscribe()
    }

    /// Resolves when the lease stops being renewed: [`LeaseState::Lost`],
    /// [`LeaseState::Capped`], or [`LeaseState::Released`] once the guard is released or
    /// dropped. Meant for `tokio::select!` against the guarded work.
    pub fn lost(&self) -> impl std::future::Future<Output = LeaseState> + Send + 'static {
        let mut rx = self.shared.state.subscribe();
        async move {
            match rx.wait_for(|s| *s != LeaseState::Held).await {
                Ok(s) => *s,
                // Every sender is gone, so the guard is too.
                Err(_) => LeaseState::Released,
            }
        }
    }

    /// Releases the slot, reporting what the upstream answered (`None`: no report). Returns
    /// whether the slot was still held (`false`: it had already been reclaimed).
    ///
    /// On an error the slot is not retried: the gateway reclaims it within one lease term.
    pub async fn release(mut self, outcome: impl Into<Option<Outcome>>) -> Result<bool, LockError> {
        self.stop();
        let outcome = outcome.into();
        self.client
            .release(&self.grant.slot_id, outcome.as_ref())
            .await
    }

    /// Ends the renewals and marks the guard released.
    fn stop(&mut self) {
        self.done = true;
        if let Some(task) = self.renewer.take() {
            task.abort();
        }
        self.shared.end(LeaseState::Released);
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.stop();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let client = self.client.clone();
                let slot = self.grant.slot_id.clone();
                runtime.spawn(async move {
                    if let Err(e) = client.release(&slot, None).await {
                        tracing::debug!(pool = client.pool(), error = %e,
                            "release on drop failed; the lease lapses within one term");
                    }
                });
            }
            Err(_) => tracing::debug!(
                pool = self.client.pool(),
                "guard dropped outside a tokio runtime; the lease lapses within one term"
            ),
        }
    }
}

/// Renews every `renewIntervalMs` until the lease is gone or capped, or the task is aborted.
/// The end of the lease is logged at `info` only: the holder learns of it through the state.
///
/// `expires` is a local lower bound of when the lease lapses (the send time of the last
/// successful renewal plus the term): when it passes with no renewal through, the gateway has
/// reclaimed or may reclaim the slot at any moment, so the holder is told it is lost rather
/// than left believing in a slot another caller may have.
async fn renew_loop(client: LockClient, grant: Grant, shared: Arc<Shared>, started: Instant) {
    let interval = Duration::from_millis(grant.renew_interval_ms.max(1));
    let term = Duration::from_millis(grant.term_ms);
    let mut expires = started + term;
    let mut next = started + interval;
    loop {
        tokio::time::sleep_until(next.into()).await;
        let sent = Instant::now();
        let left = expires.saturating_duration_since(sent);
        if left.is_zero() {
            tracing::info!(
                pool = client.pool(),
                "no renewal got through within the lease term; lease lost"
            );
            shared.end(LeaseState::Lost);
            return;
        }
        match client.renew(&grant.slot_id, left).await {
            Ok(deadline) => {
                shared.lease_deadline.store(deadline, Ordering::Relaxed);
                if deadline >= grant.request_deadline {
                    // The gateway would answer the next renewal 409: say so now, while
                    // the holder still has the rest of the lease to wrap up.
                    tracing::info!(pool = client.pool(), "lease capped at its request deadline");
                    shared.end(LeaseState::Capped);
                    return;
                }
                expires = sent + term;
                next = sent + interval;
            }
            Err(RenewFailure::NotFound) => {
                tracing::info!(pool = client.pool(), "renew: slot not found; lease lost");
                shared.end(LeaseState::Lost);
                return;
            }
            Err(RenewFailure::Capped) => {
                tracing::info!(
                    pool = client.pool(),
                    "renew: lease capped at its request deadline"
                );
                shared.end(LeaseState::Capped);
                return;
            }
            Err(RenewFailure::Other(e)) => {
                tracing::warn!(pool = client.pool(), error = %e, "renew failed; retrying");
                next = Instant::now() + (interval / 4).max(MIN_RETRY);
            }
        }
    }
}
