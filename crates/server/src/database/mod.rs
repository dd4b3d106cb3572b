//! Database pools (SPEC §8): a database pool's host (and its own listener) serves `POST /sql`
//! in Neon's SQL-over-HTTP wire format, so the `@neondatabase/serverless` HTTP driver works
//! against it, and `GET|HEAD /jobs/{jobId}` for the handles of SQL taken as async jobs.
//!
//! A `/sql` request goes through the same phases as a proxied one ([`sql`]): authorize (pool
//! key and access policies, the driver's `Authorization: Bearer` among the accepted forms) →
//! read and check the body → plan (wait budget, priority, async) → admit (the pool's gate, or
//! a job) → run (`upstream::sql` on the pool's `Database`, capped at the gate's effective
//! limit) → answer and log. It must not make admission decisions (the gate does), parse keys
//! (access does) nor speak PostgreSQL (`nthbouncer-sqlhttp` does). Its one hand-off is to
//! `jobs` (a request taken as a job, and the poll answer).

mod sql;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::response::IntoResponse;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use nthbouncer_coord::Clock;

use crate::access::{self, BodyState};
use crate::core::access_log::{AccessLog, LogLine};
use crate::core::error::{ApiError, ErrorCode};
use crate::core::request_id::RequestId;
use crate::jobs::Jobs;
use crate::pools::registry::PoolRuntime;
use crate::upstream::SharedClient;

/// The path of the SQL route, as the driver calls it.
pub const SQL_PATH: &str = "/sql";

/// What the database feature needs: the access checks' client and trusted proxies, the access
/// log, the clock, the jobs a request may become, and the bounds on a request.
pub struct DatabaseApi {
    pub http: Arc<SharedClient>,
    /// The live `[server]` settings: trusted proxies, the `/sql` body bound
    /// (`max_body_bytes`), the budget for reading it whole (`header_read_timeout`) and the
    /// scheme of `pollUrl`s on the pool host (`public_url`'s).
    pub live: Arc<crate::core::live::LiveServer>,
    pub access_log: AccessLog,
    pub clock: Arc<dyn Clock>,
    pub jobs: Arc<Jobs>,
}

impl DatabaseApi {
    fn now(&self) -> u64 {
        self.clock.now_ms()
    }
}

/// What a request on a database pool's host asks for.
enum Op {
    Sql,
    Poll(String),
}

/// Serves one request on a database pool's host (or its own listener).
pub async fn handle(
    state: Arc<DatabaseApi>,
    pool: Arc<PoolRuntime>,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Body> {
    let op = match route(req.method(), req.uri().path()) {
        Ok(op) => op,
        Err(e) => return e.into_response(),
    };
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
        peer: SocketAddr::new(client, peer.port()),
        peer_text: None,
        route: format!("sql {} {}", parts.method, parts.uri.path()),
        request_id: RequestId::of(&parts.extensions),
        client_cert: crate::tls::PeerTls::client_of(&parts.extensions),
    };
    let body_state = match op {
        Op::Poll(_) => BodyState::Empty,
        Op::Sql if http_body::Body::is_end_stream(&body) => BodyState::Empty,
        Op::Sql => BodyState::Streamed,
    };
    // Boxed: the checks' state (a JWKS fetch) is not needed while the request waits for a slot.
    let authorized = Box::pin(access::authorize(
        &state.http,
        &pool.access,
        client,
        &parts,
        body_state,
        log.at,
    ))
    .await;
    match op {
        Op::Sql => match authorized {
            Ok(authorized) => {
                Box::pin(sql::serve(&state, &pool, log, parts, body, authorized)).await
            }
            Err(failure) => access::refuse(&pool.metrics, log, None, failure),
        },
        // Polls are not access-logged, as on the API host.
        Op::Poll(job_id) => match authorized {
            Ok(_) => crate::jobs::routes::poll_job(&state.jobs, &pool, &job_id, &parts.method)
                .await
                .unwrap_or_else(IntoResponse::into_response),
            Err(failure) => access::refuse_unlogged(&pool.metrics, failure),
        },
    }
}

/// The routes of a database pool's host; anything else is `404 not_found` (a wrong method on
/// a known route: `405`).
fn route(method: &Method, path: &str) -> Result<Op, ApiError> {
    let wrong_method = || {
        ApiError::new(
            ErrorCode::MethodNotAllowed,
            "this route does not take that method",
        )
    };
    if path == SQL_PATH {
        return if method == Method::POST {
            Ok(Op::Sql)
        } else {
            Err(wrong_method())
        };
    }
    match path.strip_prefix("/jobs/") {
        Some(id) if !id.is_empty() && !id.contains('/') => {
            if method == Method::GET || method == Method::HEAD {
                Ok(Op::Poll(id.to_string()))
            } else {
                Err(wrong_method())
            }
        }
        _ => Err(ApiError::new(
            ErrorCode::NotFound,
            "a database pool serves POST /sql and GET /jobs/{jobId}",
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert!(matches!(route(&Method::POST, "/sql"), Ok(Op::Sql)));
        assert_eq!(
            route(&Method::GET, "/sql").err().map(|e| e.code),
            Some(ErrorCode::MethodNotAllowed)
        );
        assert!(matches!(route(&Method::HEAD, "/jobs/job_1"), Ok(Op::Poll(id)) if id == "job_1"));
        assert_eq!(
            route(&Method::GET, "/jobs/a/b").err().map(|e| e.code),
            Some(ErrorCode::NotFound)
        );
        assert_eq!(
            route(&Method::POST, "/").err().map(|e| e.code),
            Some(ErrorCode::NotFound)
        );
    }
}
