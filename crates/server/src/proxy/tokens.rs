//! Token-budget admission of a proxied request (SPEC §12): before the slot, a pool with a token
//! budget reads the request's body (up to `tokens.max_body_bytes`), estimates its cost and
//! waits, within the request's wait budget, until the budget has room for it. The charge
//! travels with the call: taken back if the slot gate then refuses, corrected by the usage the
//! answer reports once it has been sent.

use std::sync::Arc;

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body::Frame;
use hyper::body::Incoming;

use super::{Call, CallBody};
use crate::core::admission::Plan;
use crate::core::error::{ApiError, ErrorCode};
use crate::tokens::{self, Estimate, ReadBody, TokenGate, TokenRefusal, UsageTap};

/// A request's charge against its pool's token budget.
pub(super) struct Charge {
    pub id: u128,
    pub gate: Arc<TokenGate>,
}

/// Estimates the request and waits for the budget. `Ok((body, None))` when the pool has no
/// token budget in force (its body untouched).
pub(super) async fn admit(
    call: &Call<'_>,
    body: CallBody,
    plan: &Plan,
) -> Result<(CallBody, Option<Charge>), (CallBody, ApiError)> {
    let gate = &call.pool.tokens;
    if !gate.active() {
        return Ok((body, None));
    }
    let spec = call.pool.spec.tokens.as_ref();
    let max = spec.cloned().unwrap_or_default().max_body_bytes;
    let defaults = tokens::defaults(spec);
    let (body, estimate) = match body {
        CallBody::Whole(bytes) => {
            let e = tokens::estimate::estimate(&bytes, defaults);
            (CallBody::Whole(bytes), e)
        }
        CallBody::Streamed(incoming) if content_length(&call.parts.headers) > Some(max) => {
            (CallBody::Streamed(incoming), fallback(defaults))
        }
        CallBody::Streamed(incoming) => {
            match tokens::read_body(incoming, usize::try_from(max).unwrap_or(usize::MAX)).await {
                Ok(ReadBody::Whole(bytes)) => {
                    let e = tokens::estimate::estimate(&bytes, defaults);
                    (CallBody::Whole(bytes), e)
                }
                Ok(ReadBody::Partial(read, rest)) => {
                    (CallBody::Partial(read, rest), fallback(defaults))
                }
                Err(_) => {
                    let e = ApiError::invalid("body", "the request body could not be read");
                    return Err((CallBody::Whole(Bytes::new()), e));
                }
            }
        }
        CallBody::Partial(read, rest) => (CallBody::Partial(read, rest), fallback(defaults)),
    };
    let id = rand::random::<u128>();
    let cost = estimate.total();
    match gate.acquire(id, cost, plan.priority, plan.wait_ms).await {
        Ok(_) => {
            call.pool.metrics.admitted_tokens.increment(cost);
            let charge = Charge {
                id,
                gate: gate.clone(),
            };
            Ok((body, Some(charge)))
        }
        Err(refusal) => Err((body, refusal_error(&estimate, refusal))),
    }
}

fn fallback(defaults: tokens::Defaults) -> Estimate {
    Estimate {
        prompt: defaults.cost,
        output: 0,
        method: tokens::Method::Default,
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The answer to a request the budget refused.
fn refusal_error(estimate: &Estimate, refusal: TokenRefusal) -> ApiError {
    match refusal {
        TokenRefusal::Exceeds {
            estimate: e,
            budget,
        } => ApiError::new(
            ErrorCode::ExceedsTokenBudget,
            format!(
                "the request's estimated {e} tokens ({} prompt + {} output) exceed the pool's \
                 whole token budget of {budget} tokens; it could never be admitted",
                estimate.prompt, estimate.output
            ),
        ),
        TokenRefusal::NoRoom { retry_after_ms } => {
            let mut e = ApiError::new(
                ErrorCode::TooManyRequests,
                "the pool's token budget has no room for this request now",
            );
            e.retry_after_s = retry_after_ms.map(|ms| ms.div_ceil(1000).max(1));
            e
        }
        TokenRefusal::Timeout => ApiError::new(
            ErrorCode::QueueTimeout,
            "the wait budget ran out before the pool's token budget had room",
        ),
    }
}

/// Sets `x-nthpool-tpm-remaining` when the pool has a token budget in force.
pub(super) fn mark(headers: &mut HeaderMap, gate: &TokenGate) {
    tokens::mark(headers, gate);
}

/// After the answer's head: the origin's token announcement teaches the budget, and the body
/// is tapped for the usage it reports.
pub(super) fn answered(
    charge: Option<Charge>,
    outcome: Option<&nthbouncer_coord::Outcome>,
    gate: &Arc<TokenGate>,
    resp: Response<Body>,
    max: u64,
) -> Response<Body> {
    if let Some(window) = outcome.and_then(tokens::window_of) {
        gate.observe(charge.as_ref().map(|c| c.id), window);
    }
    let (mut parts, body) = resp.into_parts();
    mark(&mut parts.headers, gate);
    let body = match charge {
        Some(c) => {
            let max = usize::try_from(max).unwrap_or(usize::MAX);
            Body::new(UsageTap::new(body, c.gate, c.id, max))
        }
        None => body,
    };
    Response::from_parts(parts, body)
}

/// The body of a request read partly for its estimate: what was read, then the rest.
pub(super) fn rejoin(read: Bytes, rest: Incoming) -> Body {
    Body::new(Chain {
        head: Some(read),
        rest,
    })
}

struct Chain {
    head: Option<Bytes>,
    rest: Incoming,
}

impl http_body::Body for Chain {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.rest.is_end_stream()
    }
}
