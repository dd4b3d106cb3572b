//! Per pool, how many jobs are accepted and not yet terminal, held to `async.max_pending`.
//!
//! Counted in memory, cheaply: a request that would become a job reserves a place
//! ([`Backlog::reserve`]) before its body is read, and the reservation ([`Pending`]) travels with
//! the job to its runner, which gives it back when the job is done (terminal, or past its
//! deadline for the sweeper to expire). At start-up every resumed job takes its place again
//! ([`Backlog::adopt`]) before the server serves anything, so the count starts from the store's.
//!
//! On a store several nodes share, the bound is the pool's, not each node's: every claim pass
//! reads the store's count of unfinished jobs per pool ([`Backlog::observe_store`]) and the
//! jobs pending on other nodes count against the bound here too. Between two passes (at most
//! 5 s) another node's new jobs are not seen yet, so the bound can be passed by what the other
//! nodes accept in that time; without this, each of N nodes would take `max_pending` jobs.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// Jobs pending per pool.
#[derive(Default)]
pub struct Backlog {
    counts: Mutex<HashMap<String, u64>>,
    /// Per pool, the unfinished jobs in a shared store that are not pending here (another
    /// node's), as of the last claim pass. Empty on a store of one node.
    elsewhere: Mutex<HashMap<String, u64>>,
}

/// One job's place in its pool's backlog, given back on drop.
pub struct Pending {
    backlog: Arc<Backlog>,
    pool: String,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut counts = self.backlog.counts.lock();
        if let Some(n) = counts.get_mut(&self.pool) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.pool);
            }
        }
    }
}

impl Backlog {
    pub fn new() -> Arc<Backlog> {
        Arc::new(Backlog::default())
    }

    /// A place for one more job of `pool`, if fewer than `max` are pending.
    pub fn reserve(self: &Arc<Self>, pool: &str, max: u64) -> Option<Pending> {
        let elsewhere = self.elsewhere.lock().get(pool).copied().unwrap_or(0);
        let mut counts = self.counts.lock();
        let n = counts.entry(pool.to_string()).or_default();
        if n.saturating_add(elsewhere) >= max {
            return None;
        }
        *n += 1;
        Some(self.pending(pool))
    }

    /// The place of a job already accepted (resumed at start-up), whatever the bound.
    pub fn adopt(self: &Arc<Self>, pool: &str) -> Pending {
        *self.counts.lock().entry(pool.to_string()).or_default() += 1;
        self.pending(pool)
    }

    /// Jobs of `pool` pending now.
    pub fn count(&self, pool: &str) -> u64 {
        self.counts.lock().get(pool).copied().unwrap_or(0)
    }

    /// Takes in a shared store's count of unfinished jobs per pool (`stored`, every node's):
    /// what is not pending here is pending elsewhere. A job accepted here and not yet committed
    /// is counted here only, so the difference never counts it twice.
    pub fn observe_store(&self, stored: &[(String, u64)]) {
        let counts = self.counts.lock();
        let elsewhere = stored
            .iter()
            .map(|(pool, n)| {
                let here = counts.get(pool).copied().unwrap_or(0);
                (pool.clone(), n.saturating_sub(here))
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        drop(counts);
        *self.elsewhere.lock() = elsewhere;
    }

    fn pending(self: &Arc<Self>, pool: &str) -> Pending {
        Pending {
            backlog: self.clone(),
            pool: pool.to_string(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn reserves_up_to_the_bound_and_gives_places_back() {
        let backlog = Backlog::new();
        let a = backlog.reserve("p", 2).unwrap();
        let _b = backlog.reserve("p", 2).unwrap();
        assert!(backlog.reserve("p", 2).is_none());
        assert!(backlog.reserve("q", 2).is_some(), "pools are counted apart");
        drop(a);
        assert_eq!(backlog.count("p"), 1);
        let _c = backlog.reserve("p", 2).unwrap();
        // Resumed jobs count even past the bound.
        let _d = backlog.adopt("p");
        assert_eq!(backlog.count("p"), 3);
        assert!(backlog.reserve("p", 3).is_none());
    }

    #[test]
    fn jobs_pending_on_other_nodes_count_against_the_bound() {
        let backlog = Backlog::new();
        let mut held = vec![backlog.reserve("p", 5).unwrap()];
        // The store holds 4 of `p` (1 of them this node's) and 2 of `q`, none of them here.
        backlog.observe_store(&[("p".into(), 4), ("q".into(), 2)]);
        held.push(backlog.reserve("p", 5).unwrap());
        assert!(backlog.reserve("p", 5).is_none(), "2 here, 3 elsewhere");
        held.push(backlog.reserve("q", 3).unwrap());
        assert!(backlog.reserve("q", 3).is_none(), "1 here, 2 elsewhere");
        // Once the others' jobs finish, their places are free again.
        backlog.observe_store(&[("p".into(), 2)]);
        held.push(backlog.reserve("p", 5).unwrap());
        held.push(backlog.reserve("q", 3).unwrap());
        assert_eq!(
            backlog.count("p"),
            3,
            "only this node's own jobs are counted here"
        );
        assert_eq!(held.len(), 5);
    }
}
