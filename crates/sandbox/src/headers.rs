//! Rate-limit header rendering: OpenAI-style `x-ratelimit-*-requests`,
//! `Retry-After` / `retry-after-ms`, and the Go duration strings
//! (`1s`, `6m0s`, `20ms`) OpenAI uses for reset times.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};

use crate::state::RateView;
use crate::tokens::TokenView;

pub(crate) const LIMIT_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
pub(crate) const REMAINING_REQUESTS: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining-requests");
pub(crate) const RESET_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
pub(crate) const LIMIT_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
pub(crate) const REMAINING_TOKENS: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining-tokens");
pub(crate) const RESET_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");
pub(crate) const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// Writes the `x-ratelimit-*-requests` trio.
pub(crate) fn apply_rate(headers: &mut HeaderMap, rate: &RateView) {
    headers.insert(LIMIT_REQUESTS, HeaderValue::from(rate.limit));
    headers.insert(REMAINING_REQUESTS, HeaderValue::from(rate.remaining));
    if let Ok(reset) = HeaderValue::from_str(&go_duration(rate.reset)) {
        headers.insert(RESET_REQUESTS, reset);
    }
}

/// Writes the `x-ratelimit-*-tokens` trio.
pub(crate) fn apply_token_rate(headers: &mut HeaderMap, rate: &TokenView) {
    headers.insert(LIMIT_TOKENS, HeaderValue::from(rate.limit));
    headers.insert(REMAINING_TOKENS, HeaderValue::from(rate.remaining));
    if let Ok(reset) = HeaderValue::from_str(&go_duration(rate.reset)) {
        headers.insert(RESET_TOKENS, reset);
    }
}

/// Writes `Retry-After` (whole seconds, at least 1, rounded up so a client
/// that obeys it is never early) and `retry-after-ms` (rounded up, at least 1).
pub(crate) fn apply_retry_after(headers: &mut HeaderMap, wait: Duration) {
    let ms = ceil_millis(wait).max(1);
    headers.insert(
        axum::http::header::RETRY_AFTER,
        HeaderValue::from(ms.div_ceil(1000)),
    );
    headers.insert(RETRY_AFTER_MS, HeaderValue::from(ms));
}

/// Milliseconds in `d`, rounded up.
fn ceil_millis(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// Formats a duration the way Go's `time.Duration.String` does, at
/// millisecond precision (rounded up): `0s`, `20ms`, `1.5s`, `6m0s`, `1h0m0s`.
pub(crate) fn go_duration(d: Duration) -> String {
    let ms = ceil_millis(d);
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let total_secs = ms / 1000;
    let frac = ms % 1000;
    let hours = total_secs / 3600;
    let minutes = (total_secs % 3600) / 60;
    let secs = total_secs % 60;
    let secs = if frac == 0 {
        secs.to_string()
    } else {
        let frac = format!("{frac:03}");
        format!("{secs}.{}", frac.trim_end_matches('0'))
    };
    if hours > 0 {
        format!("{hours}h{minutes}m{secs}s")
    } else if minutes > 0 {
        format!("{minutes}m{secs}s")
    } else {
        format!("{secs}s")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn go_duration_matches_go_formatting() {
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_micros(1), "1ms"),
            (Duration::from_millis(20), "20ms"),
            (Duration::from_millis(999), "999ms"),
            (Duration::from_secs(1), "1s"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_millis(8640), "8.64s"),
            (Duration::from_millis(59_001), "59.001s"),
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_secs(360), "6m0s"),
            (Duration::from_millis(61_500), "1m1.5s"),
            (Duration::from_secs(3600), "1h0m0s"),
            (Duration::from_secs(3725), "1h2m5s"),
        ];
        for (d, want) in cases {
            assert_eq!(go_duration(d), want, "{d:?}");
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        let mut h = HeaderMap::new();
        apply_retry_after(&mut h, Duration::ZERO);
        assert_eq!(h["retry-after"], "1");
        assert_eq!(h["retry-after-ms"], "1");
        apply_retry_after(&mut h, Duration::from_micros(1_000_500));
        assert_eq!(h["retry-after"], "2");
        assert_eq!(h["retry-after-ms"], "1001");
        apply_retry_after(&mut h, Duration::from_secs(3));
        assert_eq!(h["retry-after"], "3");
        assert_eq!(h["retry-after-ms"], "3000");
    }

    #[test]
    fn rate_headers_are_written() {
        let mut h = HeaderMap::new();
        apply_rate(
            &mut h,
            &RateView {
                limit: 300,
                remaining: 0,
                reset: Duration::from_millis(200),
            },
        );
        assert_eq!(h["x-ratelimit-limit-requests"], "300");
        assert_eq!(h["x-ratelimit-remaining-requests"], "0");
        assert_eq!(h["x-ratelimit-reset-requests"], "200ms");
    }
}
