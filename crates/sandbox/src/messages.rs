//! `POST /v1/messages`: an Anthropic-shaped answer, under hidden input- and output-token
//! limits when `input_tpm` / `output_tpm` are set (each a token bucket refilling over
//! `token_window_ms`, like `tokens`): the prompt's words are charged to the input bucket and
//! `max_tokens` to the output bucket on arrival (both must fit, else a 429), and the output
//! the answer did not use is given back. Answers announce both buckets with Anthropic's
//! `anthropic-ratelimit-{input,output}-tokens-{limit,remaining,reset}` (reset as an RFC 3339
//! instant) and report `usage.input_tokens` / `usage.output_tokens`.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde_json::{json, Value};

use crate::error::{error_response, INVALID_REQUEST, RATE_LIMIT};
use crate::headers::apply_retry_after;
use crate::state::Sandbox;
use crate::tokens::{max_tokens, prompt_words, TokenView};

/// Answers one Anthropic message request.
pub(crate) async fn messages(State(sandbox): State<Arc<Sandbox>>, body: Bytes) -> Response {
    let request: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(err) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                INVALID_REQUEST,
                format!("request body is not valid JSON: {err}"),
            )
        }
    };
    let input = prompt_words(&request);
    let cap = max_tokens(&request);
    let views = match charge(&sandbox, input, cap) {
        Ok(views) => views,
        Err(refused) => return refused,
    };
    let reply = "Sandbox reply";
    let output = cap.min(2);
    let mut resp = Json(json!({
        "id": format!("msg_sandbox_{}", sandbox.next_id()),
        "type": "message",
        "role": "assistant",
        "model": request.get("model").and_then(Value::as_str).unwrap_or("sandbox-model"),
        "content": [{"type": "text", "text": reply}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": input, "output_tokens": output},
    }))
    .into_response();
    if let Some(bucket) = &sandbox.output_tokens {
        bucket.give_back(cap.saturating_sub(output));
    }
    announce(resp.headers_mut(), views);
    resp
}

/// The views of the input and output buckets after a charge, when set.
type Views = (Option<TokenView>, Option<TokenView>);

#[allow(clippy::result_large_err)]
fn charge(sandbox: &Sandbox, input: u64, output: u64) -> Result<Views, Response> {
    let inp = sandbox.input_tokens.as_ref().map(|b| b.charge(input));
    let out = sandbox.output_tokens.as_ref().map(|b| b.charge(output));
    let refused = |which: &str, wait: Duration, views: Views| {
        let message =
            format!("This request would exceed the rate limit for {which} tokens per minute.");
        let mut resp = error_response(StatusCode::TOO_MANY_REQUESTS, RATE_LIMIT, message);
        apply_retry_after(resp.headers_mut(), wait);
        announce(resp.headers_mut(), views);
        resp
    };
    match (inp, out) {
        (Some(Err((wait, v))), out) => {
            // Take back what the other bucket charged.
            let out_view = match out {
                Some(Ok(view)) => {
                    if let Some(b) = &sandbox.output_tokens {
                        b.give_back(output);
                    }
                    Some(view)
                }
                Some(Err((_, view))) => Some(view),
                None => None,
            };
            Err(refused("input", wait, (Some(v), out_view)))
        }
        (inp, Some(Err((wait, v)))) => {
            let in_view = inp.and_then(Result::ok);
            if in_view.is_some() {
                if let Some(b) = &sandbox.input_tokens {
                    b.give_back(input);
                }
            }
            Err(refused("output", wait, (in_view, Some(v))))
        }
        (inp, out) => Ok((inp.and_then(Result::ok), out.and_then(Result::ok))),
    }
}

fn announce(headers: &mut HeaderMap, (input, output): Views) {
    for (part, view) in [("input", input), ("output", output)] {
        let Some(v) = view else { continue };
        let name = |what: &str| {
            HeaderName::try_from(format!("anthropic-ratelimit-{part}-tokens-{what}")).ok()
        };
        let reset = SystemTime::now()
            .checked_add(v.reset)
            .unwrap_or_else(SystemTime::now);
        let pairs = [
            ("limit", HeaderValue::from(v.limit)),
            ("remaining", HeaderValue::from(v.remaining)),
            (
                "reset",
                HeaderValue::from_str(&rfc3339(reset)).unwrap_or(HeaderValue::from_static("")),
            ),
        ];
        for (what, value) in pairs {
            if let Some(n) = name(what) {
                headers.insert(n, value);
            }
        }
    }
}

/// `t` as an RFC 3339 instant in UTC with milliseconds, rounded up (a client that waits
/// for it is never early).
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    let (secs, ms) = (ms / 1000, ms % 1000);
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_in_utc() {
        let t = UNIX_EPOCH + Duration::from_millis(1_704_067_201_500);
        assert_eq!(rfc3339(t), "2024-01-01T00:00:01.500Z");
        let t = UNIX_EPOCH + Duration::from_micros(951_782_400_000_001);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.001Z");
    }
}
