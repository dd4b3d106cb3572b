//! Upstream answers as governor outcomes: the status plus whatever rate-limit dialect the
//! origin speaks, normalised by `nthbouncer-ratelimit`. Used by the proxy (its own responses)
//! and the lock API (headers reported on release).

use http::HeaderMap;
use nthbouncer_coord::{Outcome, RateInfo};
use nthbouncer_ratelimit::RateReport;

/// The outcome of an upstream response observed by the proxy.
pub fn from_response(status: u16, headers: &HeaderMap, now_ms: u64) -> Outcome {
    let pairs = headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)));
    let report = nthbouncer_ratelimit::parse(status, pairs, now_ms);
    from_report(Some(status), u32::from(status == 429), &report)
}

/// Builds an outcome from a parsed report.
pub fn from_report(status: Option<u16>, throttled: u32, report: &RateReport) -> Outcome {
    Outcome {
        status,
        throttled,
        retry_after_ms: report.retry_after_ms,
        rate: rate_info(report),
    }
}

/// The request and token windows of a report as the governor's rate fields.
pub fn rate_info(report: &RateReport) -> Option<RateInfo> {
    let req = report.requests.as_ref();
    let tok = report.tokens.as_ref();
    if req.is_none() && tok.is_none() {
        return None;
    }
    Some(RateInfo {
        limit: req.and_then(|w| w.limit),
        remaining: req.and_then(|w| w.remaining),
        reset_ms: req.and_then(|w| w.reset_ms),
        token_limit: tok.and_then(|w| w.limit),
        token_remaining: tok.and_then(|w| w.remaining),
        token_reset_ms: tok.and_then(|w| w.reset_ms),
    })
}
