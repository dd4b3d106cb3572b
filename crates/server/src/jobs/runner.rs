//! Runs one job to a terminal state: it waits in the pool's gate like any caller (FIFO with sync
//! traffic), holds a slot only while the upstream fetch runs, and writes the result fenced by
//! its attempt number. The request goes out through the same upstream layer as a proxied call.
//!
//! A fetch is retried only when the origin cannot have acted on it (the connection could not be
//! made); any later failure is the job's result, so an origin never does a job's work twice
//! because we retried.
//!
//! A store call that fails is retried with bounded exponential backoff ([`super::backoff`]), so
//! a store that is locked or down for a while delays a job but does not strand it. Starting an
//! attempt gives the slot back while it waits; recording a result keeps the slot (and the
//! attempt counted in flight) until the result is committed.
//!
//! In a pool with a token budget (SPEC §12) a job is charged like a proxied call, before it
//! waits for a slot: its stored body estimated, the estimate admitted against the budget, the
//! charge taken back if the attempt does not go out and settled by the answer's usage.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use nthbouncer_coord::{AcquireRequest, Outcome, Priority, Refusal, SlotKind};
use nthbouncer_store::jobs::status;
use nthbouncer_store::{Finish, JobResult, StoredJob};

use crate::jobs::attempt_writes::Ended;
use crate::jobs::backlog::Pending;
use crate::jobs::backoff::{until_ok, Backoff};
use crate::jobs::Jobs;
use crate::pools::registry::PoolRuntime;
use crate::tokens::{self, Charge, TokenRefusal};
use crate::upstream::prepare::{self, Origin};
use crate::upstream::{self, SlotGuard, UpstreamError};

/// How many times a job tries an upstream it cannot connect to.
const MAX_CONNECT_ATTEMPTS: u32 = 3;

/// Runs a job to a terminal state in the background. `job` may come without its request body
/// (it is loaded from the store for each attempt); `pending`, the job's place in its pool's
/// backlog, is given back when the job is done. A job that already has a runner here gets no
/// second one.
pub fn spawn_runner(state: Arc<Jobs>, job: StoredJob, pending: Pending) {
    // One runner per job in this process: a claim pass may hand back a job already running.
    let Some(entry) = state.running.enter(&job.id) else {
        return;
    };
    tokio::spawn(async move {
        let _entry = entry;
        let _pending = pending;
        let stopping = state.stopping.clone();
        tokio::select! {
            biased;
            // Cancelled once the attempts in flight have been recorded (see `drain`), or when
            // `shutdown_grace_ms` ran out: an attempt still running then is abandoned, and the
            // job resumes at the next start.
            _ = stopping.cancelled() => {}
            () = run(&state, job) => {}
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

/// What one pass through the gate came to.
enum Pass {
    /// The job reached a terminal state (or nothing can run it any more).
    Done,
    /// The server is stopping: no new attempt starts; the job runs at the next start.
    Stopped,
    /// Try again after this long (refused by the gate, the origin could not be reached, or the
    /// store could not start the attempt).
    Again(Duration),
}

/// What a job's passes remember of the ones before.
#[derive(Default)]
struct Tries {
    /// Fetches that could not connect.
    connect_failures: u32,
    /// Attempts the store could not start (the slot goes back meanwhile).
    store: Backoff,
}

async fn run(state: &Arc<Jobs>, job: StoredJob) {
    if job.status == status::ACCEPTED {
        until_ok("mark_queued", &job.id, || {
            state.store.mark_queued(&job.id, state.now())
        })
        .await;
    }
    let priority = Priority::parse(&job.priority).unwrap_or_default();
    let mut tries = Tries::default();
    loop {
        match pass(state, &job, priority, &mut tries).await {
            Pass::Done | Pass::Stopped => return,
            Pass::Again(after) => tokio::time::sleep(after).await,
        }
    }
}

/// Waits for a slot, then makes one attempt.
async fn pass(state: &Arc<Jobs>, job: &StoredJob, priority: Priority, tries: &mut Tries) -> Pass {
    if state.drain.is_draining() {
        return Pass::Stopped;
    }
    let now = state.now();
    let Some(pool) = state.pool(&job.pool) else {
        // The pool was deleted: nothing can run this job any more.
        finish_without_attempt(state, job, "the pool was deleted").await;
        return Pass::Done;
    };
    if now >= job.expires_at {
        return Pass::Done; // the sweeper writes `expired`
    }
    let request = AcquireRequest {
        fairness_key: job.fairness,
        priority,
        wait_ms: pool
            .concurrency
            .queue_timeout_ms
            .min(job.expires_at - now)
            .max(1),
        kind: SlotKind::Exchange,
    };
    let charge = match charge_tokens(state, &pool, job, priority, request.wait_ms).await {
        Ok(charge) => charge,
        Err(pass) => return pass,
    };
    let grant = match pool.gate.acquire(request).await {
        Ok(g) => g,
        Err(refusal) => {
            give_back(charge);
            return gate_refused(state, job, refusal).await;
        }
    };
    let guard = SlotGuard::new(pool.gate.clone(), grant.slot_id);
    if let Some(db) = pool.upstream.database() {
        upstream::sql::cap(db, grant.headers.effective_limit);
    }
    // Counted in flight until its result is recorded: a stopping server waits for it. Once
    // stopping, the slot goes back unused and the job waits for the next start.
    let Some(entered) = state.drain.enter() else {
        give_back(charge);
        return Pass::Stopped;
    };
    let ran = attempt(state, &pool, job, guard, charge, tries).await;
    drop(entered);
    ran
}

/// The charge (if any) of an attempt that did not go out is taken back whole.
fn give_back(charge: Option<Charge>) {
    if let Some(charge) = charge {
        charge.refund();
    }
}

/// The gate refused the job's pass.
async fn gate_refused(state: &Arc<Jobs>, job: &StoredJob, refusal: Refusal) -> Pass {
    match refusal {
        // A stopping server closes every gate: that is no deleted pool.
        Refusal::PoolClosed if state.drain.is_draining() => Pass::Stopped,
        Refusal::PoolClosed => {
            finish_without_attempt(state, job, "the pool was deleted").await;
            Pass::Done
        }
        // Queue full, RPM spent, paused, or the wait ran out: the job keeps its place in the
        // store and tries again.
        refusal => Pass::Again(retry_hint(&refusal)),
    }
}

/// The job's charge against its pool's token budget, when one is in force: its stored body
/// estimated and waited for like a proxied request's (`Ok(None)` without a budget). A job
/// larger than the whole budget fails (it could never run); one the budget has no room for
/// yet tries again.
async fn charge_tokens(
    state: &Arc<Jobs>,
    pool: &PoolRuntime,
    job: &StoredJob,
    priority: Priority,
    wait_ms: u64,
) -> Result<Option<Charge>, Pass> {
    if !pool.tokens.active() {
        return Ok(None);
    }
    let body = match state.store.job_request_body(&job.id).await {
        Ok(Some(body)) => body,
        Ok(None) => return Err(Pass::Done), // the job is gone
        Err(e) => {
            tracing::warn!(job = %job.id, error = %e, "cannot read a job's body for its token estimate; retrying");
            return Err(Pass::Again(Duration::from_millis(250)));
        }
    };
    let estimate = tokens::estimate_whole(&body, pool.spec.tokens.as_ref());
    drop(body);
    match Charge::take(&pool.tokens, &estimate, priority, wait_ms).await {
        Ok(charge) => {
            pool.metrics.admitted_tokens.increment(estimate.total());
            Ok(Some(charge))
        }
        Err(refusal @ TokenRefusal::Exceeds { .. }) => {
            let why = tokens::refusal_error(&estimate, refusal).message;
            finish_without_attempt(state, job, &why).await;
            Err(Pass::Done)
        }
        Err(TokenRefusal::NoRoom { retry_after_ms }) => Err(Pass::Again(Duration::from_millis(
            retry_after_ms.unwrap_or(250).clamp(50, 5_000),
        ))),
        Err(TokenRefusal::Timeout) => Err(Pass::Again(Duration::from_millis(50))),
        Err(TokenRefusal::Unavailable { retry_after_ms }) => Err(Pass::Again(
            Duration::from_millis(retry_after_ms.clamp(50, 5_000)),
        )),
    }
}

/// One attempt holding a slot: fetch, then record the result before the slot is freed.
async fn attempt(
    state: &Arc<Jobs>,
    pool: &PoolRuntime,
    job: &StoredJob,
    guard: SlotGuard,
    charge: Option<Charge>,
    tries: &mut Tries,
) -> Pass {
    let store = &state.store;
    // The body comes from disk only now, and is dropped with the attempt.
    let started = state
        .attempt_writes
        .start_attempt(&job.id, state.now())
        .await;
    let (attempt, body) = match started {
        Ok(Some(started)) => started,
        Ok(None) => {
            give_back(charge);
            return Pass::Done; // gone, or already terminal (expired meanwhile)
        }
        Err(e) => {
            give_back(charge);
            // Nothing went out: the slot goes back (with `guard`) while the store recovers, and
            // the job queues again.
            let wait = tries.store.next_delay();
            tracing::warn!(job = %job.id, error = %e, failures = tries.store.failures(),
                retry_in_ms = wait.as_millis() as u64, "cannot start a job attempt; retrying");
            return Pass::Again(wait);
        }
    };
    tries.store.reset();
    let fetched = fetch(state, pool, job, body, guard).await;
    if let Some(charge) = charge {
        match &fetched {
            Ok((result, outcome, _)) => {
                let whole = (!result.truncated).then_some(&result.body[..]);
                charge.settle(Some(outcome), whole);
            }
            // Never sent: not spent. Sent and unanswered: the estimate stands.
            Err(e) if e.retry_safe() => charge.refund(),
            Err(_) => charge.settle(None, None),
        }
    }
    let (finish, guard) = match fetched {
        Ok((result, outcome, mut guard)) => {
            guard.outcome = Some(outcome);
            (Finish::Completed(result), Some(guard))
        }
        // The slot was freed with the failed call.
        Err(e) if e.retry_safe() && tries.connect_failures + 1 < MAX_CONNECT_ATTEMPTS => {
            tries.connect_failures += 1;
            let detail = e.to_string();
            until_ok("retry_attempt", &job.id, || {
                store.retry_attempt(&job.id, attempt, state.now(), &detail)
            })
            .await;
            return Pass::Again(Duration::from_millis(
                500 * u64::from(tries.connect_failures),
            ));
        }
        Err(e) => (Finish::Failed(e.to_string()), None),
    };
    // The slot is freed only once the result is committed (retried until the store takes it):
    // a crash before that reruns the job, so at most `limit` jobs can ever run twice.
    let ended = Arc::new(Ended {
        id: job.id.clone(),
        attempt,
        finish,
        destination_ids: pool.active_destination_ids(),
    });
    until_ok("finish_attempt", &job.id, || {
        state.attempt_writes.finish_attempt(&ended, state.now())
    })
    .await;
    drop(guard);
    state.notify_deliveries();
    Pass::Done
}

async fn finish_without_attempt(state: &Arc<Jobs>, job: &StoredJob, why: &str) {
    let store = &state.store;
    let started = until_ok("start_attempt", &job.id, || {
        store.start_attempt(&job.id, state.now())
    })
    .await;
    if let Some(attempt) = started {
        let failed = Finish::Failed(why.into());
        until_ok("finish_attempt", &job.id, || {
            store.finish_attempt(&job.id, attempt, &failed, state.now(), &[])
        })
        .await;
    }
}

/// The stored request (its headers already as the origin may see them, see
/// `prepare::caller_headers`) as a request for the origin.
fn origin_request(
    pool: &PoolRuntime,
    job: &StoredJob,
    body: Vec<u8>,
) -> Result<http::Request<Body>, UpstreamError> {
    let invalid = |what: &'static str| UpstreamError::new(upstream::Stage::Connect, what);
    let method = Method::from_bytes(job.request.method.as_bytes())
        .map_err(|_| invalid("the job's method is not a method"))?;
    let path = PathAndQuery::try_from(job.request.path_and_query.as_str())
        .map_err(|_| invalid("the job's path cannot be forwarded"))?;
    let mut headers = HeaderMap::new();
    for (k, v) in &job.request.headers {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            headers.append(k, v);
        }
    }
    // The body is sent whole: its length is the body's, not what the caller declared.
    headers.remove(http::header::CONTENT_LENGTH);
    let target = pool
        .upstream
        .http()
        .ok_or_else(|| invalid("the pool is not a proxy pool"))?;
    let origin = Origin {
        target,
        managed: &pool.upstream_headers,
        idempotency_key: Some(&job.id),
    };
    let body = Body::from(Bytes::from(body));
    prepare::origin_request(&origin, method, Some(&path), headers, body)
        .map_err(|e| UpstreamError::new(upstream::Stage::Connect, e))
}

/// One upstream fetch for a job, holding its slot (`guard`) until the answer is read; the slot
/// comes back with the answer, or is freed with a failed call.
async fn fetch(
    state: &Arc<Jobs>,
    pool: &PoolRuntime,
    job: &StoredJob,
    body: Vec<u8>,
    guard: SlotGuard,
) -> Result<(JobResult, Outcome, SlotGuard), UpstreamError> {
    if let Some(db) = pool.upstream.database() {
        return fetch_sql(pool, db, job, body, guard).await;
    }
    let req = origin_request(pool, job, body)?;
    let deadline = crate::core::time::deadline_in(pool.concurrency.request_timeout_ms);
    let answer = upstream::exchange(&pool.client(&state.client), req, guard, deadline).await?;
    let max = pool.spec.async_jobs.max_body_bytes as usize;
    let (resp, guard) = (answer.resp, answer.guard);
    let (parts, collected) = upstream::collect(resp, answer.closed, max, deadline).await?;
    let outcome =
        upstream::outcome::from_response(parts.status.as_u16(), &parts.headers, state.now());
    let mut result_headers = parts.headers;
    prepare::strip_hop_by_hop(&mut result_headers);
    let headers = result_headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect();
    let result = JobResult {
        status: parts.status.as_u16(),
        headers,
        body: collected.body,
        truncated: collected.truncated,
    };
    Ok((result, outcome, guard))
}

/// A database pool's job: the stored SQL request (its `Neon-*` headers and body) run on the
/// pool's PostgreSQL, holding the slot. An answer, a SQL error or a `507` included, is the
/// job's result; no connection (nothing was sent) is a failed connect, retried like one.
async fn fetch_sql(
    pool: &PoolRuntime,
    db: &nthbouncer_sqlhttp::Database,
    job: &StoredJob,
    body: Vec<u8>,
    mut guard: SlotGuard,
) -> Result<(JobResult, Outcome, SlotGuard), UpstreamError> {
    let mut headers = HeaderMap::new();
    for (k, v) in &job.request.headers {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            headers.append(k, v);
        }
    }
    let deadline = crate::core::time::deadline_in(pool.concurrency.request_timeout_ms);
    let request_id = job.request_id.as_deref();
    let answer = upstream::sql::run(db, &headers, &body, deadline, request_id).await;
    let outcome = upstream::sql::outcome(&answer);
    // A SQL error or a `507` is an answer (the job's result); these are not.
    let failed = answer.error.as_ref().and_then(|e| {
        if e.timed_out {
            Some(UpstreamError::deadline(upstream::Stage::ResponseHead))
        } else if e.retry_safe {
            Some(UpstreamError::new(
                upstream::Stage::Connect,
                e.message.clone(),
            ))
        } else if e.code == "upstream_unreachable" {
            Some(UpstreamError::new(upstream::Stage::Send, e.message.clone()))
        } else {
            None
        }
    });
    if let Some(err) = failed {
        // The slot goes back with what the gate should learn (a `53300` is a throttle).
        guard.outcome = Some(outcome);
        return Err(err);
    }
    let max = pool.spec.async_jobs.max_body_bytes as usize;
    let truncated = answer.body.len() > max;
    let mut result_headers = vec![("content-type".to_string(), "application/json".to_string())];
    for (k, v) in &answer.headers {
        result_headers.push((k.to_ascii_lowercase(), (*v).to_string()));
    }
    let result = JobResult {
        status: answer.status.as_u16(),
        headers: result_headers,
        body: answer.body[..answer.body.len().min(max)].to_vec(),
        truncated,
    };
    Ok((result, outcome, guard))
}
