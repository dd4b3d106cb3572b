//! The lease book: lock leases granted and not yet released, kept in the store so that a
//! restart does not hand their slots out again while their holders may still be calling the
//! origin. At start, each outstanding record of a pool takes a slot that nobody renews, so it
//! is reclaimed one lease term later, by when a live holder has tried to renew, got `404`, and
//! been told its lease is lost.
//!
//! What goes on record is each pool's holdback, not each lease ([`super::holdback`]): a grant
//! waits for a commit only when its pool's live leases outgrow the holdback on record, and a
//! release waits for nothing. The book's own thread writes, with the store's blocking writer
//! (SQLite) or, for a store without one (PostgreSQL), by driving its async write on the
//! runtime the book was started on.
//!
//! Owns the writing of those records and the reservation at start. It must not make admission
//! decisions (the gate does) nor know HTTP.

use std::sync::Arc;

use nthbouncer_coord::{AcquireRequest, Clock, Priority, SlotKind};
use nthbouncer_store::{LeaseRecord, LeaseWriter, Store, StoreError};
use tokio::sync::oneshot;

use super::holdback::Holdbacks;
use crate::core::batch::CommitError;
use crate::pools::Pools;

/// Keeps each pool's holdback on record.
///
/// Off with Redis coordination: leases then live in Redis, which outlives any one node's
/// restart, and a lease granted on one node may be released on another, so a node's own
/// record would only hold back slots Redis already accounts for.
#[derive(Clone)]
pub struct LeaseBook(Option<OwnThread>);

type Reply = oneshot::Sender<Result<(), CommitError>>;

/// What the book's thread is handed.
enum ToThread {
    /// A grant its pool's holdback does not cover yet: answered once a raised holdback is
    /// committed.
    Grant(Reply),
    /// Lower every holdback to its live leases now (a stopping server's last write).
    Flush(Reply),
}

/// How often (ms, on the book's clock) its thread lowers holdbacks to the leases still live:
/// after a crash, a pool holds back at most what it held within this long before.
const LOWER_EVERY_MS: u64 = 1_000;

/// The handle of the book's own thread.
#[derive(Clone)]
struct OwnThread {
    /// Grants waiting for a raised holdback, each with its caller's reply, and flushes.
    /// Unbounded: each caller waits for its reply, so there are never more than the acquires
    /// in flight.
    to_thread: std::sync::mpsc::Sender<ToThread>,
    holdbacks: Arc<parking_lot::Mutex<Holdbacks>>,
}

/// A store without a blocking writer, written from the book's thread through the runtime.
struct OnRuntime {
    store: Arc<dyn Store>,
    runtime: tokio::runtime::Handle,
}

impl LeaseWriter for OnRuntime {
    fn apply(
        &mut self,
        granted: &[LeaseRecord],
        released: &[String],
        now: u64,
    ) -> Result<(), StoreError> {
        self.runtime
            .block_on(self.store.apply_leases(granted, released, now))
    }
}

impl LeaseBook {
    /// Starts the book's thread. Called on the runtime (a store without a blocking writer is
    /// written through it).
    pub fn start(store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> std::io::Result<LeaseBook> {
        // Why a thread: a grant that waits for a commit, from a connection thread through the
        // runtime's writer task and blocking pool, wakes four threads in turn; at low load each
        // wake-up is most of the cost (bench/RESULTS.md, "The lease book on its own thread").
        let writer = match store.lease_writer() {
            Some(writer) => writer,
            None => Box::new(OnRuntime {
                store,
                runtime: tokio::runtime::Handle::current(),
            }),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let handle = OwnThread {
            to_thread: tx,
            holdbacks: Arc::new(parking_lot::Mutex::new(Holdbacks::of_book(clock.now_ms()))),
        };
        let holdbacks = handle.holdbacks.clone();
        std::thread::Builder::new()
            .name("nthbouncer-leases".into())
            .spawn(move || write_on_own_thread(writer, clock, rx, &holdbacks))?;
        Ok(LeaseBook(Some(handle)))
    }

    /// A book that records nothing (the leases live in the shared coordination store).
    pub fn off() -> LeaseBook {
        LeaseBook(None)
    }

    /// Returns once the grant is on record (within its pool's holdback), so a lease its holder
    /// knows of always is. On an error the grant is forgotten: its slot goes back.
    pub async fn granted(&self, lease: LeaseRecord) -> Result<(), CommitError> {
        let Some(book) = &self.0 else {
            return Ok(());
        };
        let Some(slot_id) = book.holdbacks.lock().grant(lease) else {
            return Ok(());
        };
        let (reply, done) = oneshot::channel();
        let outcome = match book.to_thread.send(ToThread::Grant(reply)) {
            Ok(()) => done.await.unwrap_or(Err(CommitError::Stopped)),
            Err(_) => Err(CommitError::Stopped),
        };
        if outcome.is_err() {
            book.holdbacks.lock().release(&slot_id);
        }
        outcome
    }

    /// Forgets a released lease (not waited for: its pool's holdback is lowered within
    /// [`LOWER_EVERY_MS`], and a record left behind only holds a slot back for one lease term
    /// after a restart).
    pub fn released(&self, slot_id: &str) {
        if let Some(book) = &self.0 {
            book.holdbacks.lock().release(slot_id);
        }
    }

    /// Waits until the holdbacks on record are what is still held (a stopping server, so that
    /// a restart does not hold back the slots of leases released just before).
    pub async fn flush(&self) {
        if let Some(book) = &self.0 {
            let (reply, done) = oneshot::channel();
            if book.to_thread.send(ToThread::Flush(reply)).is_ok() {
                let _ = done.await;
            }
        }
    }
}

/// The book's thread: raises the holdbacks that grants outgrew (for all the grants that
/// arrived while the previous commit ran, in one transaction), and every [`LOWER_EVERY_MS`] lowers
/// them to the leases still live. Ends once every handle is gone, after lowering a last time.
fn write_on_own_thread(
    mut writer: Box<dyn LeaseWriter>,
    clock: Arc<dyn Clock>,
    to_thread: std::sync::mpsc::Receiver<ToThread>,
    holdbacks: &parking_lot::Mutex<Holdbacks>,
) {
    use std::sync::mpsc::RecvTimeoutError;
    let mut replies = Vec::new();
    let mut next_lowering = clock.monotonic_ms().saturating_add(LOWER_EVERY_MS);
    loop {
        let wait = next_lowering.saturating_sub(clock.monotonic_ms());
        let wait = std::time::Duration::from_millis(wait.clamp(1, LOWER_EVERY_MS));
        let (stopping, mut lower) = match to_thread.recv_timeout(wait) {
            Ok(first) => {
                let mut flush = false;
                let mut next = Some(first);
                while let Some(msg) = next {
                    match msg {
                        ToThread::Grant(reply) => replies.push(reply),
                        ToThread::Flush(reply) => {
                            flush = true;
                            replies.push(reply);
                        }
                    }
                    next = to_thread.try_recv().ok();
                }
                (false, flush)
            }
            Err(RecvTimeoutError::Timeout) => (false, false),
            Err(RecvTimeoutError::Disconnected) => (true, true),
        };
        if clock.monotonic_ms() >= next_lowering {
            lower = true;
        }
        if lower {
            next_lowering = clock.monotonic_ms().saturating_add(LOWER_EVERY_MS);
        }
        let now = clock.now_ms();
        // Planned after the grants were received: each counted itself in before sending, so
        // the plan covers every grant whose reply is in `replies`.
        let plan = holdbacks.lock().plan(now, lower);
        let outcome = if plan.is_empty() {
            Ok(())
        } else {
            let (written, deleted) = plan.records();
            // A panic must not end the thread (every later grant would then be refused as if
            // the store were gone): it fails this batch's callers, like a failed commit.
            let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                writer.apply(&written, &deleted, now)
            }))
            .unwrap_or_else(|_| Err(StoreError::Backend("the lease writer panicked".into())));
            let mut holdbacks = holdbacks.lock();
            match written {
                Ok(()) => {
                    holdbacks.committed(&plan);
                    Ok(())
                }
                Err(e) => {
                    holdbacks.failed(&plan);
                    tracing::warn!(error = %e, "lease records could not be committed");
                    Err(CommitError::Failed(Arc::new(e)))
                }
            }
        };
        for reply in replies.drain(..) {
            let _ = reply.send(outcome.clone());
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
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn lease(i: u32) -> LeaseRecord {
        LeaseRecord {
            slot_id: format!("{i:032x}"),
            pool: "p".into(),
            request_deadline: 1_000_000,
        }
    }

    /// The slots a restart would hold back for pool `p` now: its records on file.
    async fn on_record(store: &Arc<dyn Store>) -> usize {
        let records = store.outstanding_leases(1_000).await.unwrap();
        records.iter().filter(|l| l.pool == "p").count()
    }

    /// Many grants at once from several tasks, on the book's own thread, against a real SQLite
    /// file: whenever some have been answered, the record holds back at least that many slots;
    /// once released and flushed, only what is still held.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answered_grants_are_on_record_and_a_flush_lowers_the_claim() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open_in_dir(dir.path()).unwrap());
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(1_000));
        let book = LeaseBook::start(store.clone(), clock).unwrap();

        let answered = Arc::new(AtomicUsize::new(0));
        let grants = (0..200).map(|i| {
            let (book, store, answered) = (book.clone(), store.clone(), answered.clone());
            tokio::spawn(async move {
                book.granted(lease(i)).await.unwrap();
                answered.fetch_add(1, Ordering::SeqCst);
                let seen = answered.load(Ordering::SeqCst);
                let recorded = on_record(&store).await;
                assert!(recorded >= seen, "{seen} answered, {recorded} on record");
            })
        });
        for g in futures_util::future::join_all(grants).await {
            g.unwrap();
        }
        assert_eq!(on_record(&store).await, 200);
        for i in 0..150 {
            book.released(&lease(i).slot_id);
        }
        // The flush (a stopping server) lowers the claim to what is still held.
        book.flush().await;
        assert_eq!(on_record(&store).await, 50);
        // A grant within the claim is answered without a write; one past it raises it.
        book.released(&lease(150).slot_id);
        book.granted(lease(999)).await.unwrap();
        assert_eq!(on_record(&store).await, 50);
        book.granted(lease(1_000)).await.unwrap();
        assert_eq!(on_record(&store).await, 51);
    }

    /// Without a flush, released leases stop being held back once a lowering period is over.
    #[tokio::test]
    async fn claims_come_down_on_their_own() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open_in_dir(dir.path()).unwrap());
        let clock = Arc::new(ManualClock::new(1_000));
        let book = LeaseBook::start(store.clone(), clock.clone()).unwrap();
        book.granted(lease(1)).await.unwrap();
        book.granted(lease(2)).await.unwrap();
        book.released(&lease(1).slot_id);
        assert_eq!(
            on_record(&store).await,
            2,
            "lowered only once a period is over"
        );
        clock.advance(LOWER_EVERY_MS);
        let lowered =
            nthbouncer_testkit::wait_until(100, std::time::Duration::from_millis(50), async || {
                on_record(&store).await == 1
            })
            .await;
        assert!(lowered, "the claim stayed at {}", on_record(&store).await);
    }

    /// PostgreSQL has no blocking writer: the book's thread drives its async write on the
    /// runtime. Same record, same lowering, against the machine's PostgreSQL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_without_a_blocking_writer_is_written_through_the_runtime() {
        let db = nthbouncer_testkit::pg::TestDb::create().await;
        let pg = nthbouncer_store::postgres::connect(&db.url).await.unwrap();
        assert!(pg.lease_writer().is_none(), "the case under test");
        let store: Arc<dyn Store> = Arc::new(pg);
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(1_000));
        let book = LeaseBook::start(store.clone(), clock).unwrap();
        for i in 0..3 {
            book.granted(lease(i)).await.unwrap();
        }
        assert_eq!(on_record(&store).await, 3);
        book.released(&lease(0).slot_id);
        book.released(&lease(1).slot_id);
        book.flush().await;
        assert_eq!(on_record(&store).await, 1);
    }

    /// A restarted gateway's book leaves the rows of the book before it alone: they hold their
    /// slots back until their own `until`, whatever the new book raises and lowers.
    #[tokio::test]
    async fn a_new_book_leaves_the_rows_of_the_one_before_alone() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open_in_dir(dir.path()).unwrap());
        let before = LeaseBook::start(store.clone(), Arc::new(ManualClock::new(1_000))).unwrap();
        before.granted(lease(1)).await.unwrap();
        before.granted(lease(2)).await.unwrap();
        drop(before); // the gateway died with two leases held
        let after = LeaseBook::start(store.clone(), Arc::new(ManualClock::new(2_000))).unwrap();
        after.granted(lease(3)).await.unwrap();
        assert_eq!(on_record(&store).await, 3);
        after.released(&lease(3).slot_id);
        after.flush().await;
        assert_eq!(
            on_record(&store).await,
            2,
            "the first book's rows are still there"
        );
    }
}
