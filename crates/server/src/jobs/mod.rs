//! Async jobs (SPEC §6; the seed on async jobs is normative): accepting work as a durable job,
//! running it through the pool's gate, and the poll body.
//!
//! - [`intake::JobIntake`] is the group-commit writer: a `202` is only ever sent for a durable
//!   job.
//! - [`runner`] runs one job through the pool's gate and the upstream layer, and writes the
//!   result fenced by its attempt number. Jobs left unfinished by a crash are resumed at
//!   start-up ([`sweep`]), which also expires overdue jobs and deletes retained ones. A store
//!   call that fails is retried with [`backoff`] rather than leaving the job stranded. On a
//!   store several nodes share, a node runs only the jobs it claimed, and takes over those of a
//!   node that died ([`claims`]).
//! - [`view`] is the poll (and webhook) body; [`routes`] the poll route and the admin reads.
//! - [`drain::Drain`] counts the attempts in flight (job fetches and, shared with the webhooks
//!   feature, webhook attempts): on SIGTERM none starts any more, and the shutdown waits for
//!   those running to record their results.
//!
//! Webhook delivery of finished jobs is the webhooks feature's (the outbox rows written here).

pub mod attempt_writes;
pub mod backlog;
pub mod backoff;
pub mod claims;
pub mod drain;
pub mod intake;
pub mod routes;
pub mod runner;
pub mod sweep;
pub mod view;

use std::sync::Arc;

use axum::response::IntoResponse;
use bytes::Bytes;
use http::{HeaderMap, Method};
use http_body_util::BodyExt;
use nthbouncer_coord::Priority;
use nthbouncer_store::jobs::status;
use nthbouncer_store::{JobRequest, NewJob, StoredJob};
use serde::Serialize;
use utoipa::ToSchema;

use crate::access::keys::Caller;
use crate::core::error::{ApiError, ErrorCode};
use crate::pools::registry::PoolRuntime;

pub use intake::JobIntake;
use nthbouncer_coord::Clock;
use nthbouncer_store::JobStore;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::pools::Pools;
use crate::upstream::SharedClient;

/// What the jobs feature needs: its store and writer, the pools its jobs run in, the upstream
/// client, and the signals it shares with the webhook dispatcher and the shutdown.
pub struct Jobs {
    pub store: Arc<dyn JobStore>,
    pub intake: JobIntake,
    /// The batching writers of attempt starts and finishes.
    pub attempt_writes: attempt_writes::AttemptWrites,
    pub pools: Arc<Pools>,
    pub client: Arc<SharedClient>,
    pub clock: Arc<dyn Clock>,
    /// The live `[server]` settings: `public_url`, the base of every `pollUrl`.
    pub live: Arc<crate::core::live::LiveServer>,
    /// Cancelled when the server stops: runners end with it, leaving unfinished jobs in the
    /// store for the next start.
    pub stopping: CancellationToken,
    /// Wakes the webhook dispatcher when deliveries are enqueued.
    pub deliveries_pending: Arc<Notify>,
    /// Job and webhook attempts in flight; once draining, none starts and no job is accepted.
    pub drain: Arc<drain::Drain>,
    /// Jobs pending per pool, held to `async.max_pending`.
    pub backlog: Arc<backlog::Backlog>,
    /// The jobs with a runner in this process (on a shared store, the claims it renews).
    pub running: Arc<claims::Running>,
}

impl Jobs {
    pub fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    pub fn pool(&self, name: &str) -> Option<Arc<crate::pools::registry::PoolRuntime>> {
        self.pools.get(name)
    }

    pub fn notify_deliveries(&self) {
        self.deliveries_pending.notify_one();
    }
}
pub use runner::spawn_runner;
pub use sweep::{resume, run_sweeper, sweep};
pub use view::JobView;

/// Why a job was created (the `reason` of the poll body).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// `X-Nthpool-Async: 1`.
    Requested,
    /// The request would have waited for a slot.
    Busy,
    /// The request's wait hit the queue timeout.
    WaitTimeout,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Requested => "requested",
            Reason::Busy => "busy",
            Reason::WaitTimeout => "wait_timeout",
        }
    }
}

/// A fresh job id: `job_` + 32 lowercase hex.
pub fn new_job_id() -> String {
    format!("job_{:032x}", rand::random::<u128>())
}

/// The accept answer.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Accepted {
    pub job_id: String,
    pub status: &'static str,
    pub poll_url: String,
    pub webhook: WebhookCount,
}

#[derive(Serialize, ToSchema)]
pub struct WebhookCount {
    pub destinations: u32,
}

/// `Retry-After` of a request refused because its pool's backlog is full.
pub const BACKLOG_RETRY_AFTER_S: u64 = 1;

/// Whether a request may become a job now, checked before its body is read: a stopping server
/// takes no new job (`503 draining`), nor does a pool with `async.max_pending` jobs pending
/// (`429 too_many_requests`). The place reserved travels with the job to its runner.
pub fn admit(state: &Jobs, pool: &PoolRuntime) -> Result<backlog::Pending, ApiError> {
    if state.drain.is_draining() {
        let mut e = ApiError::new(ErrorCode::Draining, "shutting down; retry shortly");
        e.retry_after_s = Some(1);
        return Err(e);
    }
    let max = pool.spec.async_jobs.max_pending;
    state.backlog.reserve(&pool.name, max).ok_or_else(|| {
        let mut e = ApiError::new(
            ErrorCode::TooManyRequests,
            format!("this pool has {max} async jobs pending (async.max_pending); retry later"),
        );
        e.retry_after_s = Some(BACKLOG_RETRY_AFTER_S);
        e
    })
}

/// A body already read whole, held to the pool's `async.max_body_bytes` (`413` beyond).
pub fn bounded_body(pool: &PoolRuntime, body: Bytes) -> Result<Bytes, ApiError> {
    let max = pool.spec.async_jobs.max_body_bytes;
    if body.len() as u64 > max {
        return Err(ApiError::payload_too_large(max));
    }
    Ok(body)
}

/// Reads a request body for a job, up to the pool's `async.max_body_bytes` (`413` beyond).
pub async fn read_body(pool: &PoolRuntime, body: hyper::body::Incoming) -> Result<Bytes, ApiError> {
    let max = pool.spec.async_jobs.max_body_bytes;
    Ok(http_body_util::Limited::new(body, max as usize)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ApiError::payload_too_large(max)
            } else {
                ApiError::invalid("body", "the request body could not be read")
            }
        })?
        .to_bytes())
}

/// The request a job will send, as the origin may see it (the caller's side already prepared,
/// see `upstream::prepare::caller_headers`).
pub struct JobHead {
    pub method: Method,
    pub path_and_query: String,
    pub headers: HeaderMap,
}

/// What a job is made of: its request (the body already read and verified, the head prepared
/// for the origin), who asked, and its place in the pool's backlog ([`admit`]).
pub struct Submission {
    pub head: JobHead,
    pub body: Bytes,
    pub priority: Priority,
    pub reason: Reason,
    pub pending: backlog::Pending,
    /// The request's id (`core::request_id`), recorded on the job and its deliveries.
    pub request_id: Option<String>,
    /// Where the job is polled, when not `{public_url}/pools/{pool}`: a database pool's host
    /// as the request reached it (`{scheme}://{host}`, SPEC §8).
    pub poll_base: Option<String>,
}

/// What admitting a caller that may become a job came to.
pub enum Admission {
    /// A slot of the gate.
    Slot(nthbouncer_coord::Grant),
    /// Taken as a job instead, for this reason.
    Job(Reason),
    /// Refused by the gate, with no promotion to take it.
    Refused(nthbouncer_coord::Refusal),
}

/// Admission for a pool-host caller (a proxied call, a SQL request; SPEC §3, §6): a job when
/// asked for, else a slot of the gate; where the pool promotes, a call that would wait (or
/// whose wait ran out) becomes a job. With no active webhook destination the pool behaves
/// exactly as with async off.
pub async fn admit_or_promote(
    pool: &PoolRuntime,
    fairness: u64,
    plan: &crate::core::admission::Plan,
) -> Admission {
    use nthbouncer_coord::{AcquireRequest, Refusal, SlotKind};
    let live = pool.async_live();
    if plan.asked_async && live {
        return Admission::Job(Reason::Requested);
    }
    let async_jobs = &pool.spec.async_jobs;
    let promote_busy = live && async_jobs.on_open_wait && plan.wait_ms > 0;
    let promote_timeout = live && async_jobs.on_queue_timeout;
    let request = AcquireRequest {
        fairness_key: fairness,
        priority: plan.priority,
        // A request that would wait is taken as a job instead: try without waiting first.
        wait_ms: if promote_busy { 0 } else { plan.wait_ms },
        kind: SlotKind::Exchange,
    };
    match pool.gate.acquire(request).await {
        Ok(grant) => Admission::Slot(grant),
        Err(Refusal::TooManyRequests { .. }) if promote_busy => Admission::Job(Reason::Busy),
        Err(Refusal::QueueTimeout { .. }) if promote_timeout => Admission::Job(Reason::WaitTimeout),
        Err(refusal) => Admission::Refused(refusal),
    }
}

/// The caller's answer once [`accept`] is done: `202` with the handle, or the refusal; either
/// way with its access-log entry (`reason`: why the request became a job).
pub fn answer(
    log: crate::core::access_log::LogLine<'_>,
    key_id: &str,
    reason: &str,
    accepted: Result<Accepted, ApiError>,
) -> axum::response::Response {
    use crate::core::access_log::{LogOutcome, UpstreamSeen};
    match accepted {
        Ok(accepted) => {
            log.write(
                Some(key_id),
                LogOutcome::Accepted,
                Some(reason),
                http::StatusCode::ACCEPTED,
                0,
                UpstreamSeen::default(),
            );
            (http::StatusCode::ACCEPTED, axum::Json(accepted)).into_response()
        }
        Err(e) => log.refuse(Some(key_id), e),
    }
}

/// Accepts a request as a job: writes it durably, starts its runner (which loads the body from
/// the store when its turn comes), and returns the `202` body.
pub async fn accept(
    state: &Arc<Jobs>,
    pool: &Arc<PoolRuntime>,
    caller: &Caller,
    submission: Submission,
) -> Result<Accepted, ApiError> {
    let Submission {
        head,
        body,
        priority,
        reason,
        pending,
        request_id,
        poll_base,
    } = submission;
    let fairness = caller.fairness;
    let headers: Vec<(String, String)> = head
        .headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect();
    let now = state.now();
    let destinations = pool.active_destination_ids();
    let job = NewJob {
        id: new_job_id(),
        pool: pool.name.clone(),
        reason: reason.as_str().into(),
        key_id: caller.key_id.to_string(),
        fairness,
        priority: priority.as_str().into(),
        created_at: now,
        expires_at: now + pool.spec.async_jobs.retention_s * 1000,
        retention_ms: pool.spec.async_jobs.retention_s * 1000,
        destinations: destinations.len() as u32,
        request: JobRequest {
            method: head.method.to_string(),
            path_and_query: head.path_and_query,
            headers,
            body: body.to_vec(),
        },
        request_id,
    };
    state.intake.submit(job.clone()).await.map_err(|e| {
        tracing::error!(error = %e, "job not stored");
        ApiError::store_unavailable("the job could not be stored; retry later")
    })?;
    let stored = StoredJob {
        id: job.id.clone(),
        pool: job.pool.clone(),
        status: status::QUEUED.into(),
        reason: job.reason.clone(),
        key_id: job.key_id.clone(),
        fairness,
        priority: job.priority.clone(),
        created_at: now,
        updated_at: now,
        expires_at: job.expires_at,
        retention_ms: job.retention_ms,
        attempt: 0,
        destinations: job.destinations,
        delivered: 0,
        failed: 0,
        error: None,
        // The body stays on disk until the job's turn comes.
        request: JobRequest {
            body: Vec::new(),
            ..job.request
        },
        result: None,
        request_id: job.request_id.clone(),
    };
    spawn_runner(state.clone(), stored, pending);
    Ok(Accepted {
        poll_url: match poll_base {
            Some(base) => format!("{base}/jobs/{}", job.id),
            None => format!(
                "{}/pools/{}/jobs/{}",
                state.live.load().public_url,
                pool.name,
                job.id
            ),
        },
        job_id: job.id,
        status: "accepted",
        webhook: WebhookCount {
            destinations: destinations.len() as u32,
        },
    })
}
