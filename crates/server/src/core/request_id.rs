//! The request id (SPEC §12, #13): every request gets one as it arrives (`app::serve`), the
//! caller's own `x-request-id` when it is sane, else a new one. It travels in the request's
//! extensions (and, rewritten, in its `x-request-id` header, so the proxy and async jobs
//! forward it upstream as they forward any header) and comes back on every answer.
//!
//! Sane: 1 to [`MAX_LEN`] bytes, each a visible ASCII character (`!` to `~`): no spaces, no
//! control characters, nothing beyond ASCII. Anything else is replaced, not cut or escaped, so
//! what we log and forward is never something a client crafted to break a log line or a header.

use axum::body::Body;
use http::{HeaderMap, HeaderName, HeaderValue, Response};

/// The header, on requests (the caller's, forwarded upstream) and on every answer.
pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The longest caller id kept, in bytes.
pub const MAX_LEN: usize = 128;

/// An error body bigger than this is not rewritten (ours are a few hundred bytes).
const MAX_ERROR_BODY: usize = 64 * 1024;

/// One request's id, in its extensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestId(pub String);

impl RequestId {
    /// The caller's id if it sent one sane `x-request-id`, else a new one: 32 lowercase hex
    /// characters of randomness.
    pub fn assign(headers: &HeaderMap) -> RequestId {
        let mut sent = headers.get_all(&HEADER).iter();
        match (sent.next(), sent.next()) {
            (Some(v), None) if is_sane(v.as_bytes()) => {
                // Sane bytes are visible ASCII, so this never fails.
                RequestId(String::from_utf8_lossy(v.as_bytes()).into_owned())
            }
            _ => RequestId::generate(),
        }
    }

    /// The id a request was given, as the access log and jobs record it.
    pub fn of(extensions: &http::Extensions) -> Option<String> {
        extensions.get::<RequestId>().map(|id| id.0.clone())
    }

    /// The id as the dispatcher wrote it into the request's `x-request-id` header: for a
    /// handler that has the headers at hand and not the extensions.
    pub fn in_header(headers: &HeaderMap) -> Option<String> {
        let id = headers.get(&HEADER)?.as_bytes();
        is_sane(id).then(|| String::from_utf8_lossy(id).into_owned())
    }

    pub fn generate() -> RequestId {
        // The same 32 lower-case hex digits as `{:032x}`, without the formatting machinery
        // nor `hex::encode`'s char-by-char `String` (every request without an id of its own
        // gets one): into a buffer, then one copy.
        let mut digits = [0u8; 32];
        let encoded = hex::encode_to_slice(rand::random::<u128>().to_be_bytes(), &mut digits);
        let text = encoded
            .ok()
            .and_then(|()| std::str::from_utf8(&digits).ok())
            .unwrap_or("00000000000000000000000000000000");
        RequestId(text.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn header_value(&self) -> HeaderValue {
        // Always valid: sane caller ids and generated ones are visible ASCII.
        let mut value =
            HeaderValue::from_str(&self.0).unwrap_or_else(|_| HeaderValue::from_static("invalid"));
        never_indexed(&mut value);
        value
    }
}

/// 1..=[`MAX_LEN`] visible ASCII characters.
pub fn is_sane(id: &[u8]) -> bool {
    (1..=MAX_LEN).contains(&id.len()) && id.iter().all(|b| (b'!'..=b'~').contains(b))
}

/// Keeps a value unique to one request out of HPACK's dynamic table (HTTP/2 sends it as a
/// never-indexed literal; HTTP/1.1 ignores the mark). Indexed, every answer's fresh id was
/// inserted into the connection's 4 KB table, evicting the entries worth keeping, and the
/// encoder compared each new id with every id still there: ~8,000 of ~94,000 instructions per
/// h2 answer were HPACK's (bench/RESULTS.md).
fn never_indexed(value: &mut HeaderValue) {
    value.set_sensitive(true);
}

/// Marks an answer whose body is one of our JSON error bodies (`core::error::ApiError`), so
/// that [`stamp`] can add `requestId` to it. Features build their errors as before, without
/// knowing the id: the one place that knows it (the dispatcher) finishes the body.
#[derive(Clone, Copy, Debug)]
pub struct ErrorBodyMark;

/// Puts the id on an answer: the `x-request-id` header always, and `requestId` into our JSON
/// error bodies. An origin's own `x-request-id` is kept as `x-upstream-request-id`.
pub async fn stamp(id: &RequestId, mut resp: Response<Body>) -> Response<Body> {
    let ours = id.header_value();
    let headers = resp.headers_mut();
    if let Some(mut theirs) = headers.insert(HEADER, ours) {
        if theirs.as_bytes() != id.as_str().as_bytes() {
            never_indexed(&mut theirs);
            headers.insert(HeaderName::from_static("x-upstream-request-id"), theirs);
        }
    }
    if resp.extensions_mut().remove::<ErrorBodyMark>().is_none() {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_ERROR_BODY).await else {
        // Our error bodies are in memory: this does not happen; answer without a body rather
        // than a broken one.
        parts.headers.remove(http::header::CONTENT_LENGTH);
        return Response::from_parts(parts, Body::empty());
    };
    let body = match with_request_id(&bytes, id.as_str()) {
        Some(stamped) => {
            parts.headers.remove(http::header::CONTENT_LENGTH);
            Body::from(stamped)
        }
        None => Body::from(bytes),
    };
    Response::from_parts(parts, body)
}

/// `body` (a JSON object, as every `ApiError` body is) with `"requestId": id` added before its
/// closing brace. No parse: an error answer (a flood of refusals) costs a copy, not a JSON
/// round trip. `None` if the body is not an object.
fn with_request_id(body: &[u8], id: &str) -> Option<Vec<u8>> {
    let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if body.first() != Some(&b'{') || body[end] != b'}' {
        return None;
    }
    let id = serde_json::to_string(id).ok()?;
    let mut out = Vec::with_capacity(end + id.len() + 16);
    out.extend_from_slice(&body[..end]);
    if !body[1..end].iter().all(u8::is_ascii_whitespace) {
        out.push(b',');
    }
    out.extend_from_slice(b"\"requestId\":");
    out.extend_from_slice(id.as_bytes());
    out.push(b'}');
    Some(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_never_indexed_by_hpack() {
        assert!(RequestId::generate().header_value().is_sensitive());
    }

    #[test]
    fn generated_ids_are_32_lower_case_hex_digits_and_differ() {
        let (a, b) = (RequestId::generate(), RequestId::generate());
        for id in [&a, &b] {
            assert_eq!(id.as_str().len(), 32, "{}", id.as_str());
            assert!(id
                .as_str()
                .bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        }
        assert_ne!(a.as_str(), b.as_str());
    }

    #[test]
    fn the_id_joins_an_error_body_as_valid_json() {
        let stamped = with_request_id(
            br#"{"error":"invalid","message":"a \"quoted\" }"}"#,
            "id\"1",
        )
        .map(|b| serde_json::from_slice::<serde_json::Value>(&b).unwrap());
        assert_eq!(
            stamped,
            Some(
                serde_json::json!({"error": "invalid", "message": "a \"quoted\" }", "requestId": "id\"1"})
            )
        );
        let empty = with_request_id(b"{ }\n", "x")
            .map(|b| serde_json::from_slice::<serde_json::Value>(&b).unwrap());
        assert_eq!(empty, Some(serde_json::json!({"requestId": "x"})));
        assert_eq!(with_request_id(b"[1]", "x"), None);
        assert_eq!(with_request_id(b"", "x"), None);
    }

    #[test]
    fn sane_ids_are_visible_ascii_up_to_128_bytes() {
        assert!(is_sane(b"abc-123_XYZ.~!"));
        assert!(is_sane("x".repeat(MAX_LEN).as_bytes()));
        assert!(!is_sane(b""));
        assert!(!is_sane("x".repeat(MAX_LEN + 1).as_bytes()));
        assert!(!is_sane(b"a b"));
        assert!(!is_sane(b"a\tb"));
        assert!(!is_sane(b"a\x7fb"));
        assert!(!is_sane("é".as_bytes()));
    }

    #[test]
    fn a_missing_repeated_or_insane_id_is_replaced() {
        let mut h = HeaderMap::new();
        let fresh = RequestId::assign(&h);
        assert_eq!(fresh.as_str().len(), 32);
        assert!(fresh.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
        h.insert(HEADER, HeaderValue::from_static("caller-1"));
        assert_eq!(RequestId::assign(&h).as_str(), "caller-1");
        h.append(HEADER, HeaderValue::from_static("caller-2"));
        assert_ne!(RequestId::assign(&h).as_str(), "caller-1");
        h.insert(HEADER, HeaderValue::from_static("has space"));
        assert_ne!(RequestId::assign(&h).as_str(), "has space");
    }
}
