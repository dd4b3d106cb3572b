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

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{HeaderMap, Method, Request, Version};

use super::target::{PathRefused, Target};
use crate::core::peer::Peer;

/// Headers that belong to one connection (RFC 9110 §7.6.1) and never cross a proxy.
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    KEEP_ALIVE,
    PROXY_CONNECTION,
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
pub struct Forwarded<'a> {
    /// The connection's peer address (`X-Forwarded-For` gets it appended).
    pub peer: &'a Peer,
    /// The `Host` the caller sent (`X-Forwarded-Host`).
    pub host: Option<HeaderValue>,
}

/// A header that belongs to one connection: [`HOP_BY_HOP`] and `Upgrade`.
/// Asked of every name of every request and every answer: by length first, since most names
/// have none of the hop-by-hop lengths, and comparing one with each of nine names costs more.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    match name.as_str().len() {
        2 => *name == header::TE,
        7 => *name == header::TRAILER || *name == header::UPGRADE,
        10 => *name == header::CONNECTION || *name == KEEP_ALIVE,
        16 => *name == PROXY_CONNECTION,
        17 => *name == header::TRANSFER_ENCODING,
        18 => *name == header::PROXY_AUTHENTICATE,
        19 => *name == header::PROXY_AUTHORIZATION,
        _ => false,
    }
}

/// Drops hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One walk over the names first: most maps have none, and a removal of an absent name
    // still hashes and probes (nine of them per map).
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    remove_hop_by_hop(headers);
}

fn remove_hop_by_hop(headers: &mut HeaderMap) {
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

/// Our control headers (`X-Nthpool-*`) never reach the upstream.
fn is_nthpool(name: &HeaderName) -> bool {
    name.as_str().starts_with("x-nthpool-")
}

/// `X-Forwarded-For`: the caller's value, if any, with the peer (its address as text, see
/// `Peer`) appended.
fn forwarded_for(prior: Option<&str>, peer: &HeaderValue) -> Option<HeaderValue> {
    let Some(prior) = prior else {
        return Some(peer.clone());
    };
    let peer = peer.as_bytes();
    let mut value = Vec::with_capacity(prior.len() + 2 + peer.len());
    value.extend_from_slice(prior.as_bytes());
    value.extend_from_slice(b", ");
    value.extend_from_slice(peer);
    HeaderValue::from_maybe_shared(Bytes::from(value)).ok()
}

/// Step 1: the caller's headers as the origin may see them.
///
/// One walk over the caller's names decides what goes; only names present are removed (a
/// removal hashes and probes the map even for an absent name, and the hygiene checks a dozen).
pub fn caller_headers(headers: &mut HeaderMap, consumed: &Consumed<'_>, forwarded: Forwarded<'_>) {
    let (mut hop, mut ours, mut credentials, mut prior_for) = (false, false, false, false);
    for name in headers.keys() {
        if is_hop_by_hop(name) {
            hop = true;
        } else if is_nthpool(name) {
            ours = true;
        } else if *name == X_FORWARDED_FOR {
            prior_for = true;
        } else if (consumed.authorization && *name == header::AUTHORIZATION)
            || consumed.credential_headers.contains(name)
        {
            credentials = true;
        }
    }
    if hop {
        remove_hop_by_hop(headers);
    }
    if ours {
        // Usually one (the pool key): each removed as found, without a list allocated for them.
        while let Some(name) = headers.keys().find(|k| is_nthpool(k)).cloned() {
            headers.remove(name);
        }
    }
    if credentials {
        for h in consumed.credential_headers {
            headers.remove(h);
        }
        if consumed.authorization {
            headers.remove(header::AUTHORIZATION);
        }
    }
    let prior = if prior_for {
        headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok())
    } else {
        None
    };
    if let Some(v) = forwarded_for(prior, forwarded.peer.ip_text()) {
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
    fn the_hop_by_hop_test_is_the_list_and_upgrade() {
        for name in HOP_BY_HOP.iter().chain([&header::UPGRADE]) {
            assert!(is_hop_by_hop(name), "{name}");
        }
        let others = [
            header::HOST,
            header::CONTENT_LENGTH,
            header::CONTENT_TYPE,
            header::AUTHORIZATION,
            header::DATE,
            header::ACCEPT,
            header::ETAG,
            HeaderName::from_static("keep-alivf"),
            HeaderName::from_static("proxy-connectioo"),
            HeaderName::from_static("x-nthpool-key"),
            HeaderName::from_static("tf"),
        ];
        for name in &others {
            assert!(!is_hop_by_hop(name), "{name}");
        }
    }

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
        let peer = Peer::new("10.1.2.3:80".parse().unwrap());
        let peer = peer.ip_text();
        assert_eq!(forwarded_for(None, peer).unwrap(), "10.1.2.3");
        assert_eq!(
            forwarded_for(Some("1.1.1.1"), peer).unwrap(),
            "1.1.1.1, 10.1.2.3"
        );
        let v6 = Peer::new("[::1]:80".parse().unwrap());
        assert_eq!(forwarded_for(None, v6.ip_text()).unwrap(), "::1");
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
                peer: &Peer::new("10.0.0.1:80".parse().unwrap()),
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
    fn the_caller_side_strips_connection_named_headers_and_appends_to_a_prior_forwarded_for() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("x-hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert("x-forwarded-for", HeaderValue::from_static("1.1.1.1"));
        h.insert("authorization", HeaderValue::from_static("Bearer caller"));
        caller_headers(
            &mut h,
            &Consumed {
                credential_headers: &[],
                authorization: false,
            },
            Forwarded {
                peer: &Peer::new("10.0.0.2:80".parse().unwrap()),
                host: None,
            },
        );
        let mut names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            ["authorization", "x-forwarded-for", "x-forwarded-proto"]
        );
        assert_eq!(h["x-forwarded-for"], "1.1.1.1, 10.0.0.2");
        // A forwarded-for the `Connection` header names is dropped, then set afresh.
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("x-forwarded-for"),
        );
        h.insert("x-forwarded-for", HeaderValue::from_static("1.1.1.1"));
        let consumed = Consumed {
            credential_headers: &[],
            authorization: false,
        };
        let peer = Peer::new("10.0.0.2:80".parse().unwrap());
        let forwarded = Forwarded {
            peer: &peer,
            host: None,
        };
        caller_headers(&mut h, &consumed, forwarded);
        assert_eq!(h["x-forwarded-for"], "10.0.0.2");
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
