//! Async jobs (SPEC §6; the seed on async jobs is normative): accepting work as a durable job,
//! running it through the pool's gate, and the poll body.
//!
//! - [`JobIntake`] is the group-commit writer: callers hand it a job and get their answer once
//!   the batch holding it is committed, so a `202` is only ever sent for a durable job.
//! - [`spawn_runner`] runs one job: it waits in the pool's gate like any caller (FIFO with sync
//!   traffic), holds a slot only while the upstream fetch runs, and writes the result fenced by
//!   its attempt number. Jobs left unfinished by a crash are resumed at start-up.
//! - The sweeper marks overdue jobs `expired` and deletes jobs whose retention has passed.
//!
//! Webhook delivery of finished jobs is the dispatcher's (the outbox rows written here).

pub mod routes;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use base64::prelude::*;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::BodyExt;
use nthbouncer_coord::{AcquireRequest, Priority, Refusal, SlotKind};
use nthbouncer_store::jobs::status;
use nthbouncer_store::{Finish, JobRequest, JobResult, JobStore, NewJob, StoredJob};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use utoipa::ToSchema;

use crate::app::state::AppState;
use crate::core::error::ApiError;
use crate::pools::registry::PoolRuntime;
use crate::proxy::SlotGuard;

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

/// How many times a job retries an upstream that cannot be reached or times out.
const MAX_FETCH_ATTEMPTS: u32 = 3;
const INTAKE_BATCH: usize = 512;

/// A fresh job id: `job_` + 32 lowercase hex.
pub fn new_job_id() -> String {
    format!("job_{:032x}", rand::random::<u128>())
}

/// The group-commit writer of new jobs.
#[derive(Clone)]
pub struct JobIntake {
    tx: mpsc::Sender<(NewJob, oneshot::Sender<Result<(), String>>)>,
}

impl JobIntake {
    pub fn start(store: Arc<dyn JobStore>) -> JobIntake {
        let (tx, mut rx) = mpsc::channel::<(NewJob, oneshot::Sender<Result<(), String>>)>(4096);
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(INTAKE_BATCH);
            while rx.recv_many(&mut batch, INTAKE_BATCH).await > 0 {
                let jobs: Vec<NewJob> = batch.iter().map(|(j, _)| j.clone()).collect();
                let outcome = store.insert_jobs(&jobs).await.map_err(|e| e.to_string());
                for (_, done) in batch.drain(..) {
                    let _ = done.send(outcome.clone());
                }
            }
        });
        JobIntake { tx }
    }

    /// Returns once the job is committed.
    pub async fn submit(&self, job: NewJob) -> Result<(), String> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send((job, done))
            .await
            .map_err(|_| "job intake stopped".to_string())?;
        wait.await.map_err(|_| "job intake stopped".to_string())?
    }
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

/// Accepts a proxied request (its body already read and verified) as a job: writes it durably,
/// starts its runner, and returns the `202` body. Our headers, hop-by-hop headers and the
/// credentials the caller authenticated with are not stored.
pub async fn accept(
    state: &Arc<AppState>,
    pool: &Arc<PoolRuntime>,
    parts: &http::request::Parts,
    body: Bytes,
    caller: &crate::access::keys::Caller,
    priority: Priority,
    reason: Reason,
) -> Result<Accepted, ApiError> {
    let fairness = caller.fairness;
    let mut kept = parts.headers.clone();
    crate::proxy::strip_hop_by_hop(&mut kept);
    crate::proxy::strip_nthpool_headers(&mut kept);
    pool.access.strip_credentials(&mut kept);
    if caller.used_authorization {
        kept.remove(http::header::AUTHORIZATION);
    }
    let headers: Vec<(String, String)> = kept
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
            method: parts.method.to_string(),
            path_and_query: parts
                .uri
                .path_and_query()
                .map(|p| p.as_str().to_string())
                .unwrap_or_else(|| "/".into()),
            headers,
            body: body.to_vec(),
        },
    };
    state.job_intake.submit(job.clone()).await.map_err(|e| {
        tracing::error!(error = %e, "job not stored");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            "the job could not be stored; retry later",
        )
    })?;
    let stored = StoredJob {
        id: job.id.clone(),
        pool: job.pool.clone(),
        status: status::ACCEPTED.into(),
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
        request: job.request,
        result: None,
    };
    spawn_runner(state.clone(), stored);
    Ok(Accepted {
        poll_url: format!("{}/pools/{}/jobs/{}", state.public_url, pool.name, job.id),
        job_id: job.id,
        status: "accepted",
        webhook: WebhookCount {
            destinations: destinations.len() as u32,
        },
    })
}

/// Runs a job to a terminal state in the background.
pub fn spawn_runner(state: Arc<AppState>, job: StoredJob) {
    tokio::spawn(async move {
        let id = job.id.clone();
        let stopping = state.stopping.clone();
        tokio::select! {
            // A stopping server abandons the attempt; the job resumes at the next start.
            _ = stopping.cancelled() => {}
            ran = run(&state, job) => {
                if let Err(e) = ran {
                    tracing::warn!(job = %id, error = %e, "job runner stopped; the job resumes at the next start");
                }
            }
        }
    });
}

fn retry_hint(refusal: &Refusal) -> Duration {
    match refusal {
        Refusal::TooManyRequests {
            retry_after_ms: Some(ms),
            ..
        } => Duration::from_millis((*ms).clamp(50, 5_000)),
        _ => Duration::from_millis(250),
    }
}

async fn run(state: &Arc<AppState>, job: StoredJob) -> Result<(), String> {
    let store = &state.jobs;
    if job.status == status::ACCEPTED {
        store
            .mark_queued(&job.id, state.now())
            .await
            .map_err(|e| e.to_string())?;
    }
    let priority = Priority::parse(&job.priority).unwrap_or_default();
    let mut fetch_failures = 0u32;
    loop {
        let now = state.now();
        let Some(pool) = state.pool(&job.pool) else {
            // The pool was deleted: nothing can run this job any more.
            return finish_without_attempt(state, &job, "the pool was deleted").await;
        };
        if now >= job.expires_at {
            // The sweeper writes `expired`; nothing more to do here.
            return Ok(());
        }
        let wait_ms = pool
            .concurrency
            .queue_timeout_ms
            .min(job.expires_at - now)
            .max(1);
        let request = AcquireRequest {
            fairness_key: job.fairness,
            priority,
            wait_ms,
            kind: SlotKind::Exchange,
        };
        let grant = match pool.gate.acquire(request).await {
            Ok(g) => g,
            Err(Refusal::PoolClosed) => {
                return finish_without_attempt(state, &job, "the pool was deleted").await
            }
            Err(refusal) => {
                // Queue full, RPM spent, paused, or the wait ran out: the job keeps its place
                // in the store and tries again.
                tokio::time::sleep(retry_hint(&refusal)).await;
                continue;
            }
        };
        let mut guard = SlotGuard::new(pool.gate.clone(), grant.slot_id);
        let Some(attempt) = store
            .start_attempt(&job.id, state.now())
            .await
            .map_err(|e| e.to_string())?
        else {
            return Ok(()); // already terminal (expired meanwhile)
        };
        let fetched = fetch(state, &pool, &job).await;
        match fetched {
            Ok((result, outcome)) => {
                guard.outcome = Some(outcome);
                // The slot is freed only once the result is committed: a crash before that
                // reruns the job, so at most `limit` jobs can ever run twice.
                let dests = pool.active_destination_ids();
                store
                    .finish_attempt(
                        &job.id,
                        attempt,
                        &Finish::Completed(result),
                        state.now(),
                        &dests,
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                drop(guard);
                state.notify_deliveries();
                return Ok(());
            }
            Err(error) => {
                drop(guard);
                fetch_failures += 1;
                if fetch_failures >= MAX_FETCH_ATTEMPTS {
                    let dests = pool.active_destination_ids();
                    store
                        .finish_attempt(
                            &job.id,
                            attempt,
                            &Finish::Failed(error),
                            state.now(),
                            &dests,
                        )
                        .await
                        .map_err(|e| e.to_string())?;
                    state.notify_deliveries();
                    return Ok(());
                }
                store
                    .retry_attempt(&job.id, attempt, state.now(), &error)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::time::sleep(Duration::from_millis(500 * u64::from(fetch_failures))).await;
            }
        }
    }
}

async fn finish_without_attempt(
    state: &Arc<AppState>,
    job: &StoredJob,
    why: &str,
) -> Result<(), String> {
    let store = &state.jobs;
    if let Some(attempt) = store
        .start_attempt(&job.id, state.now())
        .await
        .map_err(|e| e.to_string())?
    {
        store
            .finish_attempt(
                &job.id,
                attempt,
                &Finish::Failed(why.into()),
                state.now(),
                &[],
            )
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// One upstream fetch for a job. `Err` is a retryable failure (unreachable, timed out).
async fn fetch(
    state: &Arc<AppState>,
    pool: &PoolRuntime,
    job: &StoredJob,
) -> Result<(JobResult, nthbouncer_coord::Outcome), String> {
    let target = format!(
        "{}://{}{}{}",
        pool.upstream.scheme,
        pool.upstream.authority,
        pool.upstream.base_path,
        job.request.path_and_query
    );
    let uri: http::Uri = target
        .parse()
        .map_err(|_| "the job's path cannot be forwarded".to_string())?;
    let method =
        Method::from_bytes(job.request.method.as_bytes()).map_err(|_| "bad method".to_string())?;
    let mut headers = HeaderMap::new();
    for (k, v) in &job.request.headers {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            headers.append(k, v);
        }
    }
    crate::proxy::strip_hop_by_hop(&mut headers);
    crate::proxy::strip_nthpool_headers(&mut headers);
    headers.remove(http::header::AUTHORIZATION);
    headers.remove(http::header::CONTENT_LENGTH);
    headers.insert(http::header::HOST, pool.upstream.host.clone());
    if !headers.contains_key(&IDEMPOTENCY_KEY) {
        // Lets origins that support it deduplicate a job retried after a crash.
        if let Ok(v) = HeaderValue::from_str(&job.id) {
            headers.insert(IDEMPOTENCY_KEY.clone(), v);
        }
    }
    for (name, value) in &pool.upstream_headers {
        headers.insert(name.clone(), value.clone());
    }
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(h) = req.headers_mut() {
        *h = headers;
    }
    let req = req
        .body(Body::from(Bytes::from(job.request.body.clone())))
        .map_err(|e| e.to_string())?;
    let timeout = Duration::from_millis(pool.concurrency.request_timeout_ms);
    let max = pool.spec.async_jobs.max_body_bytes as usize;
    let exchange = async {
        let resp = state
            .client
            .request(req)
            .await
            .map_err(|e| format!("upstream unreachable: {e}"))?;
        let (parts, mut body) = resp.into_parts();
        let mut collected = Vec::new();
        let mut truncated = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("upstream body failed: {e}"))?;
            if let Some(data) = frame.data_ref() {
                let room = max.saturating_sub(collected.len());
                if data.len() > room {
                    collected.extend_from_slice(&data[..room]);
                    truncated = true;
                    break;
                }
                collected.extend_from_slice(data);
            }
        }
        Ok::<_, String>((parts, collected, truncated))
    };
    let (parts, body, truncated) =
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| {
                format!(
                    "upstream timed out after {} ms",
                    pool.concurrency.request_timeout_ms
                )
            })??;
    let outcome =
        crate::upstream::outcome::from_response(parts.status.as_u16(), &parts.headers, state.now());
    let mut result_headers = parts.headers;
    crate::proxy::strip_hop_by_hop(&mut result_headers);
    let headers = result_headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect();
    Ok((
        JobResult {
            status: parts.status.as_u16(),
            headers,
            body,
            truncated,
        },
        outcome,
    ))
}

/// The poll (and webhook) body of a job.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobView {
    pub job_id: String,
    pub status: String,
    pub reason: String,
    pub created_at: u64,
    pub updated_at: u64,
    pub expires_at: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<ResultView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookView>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResultView {
    pub status: u16,
    #[schema(value_type = Object)]
    pub headers: HashMap<String, String>,
    pub body: String,
    /// `utf8` or `base64`.
    pub body_encoding: &'static str,
    pub truncated: bool,
}

#[derive(Serialize, ToSchema)]
pub struct WebhookView {
    pub destinations: u32,
    pub delivered: u32,
    pub failed: u32,
}

impl JobView {
    pub fn of(job: &StoredJob, now: u64) -> JobView {
        let terminal = status::is_terminal(&job.status);
        // Past its deadline and never finished: expired, whether or not the sweeper got there.
        let status = if !terminal && now >= job.expires_at {
            status::EXPIRED.to_string()
        } else {
            job.status.clone()
        };
        let result = job.result.as_ref().map(|r| {
            let mut headers: HashMap<String, String> = HashMap::new();
            for (k, v) in &r.headers {
                headers
                    .entry(k.clone())
                    .and_modify(|e| {
                        e.push_str(", ");
                        e.push_str(v);
                    })
                    .or_insert_with(|| v.clone());
            }
            let (body, body_encoding) = match std::str::from_utf8(&r.body) {
                Ok(text) => (text.to_string(), "utf8"),
                Err(_) => (BASE64_STANDARD.encode(&r.body), "base64"),
            };
            ResultView {
                status: r.status,
                headers,
                body,
                body_encoding,
                truncated: r.truncated,
            }
        });
        JobView {
            job_id: job.id.clone(),
            status,
            reason: job.reason.clone(),
            created_at: job.created_at,
            updated_at: job.updated_at,
            expires_at: job.expires_at,
            result,
            error: job.error.clone().filter(|_| job.status == status::FAILED),
            webhook: (job.destinations > 0).then_some(WebhookView {
                destinations: job.destinations,
                delivered: job.delivered,
                failed: job.failed,
            }),
        }
    }
}

/// Resumes every unfinished job (start-up) and runs the sweeper until the process ends.
pub async fn resume_and_sweep(state: Arc<AppState>) {
    match state.jobs.unfinished_jobs().await {
        Ok(jobs) => {
            if !jobs.is_empty() {
                tracing::info!(jobs = jobs.len(), "resuming unfinished jobs");
            }
            for job in jobs {
                spawn_runner(state.clone(), job);
            }
        }
        Err(e) => tracing::error!(error = %e, "cannot read unfinished jobs"),
    }
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        sweep(&state).await;
    }
}

/// Expires overdue jobs and deletes those past retention.
pub async fn sweep(state: &AppState) {
    let now = state.now();
    let active: HashMap<String, Vec<String>> = state
        .registry
        .load()
        .pools
        .values()
        .map(|p| (p.name.clone(), p.active_destination_ids()))
        .collect();
    match state.jobs.expire_jobs(now, &active).await {
        Ok(expired) if !expired.is_empty() => {
            tracing::info!(jobs = expired.len(), "jobs expired");
            state.notify_deliveries();
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "expiring jobs failed"),
    }
    if let Err(e) = state.jobs.delete_retained(now).await {
        tracing::warn!(error = %e, "deleting retained jobs failed");
    }
}
