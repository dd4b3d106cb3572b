//! The lease book: lock leases granted and not yet released, kept in the store so that a
//! restart does not hand their slots out again while their holders may still be calling the
//! origin. At start, each outstanding lease of a pool takes a slot that nobody renews, so it is
//! reclaimed one lease term later, by when a live holder has tried to renew, got `404`, and
//! been told its lease is lost.
//!
//! Owns the batching of those writes and the reservation at start. It must not make admission
//! decisions (the gate does) nor know HTTP.

use std::sync::Arc;

use nthbouncer_coord::{AcquireRequest, Clock, Priority, SlotKind};
use nthbouncer_store::{LeaseRecord, Store, StoreError};

use crate::core::batch::{BatchConfig, Batcher, Commit, CommitError};
use crate::pools::Pools;

const CONFIG: BatchConfig = BatchConfig {
    capacity: 16_384,
    max_batch: 1024,
    min_interval: None,
};

enum Op {
    Granted(LeaseRecord),
    Released(String),
}

struct Apply {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
}

impl Commit for Apply {
    type Item = Op;
    type Done = ();
    async fn commit(&mut self, ops: Vec<Op>) -> Result<Vec<()>, StoreError> {
        let n = ops.len();
        let mut granted = Vec::new();
        let mut released = Vec::new();
        for op in ops {
            match op {
                Op::Granted(lease) => granted.push(lease),
                Op::Released(id) => released.push(id),
            }
        }
        let now = self.clock.now_ms();
        self.store.apply_leases(&granted, &released, now).await?;
        Ok(vec![(); n])
    }
}

/// Writes lease grants and releases in batches, one transaction per batch.
///
/// Off with Redis coordination: leases then live in Redis, which outlives any one node's
/// restart, and a lease granted on one node may be released on another, so a node's own
/// record would only hold back slots Redis already accounts for.
#[derive(Clone)]
pub struct LeaseBook(Option<Batcher<Op, ()>>);

impl LeaseBook {
    pub fn start(store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> LeaseBook {
        LeaseBook(Some(Batcher::start(Apply { store, clock }, CONFIG).0))
    }

    /// A book that records nothing (the leases live in the shared coordination store).
    pub fn off() -> LeaseBook {
        LeaseBook(None)
    }

    /// Returns once the grant is committed, so a lease its holder knows of is always on record.
    pub async fn granted(&self, lease: LeaseRecord) -> Result<(), CommitError> {
        match &self.0 {
            Some(book) => book.submit(Op::Granted(lease)).await,
            None => Ok(()),
        }
    }

    /// Forgets a released lease (not waited for: a record left behind only holds a slot back
    /// for one lease term after a restart).
    pub fn released(&self, slot_id: String) {
        if let Some(book) = &self.0 {
            book.enqueue(Op::Released(slot_id));
        }
    }
}

/// At start, before any request is served: holds back one slot per outstanding lease.
pub async fn reserve_outstanding(store: &dyn Store, pools: &Pools, now: u64) {
    let leases = match store.outstanding_leases(now).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the outstanding lock leases");
            return;
        }
    };
    let mut held = 0u32;
    for lease in &leases {
        let Some(pool) = pools.get(&lease.pool) else {
            continue; // the pool is gone, and its slots with it
        };
        let request = AcquireRequest {
            fairness_key: 0,
            priority: Priority::High,
            wait_ms: 0,
            kind: SlotKind::Lease,
        };
        // Never renewed: the gate reclaims it one lease term from now.
        if pool.gate.acquire(request).await.is_ok() {
            held += 1;
        }
    }
    if held > 0 {
        tracing::info!(
            leases = held,
            "holding back the slots of lock leases granted before the restart for one lease term"
        );
    }
}
