//! Turning HTTP requests into admission requests and admission answers into HTTP (SPEC §3):
//! the wait-budget rules, priority, the `x-nthpool-*` headers, and refusals as 429/504.
//!
//! The decisions themselves are the gate's; this module only translates.

use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use nthbouncer_config::{ConcurrencySpec, ProxyWait};
use nthbouncer_coord::{GateHeaders, Priority, Refusal};

use crate::core::access_log::LogLine;
use crate::core::error::{ApiError, ErrorCode};
use crate::core::metrics::PoolMetrics;

pub const QUEUE_TIMEOUT_HEADER: &str = "x-nthpool-queue-timeout-ms";
pub const NO_QUEUE_HEADER: &str = "x-nthpool-no-queue";
pub const PRIORITY_HEADER: &str = "x-nthpool-priority";
pub const ASYNC_HEADER: &str = "x-nthpool-async";

// Looked up as parsed names: a `&str` key is parsed and validated again on every lookup.
static NO_QUEUE: HeaderName = HeaderName::from_static(NO_QUEUE_HEADER);
static QUEUE_TIMEOUT: HeaderName = HeaderName::from_static(QUEUE_TIMEOUT_HEADER);
static PRIORITY: HeaderName = HeaderName::from_static(PRIORITY_HEADER);
static ASYNC: HeaderName = HeaderName::from_static(ASYNC_HEADER);

static REMAINING_SLOTS: HeaderName = HeaderName::from_static("x-nthpool-remaining-slots");
static EFFECTIVE_LIMIT: HeaderName = HeaderName::from_static("x-nthpool-effective-limit");
static QUEUED_MS: HeaderName = HeaderName::from_static("x-nthpool-queued-ms");
static RPM_REMAINING: HeaderName = HeaderName::from_static("x-nthpool-rpm-remaining");

/// Who is asking decides the default wait when the caller names none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    Proxy,
    Lock,
}

/// The wait budget of a request in ms (0 = fail fast), per SPEC §3:
/// `X-Nthpool-No-Queue` forces 0; the lock body's `waitMs` beats the header; the result is
/// clamped to `queue_timeout_ms`; absent both, locks fail fast and proxy requests wait the
/// queue timeout when `proxy_wait = "open"`.
pub fn wait_budget(
    headers: &HeaderMap,
    spec: &ConcurrencySpec,
    caller: Caller,
    body_wait_ms: Option<u64>,
) -> Result<u64, ApiError> {
    if headers.contains_key(&NO_QUEUE) {
        return Ok(0);
    }
    let asked = match body_wait_ms {
        Some(w) => Some(w),
        None => match headers.get(&QUEUE_TIMEOUT) {
            Some(v) => Some(
                v.to_str()
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "X-Nthpool-Queue-Timeout-Ms",
                            "X-Nthpool-Queue-Timeout-Ms must be a whole number of milliseconds",
                        )
                    })?,
            ),
            None => None,
        },
    };
    Ok(match asked {
        Some(w) => w.min(spec.queue_timeout_ms),
        None => match (caller, spec.proxy_wait) {
            (Caller::Proxy, ProxyWait::Open) => spec.queue_timeout_ms,
            _ => 0,
        },
    })
}

/// `X-Nthpool-Priority: high|normal|low` (default normal).
pub fn priority_from_headers(headers: &HeaderMap) -> Result<Priority, ApiError> {
    match headers.get(&PRIORITY) {
        None => Ok(Priority::Normal),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| Priority::parse(s.trim()))
            .ok_or_else(|| {
                ApiError::invalid(
                    "X-Nthpool-Priority",
                    "X-Nthpool-Priority must be high, normal or low",
                )
            }),
    }
}

/// Writes the governor figures every admitted or refused answer carries.
pub fn write_gate_headers(headers: &mut HeaderMap, gate: &GateHeaders) {
    headers.insert(
        REMAINING_SLOTS.clone(),
        number_value(u64::from(gate.remaining_slots)),
    );
    headers.insert(
        EFFECTIVE_LIMIT.clone(),
        number_value(u64::from(gate.effective_limit)),
    );
    headers.insert(QUEUED_MS.clone(), number_value(gate.queued_ms));
    if let Some(rpm) = gate.rpm_remaining {
        headers.insert(RPM_REMAINING.clone(), number_value(u64::from(rpm)));
    }
}

/// Numbers up to this are answered from a table built once: slots, limits and most queue
/// times are small, and formatting one costs an allocation per header per answer.
const SMALL_NUMBERS: usize = 1024;

/// `n` as a header value; from the table (a static copy, no allocation) when it is small.
fn number_value(n: u64) -> HeaderValue {
    static TABLE: std::sync::LazyLock<Vec<HeaderValue>> = std::sync::LazyLock::new(|| {
        (0..=SMALL_NUMBERS)
            // Leaked once for the life of the process, so each value is a static slice whose
            // clones copy a pointer instead of counting references across threads.
            .map(|i| HeaderValue::from_static(Box::leak(i.to_string().into_boxed_str())))
            .collect()
    });
    usize::try_from(n)
        .ok()
        .and_then(|i| TABLE.get(i))
        .cloned()
        .unwrap_or_else(|| HeaderValue::from(n))
}

/// A refusal as the caller sees it.
pub fn refusal_error(refusal: &Refusal) -> ApiError {
    match refusal {
        Refusal::TooManyRequests {
            reason,
            retry_after_ms,
            headers,
        } => {
            let message = match reason {
                nthbouncer_coord::RefusalReason::NoSlot => "no free slot and no wait budget",
                nthbouncer_coord::RefusalReason::QueueFull => {
                    "no free slot and the wait queue is full"
                }
                nthbouncer_coord::RefusalReason::Rpm => {
                    "the pool's requests-per-minute budget is spent"
                }
                nthbouncer_coord::RefusalReason::Paused => {
                    "admission is paused: the upstream asked us to back off"
                }
            };
            let mut e = ApiError::new(ErrorCode::TooManyRequests, message).with_gate(*headers);
            // Seconds, rounded up; never 0, which would invite an immediate retry storm.
            e.retry_after_s = retry_after_ms.map(|ms| ms.div_ceil(1000).max(1));
            e
        }
        Refusal::QueueTimeout { headers } => ApiError::new(
            ErrorCode::QueueTimeout,
            format!(
                "no slot opened within the wait budget ({} ms waited)",
                headers.queued_ms
            ),
        )
        .with_gate(*headers),
        Refusal::PoolClosed => ApiError::pool_not_found(),
        Refusal::CoordinationUnavailable { retry_after_ms } => {
            let mut e = ApiError::new(
                ErrorCode::CoordinationUnavailable,
                "the coordination store is unreachable; nothing was admitted",
            );
            e.retry_after_s = Some(retry_after_ms.div_ceil(1000).max(1));
            e
        }
    }
}

/// Answers a refusal of the gate: counted in the pool's metrics, written to the access log
/// (outcome, time queued) and turned into its `429`/`504` answer.
pub fn refuse(
    metrics: &PoolMetrics,
    log: LogLine<'_>,
    key_id: &str,
    refusal: &Refusal,
) -> axum::response::Response {
    let e = refusal_error(refusal);
    match e.status {
        StatusCode::GATEWAY_TIMEOUT => metrics.refused_504.increment(1),
        _ => metrics.refused_429.increment(1),
    }
    log.refuse(Some(key_id), e)
}

/// `X-Nthpool-Async`: `1`/`true` asks for a job; `0`/`false` (or absent) does not.
pub fn async_requested(headers: &HeaderMap) -> Result<bool, ApiError> {
    match headers.get(&ASYNC).map(|v| v.to_str().map(str::trim)) {
        None => Ok(false),
        Some(Ok("1")) | Some(Ok("true")) => Ok(true),
        Some(Ok("0")) | Some(Ok("false")) => Ok(false),
        Some(_) => Err(ApiError::invalid(
            "X-Nthpool-Async",
            "X-Nthpool-Async must be 1 (or 0)",
        )),
    }
}

/// What a caller of a pool host (a proxied call, a SQL request) asked of admission.
pub struct Plan {
    pub wait_ms: u64,
    pub priority: Priority,
    pub asked_async: bool,
}

/// Reads a pool-host caller's wait budget, priority and async wish (SPEC §3, §6); a job asked
/// for on a pool that takes none is refused here, before any admission.
pub fn plan(
    headers: &HeaderMap,
    concurrency: &ConcurrencySpec,
    async_enabled: bool,
) -> Result<Plan, ApiError> {
    // Most calls send none of the four headers read below: one pass over the (few) names
    // the request has costs less than four lookups by name, each hashing its name (~150
    // instructions apiece, bench/RESULTS.md). Without any of them, every reading below sees
    // what it would see in an empty map, which answers at once.
    let none = HeaderMap::new();
    let asks =
        |k: &http::HeaderName| k == NO_QUEUE || k == QUEUE_TIMEOUT || k == PRIORITY || k == ASYNC;
    let headers = if headers.keys().any(asks) {
        headers
    } else {
        &none
    };
    let wait_ms = wait_budget(headers, concurrency, Caller::Proxy, None)?;
    let priority = priority_from_headers(headers)?;
    let asked_async = async_requested(headers)?;
    if asked_async && !async_enabled {
        return Err(ApiError::new(
            ErrorCode::AsyncDisabled,
            "this pool does not take async jobs (async.enabled = false)",
        ));
    }
    Ok(Plan {
        wait_ms,
        priority,
        asked_async,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn spec(proxy_wait: ProxyWait) -> ConcurrencySpec {
        ConcurrencySpec {
            queue_timeout_ms: 5000,
            proxy_wait,
            ..ConcurrencySpec::default()
        }
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    /// The plan reads each of its headers among others, and defaults without them.
    #[test]
    fn plan_reads_its_headers_among_others() {
        let open = spec(ProxyWait::Open);
        let others = headers(&[("x-nthpool-key", "k"), ("accept", "*/*")]);
        let p = plan(&others, &open, true).unwrap();
        assert_eq!(
            (p.wait_ms, p.priority, p.asked_async),
            (5000, Priority::Normal, false)
        );
        let each = [
            (NO_QUEUE_HEADER, "1"),
            (QUEUE_TIMEOUT_HEADER, "100"),
            (PRIORITY_HEADER, "high"),
            (ASYNC_HEADER, "1"),
        ];
        for (name, value) in each {
            let h = headers(&[("x-nthpool-key", "k"), (name, value), ("accept", "*/*")]);
            let p = plan(&h, &open, true).unwrap();
            let got = (p.wait_ms, p.priority, p.asked_async);
            let want = match name {
                NO_QUEUE_HEADER => (0, Priority::Normal, false),
                QUEUE_TIMEOUT_HEADER => (100, Priority::Normal, false),
                PRIORITY_HEADER => (5000, Priority::High, false),
                _ => (5000, Priority::Normal, true),
            };
            assert_eq!(got, want, "{name}");
        }
        let bad = headers(&[("x-nthpool-key", "k"), (PRIORITY_HEADER, "urgent")]);
        let refused = plan(&bad, &open, true).err().map(|e| e.field);
        assert_eq!(refused, Some(Some("X-Nthpool-Priority".into())));
    }

    #[test]
    fn wait_budget_rules() {
        let open = spec(ProxyWait::Open);
        let ff = spec(ProxyWait::FailFast);
        let none = headers(&[]);
        // Defaults: proxy waits the queue timeout when open; locks fail fast.
        assert_eq!(
            wait_budget(&none, &open, Caller::Proxy, None).unwrap(),
            5000
        );
        assert_eq!(wait_budget(&none, &ff, Caller::Proxy, None).unwrap(), 0);
        assert_eq!(wait_budget(&none, &open, Caller::Lock, None).unwrap(), 0);
        // The header, clamped.
        let h = headers(&[(QUEUE_TIMEOUT_HEADER, "100")]);
        assert_eq!(wait_budget(&h, &open, Caller::Lock, None).unwrap(), 100);
        let h = headers(&[(QUEUE_TIMEOUT_HEADER, "999999")]);
        assert_eq!(wait_budget(&h, &ff, Caller::Proxy, None).unwrap(), 5000);
        // The body beats the header.
        let h = headers(&[(QUEUE_TIMEOUT_HEADER, "100")]);
        assert_eq!(
            wait_budget(&h, &open, Caller::Lock, Some(300)).unwrap(),
            300
        );
        // No-Queue beats everything.
        let h = headers(&[(NO_QUEUE_HEADER, "1"), (QUEUE_TIMEOUT_HEADER, "100")]);
        assert_eq!(wait_budget(&h, &open, Caller::Lock, Some(300)).unwrap(), 0);
        assert_eq!(wait_budget(&h, &open, Caller::Proxy, None).unwrap(), 0);
        // Garbage is a 400 naming the header.
        let h = headers(&[(QUEUE_TIMEOUT_HEADER, "soon")]);
        let e = wait_budget(&h, &open, Caller::Proxy, None).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.field.as_deref(), Some("X-Nthpool-Queue-Timeout-Ms"));
    }

    #[test]
    fn priorities() {
        assert_eq!(
            priority_from_headers(&headers(&[])).unwrap(),
            Priority::Normal
        );
        assert_eq!(
            priority_from_headers(&headers(&[(PRIORITY_HEADER, "HIGH")])).unwrap(),
            Priority::High
        );
        assert!(priority_from_headers(&headers(&[(PRIORITY_HEADER, "urgent")])).is_err());
    }

    #[test]
    fn gate_numbers_from_the_table_and_beyond_it() {
        for n in [0u64, 1, 7, 1023, 1024, 1025, 65_536, u64::MAX] {
            assert_eq!(number_value(n).to_str().unwrap(), n.to_string());
        }
        let mut h = HeaderMap::new();
        write_gate_headers(
            &mut h,
            &GateHeaders {
                remaining_slots: 3,
                effective_limit: 5000,
                rpm_remaining: Some(0),
                queued_ms: 12,
            },
        );
        assert_eq!(h["x-nthpool-remaining-slots"], "3");
        assert_eq!(h["x-nthpool-effective-limit"], "5000");
        assert_eq!(h["x-nthpool-rpm-remaining"], "0");
        assert_eq!(h["x-nthpool-queued-ms"], "12");
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        let gate = GateHeaders {
            remaining_slots: 0,
            effective_limit: 1,
            rpm_remaining: None,
            queued_ms: 0,
        };
        let r = Refusal::TooManyRequests {
            reason: nthbouncer_coord::RefusalReason::Rpm,
            retry_after_ms: Some(1001),
            headers: gate,
        };
        assert_eq!(refusal_error(&r).retry_after_s, Some(2));
        let r = Refusal::TooManyRequests {
            reason: nthbouncer_coord::RefusalReason::Rpm,
            retry_after_ms: Some(0),
            headers: gate,
        };
        assert_eq!(refusal_error(&r).retry_after_s, Some(1));
    }
}
