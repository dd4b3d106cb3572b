//! Fuzz target `lock_bodies`: the whole input is the body of a lock acquire and of a lock
//! release, read by the functions the handlers call (`lock::acquire_params`,
//! `lock::release_outcome`); a release's outcome then goes where the gate sends it, into a
//! governor (`observe_held`, then `release`).
//!
//! Properties: nothing panics; a refused body is `400 invalid`; an accepted acquire's wait is
//! clamped to the queue timeout and its priority is the body's (else the header's); an accepted
//! release's outcome carries the status, `throttled`, `retryAfterMs` and `rate` fields the body
//! gave, as read by a plain `serde_json::Value`.
//!
//! Shared by `fuzz_targets/lock_bodies.rs` and `crates/server/tests/it/fuzz_regressions.rs`.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use nthbouncer_config::ConcurrencySpec;
use nthbouncer_governor::{Governor, Outcome, PoolSettings, Priority, Ticket, TryAcquire};
use nthbouncer_server::core::admission::{NO_QUEUE_HEADER, PRIORITY_HEADER, QUEUE_TIMEOUT_HEADER};
use nthbouncer_server::core::error::ApiError;
use nthbouncer_server::lock;
use serde_json::Value;

/// A plausible clock: 2023-11-14.
const NOW: u64 = 1_700_000_000_000;

pub fn run(data: &[u8]) {
    let body = Bytes::copy_from_slice(data);
    // The body's fields as a plain JSON object, when serde_json reads it as one. It may not
    // while the typed parse succeeds: `1e400` in a field the type ignores, or an array (serde
    // reads a struct from its fields in order).
    let value: Option<Value> = serde_json::from_slice(data).ok().filter(Value::is_object);
    acquire(&body, value.as_ref());
    for now_ms in [0, NOW, u64::MAX] {
        release(&body, value.as_ref(), now_ms);
    }
}

fn assert_invalid(e: &ApiError) {
    assert_eq!(
        (e.status, e.code.as_str()),
        (StatusCode::BAD_REQUEST, "invalid"),
        "a body is refused as 400 invalid: {e:?}"
    );
}

/// `Some(v)` for a field present and not null.
fn field<'a>(value: Option<&'a Value>, name: &str) -> Option<&'a Value> {
    value?.get(name).filter(|v| !v.is_null())
}

fn acquire(body: &Bytes, value: Option<&Value>) {
    let spec = ConcurrencySpec::default();
    let header_sets: [&[(&str, &str)]; 3] = [
        &[],
        &[(QUEUE_TIMEOUT_HEADER, "250"), (PRIORITY_HEADER, "low")],
        &[(NO_QUEUE_HEADER, "1")],
    ];
    for pairs in header_sets {
        let mut headers = HeaderMap::new();
        for (k, v) in pairs {
            headers.insert(*k, HeaderValue::from_static(v));
        }
        let (wait_ms, priority) = match lock::acquire_params(body, &headers, &spec) {
            Ok(ok) => ok,
            Err(e) => {
                assert_invalid(&e);
                continue;
            }
        };
        assert!(
            wait_ms <= spec.queue_timeout_ms,
            "wait {wait_ms} ms beyond the queue timeout"
        );
        if headers.contains_key(NO_QUEUE_HEADER) {
            assert_eq!(wait_ms, 0, "X-Nthpool-No-Queue waits");
        }
        match field(value, "priority").and_then(Value::as_str) {
            Some(asked) => assert_eq!(Some(priority), Priority::parse(asked), "body priority"),
            None if value.is_some() => {
                let from_header = if headers.contains_key(PRIORITY_HEADER) {
                    Priority::Low
                } else {
                    Priority::Normal
                };
                assert_eq!(priority, from_header, "priority without a body priority");
            }
            None => {}
        }
        if let Some(asked) = field(value, "waitMs").and_then(Value::as_u64) {
            if !headers.contains_key(NO_QUEUE_HEADER) {
                assert_eq!(
                    wait_ms,
                    asked.min(spec.queue_timeout_ms),
                    "waitMs not honoured"
                );
            }
        }
    }
}

fn release(body: &Bytes, value: Option<&Value>, now_ms: u64) {
    let outcome = match lock::release_outcome(body, now_ms) {
        Ok(Some(outcome)) => outcome,
        Ok(None) => {
            assert!(
                body.iter().all(u8::is_ascii_whitespace),
                "a non-empty body reported nothing"
            );
            return;
        }
        Err(e) => {
            assert_invalid(&e);
            return;
        }
    };
    assert_eq!(outcome.via, Some("lock release"));
    if let Some(status) = outcome.status {
        assert!((100..=599).contains(&status), "status {status} accepted");
    }
    if value.is_some() {
        let u64_of = |v: Option<&Value>| v.and_then(Value::as_u64);
        assert_eq!(
            outcome.status.map(u64::from),
            u64_of(field(value, "status")),
            "status"
        );
        if let Some(n) = u64_of(field(value, "throttled")) {
            assert_eq!(u64::from(outcome.throttled), n, "throttled");
        }
        if let Some(ms) = u64_of(field(value, "retryAfterMs")) {
            assert_eq!(outcome.retry_after_ms, Some(ms), "retryAfterMs");
        }
        if let Some(rate) = field(value, "rate") {
            let Some(got) = outcome.rate else {
                panic!("rate sent but not in the outcome");
            };
            let r = |name: &str| u64_of(field(Some(rate), name));
            assert_eq!(got.limit, r("limit"), "rate.limit");
            assert_eq!(got.remaining, r("remaining"), "rate.remaining");
            assert_eq!(got.reset_ms, r("resetMs"), "rate.resetMs");
            assert_eq!(got.token_limit, r("tokenLimit"), "rate.tokenLimit");
            assert_eq!(
                got.token_remaining,
                r("tokenRemaining"),
                "rate.tokenRemaining"
            );
            assert_eq!(got.token_reset_ms, r("tokenResetMs"), "rate.tokenResetMs");
            assert_eq!(got.window_ms, None, "rate.windowMs is not a field");
        } else if field(value, "headers").is_none() {
            assert_eq!(
                (outcome.rate, outcome.dialect),
                (None, None),
                "rate from nothing"
            );
        }
    }
    feed_governor(&outcome);
}

/// What the in-process gate does with a released slot's outcome, at a plausible time.
fn feed_governor(outcome: &Outcome) {
    let mut gov = Governor::new(PoolSettings::default());
    let ticket = |id| Ticket {
        id,
        fairness_key: 0,
        priority: Priority::Normal,
        lease_ms: 30_000,
        grace_ms: 0,
    };
    assert!(matches!(
        gov.try_acquire(NOW, ticket(1), false),
        TryAcquire::Admitted(_)
    ));
    let _ = gov.observe_held(NOW, 1, outcome);
    assert!(gov.release(NOW, 1), "the held slot releases");
    let _ = gov.observe(NOW, outcome);
    // Admission never exceeds the effective limit of the moment (ARCHITECTURE.md).
    let within_limit = |gov: &Governor, now: u64| {
        assert!(
            gov.in_flight() <= gov.snapshot(now).effective_limit,
            "admitted beyond the effective limit after {outcome:?}"
        );
    };
    for (i, now) in [NOW, NOW + 1, NOW + 60_000, NOW + 3_600_000]
        .into_iter()
        .enumerate()
    {
        let _ = gov.next_wakeup(now);
        if let TryAcquire::Admitted(_) = gov.try_acquire(now, ticket(10 + i as u128), true) {
            within_limit(&gov, now);
        }
        while gov.dispatch(now).is_some() {
            within_limit(&gov, now);
        }
        let _ = gov.headers(now);
        while gov.reclaim_expired(now).is_some() {}
    }
}
