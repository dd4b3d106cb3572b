//! The one error type of the HTTP layer: every refusal we answer knows its status and its JSON
//! `error` code here, so no handler invents its own shape (SPEC §0).

use std::borrow::Cow;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use nthbouncer_coord::GateHeaders;

use crate::core::admission::write_gate_headers;

/// An error answer: `{"error": code, "message": …, "field"?: …}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: Cow<'static, str>,
    /// For `400 invalid`: the offending field.
    pub field: Option<String>,
    /// `Retry-After` in seconds.
    pub retry_after_s: Option<u64>,
    /// Governor figures, on admission refusals.
    pub gate: Option<GateHeaders>,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        code: &'static str,
        message: impl Into<Cow<'static, str>>,
    ) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            field: None,
            retry_after_s: None,
            gate: None,
        }
    }

    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "no such route")
    }

    pub fn pool_not_found() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "pool_not_found",
            "no pool answers to this host or name",
        )
    }

    pub fn unauthorized(message: &'static str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub fn invalid(field: impl Into<String>, message: impl Into<Cow<'static, str>>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid", message);
        e.field = Some(field.into());
        e
    }

    pub fn payload_too_large(limit: u64) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    pub fn internal(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
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
        resp
    }
}

/// Store failures surface as 503: the request may be retried once storage is back.
impl From<nthbouncer_store::StoreError> for ApiError {
    fn from(e: nthbouncer_store::StoreError) -> Self {
        match e {
            nthbouncer_store::StoreError::Conflict(what) => ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("already exists: {what}"),
            ),
            nthbouncer_store::StoreError::Backend(msg) => {
                tracing::error!(error = %msg, "store failure");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store_unavailable",
                    "storage is unavailable; retry later",
                )
            }
        }
    }
}
