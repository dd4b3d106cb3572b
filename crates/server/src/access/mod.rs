//! Access policies on every pool route (SPEC §2, §9): the pool key plus whatever the pool's
//! `access` table configures — IP allowlist, JWT, Cloudflare Access, HMAC request signing — all
//! of which must pass.
//!
//! Order: the IP allowlist (`403`, decided by the address alone), the failure throttle (`429`
//! for an address that failed too often), then the credentials, cheapest first: pool key, HMAC
//! head (timestamp window, header shapes), JWT, Cloudflare Access, and last the HMAC signature
//! and nonce. A failed credential is counted against the client address ([`throttle`]).
//!
//! Every refusal has the same body, `{"error":"unauthorized","message":CREDENTIALS_MESSAGE}`;
//! only the status tells `401` from `403`. The precise reason goes to the access log.
//!
//! The proxy streams bodies, so a signed request's body is verified as it streams
//! ([`SignedBody`]); the lock and poll routes go through [`require`], which reads their small
//! bodies whole when the pool signs requests.

mod client_ip;
mod jwt;
pub mod keys;
mod signing;
mod throttle;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderName, Method, StatusCode, Uri};
use ipnet::IpNet;
use nthbouncer_config::{AccessSpec, ConfigError};
use nthbouncer_coord::{InProcessNonces, NonceStore};

pub use client_ip::client_addr;
pub use jwt::{JwtFailure, JwtPolicy};
pub use signing::{
    rejection_in, BodyRejected, HmacFailure, HmacPolicy, Pending, SignedBody, Verdict,
};
pub use throttle::{FailureThrottle, BLOCK_MS, FAILURE_WINDOW_MS, MAX_FAILURES};

use crate::app::state::AppState;
use crate::core::access_log::{LogLine, LogOutcome, UpstreamSeen};
use crate::core::error::{ApiError, ErrorCode};
use crate::core::extract;
use crate::pools::registry::PoolRuntime;
use keys::{AuthFailure, Caller};

/// The one message of every authentication refusal: it must not say which part failed.
pub const CREDENTIALS_MESSAGE: &str = "missing or invalid credentials";
/// Unexpired nonces one pool remembers at most (about 50 bytes each).
pub const NONCE_CAPACITY: usize = 1_000_000;
/// Largest body [`require`] reads to check a signature on the API host's pool routes.
pub const MAX_SIGNED_API_BODY: usize = crate::core::extract::MAX_API_BODY_BYTES;
pub const CF_ACCESS_HEADER: &str = "cf-access-jwt-assertion";

/// Why access was refused (for the access log; the caller only sees the status).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    Key(AuthFailure),
    IpNotAllowed,
    Throttled { retry_after_ms: u64 },
    Hmac(HmacFailure),
    Jwt(JwtFailure),
    CloudflareAccess(JwtFailure),
}

impl Failure {
    pub fn status(&self) -> StatusCode {
        match self {
            Failure::IpNotAllowed => StatusCode::FORBIDDEN,
            Failure::Throttled { .. } => StatusCode::TOO_MANY_REQUESTS,
            _ => StatusCode::UNAUTHORIZED,
        }
    }

    /// The precise reason, for the access log.
    pub fn reason(&self) -> String {
        match self {
            Failure::Key(f) => f.as_str().to_string(),
            Failure::IpNotAllowed => "client address not in access.ip_allow".to_string(),
            Failure::Throttled { .. } => {
                "throttled after repeated failed authentication".to_string()
            }
            Failure::Hmac(f) => f.as_str().to_string(),
            Failure::Jwt(f) => format!("jwt: {}", f.as_str()),
            Failure::CloudflareAccess(f) => format!("cloudflare access: {}", f.as_str()),
        }
    }

    /// Whether the failure counts towards throttling the client address: guesses do; an
    /// address outside the allowlist, or a nonce store full of honest traffic, do not.
    fn counts(&self) -> bool {
        !matches!(
            self,
            Failure::IpNotAllowed
                | Failure::Throttled { .. }
                | Failure::Hmac(HmacFailure::NonceStoreFull)
                | Failure::Hmac(HmacFailure::BodyIncomplete)
                | Failure::Jwt(JwtFailure::KeysUnavailable)
                | Failure::CloudflareAccess(JwtFailure::KeysUnavailable)
        )
    }

    /// The answer: identical for every credential failure but for the status.
    pub fn error(&self) -> ApiError {
        match self {
            Failure::Throttled { retry_after_ms } => {
                let mut e = ApiError::new(
                    ErrorCode::TooManyRequests,
                    "too many failed authentication attempts; retry later",
                );
                e.retry_after_s = Some(retry_after_ms.div_ceil(1000).max(1));
                e
            }
            other => ApiError::new(ErrorCode::Unauthorized, CREDENTIALS_MESSAGE)
                .with_status(other.status()),
        }
    }
}

/// State of a pool's policies that outlives a settings change: the nonces seen (coordination
/// state, see `nthbouncer_coord::nonces`) and the failure counts.
pub struct AccessState {
    pub nonces: Arc<dyn NonceStore>,
    pub throttle: FailureThrottle,
}

impl Default for AccessState {
    fn default() -> Self {
        AccessState {
            nonces: Arc::new(InProcessNonces::new(NONCE_CAPACITY)),
            throttle: FailureThrottle::default(),
        }
    }
}

/// `access.jwt`: the policy and where its token is read.
struct JwtSource {
    policy: JwtPolicy,
    header: HeaderName,
}

impl JwtSource {
    /// The token: in the configured header (bare, or `Bearer <jwt>`), else in
    /// `Authorization: Bearer <jwt>` unless that header carried the pool key. The flag says
    /// whether `Authorization` carried it (then it must not be forwarded).
    fn token<'a>(
        &self,
        headers: &'a HeaderMap,
        key_in_authorization: bool,
    ) -> Option<(&'a str, bool)> {
        if let Some(v) = headers.get(&self.header) {
            let from_authorization = self.header == http::header::AUTHORIZATION;
            if from_authorization && key_in_authorization {
                return None;
            }
            let v = v.to_str().ok()?;
            let token = extract::bearer(v).unwrap_or_else(|| v.trim());
            return Some((token, from_authorization));
        }
        if key_in_authorization {
            return None;
        }
        Some((extract::bearer(extract::authorization(headers)?)?, true))
    }
}

/// A pool's access policies, ready to check requests.
pub struct AccessPolicy {
    ip_allow: Vec<IpNet>,
    hmac: Option<HmacPolicy>,
    jwt: Option<JwtSource>,
    cloudflare: Option<JwtPolicy>,
    /// Credential headers that must not reach the upstream (beyond `X-Nthpool-*`).
    credential_headers: Vec<HeaderName>,
    state: Arc<AccessState>,
}

impl AccessPolicy {
    /// Resolves a validated spec; `at` names the table in errors (`pools[0].access`).
    pub fn build(at: &str, spec: &AccessSpec) -> Result<AccessPolicy, ConfigError> {
        spec.validate(at)?;
        let hmac = match &spec.hmac {
            Some(h) => Some(HmacPolicy::new(
                h.resolved_secrets(&format!("{at}.hmac"))?,
                h.window_s,
            )),
            None => None,
        };
        let mut credential_headers = Vec::new();
        let jwt = match &spec.jwt {
            Some(j) => {
                let header = HeaderName::from_bytes(j.header.as_bytes()).map_err(|_| {
                    ConfigError::new(format!("{at}.jwt.header"), "is not a valid header name")
                })?;
                credential_headers.push(header.clone());
                Some(JwtSource {
                    policy: JwtPolicy::build(
                        &format!("{at}.jwt"),
                        j.issuer.clone(),
                        j.audience.clone(),
                        &j.algorithms,
                        j.leeway_s,
                        j.jwks_url.as_deref(),
                        &j.public_keys,
                    )?,
                    header,
                })
            }
            None => None,
        };
        let cloudflare = match &spec.cloudflare_access {
            Some(c) => {
                credential_headers.push(HeaderName::from_static(CF_ACCESS_HEADER));
                Some(JwtPolicy::build(
                    &format!("{at}.cloudflare_access"),
                    c.issuer(),
                    c.audience.clone(),
                    &["RS256".to_string()],
                    nthbouncer_config::access::DEFAULT_JWT_LEEWAY_S,
                    Some(&c.certs_url()),
                    &[],
                )?)
            }
            None => None,
        };
        Ok(AccessPolicy {
            ip_allow: spec.ip_allow_nets(),
            hmac,
            jwt,
            cloudflare,
            credential_headers,
            state: Arc::new(AccessState::default()),
        })
    }

    /// Keeps the nonces and failure counts of the pool's previous settings.
    pub fn carry_state_from(&mut self, previous: &AccessPolicy) {
        self.state = previous.state.clone();
    }

    pub fn signs_requests(&self) -> bool {
        self.hmac.is_some()
    }

    /// The credential headers our policies consume (the JWT header, the Cloudflare assertion):
    /// they never reach the upstream.
    pub fn credential_headers(&self) -> &[HeaderName] {
        &self.credential_headers
    }

    /// Counts a failure of `client` found after [`authorize`] (a streamed body's signature), if
    /// it is one that counts.
    pub fn record_failure(&self, client: IpAddr, now: u64, failure: Failure) {
        if failure.counts() {
            self.state.throttle.record_failure(client, now);
        }
    }
}

/// What the request's body is, as far as signing is concerned.
pub enum BodyState<'a> {
    /// No body at all (or `Content-Length: 0`): the signature covers the empty string.
    Empty,
    /// Read whole already.
    Whole(&'a [u8]),
    /// Still to stream: a signed request comes back with a [`Pending`] check for [`SignedBody`].
    Streamed,
}

/// A caller that passed every policy that can be checked before the body.
pub struct Authorized {
    pub caller: Caller,
    /// The signature still needs the streamed body's hash.
    pub pending: Option<Pending>,
}

/// Checks a request against the pool key and the pool's access policies at `now` (epoch ms).
#[allow(clippy::too_many_arguments)]
pub async fn authorize(
    state: &AppState,
    pool: &PoolRuntime,
    client: IpAddr,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: BodyState<'_>,
    now: u64,
) -> Result<Authorized, Failure> {
    let policy = &pool.access;
    if !policy.ip_allow.is_empty() && !policy.ip_allow.iter().any(|n| n.contains(&client)) {
        return Err(Failure::IpNotAllowed);
    }
    if let Some(ms) = policy.state.throttle.blocked(client, now) {
        return Err(Failure::Throttled { retry_after_ms: ms });
    }
    let result = credentials(state, pool, method, uri, headers, body, now).await;
    if let Err(f) = &result {
        if f.counts() {
            policy.state.throttle.record_failure(client, now);
        }
    }
    result
}

async fn credentials(
    state: &AppState,
    pool: &PoolRuntime,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: BodyState<'_>,
    now: u64,
) -> Result<Authorized, Failure> {
    let policy = &pool.access;
    let mut caller = keys::authenticate(pool, headers, now).map_err(Failure::Key)?;
    let pending = match &policy.hmac {
        Some(h) => Some(
            h.begin(method, uri, headers, now, policy.state.nonces.clone())
                .map_err(Failure::Hmac)?,
        ),
        None => None,
    };
    if let Some(j) = &policy.jwt {
        let (token, from_authorization) = j
            .token(headers, caller.used_authorization)
            .ok_or(Failure::Jwt(JwtFailure::Missing))?;
        j.policy
            .verify(token, &state.client, now)
            .await
            .map_err(Failure::Jwt)?;
        caller.used_authorization |= from_authorization;
    }
    if let Some(cf) = &policy.cloudflare {
        let token = headers
            .get(CF_ACCESS_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .ok_or(Failure::CloudflareAccess(JwtFailure::Missing))?;
        cf.verify(token, &state.client, now)
            .await
            .map_err(Failure::CloudflareAccess)?;
    }
    let pending = match (pending, body) {
        (None, _) => None,
        (Some(p), BodyState::Empty) => {
            p.finish_with_body(b"").await.map_err(Failure::Hmac)?;
            None
        }
        (Some(p), BodyState::Whole(bytes)) => {
            p.finish_with_body(bytes).await.map_err(Failure::Hmac)?;
            None
        }
        (Some(p), BodyState::Streamed) => Some(p),
    };
    Ok(Authorized { caller, pending })
}

/// Waits for a streamed body's verdict (the upstream may answer before the body ended); a body
/// that never finished by `deadline` counts as unverified.
pub async fn body_verdict(
    verdict: Verdict,
    deadline: tokio::time::Instant,
) -> Result<(), HmacFailure> {
    match tokio::time::timeout_at(deadline, verdict).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) | Err(_) => Err(HmacFailure::BodyIncomplete),
    }
}

/// Answers a refusal: the metric, the access-log line with the precise reason, the uniform body.
pub fn refuse(
    pool: &PoolRuntime,
    log: LogLine<'_>,
    key_id: Option<&str>,
    failure: Failure,
) -> Response {
    count_refusal(pool, failure);
    let e = failure.error();
    log.write(
        key_id,
        LogOutcome::Refused(e.status),
        Some(&failure.reason()),
        e.status,
        0,
        UpstreamSeen::default(),
    );
    e.into_response()
}

fn count_refusal(pool: &PoolRuntime, failure: Failure) {
    match failure {
        Failure::Throttled { .. } => pool.metrics.refused_429.increment(1),
        _ => pool.metrics.unauthorized.increment(1),
    }
}

/// The pool named by a `/pools/{pool}/…` path, percent-decoded the way the router decodes it for
/// the handlers (so an encoded name cannot reach a pool around these checks).
fn pool_segment(path: &str) -> Option<String> {
    let mut segments = path.strip_prefix('/')?.split('/');
    if segments.next()? != "pools" {
        return None;
    }
    let raw = segments.next()?.as_bytes();
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        let hex = |j: usize| raw.get(j).and_then(|c| (*c as char).to_digit(16));
        match (b, hex(i + 1), hex(i + 2)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn route_label(method: &Method, path: &str) -> String {
    match path.rsplit('/').next() {
        Some(op @ ("acquire" | "renew" | "release")) if path.contains("/lock/") => {
            format!("lock {op}")
        }
        _ => format!("{method} {path}"),
    }
}

/// Middleware for the API host's pool routes (`/pools/{pool}/…`: lock, job poll): the same
/// checks as the proxy, once per request; the result travels to the handler as a [`PoolCaller`].
pub async fn require(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    let Some(pool) = pool_segment(req.uri().path()).and_then(|name| state.pool(&name)) else {
        return ApiError::pool_not_found().into_response();
    };
    let client = client_addr(peer.ip(), req.headers(), &state.trusted_proxies);
    let route = route_label(req.method(), req.uri().path());
    // Like the handlers: acquire attempts are access-logged; renew, release and polls are not.
    let logged = route == "lock acquire";
    let log = LogLine {
        log: &state.access_log,
        pool: &pool.name,
        at: state.now(),
        peer: SocketAddr::new(client, peer.port()),
        route,
    };
    let (parts, mut body) = req.into_parts();
    let mut bytes = None;
    if pool.access.signs_requests() {
        match axum::body::to_bytes(body, MAX_SIGNED_API_BODY).await {
            Ok(b) => {
                body = Body::from(b.clone());
                bytes = Some(b);
            }
            Err(_) => {
                return ApiError::payload_too_large(MAX_SIGNED_API_BODY as u64).into_response()
            }
        }
    }
    let body_state = match &bytes {
        Some(b) => BodyState::Whole(b),
        None => BodyState::Empty,
    };
    // Boxed: this middleware's state lives as long as the handler behind it (a lock acquire
    // may wait in the queue), and the checks' state is not needed while it waits.
    let checked = Box::pin(authorize(
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
    let caller = match checked {
        Ok(authorized) => authorized.caller,
        Err(failure) if logged => return refuse(&pool, log, None, failure),
        Err(failure) => {
            count_refusal(&pool, failure);
            return failure.error().into_response();
        }
    };
    let mut req = Request::from_parts(parts, body);
    req.extensions_mut().insert(PoolCaller { pool, caller });
    next.run(req).await
}

/// The pool a `/pools/{pool}/…` route names and the caller [`require`] authenticated: handlers
/// behind it take this from the request's extensions instead of authenticating again.
#[derive(Clone)]
pub struct PoolCaller {
    pub pool: Arc<PoolRuntime>,
    pub caller: Caller,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn refusals_look_alike_but_for_the_status() {
        let all = [
            Failure::Key(AuthFailure::Unknown),
            Failure::Hmac(HmacFailure::Signature),
            Failure::Hmac(HmacFailure::Replayed),
            Failure::Jwt(JwtFailure::Expired),
            Failure::CloudflareAccess(JwtFailure::Audience),
            Failure::IpNotAllowed,
        ];
        for f in all {
            let body = f.error().body_json();
            assert_eq!(body["error"], "unauthorized");
            assert_eq!(body["message"], CREDENTIALS_MESSAGE);
        }
        assert_eq!(Failure::IpNotAllowed.status(), StatusCode::FORBIDDEN);
        assert_eq!(
            Failure::Jwt(JwtFailure::Signature).status(),
            StatusCode::UNAUTHORIZED
        );
        let t = Failure::Throttled {
            retry_after_ms: 1_500,
        }
        .error();
        assert_eq!(t.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(t.retry_after_s, Some(2));
    }

    #[test]
    fn jwt_tokens_are_found_where_the_pool_looks() {
        let src = JwtSource {
            policy: JwtPolicy::build(
                "jwt",
                "i".into(),
                "a".into(),
                &["RS256".into()],
                60,
                Some("https://id.example/jwks"),
                &[],
            )
            .unwrap(),
            header: HeaderName::from_static("x-nthpool-jwt"),
        };
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer a.b.c".parse().unwrap());
        assert_eq!(src.token(&h, false), Some(("a.b.c", true)));
        assert_eq!(
            src.token(&h, true),
            None,
            "that Authorization carried the key"
        );
        h.insert("x-nthpool-jwt", "Bearer d.e.f".parse().unwrap());
        assert_eq!(src.token(&h, true), Some(("d.e.f", false)));
        h.insert("x-nthpool-jwt", "g.h.i".parse().unwrap());
        assert_eq!(src.token(&h, false), Some(("g.h.i", false)));
    }

    #[test]
    fn the_pool_segment_is_decoded_like_the_router_does() {
        assert_eq!(pool_segment("/pools/p/lock/acquire").as_deref(), Some("p"));
        assert_eq!(
            pool_segment("/pools/%70/lock/acquire").as_deref(),
            Some("p")
        );
        assert_eq!(pool_segment("/pools/a%2/x").as_deref(), Some("a%2"));
        assert_eq!(pool_segment("/pools/%FF/lock/acquire"), None);
        assert_eq!(pool_segment("/admin/pools/p"), None);
        assert_eq!(pool_segment("/pools"), None);
    }

    #[test]
    fn lock_routes_keep_their_log_labels() {
        assert_eq!(
            route_label(&Method::POST, "/pools/p/lock/acquire"),
            "lock acquire"
        );
        assert_eq!(
            route_label(&Method::POST, "/pools/p/lock/0af/release"),
            "lock release"
        );
        assert_eq!(
            route_label(&Method::GET, "/pools/p/jobs/j1"),
            "GET /pools/p/jobs/j1"
        );
    }
}
