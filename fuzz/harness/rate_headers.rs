//! Fuzz target `rate_headers`: arbitrary response headers through `nthbouncer_ratelimit::parse`.
//!
//! Input (lossy UTF-8, so any bytes do): the first line is `<status> <now_ms>` (a field that
//! does not parse is 0); every further line is one header, `name:value`, split at the first
//! `:` (a line without one is a name with an empty value). Names and values are passed as they
//! are, untrimmed.
//!
//! Properties: nothing panics or overflows (fuzz builds check overflow), and the invariants of
//! `tests/it/no_panic.rs` hold — only 429 and 403 throttle; no retry hint below 400; a source is
//! named iff a window or a hint was read, `retry-after` only without windows; no empty window;
//! header names are case-insensitive. The value parsers are fed every value on their own too.
//!
//! Shared by `fuzz_targets/rate_headers.rs` and `crates/ratelimit/tests/it/fuzz_regressions.rs`.

use nthbouncer_ratelimit::{parse, parse_go_duration, parse_retry_after, parse_rfc3339, Dialect};

pub fn run(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.split('\n');
    let mut head = lines.next().unwrap_or_default().split_ascii_whitespace();
    let status: u16 = head.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let now_ms: u64 = head.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers: Vec<(&str, &str)> = lines
        .map(|line| line.split_once(':').unwrap_or((line, "")))
        .collect();

    for (_, value) in &headers {
        let _ = parse_go_duration(value);
        let _ = parse_retry_after(value, now_ms);
        let _ = parse_rfc3339(value);
    }

    let report = parse(status, headers.iter().copied(), now_ms);
    assert!(
        !report.throttled || status == 429 || status == 403,
        "throttled on status {status}"
    );
    if (1..400).contains(&status) {
        assert_eq!(report.retry_after_ms, None, "retry hint on status {status}");
    }
    let has_window = report.windows().next().is_some();
    assert_eq!(
        report.source.is_some(),
        has_window || report.retry_after_ms.is_some(),
        "source named without anything read, or the reverse: {report:?}"
    );
    if report.source == Some(Dialect::RetryAfter) {
        assert!(!has_window, "retry-after source with windows: {report:?}");
    }
    assert!(
        report.windows().all(|w| !w.is_empty()),
        "an empty window: {report:?}"
    );
    let _ = report.wait_ms();
    let _ = report.is_empty();

    let upper: Vec<(String, &str)> = headers
        .iter()
        .map(|(n, v)| (n.to_ascii_uppercase(), *v))
        .collect();
    let lower: Vec<(String, &str)> = headers
        .iter()
        .map(|(n, v)| (n.to_ascii_lowercase(), *v))
        .collect();
    let cased =
        |h: &[(String, &str)]| parse(status, h.iter().map(|(n, v)| (n.as_str(), *v)), now_ms);
    assert_eq!(
        cased(&upper),
        report,
        "header names are not case-insensitive"
    );
    assert_eq!(
        cased(&lower),
        report,
        "header names are not case-insensitive"
    );
}
