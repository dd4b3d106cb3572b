//! The lease book: lock leases granted and not yet released, kept in the store so that a
//! restart does not hand their slots out again while their holders may still be calling the
//! origin. At start, each outstanding lease of a pool takes a slot that nobody renews, so it is
//! reclaimed one lease term later, by when a live holder has tried to renew, got `404`, and
//! been told its lease is lost.
//!
//! Owns the batching of those writes (on a thread of its own when the store can write without
//! a runtime, as SQLite can) and the reservation at start. It must not make admission
//! decisions (the gate does) nor know HTTP.

use std::sync::Arc;

use nthbouncer_coord::{AcquireRequest, Clock, Priority, SlotKind};
use nthbouncer_store::{LeaseRecord, LeaseWriter, Store, StoreError};
use tokio::sync::oneshot;

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
pub struct LeaseBook(Book);

#[derive(Clone)]
enum Book {
    Off,
    /// Through the store's async API, by the group-commit writer task.
    Batched(Batcher<Op, ()>),
    /// On a thread of the book's own, with the store's blocking writer (SQLite).
    Thread(OwnThread),
}

type Reply = oneshot::Sender<Result<(), CommitError>>;

/// What the book's thread is handed.
enum ToThread {
    Grant(LeaseRecord, Reply),
    /// Commit the releases waiting now (a stopping server's last write).
    Flush(Reply),
}

/// Releases wait at most this long for a grant's commit to go with, before the book's thread
/// commits them on their own.
const RELEASES_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The handle of the book's own thread.
#[derive(Clone)]
struct OwnThread {
    /// Grants, each with its caller's reply, and flushes. Unbounded: each caller waits for its
    /// reply, so there are never more than the acquires in flight.
    grants: std::sync::mpsc::Sender<ToThread>,
    /// Releases wait here without waking the thread, for the next commit: a grant's, or the
    /// thread's own after [`RELEASES_WAIT`]. (A record left behind a while longer only holds
    /// its slot back for a lease term after a crash, as any release not yet written does.)
    released: Arc<parking_lot::Mutex<Vec<String>>>,
}

impl LeaseBook {
    pub fn start(store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> LeaseBook {
        if let Some(writer) = store.lease_writer() {
            // Why a thread: a grant waits for its commit before its holder is answered, and
            // from a connection thread the way through the runtime's writer task and blocking
            // pool wakes four threads in turn; at low load each wake-up is most of the cost
            // (bench/RESULTS.md, "The lease book on its own thread").
            let (tx, rx) = std::sync::mpsc::channel();
            let handle = OwnThread {
                grants: tx,
                released: Arc::default(),
            };
            let released = handle.released.clone();
            let thread_clock = clock.clone();
            let spawned = std::thread::Builder::new()
                .name("nthbouncer-leases".into())
                .spawn(move || write_on_own_thread(writer, thread_clock, rx, &released));
            match spawned {
                Ok(_) => return LeaseBook(Book::Thread(handle)),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start the lease book's thread; writing through the runtime")
                }
            }
        }
        LeaseBook(Book::Batched(
            Batcher::start(Apply { store, clock }, CONFIG).0,
        ))
    }

    /// A book that records nothing (the leases live in the shared coordination store).
    pub fn off() -> LeaseBook {
        LeaseBook(Book::Off)
    }

    /// Returns once the grant is committed, so a lease its holder knows of is always on record.
    pub async fn granted(&self, lease: LeaseRecord) -> Result<(), CommitError> {
        match &self.0 {
            Book::Off => Ok(()),
            Book::Batched(book) => book.submit(Op::Granted(lease)).await,
            Book::Thread(book) => {
                let (reply, done) = oneshot::channel();
                book.grants
                    .send(ToThread::Grant(lease, reply))
                    .map_err(|_| CommitError::Stopped)?;
                done.await.map_err(|_| CommitError::Stopped)?
            }
        }
    }

    /// Forgets a released lease (not waited for: a record left behind only holds a slot back
    /// for one lease term after a restart).
    pub fn released(&self, slot_id: String) {
        match &self.0 {
            Book::Off => {}
            Book::Batched(book) => {
                book.enqueue(Op::Released(slot_id));
            }
            Book::Thread(book) => book.released.lock().push(slot_id),
        }
    }

    /// Waits until the releases handed over so far are on record (a stopping server, so that
    /// a restart does not hold back the slots of leases released just before).
    pub async fn flush(&self) {
        match &self.0 {
            Book::Off => {}
            Book::Batched(book) => book.flush().await,
            Book::Thread(book) => {
                let (reply, done) = oneshot::channel();
                if book.grants.send(ToThread::Flush(reply)).is_ok() {
                    let _ = done.await;
                }
            }
        }
    }
}

/// The book's thread: commits the grants that arrived while the previous commit ran (up to a
/// batch) and the releases waiting, in one transaction; with no grant coming, the releases
/// every [`RELEASES_WAIT`]. Ends once every handle is gone, after writing what is left.
fn write_on_own_thread(
    mut writer: Box<dyn LeaseWriter>,
    clock: Arc<dyn Clock>,
    grants: std::sync::mpsc::Receiver<ToThread>,
    released: &parking_lot::Mutex<Vec<String>>,
) {
    use std::sync::mpsc::RecvTimeoutError;
    let mut granted = Vec::new();
    let mut replies = Vec::new();
    loop {
        let stopping = match grants.recv_timeout(RELEASES_WAIT) {
            Ok(first) => {
                let mut next = Some(first);
                while let Some(msg) = next {
                    match msg {
                        ToThread::Grant(lease, reply) => {
                            granted.push(lease);
                            replies.push(reply);
                        }
                        ToThread::Flush(reply) => replies.push(reply),
                    }
                    next = if granted.len() < CONFIG.max_batch {
                        grants.try_recv().ok()
                    } else {
                        None
                    };
                }
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        let gone = std::mem::take(&mut *released.lock());
        if !replies.is_empty() || !gone.is_empty() {
            let now = clock.now_ms();
            // A panic must not end the thread (every later grant would then be refused as if
            // the store were gone): it fails this batch's callers, like a failed commit.
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                writer.apply(&granted, &gone, now)
            }))
            .unwrap_or_else(|_| Err(StoreError::Backend("the lease writer panicked".into())));
            granted.clear();
            let outcome = outcome.map_err(|e| {
                tracing::warn!(error = %e, "lease records could not be committed");
                CommitError::Failed(Arc::new(e))
            });
            for reply in replies.drain(..) {
                let _ = reply.send(outcome.clone());
            }
        }
        if stopping {
            return;
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use nthbouncer_coord::ManualClock;
    use nthbouncer_store::sqlite::SqliteStore;

    fn lease(i: u32) -> LeaseRecord {
        LeaseRecord {
            slot_id: format!("slot-{i:03}"),
            pool: "p".into(),
            request_deadline: 1_000_000,
        }
    }

    /// Many grants at once from several tasks, on the book's own thread: each is on record when
    /// its `granted` returns, and a release is gone from the record by the next grant's commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grants_are_on_record_when_answered_and_releases_follow() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open_in_dir(dir.path()).unwrap());
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(1_000));
        let book = LeaseBook::start(store.clone(), clock);
        assert!(
            matches!(book.0, Book::Thread(_)),
            "SQLite writes on the book's thread"
        );

        let grants = (0..200).map(|i| {
            let book = book.clone();
            let store = store.clone();
            tokio::spawn(async move {
                book.granted(lease(i)).await.unwrap();
                let on_record = store.outstanding_leases(1_000).await.unwrap();
                assert!(on_record.iter().any(|l| l.slot_id == lease(i).slot_id));
            })
        });
        for g in futures_util::future::join_all(grants).await {
            g.unwrap();
        }
        for i in 0..150 {
            book.released(lease(i).slot_id);
        }
        // Releases go with the next commit: once this grant is committed, so are they.
        book.granted(lease(999)).await.unwrap();
        let mut left: Vec<String> = store
            .outstanding_leases(1_000)
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.slot_id)
            .collect();
        left.sort();
        let mut expected: Vec<String> = (150..200).chain([999]).map(|i| lease(i).slot_id).collect();
        expected.sort();
        assert_eq!(left, expected);
    }

    /// A release waits for the next commit; a flush (a stopping server) is one, with no grant.
    #[tokio::test]
    async fn a_flush_puts_the_waiting_releases_on_record() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open_in_dir(dir.path()).unwrap());
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(1_000));
        let book = LeaseBook::start(store.clone(), clock);
        book.granted(lease(1)).await.unwrap();
        book.granted(lease(2)).await.unwrap();
        book.released(lease(1).slot_id);
        book.flush().await;
        let left: Vec<String> = store
            .outstanding_leases(1_000)
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.slot_id)
            .collect();
        assert_eq!(left, vec![lease(2).slot_id]);
    }
}
