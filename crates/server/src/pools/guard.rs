//! The guard of the API host's pool routes (`/pools/{pool}/…`: lock, job poll): it finds the
//! pool the path names and runs the same access checks as the proxy, once per request. The
//! handlers behind it take the pool and the caller from the request's extensions
//! ([`PoolCaller`]) instead of authenticating again.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::Method;
use nthbouncer_coord::Clock;

use super::registry::PoolRuntime;
use super::Pools;
use crate::access::keys::Caller;
use crate::access::{self, BodyState, MAX_SIGNED_API_BODY};
use crate::core::access_log::{AccessLog, LogLine};
use crate::core::error::ApiError;
use crate::core::request_id::RequestId;
use crate::upstream::SharedClient;

/// What the guard needs: the pools, the access checks' client and trusted proxies, the log.
pub struct Guard {
    pub pools: Arc<Pools>,
    pub http: Arc<SharedClient>,
    /// The live `[server]` settings (trusted proxies).
    pub live: Arc<crate::core::live::LiveServer>,
    pub access_log: AccessLog,
    pub clock: Arc<dyn Clock>,
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
    State(guard): State<Arc<Guard>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    let Some(pool) = pool_segment(req.uri().path()).and_then(|name| guard.pools.get(&name)) else {
        return ApiError::pool_not_found().into_response();
    };
    let client = access::client_addr(peer.ip(), req.headers(), &guard.live.load().trusted_proxies);
    let route = route_label(req.method(), req.uri().path());
    // Like the handlers: acquire attempts are access-logged; renew, release and polls are not.
    let logged = route == "lock acquire";
    let log = LogLine {
        log: &guard.access_log,
        pool: &pool.name,
        at: guard.clock.now_ms(),
        peer: SocketAddr::new(client, peer.port()),
        peer_text: None,
        route,
        request_id: RequestId::of(req.extensions()),
        client_cert: crate::tls::PeerTls::client_of(req.extensions()),
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
    let checked = Box::pin(access::authorize(
        &guard.http,
        &pool.access,
        client,
        &parts,
        body_state,
        log.at,
    ))
    .await;
    let caller = match checked {
        Ok(authorized) => authorized.caller,
        Err(failure) if logged => return access::refuse(&pool.metrics, log, None, failure),
        Err(failure) => return access::refuse_unlogged(&pool.metrics, failure),
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
