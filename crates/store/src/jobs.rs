//! Durable async jobs, webhook destinations and the delivery outbox (SPEC §6, §7).
//!
//! [`JobStore`] is the seam. A job's row is written before its `202` is sent; every run attempt
//! bumps `attempt`, and a result is only accepted from the attempt that holds the job (fencing),
//! so a runner that lost its job to a restart cannot overwrite the rescuer's result. A job's
//! terminal state and one pending delivery per active destination are written in one
//! transaction (the outbox), so no crash separates them.

use serde::{Deserialize, Serialize};

use crate::Result;

/// Lifecycle: `accepted → queued → running → completed | failed | expired`.
pub mod status {
    pub const ACCEPTED: &str = "accepted";
    pub const QUEUED: &str = "queued";
    pub const RUNNING: &str = "running";
    pub const COMPLETED: &str = "completed";
    pub const FAILED: &str = "failed";
    pub const EXPIRED: &str = "expired";

    pub fn is_terminal(s: &str) -> bool {
        matches!(s, COMPLETED | FAILED | EXPIRED)
    }
}

/// The upstream request a job will make.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRequest {
    pub method: String,
    /// Path and query as the caller sent them (the pool's upstream base is added at run time).
    pub path_and_query: String,
    /// Headers to forward (already stripped of ours, hop-by-hop and pool auth).
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// What the upstream answered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobResult {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The body was cut at the pool's `async.max_body_bytes`.
    pub truncated: bool,
}

/// A job to insert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewJob {
    pub id: String,
    pub pool: String,
    /// `requested`, `busy` or `wait_timeout`.
    pub reason: String,
    pub key_id: String,
    pub fairness: u64,
    pub priority: String,
    pub created_at: u64,
    pub expires_at: u64,
    /// How long the job stays readable after it ends.
    pub retention_ms: u64,
    /// Active destinations when it was accepted.
    pub destinations: u32,
    pub request: JobRequest,
}

/// A job as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredJob {
    pub id: String,
    pub pool: String,
    pub status: String,
    pub reason: String,
    pub key_id: String,
    pub fairness: u64,
    pub priority: String,
    pub created_at: u64,
    pub updated_at: u64,
    pub expires_at: u64,
    pub retention_ms: u64,
    pub attempt: u32,
    pub destinations: u32,
    pub delivered: u32,
    pub failed: u32,
    pub error: Option<String>,
    pub request: JobRequest,
    pub result: Option<JobResult>,
}

/// One step of a job's history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobEvent {
    pub at: u64,
    pub status: String,
    pub attempt: u32,
    pub detail: Option<String>,
}

/// A webhook destination.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredDestination {
    pub id: String,
    pub pool: String,
    pub url: String,
    pub secret: String,
    pub active: bool,
    pub deactivate_after: u32,
    pub consecutive_failures: u32,
    pub deactivated_at: Option<u64>,
    /// `"config"` or `"api"`.
    pub managed_by: String,
    pub created_at: u64,
}

/// How a run attempt ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    Completed(JobResult),
    Failed(String),
}

#[async_trait::async_trait]
pub trait JobStore: Send + Sync + 'static {
    /// Inserts a batch in one transaction (group commit); every job is durable when this returns.
    async fn insert_jobs(&self, jobs: &[NewJob]) -> Result<()>;
    async fn get_job(&self, pool: &str, id: &str) -> Result<Option<StoredJob>>;
    /// Newest first; `before` is the previous page's last id.
    async fn list_jobs(
        &self,
        pool: &str,
        status: Option<&str>,
        before: Option<&str>,
        limit: u32,
    ) -> Result<Vec<StoredJob>>;
    async fn job_events(&self, id: &str) -> Result<Vec<JobEvent>>;
    /// Jobs not yet terminal (to resume at start-up).
    async fn unfinished_jobs(&self) -> Result<Vec<StoredJob>>;
    /// `accepted → queued`; no effect on any other status.
    async fn mark_queued(&self, id: &str, now: u64) -> Result<()>;
    /// Starts a run attempt: status `running`, `attempt + 1`. `None` if the job is terminal or
    /// gone (nothing to run).
    async fn start_attempt(&self, id: &str, now: u64) -> Result<Option<u32>>;
    /// Back to `queued` after a retryable failure, if `attempt` still holds the job.
    async fn retry_attempt(&self, id: &str, attempt: u32, now: u64, detail: &str) -> Result<bool>;
    /// Ends the job if `attempt` still holds it, writing one pending delivery per destination
    /// in `destination_ids` in the same transaction. `false` if fenced off.
    async fn finish_attempt(
        &self,
        id: &str,
        attempt: u32,
        finish: &Finish,
        now: u64,
        destination_ids: &[String],
    ) -> Result<bool>;
    /// Marks non-terminal jobs past `expires_at` as `expired`, with one pending delivery per active
    /// destination of their pool (`active_destinations`: pool → destination ids); returns their ids.
    async fn expire_jobs(
        &self,
        now: u64,
        active_destinations: &std::collections::HashMap<String, Vec<String>>,
    ) -> Result<Vec<String>>;
    /// Deletes terminal jobs whose retention has passed, with their history and deliveries.
    async fn delete_retained(&self, now: u64) -> Result<u64>;

    async fn list_destinations(&self, pool: Option<&str>) -> Result<Vec<StoredDestination>>;
    /// `Conflict` if the id exists.
    async fn create_destination(&self, d: &StoredDestination) -> Result<()>;
    /// Replaces a destination's mutable fields (url, secret, active, deactivate_after,
    /// consecutive_failures, deactivated_at); `false` if unknown.
    async fn update_destination(&self, d: &StoredDestination) -> Result<bool>;
    async fn delete_destination(&self, pool: &str, id: &str) -> Result<bool>;
}
