//! The one place a request for an origin is built, in two steps that the proxy takes back to back
//! and a job takes at intake and at its run:
//!
//! 1. [`caller_headers`], the caller's side: drops what must not cross (hop-by-hop headers and
//!    those `Connection` names, every `X-Nthpool-*`, the credentials the gateway consumed) and
//!    sets `X-Forwarded-For`, `-Proto` and `-Host`. A job stores its headers in this form.
//! 2. [`origin_request`], the origin's side: the URL joined to the pool's base path (dot
//!    segments resolved or refused), `Host`, the managed credentials (overriding the caller's)
//!    and, for jobs, `Idempotency-Key`.
//!
//! It must not decide admission nor read bodies.

use std::net::IpAddr;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{HeaderMap, Method, Request, Version};

use super::target::{PathRefused, Target};

/// Headers that belong to one connection (RFC 9110 §7.6.1) and never cross a proxy.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// What the gateway consumed of a caller's headers and must not pass on.
pub struct Consumed<'a> {
    /// Credential headers of the pool's access policies (the JWT header, the Cloudflare
    /// assertion).
    pub credential_headers: &'a [HeaderName],
    /// `Authorization` carried the pool key (or a JWT the gateway checked).
    pub authorization: bool,
}

/// Who called, as the origin is told in `X-Forwarded-*`.
pub struct Forwarded {
    /// The connection's peer address (`X-Forwarded-For` gets it appended).
    pub peer: IpAddr,
    /// The `Host` the caller sent (`X-Forwarded-Host`).
    pub host: Option<HeaderValue>,
}

/// Drops hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    headers.remove(header::UPGRADE);
}

/// Drops every `X-Nthpool-*` header: our control headers never reach the upstream.
fn strip_nthpool_headers(headers: &mut HeaderMap) {
    let ours: Vec<HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("x-nthpool-"))
        .cloned()
        .collect();
    for name in ours {
        headers.remove(name);
    }
}

/// `X-Forwarded-For`: the caller's value, if any, with the peer appended.
fn forwarded_for(prior: Option<&str>, peer: IpAddr) -> Option<HeaderValue> {
    use std::fmt::Write as _;
    let mut value = String::with_capacity(prior.map_or(0, |p| p.len() + 2) + 39);
    if let Some(prior) = prior {
        value.push_str(prior);
        value.push_str(", ");
    }
    let _ = write!(value, "{peer}");
    HeaderValue::from_maybe_shared(Bytes::from(value)).ok()
}

/// Step 1: the caller's headers as the origin may see them.
pub fn caller_headers(headers: &mut HeaderMap, consumed: &Consumed<'_>, forwarded: Forwarded) {
    strip_hop_by_hop(headers);
    strip_nthpool_headers(headers);
    for h in consumed.credential_headers {
        headers.remove(h);
    }
    if consumed.authorization {
        headers.remove(header::AUTHORIZATION);
    }
    let prior = headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok());
    if let Some(v) = forwarded_for(prior, forwarded.peer) {
        headers.insert(X_FORWARDED_FOR.clone(), v);
    }
    headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    if let Some(h) = forwarded.host {
        headers.insert(X_FORWARDED_HOST.clone(), h);
    }
}

/// What the origin's side of a request is made of.
pub struct Origin<'a> {
    pub target: &'a Target,
    /// The pool's managed credentials (`upstream_headers`).
    pub managed: &'a [(HeaderName, HeaderValue)],
    /// A job's id: sent as `Idempotency-Key` unless the caller sent its own.
    pub idempotency_key: Option<&'a str>,
}

/// Step 2: the request for the origin, from a caller's method, path and (step-1) headers.
pub fn origin_request<B>(
    origin: &Origin<'_>,
    method: Method,
    path_and_query: Option<&PathAndQuery>,
    mut headers: HeaderMap,
    body: B,
) -> Result<Request<B>, PathRefused> {
    let uri = origin.target.join(path_and_query)?;
    // hyper-util only fills Host when absent: replace the caller's explicitly.
    headers.insert(header::HOST, origin.target.host.clone());
    if let Some(id) = origin.idempotency_key {
        if !headers.contains_key(&IDEMPOTENCY_KEY) {
            // Lets origins that support it deduplicate a job retried after a crash.
            if let Ok(v) = HeaderValue::from_str(id) {
                headers.insert(IDEMPOTENCY_KEY.clone(), v);
            }
        }
    }
    for (name, value) in origin.managed {
        headers.insert(name.clone(), value.clone());
    }
    let mut req = Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;
    Ok(req)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret-Hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("yes"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn forwarded_for_appends_the_peer() {
        let peer: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(forwarded_for(None, peer).unwrap(), "10.1.2.3");
        assert_eq!(
            forwarded_for(Some("1.1.1.1"), peer).unwrap(),
            "1.1.1.1, 10.1.2.3"
        );
        let v6: IpAddr = "::1".parse().unwrap();
        assert_eq!(forwarded_for(None, v6).unwrap(), "::1");
    }

    #[test]
    fn the_caller_side_drops_ours_and_adds_forwarding() {
        let mut h = HeaderMap::new();
        h.insert("x-nthpool-key", HeaderValue::from_static("k"));
        h.insert("x-nthpool-priority", HeaderValue::from_static("high"));
        h.insert("authorization", HeaderValue::from_static("Bearer k"));
        h.insert("x-jwt", HeaderValue::from_static("a.b.c"));
        h.insert("x-other", HeaderValue::from_static("1"));
        let jwt = [HeaderName::from_static("x-jwt")];
        caller_headers(
            &mut h,
            &Consumed {
                credential_headers: &jwt,
                authorization: true,
            },
            Forwarded {
                peer: "10.0.0.1".parse().unwrap(),
                host: Some(HeaderValue::from_static("p.localhost:8080")),
            },
        );
        let mut names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "x-forwarded-for",
                "x-forwarded-host",
                "x-forwarded-proto",
                "x-other"
            ]
        );
    }

    #[test]
    fn the_origin_side_sets_host_credentials_and_the_idempotency_key() {
        let target = Target::parse("t", "https://api.example.com/v1").unwrap();
        let managed = [(
            HeaderName::from_static("authorization"),
            HeaderValue::from_static("Bearer origin-secret"),
        )];
        let origin = Origin {
            target: &target,
            managed: &managed,
            idempotency_key: Some("job_1"),
        };
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("p.localhost"));
        h.insert("authorization", HeaderValue::from_static("Bearer caller"));
        let pq = PathAndQuery::from_static("/chat?x=1");
        let req = origin_request(&origin, Method::POST, Some(&pq), h, ()).unwrap();
        assert_eq!(req.uri(), "https://api.example.com/v1/chat?x=1");
        assert_eq!(req.headers()["host"], "api.example.com");
        assert_eq!(req.headers()["authorization"], "Bearer origin-secret");
        assert_eq!(req.headers()["idempotency-key"], "job_1");
        let mut own = HeaderMap::new();
        own.insert("idempotency-key", HeaderValue::from_static("mine"));
        let req = origin_request(&origin, Method::POST, Some(&pq), own, ()).unwrap();
        assert_eq!(req.headers()["idempotency-key"], "mine");
        let above = PathAndQuery::from_static("/../admin");
        assert!(origin_request(&origin, Method::GET, Some(&above), HeaderMap::new(), ()).is_err());
    }
}
