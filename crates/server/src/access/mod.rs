//! Access policies on every pool route (SPEC §2, §9): the pool key plus whatever the pool's
//! `access` table configures — IP allowlist, client certificate (`mtls`, the chain from the
//! connection's handshake, judged here per request), JWT, Cloudflare Access, HMAC request
//! signing — all of which must pass.
//!
//! Order: the IP allowlist (`403`, decided by the address alone), the failure throttle (`429`
//! for an address that failed too often), the client certificate (`mtls`: not counted, it is
//! no guess), then the credentials, cheapest first: pool key, HMAC head (timestamp window,
//! header shapes), JWT, Cloudflare Access, and last the HMAC signature and nonce. A failed
//! credential is counted against the client address ([`throttle`]).
//!
//! Every refusal has the same body, `{"error":"unauthorized","message":CREDENTIALS_MESSAGE}`;
//! only the status tells `401` from `403`. The precise reason goes to the access log.
//!
//! A signed request's body is read whole (bounded) and verified before anything of it is
//! admitted or forwarded: by the proxy (`access.hmac.max_body_bytes`) and by the guard of the
//! API host's pool routes (`pools::guard`).

mod client_ip;
mod jwt;
pub mod keys;
mod nonces;
mod signing;
mod throttle;

use std::net::IpAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderName, Method, StatusCode, Uri};
use ipnet::IpNet;
use nthbouncer_config::{AccessSpec, ConfigError};
use nthbouncer_coord::{InProcessNonces, NonceStore};

pub use client_ip::client_addr;
pub use jwt::{JwtFailure, JwtPolicy};
pub use nonces::{NonceJournal, NonceSource, PURGE_EVERY_MS};
pub use signing::{HmacFailure, HmacPolicy, Pending};
pub use throttle::{FailureThrottle, BLOCK_MS, FAILURE_WINDOW_MS, MAX_FAILURES};

use crate::core::access_log::LogLine;
use crate::core::error::{ApiError, ErrorCode};
use crate::core::extract;
use crate::core::metrics::PoolMetrics;
use crate::tls::{CertIdentity, MtlsFailure, MtlsPolicy, PeerTls};
use crate::upstream::SharedClient;
use keys::{Accept, AuthFailure, Caller, KeyIndex};

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
    Throttled {
        retry_after_ms: u64,
    },
    Hmac(HmacFailure),
    Jwt(JwtFailure),
    CloudflareAccess(JwtFailure),
    /// `access.mtls`: no client certificate, or one the pool does not accept.
    Mtls(MtlsFailure),
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
            Failure::Mtls(f) => f.as_str().to_string(),
        }
    }

    /// Whether the failure counts towards throttling the client address: guesses do; an
    /// address outside the allowlist, or a nonce store full of honest traffic, do not.
    fn counts(&self) -> bool {
        !matches!(
            self,
            Failure::IpNotAllowed
                | Failure::Throttled { .. }
                | Failure::Mtls(_)
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
    mtls: Option<MtlsPolicy>,
    /// Credential headers that must not reach the upstream (beyond `X-Nthpool-*`).
    credential_headers: Vec<HeaderName>,
    state: Arc<AccessState>,
    /// The forms of the pool key the pool accepts.
    accept: Accept,
    /// The pool's keys; shared across settings changes, swapped when keys change.
    keys: Arc<ArcSwap<KeyIndex>>,
}

impl AccessPolicy {
    /// Resolves a validated spec; `at` names the table in errors (`pools[0].access`).
    pub fn build(
        at: &str,
        spec: &AccessSpec,
        accept: Accept,
        keys: Arc<ArcSwap<KeyIndex>>,
    ) -> Result<AccessPolicy, ConfigError> {
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
        let mtls = match &spec.mtls {
            Some(m) => Some(MtlsPolicy::build(&format!("{at}.mtls"), m)?),
            None => None,
        };
        Ok(AccessPolicy {
            ip_allow: spec.ip_allow_nets(),
            hmac,
            jwt,
            cloudflare,
            mtls,
            credential_headers,
            state: Arc::new(AccessState::default()),
            accept,
            keys,
        })
    }

    /// The pool's key index (shared by every settings version of the pool).
    pub fn keys(&self) -> &Arc<ArcSwap<KeyIndex>> {
        &self.keys
    }

    /// A new pool's seen nonces (before it serves): the durable store instead of memory alone.
    pub fn use_nonces(&mut self, nonces: Arc<dyn NonceStore>) {
        self.state = Arc::new(AccessState {
            nonces,
            throttle: FailureThrottle::default(),
        });
    }

    /// Keeps the nonces and failure counts of the pool's previous settings.
    pub fn carry_state_from(&mut self, previous: &AccessPolicy) {
        self.state = previous.state.clone();
    }

    /// Whether callers must present a client certificate (`access.mtls`).
    pub fn requires_client_cert(&self) -> bool {
        self.mtls.is_some()
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
    /// Still to read: a signed request comes back with a [`Pending`] check for the body.
    Streamed,
}

/// A caller that passed every policy that can be checked before the body.
pub struct Authorized {
    pub caller: Caller,
    /// Who the client certificate names, when the pool checked one (`access.mtls`).
    pub client_cert: Option<CertIdentity>,
    /// The signature still needs the streamed body's hash.
    pub pending: Option<Pending>,
}

/// Checks a request (its head `parts`, from `client`) against the pool key and the pool's
/// access policies at `now` (epoch ms).
pub async fn authorize(
    http: &SharedClient,
    policy: &AccessPolicy,
    client: IpAddr,
    parts: &http::request::Parts,
    body: BodyState<'_>,
    now: u64,
) -> Result<Authorized, Failure> {
    let tls = PeerTls::of_request(&parts.extensions);
    if !policy.ip_allow.is_empty() && !policy.ip_allow.iter().any(|n| n.contains(&client)) {
        return Err(Failure::IpNotAllowed);
    }
    if let Some(ms) = policy.state.throttle.blocked(client, now) {
        return Err(Failure::Throttled { retry_after_ms: ms });
    }
    // The client certificate first: it costs no lookup, and a caller without the right one
    // learns nothing about its key.
    let client_cert = match &policy.mtls {
        Some(m) => {
            let (identity, checked) = m.check(tls.and_then(|t| t.chain.as_deref()));
            if let Err(f) = checked {
                if let Some(id) = &identity {
                    tracing::info!(client = %client, cert = %id.describe(), reason = f.as_str(), "client certificate refused");
                }
                return Err(Failure::Mtls(f));
            }
            identity
        }
        None => None,
    };
    let (method, uri, headers) = (&parts.method, &parts.uri, &parts.headers);
    let result = credentials(http, policy, method, uri, headers, body, now)
        .await
        .map(|mut a| {
            a.client_cert = client_cert;
            a
        });
    if let Err(f) = &result {
        if f.counts() {
            policy.state.throttle.record_failure(client, now);
        }
    }
    result
}

async fn credentials(
    http: &SharedClient,
    policy: &AccessPolicy,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: BodyState<'_>,
    now: u64,
) -> Result<Authorized, Failure> {
    let index = policy.keys.load();
    let mut caller =
        keys::authenticate(policy.accept, &index, headers, now).map_err(Failure::Key)?;
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
            .verify(token, http, now)
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
        cf.verify(token, http, now)
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
    Ok(Authorized {
        caller,
        client_cert: None,
        pending,
    })
}

/// Answers a refusal: the metric, the access-log line with the precise reason, the uniform body.
pub fn refuse(
    metrics: &PoolMetrics,
    log: LogLine<'_>,
    key_id: Option<&str>,
    failure: Failure,
) -> Response {
    log.write_auth_refusal(key_id, &failure.reason(), failure.error().status);
    refuse_unlogged(metrics, failure)
}

/// Counts a refusal in the pool's metrics and answers it, writing no access-log row.
pub fn refuse_unlogged(metrics: &PoolMetrics, failure: Failure) -> Response {
    match failure {
        Failure::Throttled { .. } => metrics.refused_429.increment(1),
        _ => metrics.unauthorized.increment(1),
    }
    failure.error().into_response()
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
}
