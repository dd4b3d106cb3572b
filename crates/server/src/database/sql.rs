//! `POST /sql`: one authorized request's way through body, plan, admission and the database.
//!
//! The body is read whole (bounded by `server.max_body_bytes`, within the header timeout's
//! budget), a signed one verified, and the SQL request parsed before admission: bad input
//! costs no slot. The slot is held while the statement runs; a caller that goes away drops
//! this future, which cancels its statement on the server (`nthbouncer_sqlhttp::Database`) and
//! frees the slot.

use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Method, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use nthbouncer_coord::{GateHeaders, Priority};

use super::{DatabaseApi, SQL_PATH};
use crate::access::keys::Caller;
use crate::access::{self, Authorized};
use crate::core::access_log::{LogLine, LogOutcome, UpstreamSeen};
use crate::core::admission::{self, Plan};
use crate::core::error::ApiError;
use crate::jobs::{self, JobHead, Reason};
use crate::pools::registry::PoolRuntime;
use crate::upstream::sql::{self as run_sql, SqlAnswer};
use crate::upstream::SlotGuard;

/// One `/sql` request on its way.
struct Call<'a> {
    state: &'a DatabaseApi,
    pool: &'a Arc<PoolRuntime>,
    log: LogLine<'a>,
    headers: HeaderMap,
    caller: Caller,
    body: Bytes,
}

/// Serves an authorized `POST /sql`.
pub(super) async fn serve<'a>(
    state: &'a DatabaseApi,
    pool: &'a Arc<PoolRuntime>,
    log: LogLine<'a>,
    parts: Parts,
    body: Incoming,
    authorized: Authorized,
) -> Response<Body> {
    let Authorized {
        caller, pending, ..
    } = authorized;
    let body = match read_body(state, body).await {
        Ok(b) => b,
        Err(e) => return log.refuse(Some(&caller.key_id), e),
    };
    if let Some(pending) = pending {
        if let Err(f) = pending.finish_with_body(&body).await {
            let failure = access::Failure::Hmac(f);
            pool.access.record_failure(log.peer.ip(), log.at, failure);
            return access::refuse(&pool.metrics, log, Some(&caller.key_id), failure);
        }
    }
    let call = Call {
        state,
        pool,
        headers: parts.headers,
        caller,
        body,
        log,
    };
    // Bad input is answered before admission: it costs no slot.
    if let Err(answer) = run_sql::check(&call.headers, &call.body, call.log.request_id.as_deref()) {
        return refused_answer(call, answer);
    }
    let plan = match plan(&call) {
        Ok(p) => p,
        Err(e) => return call.log.refuse(Some(&call.caller.key_id), e),
    };
    admit(call, plan).await
}

/// The body, whole: at most `server.max_body_bytes` (`413`), within the header timeout's
/// budget (`400` when it does not arrive whole in time).
async fn read_body(state: &DatabaseApi, body: Incoming) -> Result<Bytes, ApiError> {
    let live = state.live.load();
    let max = live.max_body_bytes;
    let read = Limited::new(body, max as usize).collect();
    match tokio::time::timeout(live.header_read_timeout, read).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<LengthLimitError>() => Err(ApiError::payload_too_large(max)),
        Ok(Err(_)) | Err(_) => Err(ApiError::invalid(
            "body",
            "the request body did not arrive whole in time",
        )),
    }
}

/// The wait budget, the priority and whether a job is asked for (SPEC §3, §6).
fn plan(call: &Call<'_>) -> Result<Plan, ApiError> {
    let headers = &call.headers;
    admission::plan(
        headers,
        &call.pool.concurrency,
        call.pool.spec.async_jobs.enabled,
    )
}

/// Admission: a job when asked for or promoted from a wait, else a slot of the gate.
async fn admit(call: Call<'_>, plan: Plan) -> Response<Body> {
    let grant = match crate::jobs::admit_or_promote(call.pool, call.caller.fairness, &plan).await {
        crate::jobs::Admission::Slot(grant) => grant,
        crate::jobs::Admission::Job(reason) => {
            return accept_job(call, plan.priority, reason).await
        }
        crate::jobs::Admission::Refused(refusal) => {
            let key_id = call.caller.key_id.clone();
            return admission::refuse(&call.pool.metrics, call.log, &key_id, &refusal);
        }
    };
    let pool = call.pool;
    pool.metrics.admitted_sql.increment(1);
    pool.metrics
        .queue_wait
        .record(grant.headers.queued_ms as f64 / 1000.0);
    let mut guard = SlotGuard::new(pool.gate.clone(), grant.slot_id);
    let Some(db) = pool.upstream.database() else {
        let e = ApiError::internal("the pool has no database");
        return call.log.refuse(Some(&call.caller.key_id), e);
    };
    run_sql::cap(db, grant.headers.effective_limit);
    let deadline = crate::core::time::deadline_in(pool.concurrency.request_timeout_ms);
    let started = crate::core::time::now();
    let request_id = call.log.request_id.as_deref();
    let answer = run_sql::run(db, &call.headers, &call.body, deadline, request_id).await;
    let latency_ms = started.elapsed().as_millis() as u64;
    guard.outcome = Some(run_sql::outcome(&answer));
    // The session is back in the pool (or closed): the slot goes with it.
    drop(guard);
    answered(call, answer, &grant.headers, latency_ms)
}

/// The answer of an admitted request, logged.
fn answered(
    call: Call<'_>,
    answer: SqlAnswer,
    gate: &GateHeaders,
    latency_ms: u64,
) -> Response<Body> {
    let metrics = &call.pool.metrics;
    metrics.upstream_latency.record(latency_ms as f64 / 1000.0);
    if let Some(e) = &answer.error {
        if e.code == "upstream_unreachable" || e.timed_out {
            metrics.upstream_errors.increment(1);
            tracing::debug!(pool = %call.pool.name, error = %e.message, "database request failed");
        }
    }
    let upstream = UpstreamSeen {
        status: Some(answer.status.as_u16()),
        latency_ms: Some(latency_ms),
    };
    let reason = answer.error.as_ref().map(|e| e.code);
    call.log.write(
        Some(&call.caller.key_id),
        LogOutcome::Admitted,
        reason,
        answer.status,
        gate.queued_ms,
        upstream,
    );
    let mut resp = response(answer);
    admission::write_gate_headers(resp.headers_mut(), gate);
    resp
}

/// A request refused before admission with an answer of the SQL layer (bad input).
fn refused_answer(call: Call<'_>, answer: SqlAnswer) -> Response<Body> {
    let reason = answer.error.as_ref().map(|e| e.code);
    call.log.write(
        Some(&call.caller.key_id),
        LogOutcome::Refused(answer.status),
        reason,
        answer.status,
        0,
        UpstreamSeen::default(),
    );
    response(answer)
}

fn response(answer: SqlAnswer) -> Response<Body> {
    let mut resp = Response::new(Body::from(answer.body));
    *resp.status_mut() = answer.status;
    let headers = resp.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for (name, value) in answer.headers {
        headers.insert(name, HeaderValue::from_static(value));
    }
    resp
}

/// Takes the request as a job (SPEC §6, §8) and answers `202` with a handle polled on the pool
/// host as the request reached it.
async fn accept_job(call: Call<'_>, priority: Priority, reason: Reason) -> Response<Body> {
    let key_id = call.caller.key_id.clone();
    let pending = match jobs::admit(&call.state.jobs, call.pool) {
        Ok(pending) => pending,
        Err(e) => return call.log.refuse(Some(&key_id), e),
    };
    let body = match jobs::bounded_body(call.pool, call.body.clone()) {
        Ok(b) => b,
        Err(e) => return call.log.refuse(Some(&key_id), e),
    };
    let submission = jobs::Submission {
        head: JobHead {
            method: Method::POST,
            path_and_query: SQL_PATH.to_string(),
            headers: neon_headers(&call.headers),
        },
        body,
        priority,
        reason,
        pending,
        request_id: call.log.request_id.clone(),
        poll_base: poll_base(call.state.live.load().poll_scheme(), &call.headers),
    };
    let accepted = jobs::accept(&call.state.jobs, call.pool, &call.caller, submission).await;
    jobs::answer(call.log, &key_id, reason.as_str(), accepted)
}

/// What a SQL job keeps of the request's headers: the `Neon-*` ones, which say how to run and
/// answer it. Credentials (the driver's `Neon-Connection-String` among them) and everything
/// else stay behind.
fn neon_headers(headers: &HeaderMap) -> HeaderMap {
    headers
        .iter()
        .filter(|(name, _)| {
            name.as_str().starts_with("neon-") && name.as_str() != "neon-connection-string"
        })
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

/// `{scheme}://{host}` of the pool host as the request reached it (its `Host`, port included),
/// or `None` (then the handle is polled on the API host) when the request named no usable host.
fn poll_base(scheme: &str, headers: &HeaderMap) -> Option<String> {
    let host = headers.get(http::header::HOST)?.to_str().ok()?;
    let sane = !host.is_empty()
        && host.len() <= 261
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'));
    sane.then(|| format!("{scheme}://{host}"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn poll_base_is_the_host_as_reached() {
        let mut h = HeaderMap::new();
        assert_eq!(poll_base("http", &h), None);
        h.insert(
            http::header::HOST,
            HeaderValue::from_static("db.localhost:8080"),
        );
        assert_eq!(
            poll_base("http", &h).as_deref(),
            Some("http://db.localhost:8080")
        );
        h.insert(http::header::HOST, HeaderValue::from_static("evil/x?y"));
        assert_eq!(poll_base("http", &h), None);
    }

    #[test]
    fn only_neon_headers_travel_with_a_job() {
        let mut h = HeaderMap::new();
        h.insert("neon-array-mode", HeaderValue::from_static("true"));
        h.insert(
            "authorization",
            HeaderValue::from_static("Bearer nb_live_x"),
        );
        h.insert(
            "neon-connection-string",
            HeaderValue::from_static("postgres://u:p@h/d"),
        );
        let kept = neon_headers(&h);
        assert!(kept.contains_key("neon-array-mode"));
        assert!(!kept.contains_key("authorization"));
        assert!(!kept.contains_key("neon-connection-string"));
    }
}
