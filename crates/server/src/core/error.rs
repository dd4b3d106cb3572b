//! The one error type of the HTTP layer: every refusal we answer knows its status and its JSON
//! `error` code here, so no handler invents its own shape (SPEC §0). The codes are one enum,
//! [`ErrorCode`], which the OpenAPI document shows too.

use std::borrow::Cow;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use nthbouncer_coord::GateHeaders;
use serde::Serialize;
use utoipa::ToSchema;

use crate::core::admission::write_gate_headers;
use crate::core::request_id::ErrorBodyMark;

/// Every `error` code an answer of ours can carry (SPEC §0 and the sections that name them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// No such route on the API host.
    NotFound,
    /// No pool answers to this host or name.
    PoolNotFound,
    /// Missing or invalid credentials (`401`; `403` for an IP allowlist miss).
    Unauthorized,
    /// Bad input; `field` names it.
    Invalid,
    PayloadTooLarge,
    MethodNotAllowed,
    /// No slot and no wait budget, queue full, RPM spent, paused, or throttled.
    TooManyRequests,
    /// The wait budget ran out.
    QueueTimeout,
    UpstreamUnreachable,
    UpstreamTimeout,
    AsyncDisabled,
    /// A lease reached its request deadline and cannot be renewed.
    Capped,
    Conflict,
    ManagedByConfig,
    KeyNotFound,
    JobNotFound,
    JobNotTerminal,
    DestinationNotFound,
    NoActiveDestination,
    TooManyDestinations,
    StoreUnavailable,
    /// The coordination store (Redis) is unreachable and admission fails closed.
    CoordinationUnavailable,
    /// The server is shutting down (`/readyz`).
    Draining,
    /// Past `server.max_connections`: a new connection is answered this and closed.
    Overloaded,
    /// PostgreSQL rejected a statement on a database pool (`400`, with Neon's fields: `code`
    /// (SQLSTATE), `detail`, `hint`, `position`, …; built by `nthbouncer-sqlhttp`).
    SqlError,
    /// A database pool's answer grew past `database.max_response_bytes` (`507`).
    ResponseTooLarge,
    /// A request whose `Host` is not the TLS name (SNI) its connection was opened for, on a
    /// pool with `access.mtls` (`421`): the client opens a new connection for that host.
    Misdirected,
    /// A request's estimated tokens exceed the pool's whole token budget (`400`): it could
    /// never be admitted, and a `429` would only be retried.
    ExceedsTokenBudget,
    Internal,
}

impl ErrorCode {
    /// Every code, in declaration order (the OpenAPI document narrows error bodies by status
    /// with it; a test holds it to the enum).
    pub const ALL: [ErrorCode; 29] = [
        ErrorCode::NotFound,
        ErrorCode::PoolNotFound,
        ErrorCode::Unauthorized,
        ErrorCode::Invalid,
        ErrorCode::PayloadTooLarge,
        ErrorCode::MethodNotAllowed,
        ErrorCode::TooManyRequests,
        ErrorCode::QueueTimeout,
        ErrorCode::UpstreamUnreachable,
        ErrorCode::UpstreamTimeout,
        ErrorCode::AsyncDisabled,
        ErrorCode::Capped,
        ErrorCode::Conflict,
        ErrorCode::ManagedByConfig,
        ErrorCode::KeyNotFound,
        ErrorCode::JobNotFound,
        ErrorCode::JobNotTerminal,
        ErrorCode::DestinationNotFound,
        ErrorCode::NoActiveDestination,
        ErrorCode::TooManyDestinations,
        ErrorCode::StoreUnavailable,
        ErrorCode::CoordinationUnavailable,
        ErrorCode::Draining,
        ErrorCode::Overloaded,
        ErrorCode::SqlError,
        ErrorCode::ResponseTooLarge,
        ErrorCode::Misdirected,
        ErrorCode::ExceedsTokenBudget,
        ErrorCode::Internal,
    ];

    /// The code as it appears in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::NotFound => "not_found",
            ErrorCode::PoolNotFound => "pool_not_found",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Invalid => "invalid",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::TooManyRequests => "too_many_requests",
            ErrorCode::QueueTimeout => "queue_timeout",
            ErrorCode::UpstreamUnreachable => "upstream_unreachable",
            ErrorCode::UpstreamTimeout => "upstream_timeout",
            ErrorCode::AsyncDisabled => "async_disabled",
            ErrorCode::Capped => "capped",
            ErrorCode::Conflict => "conflict",
            ErrorCode::ManagedByConfig => "managed_by_config",
            ErrorCode::KeyNotFound => "key_not_found",
            ErrorCode::JobNotFound => "job_not_found",
            ErrorCode::JobNotTerminal => "job_not_terminal",
            ErrorCode::DestinationNotFound => "destination_not_found",
            ErrorCode::NoActiveDestination => "no_active_destination",
            ErrorCode::TooManyDestinations => "too_many_destinations",
            ErrorCode::StoreUnavailable => "store_unavailable",
            ErrorCode::CoordinationUnavailable => "coordination_unavailable",
            ErrorCode::Draining => "draining",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::SqlError => "sql_error",
            ErrorCode::ResponseTooLarge => "response_too_large",
            ErrorCode::Misdirected => "misdirected",
            ErrorCode::ExceedsTokenBudget => "exceeds_token_budget",
            ErrorCode::Internal => "internal",
        }
    }

    /// The status an answer with this code has unless said otherwise.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorCode::NotFound
            | ErrorCode::PoolNotFound
            | ErrorCode::KeyNotFound
            | ErrorCode::JobNotFound
            | ErrorCode::DestinationNotFound => StatusCode::NOT_FOUND,
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::Invalid
            | ErrorCode::AsyncDisabled
            | ErrorCode::SqlError
            | ErrorCode::ExceedsTokenBudget => StatusCode::BAD_REQUEST,
            ErrorCode::ResponseTooLarge => StatusCode::INSUFFICIENT_STORAGE,
            ErrorCode::Misdirected => StatusCode::MISDIRECTED_REQUEST,
            ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::QueueTimeout | ErrorCode::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorCode::UpstreamUnreachable => StatusCode::BAD_GATEWAY,
            ErrorCode::Capped
            | ErrorCode::Conflict
            | ErrorCode::ManagedByConfig
            | ErrorCode::JobNotTerminal
            | ErrorCode::NoActiveDestination
            | ErrorCode::TooManyDestinations => StatusCode::CONFLICT,
            ErrorCode::StoreUnavailable
            | ErrorCode::CoordinationUnavailable
            | ErrorCode::Overloaded
            | ErrorCode::Draining => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The body of every error answer, as the OpenAPI document shows it.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorCode,
    pub message: String,
    /// For `invalid`: the offending field.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The request's id, as in its `x-request-id` answer header.
    #[serde(rename = "requestId")]
    pub request_id: String,
}

/// An error answer: `{"error": code, "message": …, "field"?: …}`; on its way out the
/// dispatcher adds `"requestId"` (see `core::request_id`).
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: ErrorCode,
    pub message: Cow<'static, str>,
    /// For `400 invalid`: the offending field.
    pub field: Option<String>,
    /// `Retry-After` in seconds.
    pub retry_after_s: Option<u64>,
    /// Governor figures, on admission refusals.
    pub gate: Option<GateHeaders>,
}

impl ApiError {
    /// An answer with `code` and the status that code has.
    pub fn new(code: ErrorCode, message: impl Into<Cow<'static, str>>) -> Self {
        ApiError {
            status: code.status(),
            code,
            message: message.into(),
            field: None,
            retry_after_s: None,
            gate: None,
        }
    }

    /// The same answer with another status (`403 unauthorized` for an allowlist miss).
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub fn not_found() -> Self {
        Self::new(ErrorCode::NotFound, "no such route")
    }

    pub fn pool_not_found() -> Self {
        Self::new(
            ErrorCode::PoolNotFound,
            "no pool answers to this host or name",
        )
    }

    pub fn unauthorized(message: &'static str) -> Self {
        Self::new(ErrorCode::Unauthorized, message)
    }

    pub fn invalid(field: impl Into<String>, message: impl Into<Cow<'static, str>>) -> Self {
        let mut e = Self::new(ErrorCode::Invalid, message);
        e.field = Some(field.into());
        e
    }

    pub fn payload_too_large(limit: u64) -> Self {
        Self::new(
            ErrorCode::PayloadTooLarge,
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    pub fn store_unavailable(message: &'static str) -> Self {
        Self::new(ErrorCode::StoreUnavailable, message)
    }

    pub fn internal(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }

    pub fn with_gate(mut self, gate: GateHeaders) -> Self {
        self.gate = Some(gate);
        self
    }

    pub fn body_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({ "error": self.code, "message": self.message });
        if let (Some(field), Some(obj)) = (&self.field, v.as_object_mut()) {
            obj.insert("field".into(), serde_json::Value::String(field.clone()));
        }
        v
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body_json().to_string();
        let mut resp = Response::new(Body::from(body));
        *resp.status_mut() = self.status;
        let headers = resp.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(s) = self.retry_after_s {
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from(s));
        }
        if let Some(gate) = &self.gate {
            write_gate_headers(headers, gate);
        }
        // The dispatcher adds `requestId` to bodies so marked (`core::request_id::stamp`).
        resp.extensions_mut().insert(ErrorBodyMark);
        resp
    }
}

/// Store failures surface as 503: the request may be retried once storage is back.
impl From<nthbouncer_store::StoreError> for ApiError {
    fn from(e: nthbouncer_store::StoreError) -> Self {
        match e {
            nthbouncer_store::StoreError::Conflict(what) => {
                ApiError::new(ErrorCode::Conflict, format!("already exists: {what}"))
            }
            nthbouncer_store::StoreError::Backend(msg) => {
                tracing::error!(error = %msg, "store failure");
                ApiError::store_unavailable("storage is unavailable; retry later")
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_every_code_of_the_enum() {
        let schema = serde_json::to_value(<ErrorCode as utoipa::PartialSchema>::schema()).unwrap();
        let documented: Vec<&str> = schema["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let listed: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(documented, listed);
    }

    #[test]
    fn codes_serialise_as_their_names() {
        for code in [
            ErrorCode::PoolNotFound,
            ErrorCode::TooManyRequests,
            ErrorCode::ManagedByConfig,
            ErrorCode::Internal,
        ] {
            assert_eq!(serde_json::to_value(code).unwrap(), code.as_str());
        }
        let e = ApiError::invalid("limit", "too big");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            e.body_json(),
            serde_json::json!({"error":"invalid","message":"too big","field":"limit"})
        );
    }
}
