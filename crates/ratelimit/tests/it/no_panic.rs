//! Property tests: no input panics or overflows the parser (tests build with overflow checks,
//! so an arithmetic overflow would fail them), names are case-insensitive, and the calendar
//! arithmetic agrees with an independent implementation.

use std::time::{Duration, UNIX_EPOCH};

use nthbouncer_ratelimit::{parse, parse_go_duration, parse_retry_after, parse_rfc3339, Dialect};
use proptest::prelude::*;

const KNOWN: &[&str] = &[
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "anthropic-ratelimit-requests-limit",
    "anthropic-ratelimit-requests-remaining",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-tokens-remaining",
    "anthropic-ratelimit-tokens-reset",
    "anthropic-ratelimit-input-tokens-reset",
    "anthropic-ratelimit-output-tokens-remaining",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "x-ratelimit-used",
    "x-ratelimit-reset-after",
    "ratelimit-limit",
    "ratelimit-remaining",
    "ratelimit-reset",
    "ratelimit-policy",
    "ratelimit",
    "retry-after",
    "retry-after-ms",
];

/// A known name in random case, or anything at all.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (prop::sample::select(KNOWN), any::<u64>()).prop_map(|(name, mask)| {
            name.chars()
                .enumerate()
                .map(|(i, c)| if mask >> (i % 64) & 1 == 1 { c.to_ascii_uppercase() } else { c })
                .collect()
        }),
        1 => any::<String>(),
    ]
}

/// Values shaped like each format, broken in the ways origins and fuzzers break them.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[0-9]{1,45}",
        "[-+]?[0-9]{0,30}(\\.[0-9]{0,40})?",
        "[-+]?([0-9]{0,22}(\\.[0-9]{0,22})?(h|m|s|ms|us|µs|μs|ns|x|)){1,6}",
        "[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{0,30})?([Zz]|[-+][0-9]{2}:[0-9]{2})?",
        "(Mon|Wed|Sunday), [0-9]{1,3}[ -](Jan|Oct|Feb|Xyz)[ -][0-9]{2,5} [0-9]{2}:[0-9]{2}:[0-9]{2} (GMT|UTC)",
        "(\"[a-z,]{0,4}\"|[a-z*]{1,4}|-?[0-9]{1,25}(\\.[0-9]{0,5})?|limit|remaining|reset|\\?[01]|:[A-Za-z0-9=]{0,6}:?|\\(\\))(=-?[0-9]{1,25})?(; ?(q|w|r|t|qu|pk|l)(=(\"[a-z-]{0,14}\"?|-?[0-9.]{1,25}|:[a-zA-Z0-9=]{0,6}:|\\?[01]|requests))?){0,4}(, ?(\"[a-z]{0,4}\"|[a-z]{1,4}|[0-9]{1,25}|limit|reset)(=[0-9]{1,25})?(;(q|w|r|t)=[0-9]{1,25}){0,3}){0,4}",
        "[\\x00-\\x7f\u{b5}\u{3bc}é\u{fffd},;=\"\\\\:()?* \t]{0,40}",
    ]
}

fn now() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        Just(u64::MAX),
        Just(1_704_067_200_000),
        any::<u64>()
    ]
}

fn status() -> impl Strategy<Value = u16> {
    prop_oneof![
        Just(0),
        Just(200),
        Just(403),
        Just(429),
        Just(503),
        any::<u16>()
    ]
}

fn headers() -> impl Strategy<Value = Vec<(String, String)>> {
    prop::collection::vec((name(), value()), 0..12)
}

fn pairs(headers: &[(String, String)]) -> impl Iterator<Item = (&str, &str)> {
    headers.iter().map(|(n, v)| (n.as_str(), v.as_str()))
}

// Whole-response properties: generating a dozen shaped headers dominates their run time in a
// debug build, so they run fewer cases than the helper properties below.
proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn parse_never_panics_and_keeps_its_invariants(
        status in status(),
        headers in headers(),
        now_ms in now(),
    ) {
        let report = parse(status, pairs(&headers), now_ms);
        prop_assert!(!report.throttled || status == 429 || status == 403);
        if (1..400).contains(&status) {
            prop_assert_eq!(report.retry_after_ms, None);
        }
        let has_window = report.windows().next().is_some();
        prop_assert_eq!(report.source.is_some(), has_window || report.retry_after_ms.is_some());
        if report.source == Some(Dialect::RetryAfter) {
            prop_assert!(!has_window);
        }
        prop_assert!(report.windows().all(|w| !w.is_empty()));
        let _ = report.wait_ms();
    }

    #[test]
    fn names_are_case_insensitive(status in status(), headers in headers(), now_ms in now()) {
        let upper: Vec<_> = headers.iter().map(|(n, v)| (n.to_ascii_uppercase(), v.clone())).collect();
        let lower: Vec<_> = headers.iter().map(|(n, v)| (n.to_ascii_lowercase(), v.clone())).collect();
        prop_assert_eq!(parse(status, pairs(&upper), now_ms), parse(status, pairs(&lower), now_ms));
    }

}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn helpers_never_panic(text in value(), now_ms in now()) {
        let _ = parse_go_duration(&text);
        let _ = parse_retry_after(&text, now_ms);
        let _ = parse_rfc3339(&text);
    }

    #[test]
    fn go_duration_sums_its_parts(h in 0u64..10_000, m in 0u64..10_000, s in 0u64..10_000, ms in 0u64..10_000) {
        let expected = ((h * 60 + m) * 60 + s) * 1_000 + ms;
        prop_assert_eq!(parse_go_duration(&format!("{h}h{m}m{s}s{ms}ms")), Some(expected));
    }

    #[test]
    fn delay_seconds_scale_exactly(seconds in any::<u32>(), now_ms in now()) {
        let expected = u64::from(seconds) * 1_000;
        prop_assert_eq!(parse_retry_after(&seconds.to_string(), now_ms), Some(expected));
        let report = parse(429, [("Retry-After", seconds.to_string().as_str())], now_ms);
        prop_assert_eq!(report.retry_after_ms, Some(expected));
    }

    /// httpdate formats the same instant as an HTTP-date; rebuilding RFC 3339 from its fields
    /// checks our day counting against its calendar over the whole range both support.
    #[test]
    fn rfc3339_agrees_with_httpdate(secs in 0u64..253_402_300_800, millis in 0u64..1_000) {
        let http = httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(secs));
        // "Sun, 06 Nov 1994 08:49:37 GMT"
        let parts: Vec<&str> = http.split([' ', ',']).filter(|p| !p.is_empty()).collect();
        let month = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
            .iter()
            .position(|m| *m == parts[2])
            .unwrap() + 1;
        let rfc3339 = format!("{}-{month:02}-{}T{}.{millis:03}Z", parts[3], parts[1], parts[4]);
        let expected = i64::try_from(secs * 1_000 + millis).unwrap();
        prop_assert_eq!(parse_rfc3339(&rfc3339), Some(expected), "{}", rfc3339);
        prop_assert_eq!(parse_retry_after(&http, 0), Some(secs * 1_000));
    }
}
