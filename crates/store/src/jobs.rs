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
    /// Every status, in a job's order of life.
    pub const ALL: [&str; 6] = [ACCEPTED, QUEUED, RUNNING, COMPLETED, FAILED, EXPIRED];

    pub fn is_terminal(s: &str) -> bool {
        matches!(s, COMPLETED | FAILED | EXPIRED)
    }

    /// A job's status as its poll shows it: past its deadline and never finished, it is
    /// expired whether or not the sweeper got there.
    pub fn as_seen(status: &str, expires_at: u64, now: u64) -> &str {
        if !is_terminal(status) && now >= expires_at {
            EXPIRED
        } else {
            status
        }
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
    /// The id of the request the job was taken from (`x-request-id`, #13).
    pub request_id: Option<String>,
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
    /// The id of the request the job was taken from (`x-request-id`, #13); `None` for jobs
    /// stored before the store knew it.
    pub request_id: Option<String>,
}

/// An unfinished job as the resume pages list it: the stored job without its request body,
/// so a restart with a large backlog does not load every body at once. The body stays on disk
/// until the job's turn comes ([`JobStore::job_request_body`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnfinishedJob {
    /// The job as stored, except that `request.body` is empty.
    pub job: StoredJob,
    /// Length in bytes of the request body left on disk.
    pub body_len: u64,
}

/// Where a page of [`JobStore::unfinished_jobs_page`] ends: the last job's `(created_at, id)`.
/// A position, not a row reference, so it stays valid if that job finishes or is deleted.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobCursor {
    pub created_at: u64,
    pub id: String,
}

impl JobCursor {
    /// The cursor just after `job`.
    pub fn after(job: &StoredJob) -> Self {
        JobCursor {
            created_at: job.created_at,
            id: job.id.clone(),
        }
    }
}

/// What [`JobStore::release_claims`] gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Unfinished jobs whose claim this node gave up.
    pub jobs: u64,
    /// Pending deliveries whose claim this node gave up.
    pub deliveries: u64,
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
    /// The secret replaced by the last rotation, still used to sign (next to `secret`) until
    /// `previous_secret_expires_at`.
    #[serde(default)]
    pub previous_secret: Option<String>,
    #[serde(default)]
    pub previous_secret_expires_at: Option<u64>,
}

/// How a run attempt ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    Completed(JobResult),
    Failed(String),
}

/// One attempt's end, as [`JobStore::finish_attempt`] takes it, for
/// [`JobStore::finish_attempts`].
#[derive(Clone, Copy, Debug)]
pub struct AttemptEnd<'a> {
    pub id: &'a str,
    pub attempt: u32,
    pub finish: &'a Finish,
    pub now: u64,
    /// One pending delivery per destination, in order (duplicates once).
    pub destination_ids: &'a [String],
}

/// Delivery states of the outbox (`deliveries.status`).
pub mod delivery_status {
    pub const PENDING: &str = "pending";
    pub const DELIVERED: &str = "delivered";
    pub const FAILED: &str = "failed";
}

/// A pending delivery whose time has come, with what its attempt needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DueDelivery {
    pub id: u64,
    pub job: StoredJob,
    pub destination: StoredDestination,
    /// Attempts made so far, every round included (the next one is `attempts + 1`).
    pub attempts: u32,
    /// Attempts made in the current round (a manual redelivery starts a new round); drives the
    /// retry schedule.
    pub round_attempts: u32,
    /// Bumped by every redelivery: an attempt's result applies only to the round it started in.
    pub round: u32,
    /// The current round was asked for by hand (its failures do not count towards the
    /// destination's streak).
    pub manual: bool,
}

/// What happens to a delivery after an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeliveryNext {
    Delivered,
    Retry { at: u64 },
    Failed,
}

/// One delivery attempt to record, with the delivery's next state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptRecord {
    pub delivery_id: u64,
    pub round: u32,
    pub job_id: String,
    pub destination_id: String,
    pub pool: String,
    /// 1-based, across every round.
    pub attempt: u32,
    pub at: u64,
    pub status_code: Option<u16>,
    pub latency_ms: u64,
    /// The start of the response body (truncated by the caller).
    pub response_body: Option<String>,
    pub error: Option<String>,
    pub manual: bool,
    pub next: DeliveryNext,
    /// The destination answered `410 Gone`: deactivate it at once.
    pub gone: bool,
}

/// What recording an attempt changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttemptApplied {
    /// The attempt was logged (false when its delivery no longer exists).
    pub recorded: bool,
    /// The destination's failure streak moved.
    pub streak_changed: bool,
    /// This attempt deactivated the destination (its other pending deliveries failed with it).
    pub deactivated: bool,
}

/// A logged delivery attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryAttempt {
    pub id: u64,
    pub delivery_id: u64,
    pub job_id: String,
    pub destination_id: String,
    pub attempt: u32,
    pub at: u64,
    pub status_code: Option<u16>,
    pub latency_ms: u64,
    pub response_body: Option<String>,
    pub error: Option<String>,
    pub manual: bool,
    /// `delivered`, `retrying` or `failed`: what the attempt left the delivery in.
    pub outcome: String,
}

/// Filters for reading delivery attempts, newest first.
#[derive(Clone, Debug, Default)]
pub struct AttemptQuery {
    pub pool: String,
    pub job_id: Option<String>,
    pub destination_id: Option<String>,
    /// Only attempts with `id < before` (the pagination cursor).
    pub before: Option<u64>,
    pub limit: u32,
}

/// A delivery of one job to one destination, as it stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryState {
    pub id: u64,
    pub job_id: String,
    pub destination_id: String,
    /// `pending`, `delivered` or `failed`.
    pub status: String,
    pub attempts: u32,
    pub next_attempt_at: Option<u64>,
    pub manual: bool,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub delivered_at: Option<u64>,
    pub updated_at: u64,
    /// The job's request id (#13), copied when the delivery was created.
    pub request_id: Option<String>,
}

/// The result of asking for a job's redelivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Redeliver {
    NoSuchJob,
    NotTerminal,
    /// How many deliveries were reset to pending (or created).
    Queued(u32),
}

#[async_trait::async_trait]
pub trait JobStore: Send + Sync + 'static {
    /// Inserts a batch in one transaction (group commit); every job is durable when this returns.
    /// A job is inserted `queued`, its history `accepted` then `queued`: the caller starts its
    /// runner (or a node's claim pass does) as soon as this returns, so the step from one to
    /// the other is written with the job rather than as a transaction of its own per job.
    /// [`JobStore::mark_queued`] remains for jobs stored `accepted` by an earlier version.
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
    /// Jobs not yet terminal (to resume at start-up), bodies and all. Prefer
    /// [`JobStore::unfinished_jobs_page`]: this loads the whole backlog into memory at once.
    async fn unfinished_jobs(&self) -> Result<Vec<StoredJob>>;
    /// One page of jobs not yet terminal, oldest first by `(created_at, id)`, after `after`
    /// (exclusive; `None` = from the start), at most `limit` (clamped to 1..=1000), without
    /// their request bodies. An empty page means the end.
    async fn unfinished_jobs_page(
        &self,
        after: Option<&JobCursor>,
        limit: u32,
    ) -> Result<Vec<UnfinishedJob>>;
    /// For a store several nodes share, the claim pass a node makes every little while: extends
    /// this node's claims on `held` (the jobs it is running) to `now` plus the claim lease, then
    /// takes over up to `limit` (at most 1000) unfinished jobs no live node holds (never claimed,
    /// or their claim lapsed at `now`: their node died, or stopped renewing), oldest first, and
    /// returns them without their request bodies, as [`JobStore::unfinished_jobs_page`] does.
    /// A job accepted here is claimed by this node with its insert. Two nodes never take the
    /// same job while its claim holds, and [`JobStore::start_attempt`] refuses a job another
    /// node holds.
    ///
    /// `None`: the store serves one node (SQLite), every unfinished job is this node's, resumed
    /// at start ([`JobStore::unfinished_jobs_page`]) and never claimed.
    async fn claim_jobs(
        &self,
        now: u64,
        held: &[String],
        limit: u32,
    ) -> Result<Option<Vec<UnfinishedJob>>>;
    /// For a store several nodes share, what a node stopping gracefully does once its runners
    /// have stopped: it gives up its claims on its unfinished jobs that have no attempt running
    /// (`accepted` or `queued`: never started, or put back after an attempt the origin cannot
    /// have acted on), so another node's next claim pass takes them at once rather than one
    /// claim lease later. A job of this node's still `running` (an attempt abandoned when the
    /// shutdown grace ran out: the origin may still be working on it) keeps its claim until the
    /// lease lapses, so no other node calls the origin for it meanwhile. With `deliveries`
    /// (no webhook attempt of this node's is in flight any more) its claims on pending
    /// deliveries go too.
    ///
    /// Nothing to do on a store of one node (SQLite): nothing is ever claimed there.
    async fn release_claims(&self, deliveries: bool) -> Result<Released>;
    /// A job's request body, loaded when its turn comes; `None` if the job is gone.
    async fn job_request_body(&self, id: &str) -> Result<Option<Vec<u8>>>;
    /// How many of `pool`'s jobs are accepted and not yet terminal (`async.max_pending`).
    async fn count_unfinished_jobs(&self, pool: &str) -> Result<u64>;
    /// The same count for every pool that has any, to seed per-pool counters at start-up.
    async fn unfinished_job_counts(&self) -> Result<Vec<(String, u64)>>;
    /// `accepted → queued`; no effect on any other status.
    async fn mark_queued(&self, id: &str, now: u64) -> Result<()>;
    /// Starts a run attempt: status `running`, `attempt + 1`. `None` if the job is terminal or
    /// gone (nothing to run), or, on a store several nodes share, held by another node's
    /// claim (that node runs it).
    async fn start_attempt(&self, id: &str, now: u64) -> Result<Option<u32>>;
    /// [`JobStore::start_attempt`] with the job's request body for the attempt
    /// ([`JobStore::job_request_body`]): `None` if the job is gone, terminal or held by another
    /// node. A store that can do both in one round trip does.
    async fn start_attempt_with_body(&self, id: &str, now: u64) -> Result<Option<(u32, Vec<u8>)>> {
        let Some(body) = self.job_request_body(id).await? else {
            return Ok(None);
        };
        Ok(self
            .start_attempt(id, now)
            .await?
            .map(|attempt| (attempt, body)))
    }
    /// Whether [`JobStore::start_attempts_with_body`] and [`JobStore::finish_attempts`] write a
    /// batch in one go (one statement), so that gathering attempt starts and finishes pays;
    /// `false`: they only loop, and callers write each attempt on its own, concurrently.
    fn attempts_in_batches(&self) -> bool {
        false
    }
    /// [`JobStore::start_attempt_with_body`] for several jobs, each `(id, now)` (distinct ids):
    /// one answer per job, in order. A store that can start them all in one statement does
    /// (see [`JobStore::attempts_in_batches`]); each start is decided on its own row, as if alone.
    async fn start_attempts_with_body(
        &self,
        jobs: &[(String, u64)],
    ) -> Result<Vec<Option<(u32, Vec<u8>)>>> {
        let mut started = Vec::with_capacity(jobs.len());
        for (id, now) in jobs {
            started.push(self.start_attempt_with_body(id, *now).await?);
        }
        Ok(started)
    }
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
    /// [`JobStore::finish_attempt`] for several attempts (of distinct jobs): one answer per
    /// attempt, in order. A store that can finish them all in one statement does (see
    /// [`JobStore::attempts_in_batches`]); each is fenced on its own row, as if alone.
    async fn finish_attempts(&self, ends: &[AttemptEnd<'_>]) -> Result<Vec<bool>> {
        let mut finished = Vec::with_capacity(ends.len());
        for end in ends {
            finished.push(
                self.finish_attempt(
                    end.id,
                    end.attempt,
                    end.finish,
                    end.now,
                    end.destination_ids,
                )
                .await?,
            );
        }
        Ok(finished)
    }
    /// Marks non-terminal jobs past `expires_at` as `expired`, with one pending delivery per active
    /// destination of their pool (`active_destinations`: pool → destination ids); returns their ids.
    async fn expire_jobs(
        &self,
        now: u64,
        active_destinations: &std::collections::HashMap<String, Vec<String>>,
    ) -> Result<Vec<String>>;
    /// Deletes terminal jobs whose retention has passed, with their history and deliveries;
    /// returns how many. A store may delete a bounded number per call (PostgreSQL: in short
    /// batches, so the hot path never waits on a long delete): the rest go at the next call.
    async fn delete_retained(&self, now: u64) -> Result<u64>;

    async fn list_destinations(&self, pool: Option<&str>) -> Result<Vec<StoredDestination>>;
    /// `Conflict` if the id exists.
    async fn create_destination(&self, d: &StoredDestination) -> Result<()>;
    /// Replaces a destination's mutable fields (url, secret, active, deactivate_after,
    /// consecutive_failures, deactivated_at); `false` if unknown.
    async fn update_destination(&self, d: &StoredDestination) -> Result<bool>;
    async fn delete_destination(&self, pool: &str, id: &str) -> Result<bool>;
    /// Replaces a destination's secret, keeping the old one for signing until
    /// `previous_expires_at` (`None`: drop it now). `false` if unknown.
    async fn rotate_destination_secret(
        &self,
        pool: &str,
        id: &str,
        secret: &str,
        previous_expires_at: Option<u64>,
    ) -> Result<bool>;

    /// Pending deliveries to an active destination that are due at `now`, oldest due first,
    /// with their job and destination; deliveries in `exclude` (attempts in flight) are skipped.
    async fn due_deliveries(
        &self,
        destination_id: &str,
        now: u64,
        limit: u32,
        exclude: &[u64],
    ) -> Result<Vec<DueDelivery>>;
    /// The earliest `next_attempt_at` after `after` among a destination's pending deliveries.
    async fn next_delivery_at(&self, destination_id: &str, after: u64) -> Result<Option<u64>>;
    /// Records attempts, each in order and atomically with its delivery's new state and its
    /// destination's streak (reset on success; +1 on a failure that was not manual;
    /// deactivation at `deactivate_after` or on `gone`, which fails the destination's other
    /// pending deliveries). One transaction for the batch.
    async fn record_attempts(&self, records: &[AttemptRecord]) -> Result<Vec<AttemptApplied>>;
    /// Fails pending deliveries whose destination is not in `active_destination_ids` (deleted,
    /// deactivated, or its pool gone); returns how many.
    async fn fail_undeliverable(&self, active_destination_ids: &[String], now: u64) -> Result<u64>;
    async fn list_attempts(&self, query: &AttemptQuery) -> Result<Vec<DeliveryAttempt>>;
    async fn job_deliveries(&self, job_id: &str) -> Result<Vec<DeliveryState>>;
    /// A manual redelivery of a terminal job: one pending delivery per destination in
    /// `destination_ids` (reset if it exists), due at `now`, starting a new round.
    async fn redeliver_job(
        &self,
        pool: &str,
        job_id: &str,
        destination_ids: &[String],
        now: u64,
    ) -> Result<Redeliver>;
}
