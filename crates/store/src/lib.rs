//! Durable state behind one small trait.
//!
//! This crate owns what must survive a restart: pools created through the admin API, pool keys
//! (hashes only), the pool access log, lock leases outstanding, the HMAC nonces seen (digests
//! only), async jobs, webhook destinations, and the delivery outbox with its attempt log. [`Store`] (with [`JobStore`]) is the seam; [`sqlite::SqliteStore`] is the embedded default and
//! [`postgres::PgStore`] the one several nodes share; both pass the same conformance tests.
//!
//! It must not know about HTTP or the governor. Pool settings are stored as opaque JSON (the
//! config crate owns their shape), so the schema does not move when a setting is added.

#![forbid(unsafe_code)]

pub mod jobs;
pub mod postgres;
mod postgres_jobs;
mod postgres_log;
mod postgres_tls;
pub mod sqlite;
mod sqlite_jobs;
mod sqlite_leases;
mod sqlite_log;

pub use jobs::{
    AttemptApplied, AttemptEnd, AttemptQuery, AttemptRecord, DeliveryAttempt, DeliveryNext,
    DeliveryState, DueDelivery, Finish, JobCursor, JobEvent, JobRequest, JobResult, JobStore,
    NewJob, Redeliver, Released, StoredDestination, StoredJob, UnfinishedJob,
};

use serde::{Deserialize, Serialize};

pub type Result<T> = std::result::Result<T, StoreError>;

#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    #[error("already exists: {0}")]
    Conflict(String),
    #[error("storage failure: {0}")]
    Backend(String),
}

/// Writes lease records on the calling thread (see [`Store::lease_writer`]).
pub trait LeaseWriter: Send {
    /// [`Store::apply_leases`], blocking until the transaction is committed.
    fn apply(&mut self, granted: &[LeaseRecord], released: &[String], now: u64) -> Result<()>;
}

/// A pool created through the admin API.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredPool {
    pub name: String,
    /// The pool's settings, as the config crate serialises them.
    pub spec: serde_json::Value,
    pub created_at: u64,
    pub updated_at: u64,
}

/// A pool key. Only its SHA-256 hash is ever stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredKey {
    /// Public identifier (`key_` + hex), safe to show and log.
    pub id: String,
    pub pool: String,
    /// Lowercase hex SHA-256 of the plaintext key.
    pub hash: String,
    pub label: Option<String>,
    pub created_at: u64,
    pub expires_at: Option<u64>,
    pub revoked_at: Option<u64>,
}

/// One line of a pool's access log: an acquire attempt or a proxied request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccessLogEntry {
    /// Assigned by the store on append (monotonic); 0 before.
    pub id: u64,
    pub pool: String,
    /// Epoch ms.
    pub at: u64,
    /// The key id, never the key; `None` when authentication failed before a key matched.
    pub key_id: Option<String>,
    pub client_addr: String,
    /// e.g. `"proxy GET /v1/models"` or `"lock acquire"`.
    pub route: String,
    /// `"admitted"`, `"429"`, `"504"`, `"401"`, …
    pub outcome: String,
    /// The precise reason for a refusal (e.g. which auth check failed); never sent to the caller.
    pub reason: Option<String>,
    pub status: u16,
    pub queued_ms: u64,
    pub upstream_status: Option<u16>,
    pub upstream_latency_ms: Option<u64>,
    /// How many requests the row stands for: 1, or more for refusals folded into one row
    /// (repeated refusals of one client address, alike but for their path).
    #[serde(default = "one")]
    pub count: u64,
    /// The request's id (`x-request-id`, #13); a folded row keeps its first request's.
    /// `None` on rows written before the store knew it.
    #[serde(default)]
    pub request_id: Option<String>,
}

fn one() -> u64 {
    1
}

/// Filters for reading the access log, newest first.
#[derive(Clone, Debug, Default)]
pub struct AccessLogQuery {
    /// Only entries with `id < before` (the pagination cursor).
    pub before: Option<u64>,
    pub since: Option<u64>,
    pub until: Option<u64>,
    pub outcome: Option<String>,
    pub key_id: Option<String>,
    pub limit: u32,
}

/// A lock lease granted and not yet released, kept so that a restart can hold its slot back:
/// the process that granted it is gone, but its holder may still be calling the origin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    pub slot_id: String,
    pub pool: String,
    /// Epoch ms; the lease can never outlive it, so neither does the record.
    pub request_deadline: u64,
}

/// An HMAC request nonce seen on a pool (SPEC §9), remembered until `expires_at` so a captured
/// request cannot be replayed within the signature window, even across a restart.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NonceRecord {
    pub pool: String,
    /// A cryptographic digest of the nonce (fixed size whatever the nonce's length); the store
    /// treats it as opaque bytes.
    pub digest: Vec<u8>,
    /// Epoch ms; past it the nonce's signature can no longer pass the timestamp window, so the
    /// record may go.
    pub expires_at: u64,
}

#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Cheap liveness probe for `/readyz`.
    async fn ping(&self) -> Result<()>;

    /// A number that every change to pools, keys or webhook destinations moves, whichever node
    /// made it: a node sharing the store re-reads them when it moves. `None` for a store only
    /// this process writes (SQLite), which has nothing to notice.
    async fn settings_version(&self) -> Result<Option<u64>>;

    async fn list_pools(&self) -> Result<Vec<StoredPool>>;
    async fn get_pool(&self, name: &str) -> Result<Option<StoredPool>>;
    /// `Conflict` if a pool of that name exists.
    async fn create_pool(&self, pool: &StoredPool) -> Result<()>;
    /// Replaces the spec; `false` if there is no such pool.
    async fn update_pool(&self, name: &str, spec: &serde_json::Value, now: u64) -> Result<bool>;
    /// Deletes the pool, its keys and its access log; `false` if there was no such pool.
    async fn delete_pool(&self, name: &str) -> Result<bool>;

    /// `Conflict` if the id or hash exists.
    async fn create_key(&self, key: &StoredKey) -> Result<()>;
    /// All keys of a pool, revoked ones included, oldest first.
    async fn list_keys(&self, pool: &str) -> Result<Vec<StoredKey>>;
    /// Every key of every pool (loaded once at start into the in-memory key index).
    async fn list_all_keys(&self) -> Result<Vec<StoredKey>>;
    /// Marks a key revoked; `false` if no such key in that pool (or already revoked).
    async fn revoke_key(&self, pool: &str, id: &str, now: u64) -> Result<bool>;

    /// Appends a batch in one transaction.
    async fn append_access_log(&self, entries: &[AccessLogEntry]) -> Result<()> {
        self.append_access_log_folded(entries.to_vec(), Vec::new())
            .await
            .map(drop)
    }
    /// Appends `entries` and adds to the `count` of rows already written (`bumps`: a row id and
    /// how many more requests it stands for), in one transaction. Returns the new rows' ids, in
    /// order. A bump of a row no longer there (trimmed, or its pool deleted) changes nothing.
    /// Takes the batch by value: the embedded store writes it on a blocking thread, which would
    /// otherwise copy every entry (and each of its strings) of every batch.
    async fn append_access_log_folded(
        &self,
        entries: Vec<AccessLogEntry>,
        bumps: Vec<(u64, u64)>,
    ) -> Result<Vec<u64>>;
    async fn query_access_log(
        &self,
        pool: &str,
        query: &AccessLogQuery,
    ) -> Result<Vec<AccessLogEntry>>;
    /// Keeps the newest `keep` entries of a pool; returns how many were removed.
    async fn trim_access_log(&self, pool: &str, keep: u64) -> Result<u64>;

    /// Records granted leases and forgets released ones, in one transaction; records whose
    /// request deadline is at or before `now` go too.
    async fn apply_leases(
        &self,
        granted: &[LeaseRecord],
        released: &[String],
        now: u64,
    ) -> Result<()>;
    /// The recorded leases whose request deadline is after `now`.
    async fn outstanding_leases(&self, now: u64) -> Result<Vec<LeaseRecord>>;
    /// A writer that does what [`Store::apply_leases`] does, blocking the calling thread, for
    /// stores that can write without a runtime (`None`: the lease book's thread drives
    /// `apply_leases` on the runtime instead). The lease book runs it on a thread of its own:
    /// a commit then costs one hand-over to that thread and one back, where going through the
    /// runtime's blocking pool costs four.
    fn lease_writer(&self) -> Option<Box<dyn LeaseWriter>> {
        None
    }

    /// Remembers a batch of seen nonces in one transaction (durable when this returns), and says
    /// for each, in order, whether it is new: `true` = newly remembered (never seen, or its
    /// earlier record had expired at `now`), `false` = already remembered and unexpired at `now`
    /// (a replay; its record is left as it was). A nonce twice in one batch: the second is a
    /// replay of the first.
    async fn remember_nonces(&self, nonces: &[NonceRecord], now: u64) -> Result<Vec<bool>>;
    /// The remembered nonces unexpired at `now` (`expires_at > now`), to load at start-up.
    async fn unexpired_nonces(&self, now: u64) -> Result<Vec<NonceRecord>>;
    /// Forgets nonces expired at `now` (`expires_at <= now`); returns how many.
    async fn purge_nonces(&self, now: u64) -> Result<u64>;
}
