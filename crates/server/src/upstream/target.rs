//! Where a pool's requests go, and how a caller's path is joined to it.
//!
//! A path is joined with its dot segments resolved (RFC 3986 §5.2.4); one that climbs above the
//! root (`/../admin`) is refused rather than sent, so a caller can never reach a path outside
//! the pool's base path with the pool's managed credentials. Percent-encoded dots count as
//! dots: origins decode them.

use std::borrow::Cow;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Uri};
use nthbouncer_config::ConfigError;

/// A pool's upstream: scheme, authority and base path.
#[derive(Clone, Debug)]
pub struct Target {
    pub scheme: Scheme,
    pub authority: Authority,
    /// Path prefix of the upstream URL without a trailing slash (`""` for the root).
    pub base_path: String,
    /// The `Host` header the upstream expects.
    pub host: HeaderValue,
}

/// A request path that cannot be forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathRefused {
    #[error("the request path climbs above the root with `..` segments")]
    AboveRoot,
    #[error("the request path cannot be forwarded")]
    Unparseable,
}

impl Target {
    pub fn parse(at: &str, url: &str) -> Result<Target, ConfigError> {
        let uri = nthbouncer_config::parse_http_url(&format!("{at}.upstream"), url)?;
        let parts = uri.into_parts();
        let (Some(scheme), Some(authority)) = (parts.scheme, parts.authority) else {
            return Err(ConfigError::new(
                format!("{at}.upstream"),
                "must be an absolute URL",
            ));
        };
        let base_path = parts
            .path_and_query
            .map(|pq| pq.path().trim_end_matches('/').to_string())
            .unwrap_or_default();
        let host = HeaderValue::from_str(authority.as_str()).map_err(|_| {
            ConfigError::new(
                format!("{at}.upstream"),
                "has a host that is not a valid header value",
            )
        })?;
        Ok(Target {
            scheme,
            authority,
            base_path,
            host,
        })
    }

    /// The upstream URL of a request's path and query: the pool's scheme, authority and base
    /// path, then the request's path (dot segments resolved) and query.
    pub fn join(&self, path_and_query: Option<&PathAndQuery>) -> Result<Uri, PathRefused> {
        let (path, query) = match path_and_query {
            Some(pq) => (pq.path(), pq.query()),
            None => ("/", None),
        };
        let path = if path.starts_with('/') {
            Cow::Borrowed(path)
        } else {
            Cow::Owned(format!("/{path}"))
        };
        let path = remove_dot_segments(&path)?;
        if self.base_path.is_empty() && matches!(path, Cow::Borrowed(_)) {
            // The common case: the request's own path and query, shared rather than re-parsed.
            if let Some(pq) = path_and_query.filter(|pq| pq.path().starts_with('/')) {
                let mut parts = http::uri::Parts::default();
                parts.scheme = Some(self.scheme.clone());
                parts.authority = Some(self.authority.clone());
                parts.path_and_query = Some(pq.clone());
                return Uri::from_parts(parts).map_err(|_| PathRefused::Unparseable);
            }
        }
        let mut target = String::with_capacity(
            self.base_path.len() + path.len() + query.map_or(0, |q| q.len() + 1),
        );
        target.push_str(&self.base_path);
        target.push_str(&path);
        if let Some(q) = query {
            target.push('?');
            target.push_str(q);
        }
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        parts.path_and_query =
            Some(PathAndQuery::try_from(target).map_err(|_| PathRefused::Unparseable)?);
        Uri::from_parts(parts).map_err(|_| PathRefused::Unparseable)
    }
}

/// A segment an origin reads as `.` or `..` (percent-encoded dots included).
fn dots(segment: &str) -> Option<usize> {
    let mut n = 0;
    let mut rest = segment;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('.') {
            rest = r;
        } else if rest.len() >= 3 && rest[..3].eq_ignore_ascii_case("%2e") {
            rest = &rest[3..];
        } else {
            return None;
        }
        n += 1;
    }
    (1..=2).contains(&n).then_some(n)
}

/// Resolves `.` and `..` segments of an absolute path; borrowed when there are none.
pub fn remove_dot_segments(path: &str) -> Result<Cow<'_, str>, PathRefused> {
    if !path.split('/').any(|s| dots(s).is_some()) {
        return Ok(Cow::Borrowed(path));
    }
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    let last = segments.len().saturating_sub(1);
    for (i, segment) in segments.iter().enumerate() {
        match dots(segment) {
            Some(1) => {
                if i == last {
                    out.push(""); // `/a/.` is the directory `/a/`
                }
            }
            Some(_) => {
                if out.pop().is_none() {
                    return Err(PathRefused::AboveRoot);
                }
                if i == last {
                    out.push("");
                }
            }
            None => out.push(segment),
        }
    }
    let mut resolved = String::with_capacity(path.len());
    for s in &out {
        resolved.push('/');
        resolved.push_str(s);
    }
    if resolved.is_empty() {
        resolved.push('/');
    }
    Ok(Cow::Owned(resolved))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn joins_base_path_and_request_path() {
        for (upstream, request, want) in [
            (
                "http://127.0.0.1:9000",
                "/a/b?c=d",
                "http://127.0.0.1:9000/a/b?c=d",
            ),
            ("http://127.0.0.1:9000/", "/", "http://127.0.0.1:9000/"),
            (
                "https://api.example.com/v1/",
                "/chat?x=1",
                "https://api.example.com/v1/chat?x=1",
            ),
            ("http://h:1", "http://other/p?q", "http://h:1/p?q"),
            ("https://h/v1", "/a/../b", "https://h/v1/b"),
            ("https://h/v1", "/a/./b/.", "https://h/v1/a/b/"),
            ("https://h", "/a/%2E%2e/b?q=..", "https://h/b?q=.."),
        ] {
            let up = Target::parse("t", upstream).unwrap();
            let uri: Uri = request.parse().unwrap();
            assert_eq!(
                up.join(uri.path_and_query()).unwrap().to_string(),
                want,
                "{upstream} + {request}"
            );
        }
    }

    #[test]
    fn a_path_above_the_root_is_refused() {
        let up = Target::parse("t", "https://h/v1").unwrap();
        for request in ["/../admin", "/a/../../admin", "/%2e%2e/admin", "/.%2E/x"] {
            let uri: Uri = request.parse().unwrap();
            assert_eq!(
                up.join(uri.path_and_query()),
                Err(PathRefused::AboveRoot),
                "{request}"
            );
        }
    }

    #[test]
    fn dot_like_segments_that_are_not_dots_pass() {
        assert_eq!(remove_dot_segments("/...").unwrap(), "/...");
        assert_eq!(remove_dot_segments("/a.b/.c").unwrap(), "/a.b/.c");
        assert!(matches!(
            remove_dot_segments("/plain/path").unwrap(),
            Cow::Borrowed(_)
        ));
    }
}
