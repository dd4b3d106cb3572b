//! Reading requests on the API host: one size bound for the small JSON bodies of the lock and
//! pool routes, JSON parsing whose errors name the offending field, and the query and path
//! extractors every route uses, whose failures are JSON `400 invalid` naming the parameter
//! (never axum's plain-text rejections).

use axum::extract::{FromRequest, FromRequestParts, Request};
use bytes::Bytes;
use http::request::Parts;
use http::HeaderMap;

use crate::core::error::ApiError;

/// Largest body of a lock route (acquire, release) or of a signed API-host pool route.
pub const MAX_API_BODY_BYTES: usize = 64 * 1024;
/// Largest body of an admin route (a pool's settings with its keys, a destination).
pub const MAX_ADMIN_BODY_BYTES: usize = 1024 * 1024;

/// A request body read whole up to `LIMIT` bytes: the one body extractor of the API host's
/// routes. Past the limit (declared or read) the answer is `413 payload_too_large` in JSON,
/// never axum's plain-text rejection.
pub struct BodyBytes<const LIMIT: usize>(pub Bytes);

impl<S: Send + Sync, const LIMIT: usize> FromRequest<S> for BodyBytes<LIMIT> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, ApiError> {
        let too_large = || ApiError::payload_too_large(LIMIT as u64);
        let declared = req
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > LIMIT as u64) {
            return Err(too_large());
        }
        match axum::body::to_bytes(req.into_body(), LIMIT).await {
            Ok(bytes) => Ok(BodyBytes(bytes)),
            Err(e) if is_length_limit(&e) => Err(too_large()),
            Err(_) => Err(ApiError::invalid(
                "body",
                "the request body could not be read",
            )),
        }
    }
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Whether a body is empty or only white space (an optional JSON body left out).
pub fn is_blank(body: &[u8]) -> bool {
    body.iter().all(u8::is_ascii_whitespace)
}

/// The request's or response's `Content-Length`, if it has a valid one.
pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Parses a JSON body, naming the offending field on failure.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            "body".to_string()
        } else {
            path
        };
        ApiError::invalid(field, format!("invalid JSON body: {}", e.inner()))
    })
}

/// The latest epoch millisecond a request may name (9999-12-31T23:59:59.999Z): past it a time
/// is no time the store can keep (it holds signed 64-bit milliseconds), and is refused as
/// `400 invalid` rather than failing at the store.
pub const MAX_EPOCH_MS: u64 = 253_402_300_799_999;

/// `value` of `field` as epoch milliseconds, if it is one [`MAX_EPOCH_MS`] allows.
pub fn epoch_ms(field: &str, value: Option<u64>) -> Result<Option<u64>, ApiError> {
    match value {
        Some(ms) if ms > MAX_EPOCH_MS => Err(ApiError::invalid(
            field,
            format!("{field} must be epoch milliseconds no later than {MAX_EPOCH_MS} (year 9999)"),
        )),
        v => Ok(v),
    }
}

/// A query string parsed into `T`: `?limit=abc` or `?limit=-1` is `400 invalid` with
/// `field: "limit"`.
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        parse_query(parts.uri.query().unwrap_or("")).map(Query)
    }
}

/// Parses a query string, naming the offending parameter on failure.
pub fn parse_query<T: serde::de::DeserializeOwned>(query: &str) -> Result<T, ApiError> {
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            "query".to_string()
        } else {
            path
        };
        ApiError::invalid(field, format!("invalid query parameter: {}", e.inner()))
    })
}

/// The route's path parameters parsed into `T`; a failure (a segment that is not valid UTF-8
/// once decoded) is `400 invalid` with `field: "path"`.
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(Path(v)),
            Err(rejection) => Err(ApiError::invalid("path", rejection.body_text())),
        }
    }
}

/// A credential value as `(scheme, token)`: `Bearer abc` → `("Bearer", "abc")`. The one parser
/// of `Authorization`-style values (admin token, pool keys, JWTs).
pub fn scheme_and_token(value: &str) -> Option<(&str, &str)> {
    let (scheme, token) = value.trim().split_once(' ')?;
    Some((scheme, token.trim()))
}

/// The token of a `Bearer` value (scheme case-insensitive).
pub fn bearer(value: &str) -> Option<&str> {
    scheme_and_token(value)
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token)
}

/// The `Authorization` header's value, when it is text.
pub fn authorization(headers: &HeaderMap) -> Option<&str> {
    headers.get(http::header::AUTHORIZATION)?.to_str().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_parser_for_credential_values() {
        assert_eq!(bearer("Bearer  abc "), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("abc"), None);
        assert_eq!(scheme_and_token("Nthbouncer k"), Some(("Nthbouncer", "k")));
    }
}
