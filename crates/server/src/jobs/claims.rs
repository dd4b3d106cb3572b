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
//! On a store of one node (SQLite) there are no claims: every unfinished job is resumed at start
//! ([`super::sweep::resume`]) and [`Running`] only keeps one job from two runners.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

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

/// One claim pass: renews the claims of the jobs this process runs and starts a runner for
/// every job taken over. A draining server renews but takes nothing. Returns how many jobs it
/// took; `None` if the store has no claims (one node).
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
            return Ok(Some(taken));
        }
    }
}

/// Runs the claim pass every [`pass_interval`] until the server stops.
pub async fn run_claims(state: Arc<Jobs>, lease_ms: u64) {
    let mut tick = tokio::time::interval(pass_interval(lease_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
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
