//! The proxy (SPEC §4): a pool host's requests, admitted by the pool's gate, forwarded to the
//! upstream with the managed credentials, streamed both ways.
//!
//! It owns header hygiene (hop-by-hop and `X-Nthpool-*` never cross), the upstream client
//! (keep-alive pool with an idle timer, rustls), and the rule that a response keeps its slot
//! until its body has been sent or the client went away ([`SlotBody`]). It must not make
//! admission decisions (the gate does) nor parse keys (auth does).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::{LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use nthbouncer_config::ServerSpec;
use nthbouncer_coord::{
    AcquireRequest, Grant, Outcome, PoolGate, Priority, Refusal, SlotId, SlotKind,
};

use crate::access;
use crate::access::keys::Caller;
use crate::app::state::AppState;
use crate::core::access_log::LogLine;
use crate::core::admission::{self, Caller as AdmissionCaller};
use crate::core::error::ApiError;
use crate::jobs::Reason;
use crate::pools::registry::PoolRuntime;

pub type UpstreamClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Builds the shared upstream client: keep-alive pool whose idle connections are closed by a
/// timer below typical upstream keep-alive timeouts, so we never write into a connection the
/// upstream is about to close.
pub fn build_client(server: &ServerSpec) -> Result<UpstreamClient, String> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_millis(
        server.upstream_connect_timeout_ms,
    )));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
        .map_err(|e| e.to_string())?
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_millis(server.upstream_idle_timeout_ms))
        .pool_timer(TokioTimer::new())
        .pool_max_idle_per_host(1024)
        .build(https))
}

/// Headers that belong to one connection (RFC 9110 §7.6.1) and never cross a proxy.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Drops hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    headers.remove(header::UPGRADE);
}

/// Drops every `X-Nthpool-*` header: our control headers never reach the upstream.
pub fn strip_nthpool_headers(headers: &mut HeaderMap) {
    let ours: Vec<HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("x-nthpool-"))
        .cloned()
        .collect();
    for name in ours {
        headers.remove(name);
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn chain_has<E: std::error::Error + 'static>(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.is::<E>() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// Frees a slot when dropped; carries the upstream outcome to adaptive learning.
pub struct SlotGuard {
    gate: Arc<dyn PoolGate>,
    slot: SlotId,
    pub outcome: Option<Outcome>,
}

impl SlotGuard {
    pub fn new(gate: Arc<dyn PoolGate>, slot: SlotId) -> Self {
        SlotGuard {
            gate,
            slot,
            outcome: None,
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        // Release is async at the seam (a Redis gate talks to Redis) and dropping must not
        // block: poll it once here, and only if it is not done at once (the in-process gate
        // always is) hand the rest to a task. That saves a task per request on the hot path.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::error!(
                "slot released outside the runtime; it will be reclaimed at its deadline"
            );
            return;
        };
        let gate = self.gate.clone();
        let slot = self.slot;
        let outcome = self.outcome.take();
        let mut release = Box::pin(async move {
            gate.release(slot, outcome).await;
        });
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if release.as_mut().poll(&mut cx).is_pending() {
            rt.spawn(release);
        }
    }
}

/// The upstream call up to its response head, holding the slot.
///
/// If the caller goes away first (this future is dropped), the origin is still working on the
/// call: the rest of it runs detached and the slot is freed only when the origin answers or the
/// request deadline passes. Freeing it at once would let the next waiter reach the origin while
/// the origin still counts the abandoned call: one over the limit, seen from the origin.
struct Exchange {
    call: Option<ResponseFuture>,
    guard: Option<SlotGuard>,
    deadline: tokio::time::Instant,
}

impl Exchange {
    fn new(call: ResponseFuture, guard: SlotGuard, deadline: tokio::time::Instant) -> Self {
        Exchange {
            call: Some(call),
            guard: Some(guard),
            deadline,
        }
    }
}

type UpstreamResult = Result<Response<Incoming>, hyper_util::client::legacy::Error>;

impl Future for Exchange {
    type Output = (UpstreamResult, SlotGuard);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let (Some(call), Some(_)) = (this.call.as_mut(), this.guard.as_ref()) else {
            // Polled after completion: never happens through `.await`.
            return Poll::Pending;
        };
        let result = std::task::ready!(Pin::new(call).poll(cx));
        this.call = None;
        match this.guard.take() {
            Some(guard) => Poll::Ready((result, guard)),
            None => Poll::Pending,
        }
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let (Some(call), Some(guard)) = (self.call.take(), self.guard.take()) else {
            return;
        };
        if tokio::time::Instant::now() >= self.deadline {
            return; // the request timed out: the slot is freed now (SPEC §4)
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let deadline = self.deadline;
            rt.spawn(async move {
                // The answer is discarded: its caller is gone.
                let _ = tokio::time::timeout_at(deadline, call).await;
                drop(guard);
            });
        }
    }
}

pin_project_lite::pin_project! {
    /// An upstream response body that holds its slot until the last frame has been handed to
    /// the client, the client goes away (the body is dropped), or the request deadline passes.
    pub struct SlotBody {
        #[pin]
        inner: Incoming,
        #[pin]
        deadline: tokio::time::Sleep,
        guard: Option<SlotGuard>,
    }
}

impl SlotBody {
    pub fn new(inner: Incoming, guard: SlotGuard, deadline: tokio::time::Instant) -> Self {
        SlotBody {
            inner,
            deadline: tokio::time::sleep_until(deadline),
            guard: Some(guard),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("upstream response exceeded the request timeout")]
struct DeadlineExceeded;

impl HttpBody for SlotBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if this.guard.is_none() {
            return Poll::Ready(None);
        }
        match this.inner.poll_frame(cx) {
            Poll::Ready(None) => {
                this.guard.take();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.guard.take();
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
            Poll::Pending => {
                if this.deadline.poll(cx).is_ready() {
                    this.guard.take();
                    return Poll::Ready(Some(Err(Box::new(DeadlineExceeded))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.guard.is_none() || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
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

/// The upstream URL of a request: the pool's scheme, authority and base path, then the
/// request's path and query. `None` if that is not a valid URI.
fn upstream_uri(upstream: &crate::pools::registry::Upstream, uri: &http::Uri) -> Option<http::Uri> {
    let path_and_query = uri.path_and_query();
    if upstream.base_path.is_empty() {
        // The common case: the request's own path and query, shared rather than re-parsed.
        if let Some(pq) = path_and_query.filter(|pq| pq.as_str().starts_with('/')) {
            let mut parts = http::uri::Parts::default();
            parts.scheme = Some(upstream.scheme.clone());
            parts.authority = Some(upstream.authority.clone());
            parts.path_and_query = Some(pq.clone());
            return http::Uri::from_parts(parts).ok();
        }
    }
    let path_and_query = path_and_query.map(|pq| pq.as_str()).unwrap_or("/");
    format!(
        "{}://{}{}{}",
        upstream.scheme, upstream.authority, upstream.base_path, path_and_query
    )
    .parse()
    .ok()
}

/// `X-Forwarded-For`: the caller's value, if any, with the peer appended.
fn forwarded_for(prior: Option<&str>, peer: std::net::IpAddr) -> Option<HeaderValue> {
    use std::fmt::Write as _;
    let mut value = String::with_capacity(prior.map_or(0, |p| p.len() + 2) + 39);
    if let Some(prior) = prior {
        value.push_str(prior);
        value.push_str(", ");
    }
    let _ = write!(value, "{peer}");
    HeaderValue::from_maybe_shared(Bytes::from(value)).ok()
}

/// Serves one request on a proxy pool's host.
pub async fn handle(
    state: Arc<AppState>,
    pool: Arc<PoolRuntime>,
    req: Request<Incoming>,
    peer: SocketAddr,
    original_host: Option<HeaderValue>,
) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let client = access::client_addr(peer.ip(), &parts.headers, &state.trusted_proxies);
    let log = LogLine {
        log: &state.access_log,
        pool: &pool.name,
        at: state.now(),
        peer: SocketAddr::new(client, peer.port()),
        route: route(&parts.method, parts.uri.path()),
    };

    // Pool key and access policies (SPEC §2, §9). A signed request with a body comes back with
    // a pending check that travels with the body to the upstream.
    let body_state = if body.is_end_stream() {
        access::BodyState::Empty
    } else {
        access::BodyState::Streamed
    };
    // Boxed, like `accept_job` and `forward`: an `async fn`'s state is as large as its largest
    // await, and a parked waiter should carry only what waiting needs.
    let authorized = Box::pin(access::authorize(
        &state,
        &pool,
        client,
        &parts.method,
        &parts.uri,
        &parts.headers,
        body_state,
        log.at,
    ))
    .await;
    let (caller, mut signed) = match authorized {
        Ok(a) => (a.caller, a.pending),
        Err(failure) => return access::refuse(&pool, log, None, failure),
    };
    let key_id = caller.key_id.clone();
    let max_body = state.server.max_body_bytes;
    if content_length(&parts.headers).is_some_and(|len| len > max_body) {
        let e = ApiError::payload_too_large(max_body);
        return log.refuse(Some(&key_id), e);
    }
    let admission = admission::wait_budget(
        &parts.headers,
        &pool.concurrency,
        AdmissionCaller::Proxy,
        None,
    )
    .and_then(|wait| Ok((wait, admission::priority_from_headers(&parts.headers)?)));
    let (wait_ms, priority) = match admission {
        Ok(v) => v,
        Err(e) => {
            return log.refuse(Some(&key_id), e);
        }
    };

    // Async admission (SPEC §6): asked for with the header, or promoted from a wait.
    let asked_async = match async_header(&parts.headers) {
        Ok(v) => v,
        Err(e) => {
            return log.refuse(Some(&key_id), e);
        }
    };
    if asked_async && !pool.spec.async_jobs.enabled {
        let e = ApiError::new(
            StatusCode::BAD_REQUEST,
            "async_disabled",
            "this pool does not take async jobs (async.enabled = false)",
        );
        return log.refuse(Some(&key_id), e);
    }
    // With no active webhook destination the pool behaves exactly as with async off.
    let live = pool.async_live();
    if asked_async && live {
        return Box::pin(accept_job(
            &state,
            &pool,
            log,
            &parts,
            body,
            signed.take(),
            &caller,
            priority,
            Reason::Requested,
        ))
        .await;
    }
    let promote_busy = live && pool.spec.async_jobs.on_open_wait && wait_ms > 0;
    let promote_timeout = live && pool.spec.async_jobs.on_queue_timeout;

    let request = AcquireRequest {
        fairness_key: caller.fairness,
        priority,
        // A request that would wait is taken as a job instead: try without waiting first.
        wait_ms: if promote_busy { 0 } else { wait_ms },
        kind: SlotKind::Exchange,
    };
    let grant = match pool.gate.acquire(request).await {
        Ok(g) => g,
        Err(refusal) => {
            let promoted = match refusal {
                Refusal::TooManyRequests { .. } if promote_busy => Some(Reason::Busy),
                Refusal::QueueTimeout { .. } if promote_timeout => Some(Reason::WaitTimeout),
                _ => None,
            };
            if let Some(reason) = promoted {
                return Box::pin(accept_job(
                    &state,
                    &pool,
                    log,
                    &parts,
                    body,
                    signed.take(),
                    &caller,
                    priority,
                    reason,
                ))
                .await;
            }
            return admission::refuse(&pool, log, &key_id, &refusal);
        }
    };
    pool.metrics.admitted_proxy.increment(1);
    pool.metrics
        .queue_wait
        .record(grant.headers.queued_ms as f64 / 1000.0);
    // Forwarding runs in its own boxed future: a waiter parked in the queue then holds only
    // what admission needs, not the forwarding machinery as well (see `bench/run scale`).
    Box::pin(forward(Admitted {
        state: &state,
        pool: &pool,
        log,
        parts,
        body,
        signed,
        key_id,
        used_authorization: caller.used_authorization,
        client,
        peer,
        original_host,
        grant,
    }))
    .await
}

/// A proxied request the gate admitted, on its way to the upstream.
struct Admitted<'a> {
    state: &'a Arc<AppState>,
    pool: &'a Arc<PoolRuntime>,
    log: LogLine<'a>,
    parts: http::request::Parts,
    body: Incoming,
    signed: Option<access::Pending>,
    key_id: Arc<str>,
    used_authorization: bool,
    client: std::net::IpAddr,
    peer: SocketAddr,
    original_host: Option<HeaderValue>,
    grant: Grant,
}

/// Sends an admitted request upstream and streams the answer back, holding the slot.
async fn forward(admitted: Admitted<'_>) -> Response<Body> {
    let Admitted {
        state,
        pool,
        log,
        mut parts,
        body,
        mut signed,
        key_id,
        used_authorization,
        client,
        peer,
        original_host,
        grant,
    } = admitted;
    let max_body = state.server.max_body_bytes;
    let guard = SlotGuard::new(pool.gate.clone(), grant.slot_id);
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(pool.concurrency.request_timeout_ms);

    // The upstream request: our URL, our Host, the caller's method/headers/body minus what
    // must not cross, plus the managed credentials.
    let uri = match upstream_uri(&pool.upstream, &parts.uri) {
        Some(u) => u,
        None => {
            let e = ApiError::invalid("path", "the request path cannot be forwarded");
            log.write(
                Some(&key_id),
                "400",
                None,
                e.status,
                grant.headers.queued_ms,
                None,
                None,
            );
            return axum::response::IntoResponse::into_response(e);
        }
    };
    let headers = &mut parts.headers;
    strip_hop_by_hop(headers);
    strip_nthpool_headers(headers);
    pool.access.strip_credentials(headers);
    if used_authorization {
        headers.remove(header::AUTHORIZATION);
    }
    let prior = headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok());
    if let Some(v) = forwarded_for(prior, peer.ip()) {
        headers.insert(X_FORWARDED_FOR.clone(), v);
    }
    headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    if let Some(h) = original_host {
        headers.insert(X_FORWARDED_HOST.clone(), h);
    }
    // hyper-util only fills Host when absent: replace the caller's explicitly.
    headers.insert(header::HOST, pool.upstream.host.clone());
    for (name, value) in &pool.upstream_headers {
        headers.insert(name.clone(), value.clone());
    }
    parts.uri = uri;
    parts.version = http::Version::HTTP_11;
    let body = Limited::new(body, max_body as usize);
    let (body, verdict) = match signed.take() {
        Some(pending) => {
            let (body, verdict) = access::SignedBody::new(body, pending);
            (Body::new(body), Some(verdict))
        }
        None => (Body::new(body), None),
    };
    let upstream_req = Request::from_parts(parts, body);

    let started = Instant::now();
    let exchange = Exchange::new(state.client.request(upstream_req), guard, deadline);
    let sent = tokio::time::timeout_at(deadline, exchange).await;
    let latency_ms = started.elapsed().as_millis() as u64;
    let (resp, mut guard) = match sent {
        Ok((Ok(resp), guard)) => (resp, guard),
        Ok((Err(err), _guard)) => {
            if let Some(failure) = access::rejection_in(&err) {
                let failure = access::Failure::Hmac(failure);
                pool.access.record_failure(client, log.at, failure);
                return access::refuse(pool, log, Some(&key_id), failure);
            }
            let e = if chain_has::<LengthLimitError>(&err) {
                ApiError::payload_too_large(max_body)
            } else {
                pool.metrics.upstream_errors.increment(1);
                tracing::debug!(pool = %pool.name, error = %err, "upstream request failed");
                let what = if err.is_connect() {
                    "cannot connect to the upstream"
                } else {
                    "the upstream connection failed"
                };
                ApiError::new(StatusCode::BAD_GATEWAY, "upstream_unreachable", what)
            }
            .with_gate(grant.headers);
            log.write(
                Some(&key_id),
                &e.status.as_u16().to_string(),
                None,
                e.status,
                grant.headers.queued_ms,
                None,
                Some(latency_ms),
            );
            return axum::response::IntoResponse::into_response(e);
        }
        Err(_) => {
            pool.metrics.upstream_errors.increment(1);
            let e = ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_timeout",
                format!(
                    "the upstream did not answer within {} ms",
                    pool.concurrency.request_timeout_ms
                ),
            )
            .with_gate(grant.headers);
            log.write(
                Some(&key_id),
                "504",
                Some("upstream timeout"),
                e.status,
                grant.headers.queued_ms,
                None,
                Some(latency_ms),
            );
            return axum::response::IntoResponse::into_response(e);
        }
    };
    // The upstream may answer before a signed body ended: its answer waits for the verdict.
    if let Some(verdict) = verdict {
        if let Err(failure) = access::body_verdict(verdict, deadline).await {
            let failure = access::Failure::Hmac(failure);
            pool.access.record_failure(client, log.at, failure);
            return access::refuse(pool, log, Some(&key_id), failure);
        }
    }

    pool.metrics
        .upstream_latency
        .record(latency_ms as f64 / 1000.0);
    let (mut rparts, rbody) = resp.into_parts();
    guard.outcome = Some(crate::upstream::outcome::from_response(
        rparts.status.as_u16(),
        &rparts.headers,
        state.now(),
    ));
    strip_hop_by_hop(&mut rparts.headers);
    admission::write_gate_headers(&mut rparts.headers, &grant.headers);
    log.write(
        Some(&key_id),
        "admitted",
        None,
        rparts.status,
        grant.headers.queued_ms,
        Some(rparts.status.as_u16()),
        Some(latency_ms),
    );
    Response::from_parts(rparts, Body::new(SlotBody::new(rbody, guard, deadline)))
}

pub const ASYNC_HEADER: &str = "x-nthpool-async";

/// `X-Nthpool-Async`: `1`/`true` asks for a job; `0`/`false` (or absent) does not.
fn async_header(headers: &HeaderMap) -> Result<bool, ApiError> {
    match headers.get(ASYNC_HEADER).map(|v| v.to_str().map(str::trim)) {
        None => Ok(false),
        Some(Ok("1")) | Some(Ok("true")) => Ok(true),
        Some(Ok("0")) | Some(Ok("false")) => Ok(false),
        Some(_) => Err(ApiError::invalid(
            "X-Nthpool-Async",
            "X-Nthpool-Async must be 1 (or 0)",
        )),
    }
}

/// Takes the request as a job and answers `202` with its handle.
#[allow(clippy::too_many_arguments)]
async fn accept_job(
    state: &Arc<AppState>,
    pool: &Arc<PoolRuntime>,
    log: LogLine<'_>,
    parts: &http::request::Parts,
    body: Incoming,
    signed: Option<access::Pending>,
    caller: &Caller,
    priority: Priority,
    reason: Reason,
) -> Response<Body> {
    let body = match crate::jobs::read_body(pool, body).await {
        Ok(b) => b,
        Err(e) => {
            return log.refuse(Some(&caller.key_id), e);
        }
    };
    // A signed request is only accepted once its body matches the signature.
    if let Some(pending) = signed {
        if let Err(f) = pending.finish_with_body(&body).await {
            let failure = access::Failure::Hmac(f);
            pool.access.record_failure(log.peer.ip(), log.at, failure);
            return access::refuse(pool, log, Some(&caller.key_id), failure);
        }
    }
    match crate::jobs::accept(state, pool, parts, body, caller, priority, reason).await {
        Ok(accepted) => {
            log.write(
                Some(&caller.key_id),
                "202",
                Some(reason.as_str()),
                StatusCode::ACCEPTED,
                0,
                None,
                None,
            );
            let mut resp = axum::response::IntoResponse::into_response(axum::Json(accepted));
            *resp.status_mut() = StatusCode::ACCEPTED;
            resp
        }
        Err(e) => log.refuse(Some(&caller.key_id), e),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret-Hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("yes"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn upstream_uri_joins_base_path_and_request_path() {
        for (upstream, request, want) in [
            (
                "http://127.0.0.1:9000",
                "/a/b?c=d",
                "http://127.0.0.1:9000/a/b?c=d",
            ),
            ("http://127.0.0.1:9000/", "/", "http://127.0.0.1:9000/"),
            (
                "https://api.example.com/v1/",
                "/chat?x=1",
                "https://api.example.com/v1/chat?x=1",
            ),
            ("http://h:1", "http://other/p?q", "http://h:1/p?q"),
        ] {
            let up = crate::pools::registry::Upstream::parse("t", upstream).unwrap();
            let uri: http::Uri = request.parse().unwrap();
            assert_eq!(upstream_uri(&up, &uri).unwrap().to_string(), want);
        }
    }

    #[test]
    fn forwarded_for_appends_the_peer() {
        let peer: std::net::IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(forwarded_for(None, peer).unwrap(), "10.1.2.3");
        assert_eq!(
            forwarded_for(Some("1.1.1.1"), peer).unwrap(),
            "1.1.1.1, 10.1.2.3"
        );
        let v6: std::net::IpAddr = "::1".parse().unwrap();
        assert_eq!(forwarded_for(None, v6).unwrap(), "::1");
        assert_eq!(route(&http::Method::POST, "/x/y"), "proxy POST /x/y");
    }

    #[test]
    fn nthpool_headers_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert("x-nthpool-key", HeaderValue::from_static("k"));
        h.insert("x-nthpool-priority", HeaderValue::from_static("high"));
        h.insert("x-other", HeaderValue::from_static("1"));
        strip_nthpool_headers(&mut h);
        assert_eq!(h.len(), 1);
    }
}
