//! The proxy (SPEC §4): a pool host's requests, admitted by the pool's gate, forwarded to the
//! upstream with the managed credentials, streamed both ways.
//!
//! A request goes through named phases over one per-request context ([`Call`]): authorize
//! (pool key and access policies) → plan (body size, wait budget, priority, async) → admit (the
//! gate, or a promotion to a job, [`promote`]) → forward (the upstream layer prepares and sends
//! it; the answer streams back holding the slot). It must not make admission decisions (the
//! gate does), parse keys (access does) nor build upstream requests itself (upstream does).
//!
//! A pool with `[pools.cache]` adds one step between plan and admit: the shared response
//! cache's lookup (`crate::cache`), which may answer a hit without the gate; elsewhere the
//! proxy only hands the cache a miss's answer (`Call::cache`) and marks answers.

mod promote;
mod tokens;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::response::IntoResponse;
use bytes::Bytes;
use http::header::HeaderValue;
use http::request::Parts;
use http::{HeaderMap, Request, Response};
use http_body_util::{LengthLimitError, Limited};
use hyper::body::Incoming;
use nthbouncer_coord::{Clock, Grant};

use crate::access::{self, keys::Caller};
use crate::cache;
use crate::core::access_log::{AccessLog, LogLine, LogOutcome, UpstreamSeen};
use crate::core::admission::{self, Plan};
use crate::core::error::{ApiError, ErrorCode};
use crate::core::extract::content_length;
use crate::core::peer::Peer;
use crate::jobs::Jobs;
use crate::pools::registry::PoolRuntime;
use crate::upstream::prepare::{self, Consumed, Forwarded, Origin};
use crate::upstream::{self, SharedClient, SlotBody, SlotGuard, UpstreamError};

pub use crate::core::admission::ASYNC_HEADER;

/// What the proxy needs: the upstream client (also for JWKS), the trusted proxies, the access
/// log, the clock, the jobs a request may be handed to, and the body bound.
pub struct Proxy {
    pub client: Arc<SharedClient>,
    /// The live `[server]` settings: trusted proxies, the body bound, the body read budget.
    pub live: Arc<crate::core::live::LiveServer>,
    pub access_log: AccessLog,
    pub clock: Arc<dyn Clock>,
    pub jobs: Arc<Jobs>,
    /// The shared response cache of the pools that have one.
    pub cache: Arc<cache::Caches>,
}

impl Proxy {
    fn now(&self) -> u64 {
        self.clock.now_ms()
    }
}

/// One proxied request on its way through the phases.
struct Call<'a> {
    state: &'a Proxy,
    pool: &'a Arc<PoolRuntime>,
    log: LogLine<'a>,
    parts: Parts,
    peer: Peer,
    original_host: Option<HeaderValue>,
    caller: Caller,
    /// A cache miss that leads: its answer is stored as it streams (see `cache`). Boxed: a
    /// call parked in the queue should not grow by what storing needs.
    cache: Option<Box<cache::Fill>>,
}

/// A request's body as the phases carry it: still streaming, or read whole (a signed request's:
/// nothing of it leaves the gateway before its signature verified).
enum CallBody {
    Streamed(Incoming),
    Whole(Bytes),
    /// Read in part for a token estimate (past `tokens.max_body_bytes`): that part, then the
    /// rest still streaming.
    Partial(Bytes, Incoming),
}

/// Serves one request on a proxy pool's host.
///
/// Shaped for the waiter parked in the pool's queue, whose whole state machine is this
/// future's (bench/run scale): everything before admission runs in one boxed future
/// ([`front`]), so its locals and the request it took apart are not kept beside the call while
/// it waits; the call is then moved, once, into [`admit`]. An `async fn` keeps its arguments
/// for its whole life and every local that was ever borrowed until its scope ends, which is
/// what made this future 3,792 bytes.
pub async fn handle(
    state: Arc<Proxy>,
    pool: Arc<PoolRuntime>,
    req: Request<Incoming>,
    peer: Peer,
    original_host: Option<HeaderValue>,
    request_id: Option<String>,
) -> Response<Body> {
    let cached = pool.spec.cache.is_some();
    // Taken apart in the `let`: a named `Front` matched later would stay in the state while
    // the call waits, beside the call moved out of it.
    let (call, body, plan, mark) =
        match Box::pin(front(&state, &pool, req, peer, original_host, request_id)).await {
            Front::Answered(resp) => return marked(resp, cached),
            Front::Admit(call, body, plan, mark) => (call, body, plan, mark),
        };
    let mut resp = admit(call, body, plan).await;
    if let Some(mark) = mark {
        cache::mark(&mut resp, mark);
    }
    marked(resp, cached)
}

/// Every answer of a cache-enabled pool says what the cache did (SPEC §12).
fn marked(mut resp: Response<Body>, cached: bool) -> Response<Body> {
    if cached {
        cache::mark_unmarked(&mut resp);
    }
    resp
}

/// What [`front`] leaves for admission.
// Not boxed: it lives only until it is taken apart, and a box would cost every request an
// allocation.
#[allow(clippy::large_enum_variant)]
enum Front<'a> {
    /// Refused, or a cache hit.
    Answered(Response<Body>),
    /// To admit; with the cache's mark when the pool has a cache.
    Admit(Call<'a>, CallBody, Plan, Option<cache::Mark>),
}

/// Authorize, verify a signed body, plan, and look the cache up: all but admission.
async fn front<'a>(
    state: &'a Arc<Proxy>,
    pool: &'a Arc<PoolRuntime>,
    req: Request<Incoming>,
    peer: Peer,
    original_host: Option<HeaderValue>,
    request_id: Option<String>,
) -> Front<'a> {
    let (parts, body) = req.into_parts();
    let client = access::client_addr(
        peer.ip(),
        &parts.headers,
        &state.live.load().trusted_proxies,
    );
    let log = LogLine {
        log: &state.access_log,
        pool: &pool.name,
        at: state.now(),
        peer: SocketAddr::new(client, peer.addr().port()),
        peer_text: peer.text_of(client),
        route: route(&parts.method, parts.uri.path()),
        request_id,
        client_cert: crate::tls::PeerTls::client_of(&parts.extensions),
    };
    let authorized = authorize(state, pool, client, &parts, &body, log.at).await;
    let (caller, signed) = match authorized {
        Ok(a) => (a.caller, a.pending),
        Err(failure) => {
            return Front::Answered(access::refuse(&pool.metrics, log, None, failure));
        }
    };
    let body = match signed {
        None => CallBody::Streamed(body),
        // Boxed: only a signed request with a body needs it.
        Some(pending) => match Box::pin(verify_body(state, pool, pending, body)).await {
            Ok(bytes) => CallBody::Whole(bytes),
            Err(Refused::TooLarge(e)) => {
                return Front::Answered(log.refuse(Some(&caller.key_id), e));
            }
            Err(Refused::Unverified(failure)) => {
                pool.access.record_failure(client, log.at, failure);
                let refused = access::refuse(&pool.metrics, log, Some(&caller.key_id), failure);
                return Front::Answered(refused);
            }
        },
    };
    let mut call = Call {
        state,
        pool,
        log,
        parts,
        peer,
        original_host,
        caller,
        cache: None,
    };
    let plan = match plan(&call) {
        Ok(p) => p,
        Err(e) => return Front::Answered(call.log.refuse(Some(&call.caller.key_id), e)),
    };
    if pool.spec.cache.is_none() {
        return Front::Admit(call, body, plan, None);
    }
    let mark = match cache_lookup(&call, &body, &plan).await {
        cache::Lookup::Hit(resp) => return Front::Answered(cache_hit(call, resp)),
        cache::Lookup::Miss(fill) => {
            call.cache = fill.map(Box::new);
            cache::Mark::Miss
        }
        cache::Lookup::Bypass => cache::Mark::Bypass,
    };
    Front::Admit(call, body, plan, Some(mark))
}

/// The shared response cache's lookup (SPEC §4): after authentication and every access
/// policy, before admission.
async fn cache_lookup(call: &Call<'_>, body: &CallBody, plan: &Plan) -> cache::Lookup {
    let has_body = match body {
        CallBody::Streamed(b) => !http_body::Body::is_end_stream(b),
        CallBody::Whole(b) => !b.is_empty(),
        CallBody::Partial(..) => true,
    };
    let head = cache::RequestHead {
        method: &call.parts.method,
        uri: &call.parts.uri,
        headers: &call.parts.headers,
        has_body,
        asked_async: plan.asked_async,
        authorization_consumed: call.caller.used_authorization,
    };
    let key_id = &call.caller.key_id;
    call.state.cache.lookup(call.pool, &head, key_id).await
}

/// A hit: answered from the cache, without a slot or an RPM token; logged as a hit.
fn cache_hit(call: Call<'_>, resp: Response<Body>) -> Response<Body> {
    let status = resp.status();
    let key_id = Some(&*call.caller.key_id);
    let upstream = UpstreamSeen::default();
    call.log
        .write(key_id, LogOutcome::CacheHit, None, status, 0, upstream);
    resp
}

/// Pool key and access policies (SPEC §2, §9). A signed request with a body comes back with a
/// pending check that travels with the body to the upstream.
async fn authorize(
    state: &Proxy,
    pool: &PoolRuntime,
    client: IpAddr,
    parts: &Parts,
    body: &Incoming,
    now: u64,
) -> Result<access::Authorized, access::Failure> {
    let body_state = if http_body::Body::is_end_stream(body) {
        access::BodyState::Empty
    } else {
        access::BodyState::Streamed
    };
    access::authorize(&state.client, &pool.access, client, parts, body_state, now).await
}

/// Why a signed body was refused.
enum Refused {
    /// Past `access.hmac.max_body_bytes`: `413`.
    TooLarge(ApiError),
    /// Not whole within the header timeout's budget, or its signature or nonce failed: `401`.
    Unverified(access::Failure),
}

/// Reads a signed request's body whole (up to `access.hmac.max_body_bytes`, within the header
/// timeout's budget) and finishes its signature check, before anything of it goes upstream.
async fn verify_body(
    state: &Proxy,
    pool: &PoolRuntime,
    pending: access::Pending,
    body: Incoming,
) -> Result<Bytes, Refused> {
    let max = pool
        .spec
        .access
        .hmac
        .as_ref()
        .map_or(state.live.load().max_body_bytes, |h| h.max_body_bytes);
    let read = http_body_util::BodyExt::collect(Limited::new(body, max as usize));
    let bytes = match tokio::time::timeout(state.live.load().header_read_timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<LengthLimitError>() => {
            return Err(Refused::TooLarge(ApiError::payload_too_large(max)))
        }
        Ok(Err(_)) | Err(_) => {
            let failure = access::Failure::Hmac(access::HmacFailure::BodyIncomplete);
            return Err(Refused::Unverified(failure));
        }
    };
    pending
        .finish_with_body(&bytes)
        .await
        .map_err(|f| Refused::Unverified(access::Failure::Hmac(f)))?;
    Ok(bytes)
}

/// The body-size bound, the wait budget, the priority and whether a job is asked for.
fn plan(call: &Call<'_>) -> Result<Plan, ApiError> {
    let headers = &call.parts.headers;
    let max_body = call.state.live.load().max_body_bytes;
    if content_length(headers).is_some_and(|len| len > max_body) {
        return Err(ApiError::payload_too_large(max_body));
    }
    admission::plan(
        headers,
        &call.pool.concurrency,
        call.pool.spec.async_jobs.enabled,
    )
}

/// Admission (SPEC §3, §6, §12): a job when asked for or promoted from a wait, else the token
/// budget (when the pool has one) and then the gate.
///
/// An `async` block rather than an `async fn`: the block uses the call where it was moved to,
/// where an `async fn` would keep its argument and a copy of it (568 bytes each) while waiting.
#[allow(clippy::manual_async_fn)] // the `async` block is the point (above)
fn admit<'a>(
    call: Call<'a>,
    body: CallBody,
    plan: Plan,
) -> impl std::future::Future<Output = Response<Body>> + 'a {
    async move {
        let mut body = body;
        // Asked here, not in `tokens::admit`: most pools have no budget, and its boxed future
        // (an allocation and a 2 KB copy) would be made for nothing on every request.
        let charge = if plan.asked_async || !call.pool.tokens.active() {
            None
        } else {
            // The body is read in place (for an estimate), not moved through: one copy of it
            // in the state of a waiting call.
            match Box::pin(tokens::admit(&call, &mut body, &plan)).await {
                Ok(charge) => Some(charge),
                Err(e) => {
                    let gate = call.pool.tokens.clone();
                    let mut resp = call.log.refuse(Some(&call.caller.key_id), e);
                    tokens::mark(resp.headers_mut(), &gate);
                    return resp;
                }
            }
        };
        let admitted = crate::jobs::admit_or_promote(call.pool, call.caller.fairness, &plan).await;
        if let (Some(c), false) = (&charge, matches!(admitted, crate::jobs::Admission::Slot(_))) {
            // Not sent now: the charge is taken back (a job is charged when it runs).
            c.gate.refund(c.id);
        }
        let grant = match admitted {
            crate::jobs::Admission::Slot(grant) => grant,
            crate::jobs::Admission::Job(reason) => {
                return Box::pin(promote::accept_job(call, body, plan.priority, reason)).await;
            }
            crate::jobs::Admission::Refused(refusal) => {
                let key_id = call.caller.key_id.clone();
                return admission::refuse(&call.pool.metrics, call.log, &key_id, &refusal);
            }
        };
        call.pool.metrics.admitted_proxy.increment(1);
        call.pool
            .metrics
            .queue_wait
            .record(grant.headers.queued_ms as f64 / 1000.0);
        // Forwarding runs in its own boxed future: a waiter parked in the queue then holds only
        // what admission needs, not the forwarding machinery as well (see `bench/run scale`).
        Box::pin(forward(call, body, grant, charge)).await
    }
}

/// Sends an admitted request upstream and streams the answer back, holding the slot.
async fn forward(
    mut call: Call<'_>,
    body: CallBody,
    grant: Grant,
    charge: Option<tokens::Charge>,
) -> Response<Body> {
    let pool = call.pool;
    let guard = SlotGuard::new(pool.gate.clone(), grant.slot_id);
    let deadline = crate::core::time::deadline_in(pool.concurrency.request_timeout_ms);
    let max_body = call.state.live.load().max_body_bytes;
    let body = match body {
        CallBody::Streamed(body) => Body::new(Limited::new(body, max_body as usize)),
        CallBody::Whole(bytes) => Body::from(bytes),
        CallBody::Partial(read, rest) => {
            Body::new(Limited::new(tokens::rejoin(read, rest), max_body as usize))
        }
    };
    let headers = std::mem::take(&mut call.parts.headers);
    let request = match upstream_request(&call, headers, body) {
        Ok(r) => r,
        Err(e) => {
            let e = ApiError::invalid("path", e.to_string()).with_gate(grant.headers);
            return call.log.refuse(Some(&call.caller.key_id), e);
        }
    };
    let started = crate::core::time::now();
    let sent = upstream::exchange(
        &call.pool.client(&call.state.client),
        request,
        guard,
        deadline,
    )
    .await;
    let latency_ms = started.elapsed().as_millis() as u64;
    let upstream::Answer {
        resp,
        mut guard,
        closed,
    } = match sent {
        Ok(answer) => answer,
        Err(e) => {
            if let Some(c) = &charge {
                // Never sent: not spent. Sent and unanswered: the estimate stands.
                if e.retry_safe() {
                    c.gate.refund(c.id);
                } else {
                    c.gate.finish(c.id, None);
                }
            }
            return upstream_failure(call, e, &grant, latency_ms);
        }
    };
    pool.metrics
        .upstream_latency
        .record(latency_ms as f64 / 1000.0);
    let (mut rparts, rbody) = resp.into_parts();
    let now = call.state.now();
    guard.outcome = Some(upstream::outcome::from_response(
        rparts.status.as_u16(),
        &rparts.headers,
        now,
    ));
    prepare::strip_hop_by_hop(&mut rparts.headers);
    admission::write_gate_headers(&mut rparts.headers, &grant.headers);
    let upstream = UpstreamSeen {
        status: Some(rparts.status.as_u16()),
        latency_ms: Some(latency_ms),
    };
    let key_id = Some(&*call.caller.key_id);
    let (status, queued_ms) = (rparts.status, grant.headers.queued_ms);
    call.log.write(
        key_id,
        LogOutcome::Admitted,
        None,
        status,
        queued_ms,
        upstream,
    );
    // A pool without a budget yet learns one from the first answer that announces it.
    let tokens_on = charge.is_some()
        || pool.tokens.active()
        || guard
            .outcome
            .as_ref()
            .and_then(crate::tokens::window_of)
            .is_some()
        || crate::tokens::announces_split(&rparts.headers);
    let outcome = tokens_on.then(|| guard.outcome.clone()).flatten();
    let body = Body::new(SlotBody::new(rbody, guard, deadline, closed));
    let body = match call.cache.take() {
        None => body,
        Some(fill) => fill.answer(status, &rparts.headers, body),
    };
    let resp = Response::from_parts(rparts, body);
    if !tokens_on {
        return resp;
    }
    let max = pool.spec.tokens.clone().unwrap_or_default().max_body_bytes;
    tokens::answered(charge, outcome.as_ref(), &pool.tokens, resp, max)
}

/// The request for the origin: the caller's side, then the origin's (the upstream layer).
fn upstream_request(
    call: &Call<'_>,
    mut headers: HeaderMap,
    body: Body,
) -> Result<Request<Body>, upstream::PathRefused> {
    prepare::caller_headers(&mut headers, &consumed(call), forwarded(call));
    // The dispatcher sends only proxy pools here (a database pool's host is `database`'s).
    let target = call
        .pool
        .upstream
        .http()
        .ok_or(upstream::PathRefused::Unparseable)?;
    let origin = Origin {
        target,
        managed: &call.pool.upstream_headers,
        idempotency_key: None,
    };
    let method = call.parts.method.clone();
    prepare::origin_request(
        &origin,
        method,
        call.parts.uri.path_and_query(),
        headers,
        body,
    )
}

fn consumed<'a>(call: &'a Call<'_>) -> Consumed<'a> {
    Consumed {
        credential_headers: call.pool.access.credential_headers(),
        authorization: call.caller.used_authorization,
    }
}

fn forwarded<'a>(call: &'a Call<'_>) -> Forwarded<'a> {
    Forwarded {
        peer: &call.peer,
        host: call.original_host.clone(),
    }
}

/// The answer to a call the upstream never answered: a signature that failed as the body
/// streamed (401), a body over the limit (413), unreachable (502) or too slow (504).
fn upstream_failure(
    call: Call<'_>,
    err: UpstreamError,
    grant: &Grant,
    latency_ms: u64,
) -> Response<Body> {
    let pool = call.pool;
    let max_body = call.state.live.load().max_body_bytes;
    let (e, reason) = if err.caused_by::<LengthLimitError>().is_some() {
        (ApiError::payload_too_large(max_body), None)
    } else if err.caused_by::<upstream::Fenced>().is_some() {
        let mut e = ApiError::new(
            ErrorCode::CoordinationUnavailable,
            "the slot could not be confirmed with the coordination store; the call was cut off",
        );
        e.retry_after_s = Some(1);
        (e, Some("slot lost"))
    } else if err.timed_out() {
        pool.metrics.upstream_errors.increment(1);
        let message = format!(
            "the upstream did not answer within {} ms",
            pool.concurrency.request_timeout_ms
        );
        let e = ApiError::new(ErrorCode::UpstreamTimeout, message);
        (e, Some("upstream timeout"))
    } else {
        pool.metrics.upstream_errors.increment(1);
        tracing::debug!(pool = %pool.name, error = %err, "upstream request failed");
        let what = if err.retry_safe() {
            "cannot connect to the upstream"
        } else {
            "the upstream connection failed"
        };
        (ApiError::new(ErrorCode::UpstreamUnreachable, what), None)
    };
    let e = e.with_gate(grant.headers);
    let upstream = UpstreamSeen {
        status: None,
        latency_ms: Some(latency_ms),
    };
    let outcome = LogOutcome::Refused(e.status);
    let key_id = Some(&*call.caller.key_id);
    call.log.write(
        key_id,
        outcome,
        reason,
        e.status,
        grant.headers.queued_ms,
        upstream,
    );
    e.into_response()
}

/// The access log's route of a proxied request: `proxy METHOD PATH`.
fn route(method: &http::Method, path: &str) -> String {
    let method = method.as_str();
    let mut route = String::with_capacity(7 + method.len() + path.len());
    route.push_str("proxy ");
    route.push_str(method);
    route.push(' ');
    route.push_str(path);
    route
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn routes_and_async_headers() {
        assert_eq!(route(&http::Method::POST, "/x/y"), "proxy POST /x/y");
        let mut h = HeaderMap::new();
        assert!(!admission::async_requested(&h).unwrap());
        h.insert(ASYNC_HEADER, HeaderValue::from_static("1"));
        assert!(admission::async_requested(&h).unwrap());
        h.insert(ASYNC_HEADER, HeaderValue::from_static("yes"));
        assert_eq!(
            admission::async_requested(&h).unwrap_err().field.as_deref(),
            Some("X-Nthpool-Async")
        );
    }
}
