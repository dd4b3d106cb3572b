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
use nthbouncer_store::{LeaseRecord, Store};
use tokio::sync::{mpsc, oneshot};

use crate::pools::Pools;

const MAX_BATCH: usize = 1024;

enum Op {
    Granted(LeaseRecord, oneshot::Sender<Result<(), String>>),
    Released(String),
}

/// Writes lease grants and releases in batches, one transaction per batch.
#[derive(Clone)]
pub struct LeaseBook {
    tx: mpsc::Sender<Op>,
}

impl LeaseBook {
    pub fn start(store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> LeaseBook {
        let (tx, mut rx) = mpsc::channel::<Op>(16_384);
        tokio::spawn(async move {
            let mut ops = Vec::with_capacity(MAX_BATCH);
            while rx.recv_many(&mut ops, MAX_BATCH).await > 0 {
                let mut granted = Vec::new();
                let mut waiting = Vec::new();
                let mut released = Vec::new();
                for op in ops.drain(..) {
                    match op {
                        Op::Granted(lease, done) => {
                            granted.push(lease);
                            waiting.push(done);
                        }
                        Op::Released(id) => released.push(id),
                    }
                }
                let outcome = store
                    .apply_leases(&granted, &released, clock.now_ms())
                    .await
                    .map_err(|e| e.to_string());
                if let Err(e) = &outcome {
                    tracing::warn!(error = %e, "lease book write failed");
                }
                for done in waiting {
                    let _ = done.send(outcome.clone());
                }
            }
        });
        LeaseBook { tx }
    }

    /// Returns once the grant is committed, so a lease its holder knows of is always on record.
    pub async fn granted(&self, lease: LeaseRecord) -> Result<(), String> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send(Op::Granted(lease, done))
            .await
            .map_err(|_| "lease book stopped".to_string())?;
        wait.await.map_err(|_| "lease book stopped".to_string())?
    }

    /// Forgets a released lease (not waited for: a record left behind only holds a slot back
    /// for one lease term after a restart).
    pub fn released(&self, slot_id: String) {
        let _ = self.tx.try_send(Op::Released(slot_id));
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
