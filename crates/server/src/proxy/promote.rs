//! A proxied request taken as an async job (SPEC §6): asked for with `X-Nthpool-Async`, or
//! promoted from a wait. The proxy's one hand-off to another feature: the body is read whole
//! (a signed one was, and verified, before admission), the request is prepared as the origin
//! will see it, and the job layer stores it durably before the `202`.

use axum::body::Body;
use http::Response;
use nthbouncer_coord::Priority;

use super::{consumed, forwarded, Call, CallBody};
use crate::jobs::{self, JobHead, Reason};
use crate::upstream::prepare;

/// Takes the request as a job and answers `202` with its handle.
pub(super) async fn accept_job(
    call: Call<'_>,
    body: CallBody,
    priority: Priority,
    reason: Reason,
) -> Response<Body> {
    let key_id = call.caller.key_id.clone();
    // Before the body is read: a refused job costs no body.
    let pending = match jobs::admit(&call.state.jobs, call.pool) {
        Ok(pending) => pending,
        Err(e) => return call.log.refuse(Some(&key_id), e),
    };
    let mut headers = call.parts.headers.clone();
    prepare::caller_headers(&mut headers, &consumed(&call), forwarded(&call));
    let head = JobHead {
        method: call.parts.method.clone(),
        path_and_query: call
            .parts
            .uri
            .path_and_query()
            .map_or_else(|| "/".to_string(), |p| p.as_str().to_string()),
        headers,
    };
    let body = match body {
        CallBody::Streamed(body) => jobs::read_body(call.pool, body).await,
        // A signed body, read whole and verified already.
        CallBody::Whole(bytes) => jobs::bounded_body(call.pool, bytes),
        // Read in part for a token estimate: past the token bound, and so past the job's
        // body bound too unless that one is larger.
        CallBody::Partial(read, rest) => jobs::read_body(call.pool, rest).await.and_then(|more| {
            let mut whole = read.to_vec();
            whole.extend_from_slice(&more);
            jobs::bounded_body(call.pool, bytes::Bytes::from(whole))
        }),
    };
    let body = match body {
        Ok(b) => b,
        Err(e) => return call.log.refuse(Some(&key_id), e),
    };
    let submission = jobs::Submission {
        head,
        body,
        priority,
        reason,
        pending,
        request_id: call.log.request_id.clone(),
        poll_base: None,
    };
    let accepted = jobs::accept(&call.state.jobs, call.pool, &call.caller, submission).await;
    jobs::answer(call.log, &key_id, reason.as_str(), accepted)
}
