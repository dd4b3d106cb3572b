//! Jobs on a store several nodes share (PostgreSQL): a node runs only the jobs it has claimed.
//!
//! A job accepted here is claimed by this node with its insert, and its runner starts at once.
//! Every [`pass_interval`] the claim pass ([`nthbouncer_store::JobStore::claim_jobs`]) renews the claims of the
//! jobs this process runs (the [`Running`] set) and takes over the unfinished jobs no live node
//! holds: those of a node that died (its claims lapse one lease after its last renewal), and
//! those never claimed (moved in by `migrate-store`). Each job taken gets its runner and its
//! place in the pool's backlog. A runner whose claim another node took over meanwhile (this node
//! stalled past the lease) is refused its next attempt by the store and ends.
//!
//! The pass also wakes the webhook dispatcher, whose scan then picks up the deliveries whose
//! claims lapsed on a dead node.
//!
//! A node stopping gracefully gives its claims back once its runners have stopped
//! ([`release_on_stop`]): the jobs it accepted or took over but has not started (or put back
//! after an attempt the origin cannot have acted on) are taken by another node's next claim
//! pass, not one claim lease later. A job whose attempt it abandoned (the shutdown grace ran
//! out mid-fetch) keeps its claim until the lease lapses, so the origin is never called for it
//! by two nodes at once.
//!
//! On a store of one node (SQLite) there are no claims: every unfinished job is resumed at start
//! ([`super::sweep::resume`]) and [`Running`] only keeps one job from two runners.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;

use crate::jobs::runner::spawn_runner;
use crate::jobs::Jobs;

/// Jobs taken over per store call; a pass goes on while pages come back full.
pub const CLAIM_PAGE: u32 = 256;

/// The jobs with a runner in this process.
#[derive(Default)]
pub struct Running {
    ids: Mutex<HashSet<String>>,
}

/// A job's entry in [`Running`], removed on drop (the runner ended).
pub struct Entry {
    running: Arc<Running>,
    id: String,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.running.ids.lock().remove(&self.id);
    }
}

impl Running {
    pub fn new() -> Arc<Running> {
        Arc::new(Running::default())
    }

    /// The entry of a runner for job `id`; `None` if one runs it already.
    pub fn enter(self: &Arc<Self>, id: &str) -> Option<Entry> {
        if !self.ids.lock().insert(id.to_string()) {
            return None;
        }
        Some(Entry {
            running: self.clone(),
            id: id.to_string(),
        })
    }

    /// The ids of the jobs running now.
    pub fn ids(&self) -> Vec<String> {
        self.ids.lock().iter().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.ids.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How often the claim pass runs for a claim lease of `lease_ms`: four times a lease (so a
/// late pass or two does not let a live node's claim lapse), at most every 5 s and at least
/// every 250 ms.
pub fn pass_interval(lease_ms: u64) -> Duration {
    Duration::from_millis((lease_ms / 4).clamp(250, 5_000))
}

/// One claim pass: renews the claims of the jobs this process runs, starts a runner for every
/// job taken over, and reads every pool's unfinished jobs for the backlog's bound. A draining
/// server renews but takes nothing. Returns how many jobs it took; `None` if the store has no
/// claims (one node).
pub async fn claim_pass(state: &Arc<Jobs>) -> nthbouncer_store::Result<Option<u64>> {
    let mut taken = 0u64;
    loop {
        let limit = if state.drain.is_draining() {
            0
        } else {
            CLAIM_PAGE
        };
        let held = state.running.ids();
        let Some(page) = state.store.claim_jobs(state.now(), &held, limit).await? else {
            return Ok(None);
        };
        let full = page.len() as u32 >= limit && limit > 0;
        for unfinished in page {
            let pending = state.backlog.adopt(&unfinished.job.pool);
            spawn_runner(state.clone(), unfinished.job, pending);
            taken += 1;
        }
        if !full {
            break;
        }
    }
    // `async.max_pending` is a pool's bound, not each node's: the other nodes' jobs count too.
    let stored = state.store.unfinished_job_counts().await?;
    state.backlog.observe_store(&stored);
    Ok(Some(taken))
}

/// Runs the claim pass every [`pass_interval`] until the server stops.
pub async fn run_claims(state: Arc<Jobs>, lease_ms: u64) {
    let mut tick = tokio::time::interval(pass_interval(lease_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            // Biased: once stopping, no further pass starts (the release waits for this loop).
            biased;
            _ = state.stopping.cancelled() => return,
            _ = tick.tick() => {}
        }
        match claim_pass(&state).await {
            Ok(Some(taken)) if taken > 0 => {
                tracing::info!(jobs = taken, "took over unfinished jobs no live node holds");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "the job claim pass failed; retrying"),
        }
        // Deliveries whose claims lapsed on a node that died are due again.
        state.notify_deliveries();
    }
}

/// How long a stopping node waits for its claim loop and webhook dispatcher to end (each
/// finishes the store call it is in, then sees `stopping`), and for the release itself: at most
/// twice this after the grace, short of the 10 s systemd's `TimeoutStopSec` in the README
/// leaves past the default grace (an unreachable store costs this much, then the claims lapse).
const STOP_WAIT: Duration = Duration::from_secs(3);

/// Whether `task` ended within [`STOP_WAIT`]; aborted if not.
async fn ended(mut task: JoinHandle<()>) -> bool {
    if tokio::time::timeout(STOP_WAIT, &mut task).await.is_ok() {
        return true;
    }
    task.abort();
    false
}

/// The last step of a graceful stop on a shared store, once the drain is over and `stopping`
/// is cancelled: waits for the claim loop (`claims`) and the webhook dispatcher (`webhooks`) to
/// end, so neither claims anything after the release, then gives this node's claims back
/// ([`nthbouncer_store::JobStore::release_claims`]). Deliveries go back only if every webhook
/// attempt was recorded (`attempts_idle`) and the dispatcher has ended: a delivery being sent
/// keeps its claim. A loop that did not end in time may still claim a page after the release;
/// those rows wait one lease, as a crashed node's do. A failure is logged: the claims then
/// lapse with their lease.
pub async fn release_on_stop(
    state: &Arc<Jobs>,
    claims: JoinHandle<()>,
    webhooks: JoinHandle<()>,
    attempts_idle: bool,
) {
    let (_, dispatcher_ended) = tokio::join!(ended(claims), ended(webhooks));
    let deliveries = attempts_idle && dispatcher_ended;
    match tokio::time::timeout(STOP_WAIT, state.store.release_claims(deliveries)).await {
        Ok(Ok(released)) => tracing::info!(
            jobs = released.jobs,
            deliveries = released.deliveries,
            "gave back this node's claims: other nodes take those jobs and deliveries now"
        ),
        Ok(Err(e)) => tracing::warn!(error = %e,
            "cannot give back this node's claims; they lapse with their lease"),
        Err(_) => {
            tracing::warn!("giving back this node's claims timed out; they lapse with their lease")
        }
    }
}
