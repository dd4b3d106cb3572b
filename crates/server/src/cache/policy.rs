//! What may be cached, for how long, under which key: pure functions of a request's and an
//! answer's head (RFC 9111 as a shared cache reads it, narrowed to what SPEC §4 asks).
//!
//! No IO, no clock: the caller passes what it saw; `store` and `fill` act on the verdicts.

use http::header::{
    HeaderName, AGE, AUTHORIZATION, CACHE_CONTROL, PRAGMA, RANGE, SET_COOKIE, VARY,
};
use http::{HeaderMap, Method, StatusCode, Uri};
use nthbouncer_config::CacheSpec;

use crate::core::extract::content_length;

/// Why a request does not use the cache at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BypassReason {
    /// Not a `GET` or `HEAD`, or it carries a body.
    Method,
    /// `X-Nthpool-Async`: jobs never use the cache (seed).
    Async,
    /// The request's `Cache-Control: no-store` or `private`.
    NoStore,
    /// An `Authorization` header the origin sees, which `cache.vary` does not name: the
    /// answer may be the credential's own (RFC 9111 §3.5).
    Authorization,
    /// A `Range` request: partial answers are not cached, nor served from a whole one.
    Range,
}

/// What a request may do with the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestRule {
    Bypass(BypassReason),
    /// Look the key up (`read`), or, for `Cache-Control: no-cache` / `max-age=0`, skip the
    /// stored answer but store the fresh one.
    Use {
        read: bool,
    },
}

/// What the request looks like to the cache.
pub struct RequestHead<'a> {
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
    pub has_body: bool,
    pub asked_async: bool,
    /// The `Authorization` header carried the pool key (it is not forwarded).
    pub authorization_consumed: bool,
}

pub fn request_rule(spec: &Prepared, req: &RequestHead<'_>) -> RequestRule {
    if !(req.method == Method::GET || req.method == Method::HEAD) || req.has_body {
        return RequestRule::Bypass(BypassReason::Method);
    }
    if req.asked_async {
        return RequestRule::Bypass(BypassReason::Async);
    }
    if req.headers.contains_key(RANGE) {
        return RequestRule::Bypass(BypassReason::Range);
    }
    let directives = Directives::of(req.headers);
    if directives.no_store || directives.private {
        return RequestRule::Bypass(BypassReason::NoStore);
    }
    if req.headers.contains_key(AUTHORIZATION)
        && !req.authorization_consumed
        && !spec.vary.contains(&AUTHORIZATION)
    {
        return RequestRule::Bypass(BypassReason::Authorization);
    }
    let pragma_no_cache = !req.headers.contains_key(CACHE_CONTROL)
        && req
            .headers
            .get_all(PRAGMA)
            .iter()
            .any(|v| v.as_bytes().eq_ignore_ascii_case(b"no-cache"));
    let revalidate = directives.no_cache || directives.max_age == Some(0) || pragma_no_cache;
    RequestRule::Use { read: !revalidate }
}

/// A pool's cache settings, parsed once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    pub ttl_ms: u64,
    pub max_entry_bytes: u64,
    pub vary: Vec<HeaderName>,
    pub shared_across_keys: bool,
}

impl Prepared {
    pub fn of(spec: &CacheSpec) -> Prepared {
        Prepared {
            ttl_ms: spec.ttl_s.saturating_mul(1000),
            max_entry_bytes: spec.max_entry_bytes,
            // Validated names; one that does not parse cannot be in a valid spec.
            vary: spec
                .vary
                .iter()
                .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
                .collect(),
            shared_across_keys: spec.shared_across_keys,
        }
    }
}

/// The cache key: method, path and query as received, the `cache.vary` headers' values (as
/// bytes: two values are one key only if they are the same bytes), and the caller's key id
/// (unless `shared_across_keys`). Fields are separated by `\n`, which neither a request target
/// nor a header value can hold, so two requests never share a key by accident.
pub fn key(
    spec: &Prepared,
    key_id: &str,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Vec<u8> {
    let target = uri.path_and_query().map_or("/", |pq| pq.as_str());
    let mut key = Vec::with_capacity(16 + target.len() + key_id.len());
    key.extend_from_slice(method.as_str().as_bytes());
    key.push(b'\n');
    key.extend_from_slice(target.as_bytes());
    for name in &spec.vary {
        key.push(b'\n');
        key.extend_from_slice(name.as_str().as_bytes());
        key.push(b':');
        key.extend_from_slice(&joined(headers, name));
    }
    key.push(b'\n');
    if spec.shared_across_keys {
        key.push(b'*');
    } else {
        key.extend_from_slice(b"key:");
        key.extend_from_slice(key_id.as_bytes());
    }
    key
}

/// A header's values as one (`, `-joined); empty when absent.
pub fn joined(headers: &HeaderMap, name: &HeaderName) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, v) in headers.get_all(name).iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(v.as_bytes());
    }
    out
}

/// The statuses whose answers are kept (SPEC §12).
pub fn cacheable_status(status: StatusCode) -> bool {
    matches!(status.as_u16(), 200 | 203 | 204 | 301 | 404)
}

/// How an answer may be kept.
#[derive(Debug, PartialEq, Eq)]
pub struct Storable {
    /// How long from now it is fresh, in ms: `ttl_s`, or less if the origin says so.
    pub fresh_ms: u64,
    /// The origin's `Age`, in seconds: the answer was already that old.
    pub initial_age_s: u64,
    /// The origin's `Vary`: these request headers' values must match for a later hit.
    pub vary: Vec<(HeaderName, Vec<u8>)>,
}

/// Whether an answer to a cacheable request may be kept: its status, the origin's
/// `Cache-Control` (`no-store`, `private`, `no-cache` refuse; `s-maxage`, else `max-age`,
/// shortens `ttl_s`), `Vary` (`*` refuses; named headers are recorded with the request's
/// values), `Set-Cookie` (refuses: a shared cache must not hand one caller's cookie to
/// another), and a declared length over `max_entry_bytes`.
pub fn storable(
    spec: &Prepared,
    status: StatusCode,
    response: &HeaderMap,
    request: &HeaderMap,
) -> Option<Storable> {
    if !cacheable_status(status) || response.contains_key(SET_COOKIE) {
        return None;
    }
    let d = Directives::of(response);
    if d.no_store || d.private || d.no_cache {
        return None;
    }
    if content_length(response).is_some_and(|len| len > spec.max_entry_bytes) {
        return None;
    }
    let initial_age_s = response
        .get(AGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let fresh_ms = match d.s_maxage.or(d.max_age) {
        Some(origin_s) => {
            let left_s = origin_s.saturating_sub(initial_age_s);
            spec.ttl_ms.min(left_s.saturating_mul(1000))
        }
        None => spec.ttl_ms,
    };
    if fresh_ms == 0 {
        return None;
    }
    let mut vary = Vec::new();
    for value in response.get_all(VARY) {
        let Ok(value) = value.to_str() else {
            return None;
        };
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "*" {
                return None;
            }
            let Ok(name) = HeaderName::from_bytes(name.as_bytes()) else {
                return None;
            };
            if !vary.iter().any(|(n, _)| *n == name) {
                let value = joined(request, &name);
                vary.push((name, value));
            }
        }
    }
    Some(Storable {
        fresh_ms,
        initial_age_s,
        vary,
    })
}

/// Whether a request matches the origin's `Vary` recorded with an entry.
pub fn vary_matches(recorded: &[(HeaderName, Vec<u8>)], request: &HeaderMap) -> bool {
    recorded
        .iter()
        .all(|(name, value)| joined(request, name) == *value)
}

/// The `Cache-Control` directives the cache reads; malformed values are ignored.
#[derive(Debug, Default, PartialEq, Eq)]
struct Directives {
    no_store: bool,
    no_cache: bool,
    private: bool,
    max_age: Option<u64>,
    s_maxage: Option<u64>,
}

impl Directives {
    fn of(headers: &HeaderMap) -> Directives {
        let mut d = Directives::default();
        for value in headers.get_all(CACHE_CONTROL) {
            let Ok(value) = value.to_str() else { continue };
            for part in value.split(',') {
                let (name, arg) = match part.split_once('=') {
                    Some((n, a)) => (n.trim(), Some(a.trim().trim_matches('"'))),
                    None => (part.trim(), None),
                };
                let seconds = || arg.and_then(|a| a.parse::<u64>().ok());
                match name.to_ascii_lowercase().as_str() {
                    "no-store" => d.no_store = true,
                    // `no-cache="field"` restricts one field; as a shared cache we refuse the
                    // whole answer rather than edit it.
                    "no-cache" => d.no_cache = true,
                    "private" => d.private = true,
                    // A duplicate directive: the smallest is the safest reading.
                    "max-age" => d.max_age = min_some(d.max_age, seconds()),
                    "s-maxage" => d.s_maxage = min_some(d.s_maxage, seconds()),
                    _ => {}
                }
            }
        }
        d
    }
}

fn min_some(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn spec() -> Prepared {
        Prepared::of(&CacheSpec {
            ttl_s: 60,
            vary: vec!["Accept-Language".into()],
            ..CacheSpec::default()
        })
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    fn rule(method: Method, pairs: &[(&'static str, &'static str)]) -> RequestRule {
        let uri: Uri = "/v1/models?x=1".parse().unwrap();
        let h = headers(pairs);
        request_rule(
            &spec(),
            &RequestHead {
                method: &method,
                uri: &uri,
                headers: &h,
                has_body: false,
                asked_async: false,
                authorization_consumed: false,
            },
        )
    }

    #[test]
    fn requests_that_may_use_the_cache() {
        assert_eq!(rule(Method::GET, &[]), RequestRule::Use { read: true });
        assert_eq!(rule(Method::HEAD, &[]), RequestRule::Use { read: true });
        let bypass = |r| RequestRule::Bypass(r);
        assert_eq!(rule(Method::POST, &[]), bypass(BypassReason::Method));
        assert_eq!(
            rule(Method::GET, &[("cache-control", "No-Store")]),
            bypass(BypassReason::NoStore)
        );
        assert_eq!(
            rule(Method::GET, &[("cache-control", "private")]),
            bypass(BypassReason::NoStore)
        );
        assert_eq!(
            rule(Method::GET, &[("authorization", "Bearer x")]),
            bypass(BypassReason::Authorization)
        );
        assert_eq!(
            rule(Method::GET, &[("range", "bytes=0-1")]),
            bypass(BypassReason::Range)
        );
        let revalidate = RequestRule::Use { read: false };
        assert_eq!(
            rule(Method::GET, &[("cache-control", "no-cache")]),
            revalidate
        );
        assert_eq!(
            rule(Method::GET, &[("cache-control", "max-age=0")]),
            revalidate
        );
        assert_eq!(rule(Method::GET, &[("pragma", "no-cache")]), revalidate);
    }

    #[test]
    fn keys_hold_method_target_vary_and_key_id() {
        let s = spec();
        let uri: Uri = "/a?b=1".parse().unwrap();
        let h = headers(&[("accept-language", "fr"), ("accept", "x")]);
        let k = key(&s, "k1", &Method::GET, &uri, &h);
        assert_eq!(k, b"GET\n/a?b=1\naccept-language:fr\nkey:k1");
        // Values that are not UTF-8 are told apart byte for byte.
        let odd = |b: &'static [u8]| {
            let mut h = HeaderMap::new();
            h.insert("accept-language", HeaderValue::from_bytes(b).unwrap());
            key(&s, "k1", &Method::GET, &uri, &h)
        };
        assert_ne!(odd(b"\xff"), odd(b"\xfe"));
        assert_ne!(k, key(&s, "k2", &Method::GET, &uri, &h));
        assert_ne!(k, key(&s, "k1", &Method::HEAD, &uri, &h));
        let shared = Prepared {
            shared_across_keys: true,
            ..s.clone()
        };
        assert_eq!(
            key(&shared, "k1", &Method::GET, &uri, &h),
            key(&shared, "k2", &Method::GET, &uri, &h)
        );
        let other = headers(&[("accept-language", "de")]);
        assert_ne!(k, key(&s, "k1", &Method::GET, &uri, &other));
    }

    #[test]
    fn answers_that_may_be_kept_and_for_how_long() {
        let s = spec();
        let req = headers(&[("accept-encoding", "gzip")]);
        let ok = |pairs: &[(&'static str, &'static str)]| {
            storable(&s, StatusCode::OK, &headers(pairs), &req)
        };
        assert_eq!(ok(&[]).unwrap().fresh_ms, 60_000);
        assert_eq!(
            ok(&[("cache-control", "max-age=5")]).unwrap().fresh_ms,
            5_000
        );
        // The origin may shorten, never lengthen.
        assert_eq!(
            ok(&[("cache-control", "max-age=600")]).unwrap().fresh_ms,
            60_000
        );
        let s_max = ok(&[("cache-control", "max-age=5, s-maxage=9")]).unwrap();
        assert_eq!(s_max.fresh_ms, 9_000);
        let aged = ok(&[("cache-control", "max-age=10"), ("age", "4")]).unwrap();
        assert_eq!((aged.fresh_ms, aged.initial_age_s), (6_000, 4));
        assert_eq!(ok(&[("cache-control", "max-age=0")]), None);
        assert_eq!(ok(&[("cache-control", "no-store")]), None);
        assert_eq!(ok(&[("cache-control", "public, private")]), None);
        assert_eq!(ok(&[("cache-control", "no-cache")]), None);
        assert_eq!(ok(&[("set-cookie", "a=b")]), None);
        assert_eq!(ok(&[("vary", "*")]), None);
        assert_eq!(ok(&[("content-length", "2000000")]), None);
        let vary = ok(&[("vary", "Accept-Encoding, accept-encoding")]).unwrap();
        assert_eq!(vary.vary.len(), 1);
        assert!(vary_matches(&vary.vary, &req));
        assert!(!vary_matches(
            &vary.vary,
            &headers(&[("accept-encoding", "br")])
        ));
        assert!(!vary_matches(&vary.vary, &HeaderMap::new()));
        for status in [200, 203, 204, 301, 404] {
            let status = StatusCode::from_u16(status).unwrap();
            assert!(storable(&s, status, &HeaderMap::new(), &req).is_some());
        }
        for status in [201, 206, 302, 429, 500, 503] {
            let status = StatusCode::from_u16(status).unwrap();
            assert!(storable(&s, status, &HeaderMap::new(), &req).is_none());
        }
    }
}
