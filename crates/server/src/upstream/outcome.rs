//! Upstream answers as governor outcomes: the status plus whatever rate-limit dialect the
//! origin speaks, normalised by `nthbouncer-ratelimit`. Used by the proxy (its own responses)
//! and the lock API (headers reported on release), so both teach the pool the same thing.

use http::HeaderMap;
use nthbouncer_coord::{Outcome, RateInfo};
use nthbouncer_ratelimit::{Dialect, RateReport};

/// `Outcome::via` of answers the proxy saw itself.
pub const VIA_PROXY: &str = "proxy";
/// `Outcome::via` of answers a lock holder reported on release.
pub const VIA_LOCK: &str = "lock release";

/// OpenAI's and Anthropic's request limits are per minute; their reset headers say when the
/// budget is full again (a bucket refilling continuously), not when a fixed window ends.
const PER_MINUTE_MS: u64 = 60_000;

/// The outcome of an upstream response observed by the proxy.
pub fn from_response(status: u16, headers: &HeaderMap, now_ms: u64) -> Outcome {
    let report = nthbouncer_ratelimit::parse(status, rate_header_pairs(headers), now_ms);
    Outcome {
        via: Some(VIA_PROXY),
        ..from_report(Some(status), u32::from(status == 429), &report)
    }
}

/// An answer's headers as `nthbouncer_ratelimit::parse` takes them: only the names it reads,
/// so only their values are checked for text.
pub fn rate_header_pairs(headers: &HeaderMap) -> impl Iterator<Item = (&str, &str)> {
    headers
        .iter()
        .filter(|(k, _)| nthbouncer_ratelimit::reads_header(k.as_str()))
        .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)))
}

/// Builds an outcome from a parsed report.
pub fn from_report(status: Option<u16>, throttled: u32, report: &RateReport) -> Outcome {
    Outcome {
        status,
        throttled,
        retry_after_ms: report.retry_after_ms,
        rate: rate_info(report),
        via: None,
        dialect: dialect(report),
    }
}

/// The header family a report was read from, for the throttle cause.
pub fn dialect(report: &RateReport) -> Option<&'static str> {
    report.source.map(Dialect::as_str)
}

/// The request and token windows of a report as the governor's rate fields.
pub fn rate_info(report: &RateReport) -> Option<RateInfo> {
    let req = report.requests.as_ref();
    let tok = report.tokens.as_ref();
    if req.is_none() && tok.is_none() {
        return None;
    }
    // A window length the origin states wins; otherwise the dialect may imply one. It sets the
    // pace the governor keeps when no budget is mirrored (or a spent one's reset has passed);
    // without it, a budget spent to its reset simply refills there, which is right for the
    // fixed windows of GitHub-style and Discord headers.
    let implied = match report.source {
        Some(Dialect::OpenAi | Dialect::Anthropic) => Some(PER_MINUTE_MS),
        _ => None,
    };
    Some(RateInfo {
        limit: req.and_then(|w| w.limit),
        remaining: req.and_then(|w| w.remaining),
        reset_ms: req.and_then(|w| w.reset_ms),
        window_ms: req
            .and_then(|w| w.window_ms)
            .or(implied.filter(|_| req.is_some())),
        token_limit: tok.and_then(|w| w.limit),
        token_remaining: tok.and_then(|w| w.remaining),
        token_reset_ms: tok.and_then(|w| w.reset_ms),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub(crate) mod tests {
    use super::*;
    use http::{HeaderName, HeaderValue};

    pub(crate) fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    /// The sandbox's answers (OpenAI style).
    pub(crate) const SANDBOX_OK: [(&str, &str); 3] = [
        ("x-ratelimit-limit-requests", "300"),
        ("x-ratelimit-remaining-requests", "292"),
        ("x-ratelimit-reset-requests", "59.8s"),
    ];
    /// A refusal by its hidden concurrency limit: budget left, so concurrency is to blame.
    pub(crate) const SANDBOX_429: [(&str, &str); 5] = [
        ("retry-after", "2"),
        ("retry-after-ms", "1200"),
        ("x-ratelimit-limit-requests", "300"),
        ("x-ratelimit-remaining-requests", "280"),
        ("x-ratelimit-reset-requests", "58s"),
    ];

    #[test]
    fn proxy_outcomes_name_their_source_and_imply_openai_windows() {
        let o = from_response(200, &headers(&SANDBOX_OK), 0);
        assert_eq!(o.via, Some("proxy"));
        assert_eq!(o.dialect, Some("openai"));
        assert_eq!(
            o.rate,
            Some(RateInfo {
                limit: Some(300),
                remaining: Some(292),
                reset_ms: Some(59_800),
                window_ms: Some(60_000),
                ..RateInfo::default()
            })
        );
        let o = from_response(429, &headers(&SANDBOX_429), 0);
        assert_eq!(
            (o.status, o.throttled, o.retry_after_ms),
            (Some(429), 1, Some(1_200))
        );
        // GitHub style: a fixed window, no implied length.
        let o = from_response(
            200,
            &headers(&[
                ("x-ratelimit-limit", "5000"),
                ("x-ratelimit-remaining", "4000"),
                ("x-ratelimit-reset", "600"),
            ]),
            0,
        );
        assert_eq!(o.dialect, Some("github"));
        assert_eq!(o.rate.unwrap().window_ms, None);
        // A bare Retry-After names its dialect and carries no rate.
        let o = from_response(503, &headers(&[("retry-after", "3")]), 0);
        assert_eq!(
            (o.dialect, o.rate, o.retry_after_ms),
            (Some("retry-after"), None, Some(3_000))
        );
    }
}
