//! The one JSON error shape every refusal and bad request uses:
//! `{"error":{"type":...,"message":...}}`, like the APIs the sandbox imitates.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

pub(crate) const RATE_LIMIT: &str = "rate_limit_error";
pub(crate) const INVALID_REQUEST: &str = "invalid_request_error";
pub(crate) const NOT_FOUND: &str = "not_found_error";

/// Builds a JSON error response.
pub(crate) fn error_response(
    status: StatusCode,
    kind: &str,
    message: impl Into<String>,
) -> Response {
    let body = json!({ "error": { "type": kind, "message": message.into() } });
    (status, Json(body)).into_response()
}
