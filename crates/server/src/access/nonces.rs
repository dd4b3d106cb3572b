//! Seen HMAC nonces that survive a restart (SPEC §9): each pool checks nonces in memory first
//! (a replay is refused without touching the store) and records a fresh one in the store before
//! the request goes on, through one group-commit writer shared by every pool, so concurrent
//! signed requests share a commit instead of each waiting for its own.
//!
//! Guarantee: a signed request is forwarded (or queued, or taken as a job) only after its
//! nonce's record is committed. A restart, a crash or `kill -9` cannot forget it: at start the
//! unexpired records are loaded back into each pool's memory, and the store itself refuses an
//! unexpired digest it already holds. A nonce that cannot be recorded (store error, memory
//! full) refuses its request (`401`): a replay window is never reopened to let one through.
//!
//! Expired records are purged at start and then at most once a minute, on a commit (the table
//! only grows through commits). Nothing waits in the writer at shutdown: every fresh nonce was
//! committed before its request went on.
//!
//! Owns the memory and the journal of nonces; the signature check is `signing`'s.

use std::collections::HashMap;
use std::sync::Arc;

use nthbouncer_coord::{Clock, InProcessNonces, NonceKey, NonceStore, NonceVerdict};
use nthbouncer_store::{NonceRecord, Store, StoreError};
use parking_lot::Mutex;

use super::NONCE_CAPACITY;
use crate::core::batch::{BatchConfig, Batcher, Commit};

/// Expired records are purged from the store at most this often.
pub const PURGE_EVERY_MS: u64 = 60_000;

const CONFIG: BatchConfig = BatchConfig {
    capacity: 16_384,
    max_batch: 1024,
    // Every item's caller is waiting: commit as soon as possible.
    min_interval: None,
};

/// Commits a batch of nonces and, now and then, purges the expired ones.
struct Remember {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    next_purge: u64,
}

impl Commit for Remember {
    type Item = NonceRecord;
    /// `true`: newly remembered; `false`: the store already held it unexpired (a replay).
    type Done = bool;
    async fn commit(&mut self, batch: Vec<NonceRecord>) -> Result<Vec<bool>, StoreError> {
        let now = self.clock.now_ms();
        let fresh = self.store.remember_nonces(&batch, now).await?;
        if now >= self.next_purge {
            self.next_purge = now.saturating_add(PURGE_EVERY_MS);
            if let Err(e) = self.store.purge_nonces(now).await {
                tracing::warn!(error = %e, "purging expired HMAC nonces failed");
            }
        }
        Ok(fresh)
    }
}

/// The one writer of seen nonces, and the records loaded at start (handed to each pool as it
/// is built). Cheap to clone.
#[derive(Clone)]
pub struct NonceJournal {
    writer: Batcher<NonceRecord, bool>,
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    loaded: Arc<Mutex<HashMap<String, Vec<NonceRecord>>>>,
}

impl NonceJournal {
    /// Starts the writer; it ends once every handle is dropped.
    pub fn start(store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> NonceJournal {
        let remember = Remember {
            store: store.clone(),
            clock: clock.clone(),
            next_purge: 0,
        };
        NonceJournal {
            writer: Batcher::start(remember, CONFIG).0,
            store,
            clock,
            loaded: Arc::default(),
        }
    }

    /// At start, before any pool is built: purges the expired records and reads the rest.
    /// Returns how many were loaded.
    pub async fn load(&self) -> Result<usize, StoreError> {
        let now = self.clock.now_ms();
        self.store.purge_nonces(now).await?;
        let records = self.store.unexpired_nonces(now).await?;
        let n = records.len();
        let mut by_pool: HashMap<String, Vec<NonceRecord>> = HashMap::new();
        for r in records {
            by_pool.entry(r.pool.clone()).or_default().push(r);
        }
        *self.loaded.lock() = by_pool;
        Ok(n)
    }

    /// The nonce store of pool `pool`, holding the records loaded for it at start.
    pub fn for_pool(&self, pool: &str) -> Arc<dyn NonceStore> {
        let memory = InProcessNonces::new(NONCE_CAPACITY);
        let now = self.clock.now_ms();
        for r in self.loaded.lock().remove(pool).unwrap_or_default() {
            if let Ok(digest) = <[u8; 16]>::try_from(r.digest.as_slice()) {
                memory.record(NonceKey(digest), now, r.expires_at);
            }
        }
        Arc::new(DurableNonces {
            pool: pool.to_string(),
            memory,
            writer: self.writer.clone(),
        })
    }
}

/// One pool's seen nonces: memory in front, the journal behind.
struct DurableNonces {
    pool: String,
    memory: InProcessNonces,
    writer: Batcher<NonceRecord, bool>,
}

#[async_trait::async_trait]
impl NonceStore for DurableNonces {
    async fn check_and_record(
        &self,
        nonce: NonceKey,
        now_ms: u64,
        expires_at_ms: u64,
    ) -> NonceVerdict {
        match self.memory.record(nonce, now_ms, expires_at_ms) {
            NonceVerdict::Fresh => {}
            other => return other,
        }
        let record = NonceRecord {
            pool: self.pool.clone(),
            digest: nonce.0.to_vec(),
            expires_at: expires_at_ms.max(now_ms.saturating_add(1)),
        };
        match self.writer.submit(record).await {
            Ok(true) => NonceVerdict::Fresh,
            // Recorded before a restart (and not loaded: memory was full), or by another
            // process sharing the store.
            Ok(false) => NonceVerdict::Replayed,
            Err(e) => {
                tracing::warn!(error = %e, pool = %self.pool, "an HMAC nonce could not be recorded; request refused");
                // Not recorded: the caller may try the same nonce again.
                self.memory.forget(nonce);
                NonceVerdict::Full
            }
        }
    }
}

/// Where the pools' seen nonces live: this node's journal (one node), or the shared
/// coordination store (Redis: one `SET NX PX` per nonce, decided once for every node, and kept
/// by Redis across any node's restart).
#[derive(Clone)]
pub enum NonceSource {
    Journal(NonceJournal),
    Shared(Arc<nthbouncer_coord::redis::RedisCoordination>),
}

impl NonceSource {
    /// At start, before any pool is built: the journal loads its records (Redis needs nothing).
    /// Returns how many were loaded.
    pub async fn load(&self) -> Result<usize, StoreError> {
        match self {
            NonceSource::Journal(journal) => journal.load().await,
            NonceSource::Shared(_) => Ok(0),
        }
    }

    /// The nonce store of pool `pool`.
    pub fn for_pool(&self, pool: &str) -> Arc<dyn NonceStore> {
        match self {
            NonceSource::Journal(journal) => journal.for_pool(pool),
            NonceSource::Shared(redis) => redis.nonces(pool),
        }
    }
}
