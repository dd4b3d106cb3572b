//! A database pool's origin: one SQL-over-HTTP request (Neon's wire format) run on the pool's
//! PostgreSQL, shared by the `database` feature (a caller waiting for its answer) and the job
//! runner (a request taken as a job), so both run it and tell the gate about it the same way.
//!
//! Owns the translation of `nthbouncer_sqlhttp`'s answers and errors into a status, a JSON
//! body and a governor outcome (`53300 too_many_connections` is a throttle, like an origin's
//! 429). Must not know pools, keys or features: callers hand it a `Database` and a request.

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use nthbouncer_coord::Outcome;
use nthbouncer_sqlhttp::{Database, SqlHttpError, SqlRequest, WireOptions};
use serde_json::{Map, Value};
use tokio::time::Instant;

/// `Outcome::via` of answers a database pool saw.
pub const VIA_DATABASE: &str = "database";

/// What one SQL request came to.
pub struct SqlAnswer {
    pub status: StatusCode,
    /// `application/json`: the Neon answer, or an error body (`{"error", "message", …}`).
    pub body: Bytes,
    /// Headers Neon sends with a batch's answer (the transaction settings applied).
    pub headers: Vec<(&'static str, &'static str)>,
    /// Rows returned (0 on an error).
    pub rows: u64,
    /// The error, when there is one: what the access log and a job record say.
    pub error: Option<SqlFailure>,
}

/// Why a request did not get its rows.
pub struct SqlFailure {
    /// The `error` code of the body (`sql_error`, `response_too_large`, …).
    pub code: &'static str,
    /// No statement reached the server: the whole request may be sent again.
    pub retry_safe: bool,
    /// PostgreSQL refused a connection for being at its limit (`53300`).
    pub too_many_connections: bool,
    /// The request deadline passed first (the statement was cancelled).
    pub timed_out: bool,
    /// For logs: never the URL's password (`nthbouncer_sqlhttp` builds no message with it).
    pub message: String,
}

/// Reads a request (`body`, the `Neon-*` headers) and runs it on `db` until `deadline`; a
/// request still running then is cancelled on the server (dropping `Database::execute` does).
/// Bad input is answered without touching the database. Error bodies carry `request_id`.
pub async fn run(
    db: &Database,
    headers: &HeaderMap,
    body: &[u8],
    deadline: Instant,
    request_id: Option<&str>,
) -> SqlAnswer {
    let parsed = SqlRequest::from_slice(body)
        .and_then(|request| Ok((request, WireOptions::from_headers(headers)?)));
    let (request, options) = match parsed {
        Ok(p) => p,
        Err(e) => return failure(&e, request_id),
    };
    match tokio::time::timeout_at(deadline, db.execute(&request, &options)).await {
        Ok(Ok(answer)) => SqlAnswer {
            status: StatusCode::OK,
            rows: answer.rows(),
            body: answer.into_body(),
            headers: match request {
                SqlRequest::Batch(_) => options.batch_response_headers(),
                SqlRequest::Single(_) => Vec::new(),
            },
            error: None,
        },
        Ok(Err(e)) => failure(&e, request_id),
        Err(_) => timed_out(request_id),
    }
}

/// Holds `db` to the gate's effective limit (what a grant just reported): the gate admits at
/// most that many callers, and the sessions kept open follow it down when it learns a lower
/// limit (`53300`), and back up.
pub fn cap(db: &Database, effective_limit: u32) {
    let limit = effective_limit.max(1) as usize;
    if db.status().max != limit {
        db.set_max_connections(limit);
    }
}

/// Parses a request without running it: `Err` is the `400` a caller gets for bad input.
pub fn check(headers: &HeaderMap, body: &[u8], request_id: Option<&str>) -> Result<(), SqlAnswer> {
    SqlRequest::from_slice(body)
        .and_then(|_| WireOptions::from_headers(headers))
        .map(|_| ())
        .map_err(|e| failure(&e, request_id))
}

/// What the gate learns from an answer: `53300` is a throttle; anything else a plain success
/// (a SQL error is the caller's, not a sign of an overloaded database).
pub fn outcome(answer: &SqlAnswer) -> Outcome {
    let throttled = answer
        .error
        .as_ref()
        .is_some_and(|e| e.too_many_connections);
    Outcome {
        status: Some(answer.status.as_u16()),
        throttled: u32::from(throttled),
        via: Some(VIA_DATABASE),
        dialect: throttled.then_some("sqlstate 53300"),
        ..Outcome::default()
    }
}

fn failure(e: &SqlHttpError, request_id: Option<&str>) -> SqlAnswer {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_GATEWAY);
    SqlAnswer {
        status,
        body: encode(e.body(), request_id),
        headers: Vec::new(),
        rows: 0,
        error: Some(SqlFailure {
            code: e.code(),
            retry_safe: e.is_retry_safe(),
            too_many_connections: e.is_too_many_connections(),
            timed_out: false,
            message: e.to_string(),
        }),
    }
}

fn timed_out(request_id: Option<&str>) -> SqlAnswer {
    let message = "the database did not answer within the request timeout; the statement was \
                   cancelled";
    let mut body = Map::new();
    body.insert("error".into(), Value::String("upstream_timeout".into()));
    body.insert("message".into(), Value::String(message.into()));
    SqlAnswer {
        status: StatusCode::GATEWAY_TIMEOUT,
        body: encode(body, request_id),
        headers: Vec::new(),
        rows: 0,
        error: Some(SqlFailure {
            code: "upstream_timeout",
            retry_safe: false,
            too_many_connections: false,
            timed_out: true,
            message: message.into(),
        }),
    }
}

fn encode(mut body: Map<String, Value>, request_id: Option<&str>) -> Bytes {
    if let Some(id) = request_id {
        body.insert("requestId".into(), Value::String(id.into()));
    }
    Bytes::from(Value::Object(body).to_string())
}
