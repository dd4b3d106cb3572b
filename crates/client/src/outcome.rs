//! The outcome report sent on release: what the upstream answered while the slot was held.
//! It feeds the pool's adaptive learning (a 429 shrinks the limit and pauses admission, a
//! spent budget pauses it), so its JSON shape is exactly the release body of the lock API.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Rate-limit headers copied raw into [`Outcome::headers`]: every name a dialect understood by
/// the gateway starts with one of these (lower case, as `http` stores names).
const RATE_HEADER_PREFIXES: [&str; 4] = [
    "x-ratelimit-",
    "anthropic-ratelimit-",
    "ratelimit",
    "retry-after",
];

/// An upstream outcome, serialised as the lock API's release body.
///
/// Every field is optional; absent fields are left out of the JSON so that the gateway can
/// derive them (for example `throttled` from the raw `headers`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Outcome {
    /// Final upstream HTTP status (100-599).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// How many upstream `429`s were observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttled: Option<u32>,
    /// The upstream's retry hint, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// Pre-parsed rate fields; the gateway prefers them over `headers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    /// Raw upstream response headers for the gateway to parse (`x-ratelimit-*` and the like),
    /// each name with its values in order.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, Vec<String>>,
}

/// Pre-parsed rate fields of an [`Outcome`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_remaining: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_reset_ms: Option<u64>,
}

impl Outcome {
    /// Just a status; a `429` also counts one throttle.
    #[must_use]
    pub fn from_status(status: u16) -> Outcome {
        Outcome {
            status: Some(status),
            throttled: (status == 429).then_some(1),
            ..Outcome::default()
        }
    }

    /// The outcome of one upstream response: its status, its rate-limit headers copied raw
    /// (the gateway parses every dialect it knows), and its retry hint in milliseconds.
    ///
    /// The retry hint is read only on error answers (400 and up), as the gateway does: on a
    /// redirect, `Retry-After` is about that redirect and must not pause a whole pool.
    /// `retry-after-ms` wins over `Retry-After`, being more precise. `throttled` is `1` on a
    /// `429` and otherwise left for the gateway to derive from the headers (GitHub answers a
    /// spent budget with `403`).
    #[must_use]
    pub fn from_response(status: u16, headers: &http::HeaderMap) -> Outcome {
        let mut outcome = Outcome::from_status(status);
        for (name, value) in headers {
            let name = name.as_str();
            if !RATE_HEADER_PREFIXES.iter().any(|p| name.starts_with(p)) {
                continue;
            }
            // A value that is not visible ASCII cannot be a rate figure; skip it.
            if let Ok(value) = value.to_str() {
                outcome
                    .headers
                    .entry(name.to_owned())
                    .or_default()
                    .push(value.to_owned());
            }
        }
        if status >= 400 {
            outcome.retry_after_ms = retry_after_ms(headers, now_ms());
        }
        outcome
    }

    /// The JSON release body.
    pub(crate) fn to_body(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }
}

/// `retry-after-ms` (milliseconds, fractions rounded up) or else `Retry-After` (seconds or an
/// HTTP-date, read by the same parser as the gateway's).
fn retry_after_ms(headers: &http::HeaderMap, now_ms: u64) -> Option<u64> {
    let first = |name: &str| {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find_map(|v| Some(v.trim()).filter(|v| !v.is_empty()))
    };
    first("retry-after-ms").and_then(parse_ms).or_else(|| {
        first("retry-after").and_then(|v| nthbouncer_ratelimit::parse_retry_after(v, now_ms))
    })
}

/// A non-negative decimal number of milliseconds, rounded up to a whole millisecond.
fn parse_ms(value: &str) -> Option<u64> {
    let ms: f64 = value.parse().ok()?;
    if !ms.is_finite() || ms < 0.0 || ms > u64::MAX as f64 {
        return None;
    }
    // Finite and in range (checked above), so the cast is exact up to the rounding we want.
    Some(ms.ceil() as u64)
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use http::{HeaderMap, HeaderValue};

    #[test]
    fn from_status_serialises_as_the_release_body() {
        let ok = serde_json::to_value(Outcome::from_status(200)).unwrap();
        assert_eq!(ok, serde_json::json!({"status": 200}));
        let throttled = serde_json::to_value(Outcome::from_status(429)).unwrap();
        assert_eq!(
            throttled,
            serde_json::json!({"status": 429, "throttled": 1})
        );
    }

    #[test]
    fn every_field_has_its_wire_name() {
        let outcome = Outcome {
            status: Some(429),
            throttled: Some(2),
            retry_after_ms: Some(2000),
            rate: Some(Rate {
                limit: Some(60),
                remaining: Some(0),
                reset_ms: Some(1000),
                token_limit: Some(1),
                token_remaining: Some(2),
                token_reset_ms: Some(3),
            }),
            headers: BTreeMap::from([("retry-after".to_owned(), vec!["2".to_owned()])]),
        };
        assert_eq!(
            serde_json::to_value(&outcome).unwrap(),
            serde_json::json!({
                "status": 429, "throttled": 2, "retryAfterMs": 2000,
                "rate": {"limit": 60, "remaining": 0, "resetMs": 1000,
                         "tokenLimit": 1, "tokenRemaining": 2, "tokenResetMs": 3},
                "headers": {"retry-after": ["2"]},
            })
        );
    }

    #[test]
    fn from_response_copies_rate_headers_only() {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/json"));
        h.insert(
            "x-ratelimit-remaining-requests",
            HeaderValue::from_static("0"),
        );
        h.append("ratelimit-policy", HeaderValue::from_static("10;w=1"));
        h.append("ratelimit-policy", HeaderValue::from_static("100;w=60"));
        h.insert("set-cookie", HeaderValue::from_static("secret"));
        let o = Outcome::from_response(200, &h);
        assert_eq!(o.status, Some(200));
        assert_eq!(o.throttled, None);
        assert_eq!(o.retry_after_ms, None);
        assert_eq!(
            o.headers,
            BTreeMap::from([
                (
                    "ratelimit-policy".to_owned(),
                    vec!["10;w=1".to_owned(), "100;w=60".to_owned()]
                ),
                (
                    "x-ratelimit-remaining-requests".to_owned(),
                    vec!["0".to_owned()]
                ),
            ])
        );
    }

    #[test]
    fn retry_hints_are_read_on_errors_only() {
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("3"));
        let o = Outcome::from_response(429, &h);
        assert_eq!((o.throttled, o.retry_after_ms), (Some(1), Some(3000)));
        assert_eq!(o.headers["retry-after"], vec!["3".to_owned()]);
        assert_eq!(Outcome::from_response(503, &h).retry_after_ms, Some(3000));
        assert_eq!(Outcome::from_response(301, &h).retry_after_ms, None);

        h.insert("retry-after-ms", HeaderValue::from_static("1500.5"));
        assert_eq!(Outcome::from_response(429, &h).retry_after_ms, Some(1501));
        h.insert("retry-after-ms", HeaderValue::from_static("-1"));
        assert_eq!(Outcome::from_response(429, &h).retry_after_ms, Some(3000));
        h.insert("retry-after", HeaderValue::from_static("soon"));
        assert_eq!(Outcome::from_response(429, &h).retry_after_ms, None);
    }

    #[test]
    fn http_date_retry_after_is_relative_to_now() {
        let mut h = HeaderMap::new();
        h.insert(
            "retry-after",
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        // A date in the past means "now".
        assert_eq!(Outcome::from_response(429, &h).retry_after_ms, Some(0));
    }
}
