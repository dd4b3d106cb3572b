//! Behaviour of `parse` at the crate boundary, one section per dialect, from the examples the
//! origins and drafts publish, plus malformed input, name case and mixed dialects.

use nthbouncer_ratelimit::{parse, Dialect, RateReport, Window};

/// A borrowed header list, for tables of cases.
type Headers<'a> = &'a [(&'a str, &'a str)];

/// 2024-01-01T00:00:00Z.
const NEW_YEAR_MS: u64 = 1_704_067_200_000;

fn window(limit: Option<u64>, remaining: Option<u64>, reset_ms: Option<u64>) -> Window {
    Window {
        limit,
        remaining,
        reset_ms,
        window_ms: None,
    }
}

fn full(limit: u64, remaining: u64, reset_ms: u64) -> Option<Window> {
    Some(window(Some(limit), Some(remaining), Some(reset_ms)))
}

// ---------------------------------------------------------------------------------------- OpenAI

#[test]
fn openai_documented_example() {
    let report = parse(
        200,
        [
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ],
        NEW_YEAR_MS,
    );
    assert_eq!(
        report,
        RateReport {
            throttled: false,
            retry_after_ms: None,
            requests: full(60, 59, 1_000),
            tokens: full(150_000, 149_984, 360_000),
            input_tokens: None,
            output_tokens: None,
            source: Some(Dialect::OpenAi),
        }
    );
}

#[test]
fn openai_resets_in_every_go_unit() {
    for (value, ms) in [
        ("20ms", 20),
        ("1h2m3.5s", 3_723_500),
        ("0.5s", 500),
        ("850\u{b5}s", 1),
        ("850us", 1),
        ("999999ns", 1),
        ("0s", 0),
    ] {
        let report = parse(200, [("x-ratelimit-reset-requests", value)], 0);
        assert_eq!(
            report.requests.and_then(|w| w.reset_ms),
            Some(ms),
            "{value}"
        );
    }
}

#[test]
fn openai_negative_or_malformed_resets_are_unknown() {
    for value in ["-1s", "-0.5s", "1", "soon", "1 s", ""] {
        let report = parse(
            200,
            [
                ("x-ratelimit-remaining-requests", "3"),
                ("x-ratelimit-reset-requests", value),
            ],
            0,
        );
        assert_eq!(
            report.requests,
            Some(window(None, Some(3), None)),
            "{value:?}"
        );
    }
}

#[test]
fn openai_429_on_tokens_waits_for_the_spent_budget() {
    let report = parse(
        429,
        [
            ("x-ratelimit-remaining-requests", "10"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ],
        0,
    );
    assert!(report.throttled);
    assert_eq!(report.retry_after_ms, Some(360_000));
}

#[test]
fn openai_429_without_spent_budget_guesses_short() {
    // Not enough tokens for this request, but not zero either: retry at the earliest refill.
    let report = parse(
        429,
        [
            ("x-ratelimit-remaining-requests", "10"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-remaining-tokens", "12"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ],
        0,
    );
    assert_eq!(report.retry_after_ms, Some(1_000));
}

// ------------------------------------------------------------------------------------- Anthropic

#[test]
fn anthropic_every_budget_with_rfc3339_resets() {
    let report = parse(
        200,
        [
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "49"),
            ("anthropic-ratelimit-requests-reset", "2024-01-01T00:00:30Z"),
            ("anthropic-ratelimit-tokens-limit", "80000"),
            ("anthropic-ratelimit-tokens-remaining", "72000"),
            (
                "anthropic-ratelimit-tokens-reset",
                "2024-01-01T00:00:07.250Z",
            ),
            ("anthropic-ratelimit-input-tokens-limit", "40000"),
            ("anthropic-ratelimit-input-tokens-remaining", "39000"),
            (
                "anthropic-ratelimit-input-tokens-reset",
                "2024-01-01T05:30:02+05:30",
            ),
            ("anthropic-ratelimit-output-tokens-limit", "8000"),
            ("anthropic-ratelimit-output-tokens-remaining", "7000"),
            (
                "anthropic-ratelimit-output-tokens-reset",
                "2023-12-31T23:59:59Z",
            ),
        ],
        NEW_YEAR_MS,
    );
    assert_eq!(report.source, Some(Dialect::Anthropic));
    assert_eq!(report.requests, full(50, 49, 30_000));
    assert_eq!(report.tokens, full(80_000, 72_000, 7_250));
    assert_eq!(report.input_tokens, full(40_000, 39_000, 2_000));
    // A reset already in the past is "now", not unknown.
    assert_eq!(report.output_tokens, full(8_000, 7_000, 0));
}

#[test]
fn anthropic_429_prefers_retry_after() {
    let report = parse(
        429,
        [
            ("retry-after", "17"),
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", "2024-01-01T00:01:00Z"),
        ],
        NEW_YEAR_MS,
    );
    assert!(report.throttled);
    assert_eq!(report.retry_after_ms, Some(17_000));
    assert_eq!(report.source, Some(Dialect::Anthropic));
}

#[test]
fn anthropic_malformed_reset_is_ignored() {
    for value in [
        "2024-01-01",
        "2024-01-01T00:00:30",
        "1704067230",
        "2024-02-30T00:00:00Z",
    ] {
        let report = parse(
            200,
            [("anthropic-ratelimit-requests-reset", value)],
            NEW_YEAR_MS,
        );
        assert_eq!(report.requests, None, "{value}");
        assert_eq!(report.source, None);
    }
}

#[test]
fn anthropic_token_budgets_alone_still_name_the_source() {
    let report = parse(
        200,
        [("anthropic-ratelimit-output-tokens-remaining", "5")],
        0,
    );
    assert_eq!(report.source, Some(Dialect::Anthropic));
    assert_eq!(report.output_tokens, Some(window(None, Some(5), None)));
}

// ---------------------------------------------------------------------------------------- GitHub

#[test]
fn github_documented_example() {
    let report = parse(
        200,
        [
            ("x-ratelimit-limit", "60"),
            ("x-ratelimit-remaining", "56"),
            ("x-ratelimit-used", "4"),
            ("x-ratelimit-reset", "1372700873"),
        ],
        1_372_700_000_000,
    );
    assert_eq!(report.source, Some(Dialect::GitHubStyle));
    assert_eq!(report.requests, full(60, 56, 873_000));
}

#[test]
fn github_403_with_spent_budget_is_a_throttle() {
    let headers = [
        ("x-ratelimit-limit", "5000"),
        ("x-ratelimit-remaining", "0"),
        ("x-ratelimit-used", "5000"),
        ("x-ratelimit-reset", "1372700873"),
    ];
    let report = parse(403, headers, 1_372_700_000_000);
    assert!(report.throttled);
    assert_eq!(report.retry_after_ms, Some(873_000));
    // A 403 with budget left is a permissions problem.
    let report = parse(403, [("x-ratelimit-remaining", "4999")], 0);
    assert!(!report.throttled);
    // GitHub's secondary limits: 403 with Retry-After.
    let report = parse(403, [("retry-after", "60")], 0);
    assert!(report.throttled);
    assert_eq!(report.retry_after_ms, Some(60_000));
}

#[test]
fn plain_reset_under_ten_to_the_ninth_is_a_delay() {
    let report = parse(200, [("X-RateLimit-Reset", "60")], 1_700_000_000_000);
    assert_eq!(report.requests.and_then(|w| w.reset_ms), Some(60_000));
    let report = parse(
        200,
        [("X-RateLimit-Reset", "1000000000")],
        1_700_000_000_000,
    );
    assert_eq!(report.requests.and_then(|w| w.reset_ms), Some(0));
}

#[test]
fn github_used_fills_missing_remaining() {
    let report = parse(
        200,
        [("x-ratelimit-limit", "60"), ("x-ratelimit-used", "60")],
        0,
    );
    assert_eq!(report.requests.and_then(|w| w.remaining), Some(0));
}

// --------------------------------------------------------------------------------------- Discord

#[test]
fn discord_documented_headers() {
    let report = parse(
        200,
        [
            ("X-RateLimit-Limit", "5"),
            ("X-RateLimit-Remaining", "0"),
            ("X-RateLimit-Reset", "1470173023"),
            ("X-RateLimit-Reset-After", "1"),
            ("X-RateLimit-Bucket", "abcd1234"),
        ],
        1_470_173_000_000,
    );
    assert_eq!(report.source, Some(Dialect::Discord));
    // reset-after wins over the epoch reset: it is immune to clock skew.
    assert_eq!(report.requests, full(5, 0, 1_000));
    assert!(!report.throttled);
    assert_eq!(report.wait_ms(), Some(1_000));
}

#[test]
fn discord_429_uses_float_reset_after_without_retry_after() {
    let report = parse(
        429,
        [
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset-after", "1.234"),
        ],
        0,
    );
    assert!(report.throttled);
    assert_eq!(report.retry_after_ms, Some(1_234));
}

#[test]
fn discord_malformed_reset_after_falls_back_to_reset() {
    let report = parse(
        200,
        [
            ("x-ratelimit-reset-after", "-1"),
            ("x-ratelimit-reset", "1470173023.5"),
        ],
        1_470_173_023_000,
    );
    assert_eq!(report.requests.and_then(|w| w.reset_ms), Some(500));
}

// ------------------------------------------------------------------------------------ IETF drafts

#[test]
fn ietf_early_drafts_separate_fields() {
    let report = parse(
        200,
        [
            ("RateLimit-Limit", "10"),
            ("RateLimit-Remaining", "1"),
            ("RateLimit-Reset", "7"),
        ],
        0,
    );
    assert_eq!(report.source, Some(Dialect::IetfDraft));
    assert_eq!(report.requests, full(10, 1, 7_000));
}

#[test]
fn ietf_early_drafts_quota_policies_in_the_limit() {
    let report = parse(
        200,
        [
            (
                "RateLimit-Limit",
                "10, 10;w=1, 50;w=60, 1000;w=3600, 5000;w=86400",
            ),
            ("RateLimit-Remaining", "9"),
            ("RateLimit-Reset", "1"),
        ],
        0,
    );
    assert_eq!(
        report.requests,
        Some(Window {
            limit: Some(10),
            remaining: Some(9),
            reset_ms: Some(1_000),
            window_ms: Some(1_000)
        })
    );
    // Draft 05/06 moved the policies to their own field.
    let report = parse(
        200,
        [
            ("RateLimit-Limit", "100"),
            ("RateLimit-Policy", "10;w=1, 100;w=60"),
        ],
        0,
    );
    assert_eq!(report.requests.and_then(|w| w.window_ms), Some(60_000));
}

#[test]
fn ietf_draft07_dictionary() {
    let report = parse(
        429,
        [
            ("RateLimit", "limit=100, remaining=0, reset=30"),
            ("RateLimit-Policy", "100;w=60"),
        ],
        0,
    );
    assert_eq!(
        report.requests,
        Some(Window {
            limit: Some(100),
            remaining: Some(0),
            reset_ms: Some(30_000),
            window_ms: Some(60_000)
        })
    );
    assert!(report.throttled);
    assert_eq!(report.retry_after_ms, Some(30_000));
}

#[test]
fn ietf_current_named_policies() {
    let report = parse(
        200,
        [
            ("RateLimit-Policy", r#""default";q=100;w=60"#),
            ("RateLimit", r#""default";r=50;t=30"#),
        ],
        0,
    );
    assert_eq!(
        report.requests,
        Some(Window {
            limit: Some(100),
            remaining: Some(50),
            reset_ms: Some(30_000),
            window_ms: Some(60_000)
        })
    );
}

#[test]
fn ietf_several_policies_keep_the_most_constraining() {
    // 90 left in 200 s (0.45/s) binds harder than 5 left in 1 s (5/s).
    let headers = [
        (
            "RateLimit-Policy",
            r#""burst";q=10;w=1, "daily";q=1000;w=86400"#,
        ),
        ("RateLimit", r#""burst";r=5;t=1, "daily";r=90;t=200"#),
    ];
    let report = parse(200, headers, 0);
    assert_eq!(
        report.requests,
        Some(Window {
            limit: Some(1_000),
            remaining: Some(90),
            reset_ms: Some(200_000),
            window_ms: Some(86_400_000)
        })
    );
    // The same across repeated field lines, in either order; and an exhausted burst wins.
    let report = parse(
        200,
        [
            ("RateLimit", r#""daily";r=90;t=200"#),
            ("ratelimit", r#""burst";r=0;t=1"#),
            ("RateLimit-Policy", r#""daily";q=1000;w=86400"#),
            ("ratelimit-policy", r#""burst";q=10;w=1"#),
        ],
        0,
    );
    assert_eq!(
        report.requests,
        Some(Window {
            limit: Some(10),
            remaining: Some(0),
            reset_ms: Some(1_000),
            window_ms: Some(1_000)
        })
    );
}

#[test]
fn ietf_policy_alone_teaches_quota() {
    let report = parse(
        200,
        [(
            "RateLimit-Policy",
            r#""permin";q=50;w=60, "perhr";q=1000;w=3600"#,
        )],
        0,
    );
    assert_eq!(
        report.requests,
        Some(Window {
            limit: Some(1_000),
            remaining: None,
            reset_ms: None,
            window_ms: Some(3_600_000)
        })
    );
}

#[test]
fn ietf_tokens_and_bad_members_are_tolerated() {
    // Unquoted policy names, spaces after ';', one broken member: the good ones still count.
    let report = parse(
        200,
        [
            ("RateLimit-Policy", "default;q=100; w=60"),
            ("RateLimit", r#"default;r=50; t=30, "broken;r=1"#),
        ],
        0,
    );
    assert_eq!(report.requests.and_then(|w| w.remaining), Some(50));
    assert_eq!(report.requests.and_then(|w| w.limit), Some(100));
}

// ----------------------------------------------------------------------------------- Retry-After

#[test]
fn retry_after_forms_and_precedence() {
    let now = 1_445_412_450_000; // 30 s before the RFC 9110 example date
    let cases: [(Headers, Option<u64>); 6] = [
        (&[("Retry-After", "120")], Some(120_000)),
        (
            &[("Retry-After", "Wed, 21 Oct 2015 07:28:00 GMT")],
            Some(30_000),
        ),
        (&[("Retry-After", "Wed, 21 Oct 2015 07:27:00 GMT")], Some(0)),
        (&[("retry-after-ms", "1500.5")], Some(1_501)),
        (
            &[("Retry-After", "2"), ("Retry-After-Ms", "250")],
            Some(250),
        ),
        (&[("Retry-After", "soon"), ("retry-after-ms", "-5")], None),
    ];
    for (headers, expected) in cases {
        let report = parse(429, headers.iter().copied(), now);
        assert_eq!(report.retry_after_ms, expected, "{headers:?}");
    }
}

#[test]
fn retry_after_ignored_on_success_and_redirects() {
    for status in [200, 201, 301, 303, 399] {
        assert_eq!(
            parse(status, [("Retry-After", "120")], 0),
            RateReport::default(),
            "{status}"
        );
    }
    for status in [0, 400, 429, 500, 503, 529, 599, 999] {
        assert_eq!(
            parse(status, [("Retry-After", "120")], 0).retry_after_ms,
            Some(120_000),
            "{status}"
        );
    }
}

#[test]
fn retry_after_malformed_ms_falls_back_to_seconds() {
    let report = parse(503, [("retry-after-ms", "soon"), ("retry-after", "3")], 0);
    assert_eq!(report.retry_after_ms, Some(3_000));
    assert_eq!(report.source, Some(Dialect::RetryAfter));
    assert!(!report.throttled);
}

// ------------------------------------------------------------------------------ across dialects

#[test]
fn names_match_in_any_case() {
    let lower = parse(
        200,
        [
            ("x-ratelimit-remaining-requests", "5"),
            ("anthropic-ratelimit-tokens-limit", "9"),
        ],
        0,
    );
    let odd = parse(
        200,
        [
            ("X-RateLimit-Remaining-REQUESTS", "5"),
            ("Anthropic-RateLimit-Tokens-Limit", "9"),
        ],
        0,
    );
    assert_eq!(lower, odd);
    assert_eq!(odd.requests.and_then(|w| w.remaining), Some(5));
}

#[test]
fn mixed_dialects_keep_the_most_constraining_request_budget() {
    // A gateway's IETF fields in front of an OpenAI origin: the gateway is tighter here.
    let report = parse(
        200,
        [
            ("x-ratelimit-limit-requests", "5000"),
            ("x-ratelimit-remaining-requests", "4999"),
            ("x-ratelimit-reset-requests", "12ms"),
            ("RateLimit", "limit=10, remaining=2, reset=40"),
        ],
        0,
    );
    assert_eq!(report.source, Some(Dialect::IetfDraft));
    assert_eq!(report.requests, full(10, 2, 40_000));

    // And the other way round.
    let report = parse(
        200,
        [
            ("anthropic-ratelimit-requests-remaining", "1"),
            ("anthropic-ratelimit-requests-reset", "2024-01-01T00:01:00Z"),
            ("x-ratelimit-remaining", "100"),
            ("x-ratelimit-reset", "60"),
        ],
        NEW_YEAR_MS,
    );
    assert_eq!(report.source, Some(Dialect::Anthropic));
    assert_eq!(report.requests, Some(window(None, Some(1), Some(60_000))));
}

#[test]
fn mixed_dialects_tie_goes_to_the_more_specific() {
    let report = parse(
        200,
        [
            ("x-ratelimit-remaining", "7"),
            ("x-ratelimit-remaining-requests", "7"),
        ],
        0,
    );
    assert_eq!(report.source, Some(Dialect::OpenAi));
}

#[test]
fn openai_and_anthropic_tokens_keep_the_tighter() {
    let report = parse(
        200,
        [
            ("x-ratelimit-remaining-tokens", "100"),
            ("x-ratelimit-reset-tokens", "1s"),
            ("anthropic-ratelimit-tokens-remaining", "100"),
            ("anthropic-ratelimit-tokens-reset", "2024-01-01T00:01:00Z"),
        ],
        NEW_YEAR_MS,
    );
    assert_eq!(report.tokens, Some(window(None, Some(100), Some(60_000))));
    assert_eq!(report.source, Some(Dialect::Anthropic));
}

#[test]
fn malformed_values_are_as_if_absent() {
    let report = parse(
        429,
        [
            ("x-ratelimit-limit", "lots"),
            ("x-ratelimit-remaining", "-1"),
            ("x-ratelimit-reset", "tomorrow"),
            ("x-ratelimit-limit-requests", "1e3"),
            ("x-ratelimit-remaining-requests", "99999999999999999999999"),
            ("anthropic-ratelimit-requests-limit", "５０"),
            ("ratelimit-limit", "(1 2)"),
            ("RateLimit", "limit=ten"),
            ("RateLimit-Policy", "\"unterminated;q=1"),
            ("retry-after", "later"),
        ],
        0,
    );
    assert_eq!(
        report,
        RateReport {
            throttled: true,
            ..RateReport::default()
        }
    );
}

#[test]
fn unrelated_and_empty_input() {
    assert!(parse(200, [], 0).is_empty());
    assert!(parse(
        200,
        [("content-type", "application/json"), ("x-request-id", "5")],
        0
    )
    .is_empty());
    let only_status = parse(429, [], 0);
    assert!(only_status.throttled);
    assert_eq!(only_status.retry_after_ms, None);
    assert_eq!(only_status.source, None);
}

#[test]
fn duplicate_singleton_first_good_line_wins() {
    let report = parse(
        200,
        [
            ("x-ratelimit-remaining-requests", "garbage"),
            ("x-ratelimit-remaining-requests", "4"),
            ("x-ratelimit-remaining-requests", "9"),
        ],
        0,
    );
    assert_eq!(report.requests.and_then(|w| w.remaining), Some(4));
}

#[test]
fn an_answer_without_rate_headers_reports_its_status_alone() {
    let plain = [
        ("content-type", "text/plain"),
        ("content-length", "13"),
        ("x-ratelimit", "not a field we know"),
    ];
    for status in [0, 200, 302, 403, 429, 503] {
        let report = parse(status, plain, 1_700_000_000_000);
        assert_eq!(
            report,
            RateReport {
                throttled: status == 429,
                ..RateReport::default()
            },
            "status {status}"
        );
        assert_eq!(parse(status, [], 0), report, "status {status}, no headers");
    }
}
