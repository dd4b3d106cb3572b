//! Reads the rate-limit headers of one upstream response into a normalised [`RateReport`] that
//! the governor learns from (SPEC §3, "Adaptive learning").
//!
//! This crate owns the knowledge of *how origins announce their limits*: which header names
//! exist, what their values look like, how to turn absolute resets into delays, and which of
//! several overlapping budgets binds hardest. It owns nothing else. It does not depend on the
//! `http` crate or on any other part of nthbouncer, does no IO and reads no clock: the caller
//! passes the status, `(name, value)` header pairs and `now_ms` (epoch milliseconds), and gets
//! plain numbers back. What to *do* with them (shrinking the limit, pausing admission) is the
//! governor's business.
//!
//! **Invariant: parsing never fails.** A malformed, negative, overflowing or non-ASCII value is
//! ignored as if the header were absent; nothing here panics or wraps (checked and saturating
//! arithmetic throughout, and a proptest in `tests/` feeds arbitrary input to prove it).
//! Header names match ASCII case-insensitively. Fractions of a millisecond round up, so a wait
//! read from a header is never cut short.
//!
//! # Dialects
//!
//! | [`Dialect`] | headers | reset format |
//! |---|---|---|
//! | `OpenAi` | `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` | Go duration: `6m0s`, `1s`, `20ms` |
//! | `Anthropic` | `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}` | RFC 3339 instant |
//! | `GitHubStyle` | `x-ratelimit-{limit,remaining,reset,used}` | seconds: epoch at or above 10^9, else a delay |
//! | `Discord` | the same plus `x-ratelimit-reset-after` | float seconds delay (preferred over `reset`) |
//! | `IetfDraft` | `ratelimit-{limit,remaining,reset}`, `RateLimit`, `RateLimit-Policy` | delay seconds |
//! | `RetryAfter` | `Retry-After`, `retry-after-ms` | seconds or HTTP-date; float ms |
//!
//! When several dialects (or several IETF policies) describe the request budget, the report
//! keeps the most constraining: the least headroom per unit of time, `remaining / reset`, so the
//! governor never paces by the loosest of two real limits. Ties go to the more specific dialect
//! (Anthropic, OpenAI, IETF, then the plain `x-ratelimit-*` triple). Token budgets are chosen the
//! same way. `retry-after-ms` wins over `Retry-After`, being more precise.
//!
//! # Examples
//!
//! OpenAI, with the headers from its rate-limit guide:
//!
//! ```
//! use nthbouncer_ratelimit::{parse, Dialect, Window};
//!
//! let report = parse(200, [
//!     ("x-ratelimit-limit-requests", "60"),
//!     ("x-ratelimit-limit-tokens", "150000"),
//!     ("x-ratelimit-remaining-requests", "59"),
//!     ("x-ratelimit-remaining-tokens", "149984"),
//!     ("x-ratelimit-reset-requests", "1s"),
//!     ("x-ratelimit-reset-tokens", "6m0s"),
//! ], 0);
//! assert_eq!(report.source, Some(Dialect::OpenAi));
//! assert_eq!(report.requests, Some(Window {
//!     limit: Some(60), remaining: Some(59), reset_ms: Some(1_000), window_ms: None,
//! }));
//! assert_eq!(report.tokens.and_then(|w| w.reset_ms), Some(360_000));
//! ```
//!
//! Anthropic, whose resets are RFC 3339 instants (made relative to `now_ms`):
//!
//! ```
//! use nthbouncer_ratelimit::{parse, Dialect};
//!
//! let now_ms = 1_704_067_200_000; // 2024-01-01T00:00:00Z
//! let report = parse(200, [
//!     ("anthropic-ratelimit-requests-limit", "50"),
//!     ("anthropic-ratelimit-requests-remaining", "49"),
//!     ("anthropic-ratelimit-requests-reset", "2024-01-01T00:00:30Z"),
//!     ("anthropic-ratelimit-input-tokens-limit", "40000"),
//!     ("anthropic-ratelimit-input-tokens-remaining", "39000"),
//!     ("anthropic-ratelimit-input-tokens-reset", "2024-01-01T00:00:01.5+00:00"),
//! ], now_ms);
//! assert_eq!(report.source, Some(Dialect::Anthropic));
//! assert_eq!(report.requests.and_then(|w| w.reset_ms), Some(30_000));
//! assert_eq!(report.input_tokens.and_then(|w| w.reset_ms), Some(1_500));
//! ```
//!
//! GitHub, whose `x-ratelimit-reset` is an epoch second (values under 10^9 would be delays):
//!
//! ```
//! use nthbouncer_ratelimit::{parse, Dialect, Window};
//!
//! let report = parse(200, [
//!     ("X-RateLimit-Limit", "60"),
//!     ("X-RateLimit-Remaining", "56"),
//!     ("X-RateLimit-Used", "4"),
//!     ("X-RateLimit-Reset", "1372700873"),
//! ], 1_372_700_000_000);
//! assert_eq!(report.source, Some(Dialect::GitHubStyle));
//! assert_eq!(report.requests, Some(Window {
//!     limit: Some(60), remaining: Some(56), reset_ms: Some(873_000), window_ms: None,
//! }));
//! ```
//!
//! The IETF drafts, current shape (named policies), with the draft-07 dictionary and the early
//! separate fields read the same way:
//!
//! ```
//! use nthbouncer_ratelimit::{parse, Dialect, Window};
//!
//! let expected = Some(Window {
//!     limit: Some(100), remaining: Some(50), reset_ms: Some(30_000), window_ms: Some(60_000),
//! });
//! let current = parse(200, [
//!     ("RateLimit-Policy", r#""default";q=100;w=60"#),
//!     ("RateLimit", r#""default";r=50;t=30"#),
//! ], 0);
//! assert_eq!(current.source, Some(Dialect::IetfDraft));
//! assert_eq!(current.requests, expected);
//!
//! let draft07 = parse(200, [
//!     ("RateLimit", "limit=100, remaining=50, reset=30"),
//!     ("RateLimit-Policy", "100;w=60"),
//! ], 0);
//! assert_eq!(draft07.requests, expected);
//!
//! let early = parse(200, [
//!     ("RateLimit-Limit", "100, 100;w=60"),
//!     ("RateLimit-Remaining", "50"),
//!     ("RateLimit-Reset", "30"),
//! ], 0);
//! assert_eq!(early.requests, expected);
//! ```
//!
//! Discord, whose `X-RateLimit-Reset-After` is a float delay; a spent budget on a successful
//! answer is not a throttle, but [`RateReport::wait_ms`] says how long to hold off:
//!
//! ```
//! use nthbouncer_ratelimit::{parse, Dialect};
//!
//! let report = parse(200, [
//!     ("X-RateLimit-Limit", "5"),
//!     ("X-RateLimit-Remaining", "0"),
//!     ("X-RateLimit-Reset", "1470173023.123"),
//!     ("X-RateLimit-Reset-After", "1.234"),
//!     ("X-RateLimit-Bucket", "abcd1234"),
//! ], 1_470_173_021_889);
//! assert_eq!(report.source, Some(Dialect::Discord));
//! assert!(!report.throttled);
//! assert_eq!(report.retry_after_ms, None);
//! assert_eq!(report.wait_ms(), Some(1_234));
//! ```
//!
//! `Retry-After` (RFC 9110) and `retry-after-ms`, read on error answers:
//!
//! ```
//! use nthbouncer_ratelimit::{parse, Dialect};
//!
//! let report = parse(429, [("Retry-After", "120")], 0);
//! assert!(report.throttled);
//! assert_eq!(report.retry_after_ms, Some(120_000));
//! assert_eq!(report.source, Some(Dialect::RetryAfter));
//!
//! let report = parse(503, [("Retry-After", "Wed, 21 Oct 2015 07:28:00 GMT")], 1_445_412_450_000);
//! assert!(!report.throttled);
//! assert_eq!(report.retry_after_ms, Some(30_000));
//!
//! let report = parse(429, [("retry-after", "2"), ("retry-after-ms", "1500.5")], 0);
//! assert_eq!(report.retry_after_ms, Some(1_501));
//! ```
//!
//! # Layout
//!
//! `fields` names every header read; `dialects` and `ietf` turn them into windows; `report`
//! holds the output types and the "most constraining" ordering; `number`, `duration`,
//! `datetime` and `structured` parse the value formats (decimals, Go durations, RFC 3339 and
//! HTTP-dates, RFC 8941 structured fields).

#![forbid(unsafe_code)]

mod datetime;
mod dialects;
mod duration;
mod fields;
mod ietf;
mod number;
mod report;
mod structured;

pub use datetime::{parse_retry_after, parse_rfc3339};
pub use duration::parse_go_duration;
pub use report::{Dialect, RateReport, Window};

use fields::{Budget, Field, Fields};
use number::parse_scaled_ceil;
use report::tightest;

/// Whether [`parse`] reads a header of this name (any ASCII case): a caller holding values
/// that still need converting to text can skip the headers it would drop.
pub fn reads_header(name: &str) -> bool {
    fields::field_of(name).is_some()
}

/// Reads one upstream response's rate-limit headers.
///
/// - `status`: the response status; `0` when unknown (for example an outcome reported without
///   one). It decides [`RateReport::throttled`], and retry hints are read only on error answers
///   (400 and up) or an unknown status: on 3xx, RFC 9110 gives `Retry-After` a per-redirect
///   meaning that must not pause a whole pool.
/// - `headers`: `(name, value)` pairs in any case and order; unrecognised names are skipped.
///   Repeated headers are fine: list fields (`RateLimit`, `RateLimit-Policy`,
///   `RateLimit-Limit`) are combined, and for the others the first well-formed line wins.
/// - `now_ms`: epoch milliseconds, to turn absolute resets into delays.
///
/// On a throttled answer with no retry header, `retry_after_ms` is derived from the budgets:
/// the longest reset among those reporting nothing left (each must refill before a retry can
/// pass), or, if none reports that, the shortest reset known. Waking early costs one more 429;
/// waking late idles the pool, so the guess leans short.
#[must_use]
pub fn parse<'a>(
    status: u16,
    headers: impl IntoIterator<Item = (&'a str, &'a str)>,
    now_ms: u64,
) -> RateReport {
    let fields = Fields::collect(headers);
    // Most answers carry none of these headers (an origin that never announces its limits, or
    // every answer but a throttle): the report is then the status alone, without building and
    // ranking empty candidate lists on every proxied request.
    if fields.is_empty() {
        return RateReport {
            throttled: status == 429,
            ..RateReport::default()
        };
    }

    // Candidates are listed most specific dialect first, which `tightest` uses to break ties.
    let mut requests = Vec::new();
    requests.extend(
        dialects::anthropic(&fields, Budget::Requests, now_ms).map(|w| (Dialect::Anthropic, w)),
    );
    requests.extend(dialects::openai(&fields, Budget::Requests).map(|w| (Dialect::OpenAi, w)));
    requests.extend(
        ietf::windows(&fields, now_ms)
            .into_iter()
            .map(|w| (Dialect::IetfDraft, w)),
    );
    requests.extend(dialects::plain(&fields, now_ms));
    let requests = tightest(&requests);

    let mut tokens = Vec::new();
    tokens.extend(
        dialects::anthropic(&fields, Budget::Tokens, now_ms).map(|w| (Dialect::Anthropic, w)),
    );
    tokens.extend(dialects::openai(&fields, Budget::Tokens).map(|w| (Dialect::OpenAi, w)));
    let tokens = tightest(&tokens);

    let input_tokens = dialects::anthropic(&fields, Budget::InputTokens, now_ms);
    let output_tokens = dialects::anthropic(&fields, Budget::OutputTokens, now_ms);

    let hint = if status == 0 || status >= 400 {
        fields
            .first(Field::RetryAfterMs, |v| parse_scaled_ceil(v, 1))
            .or_else(|| fields.first(Field::RetryAfter, |v| parse_retry_after(v, now_ms)))
    } else {
        None
    };

    let source = requests
        .or(tokens)
        .map(|(dialect, _)| dialect)
        .or_else(|| {
            (input_tokens.is_some() || output_tokens.is_some()).then_some(Dialect::Anthropic)
        })
        .or_else(|| hint.map(|_| Dialect::RetryAfter));

    let mut report = RateReport {
        throttled: false,
        retry_after_ms: hint,
        requests: requests.map(|(_, w)| w),
        tokens: tokens.map(|(_, w)| w),
        input_tokens,
        output_tokens,
        source,
    };
    let spent = report.windows().any(Window::is_exhausted);
    // GitHub answers an exhausted primary limit, and its secondary limits, with 403 instead
    // of 429; any other 403 is a permissions problem and no throttle.
    report.throttled = status == 429 || (status == 403 && (spent || hint.is_some()));
    if report.throttled && report.retry_after_ms.is_none() {
        report.retry_after_ms = report
            .exhausted_reset_ms()
            .or_else(|| report.windows().filter_map(|w| w.reset_ms).min());
    }
    report
}
