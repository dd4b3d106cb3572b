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
use crate::core::error::ApiError;
pub(super) use crate::tokens::Charge;
use crate::tokens::{self, Estimate, ReadBody, TokenGate, UsageTap};

/// Estimates the request and waits for the budget, for a pool whose token budget is in force
/// (`TokenGate::active`, which the caller asks first). The body is replaced by what was read
/// of it.
pub(super) async fn admit(
    call: &Call<'_>,
    body: &mut CallBody,
    plan: &Plan,
) -> Result<Charge, ApiError> {
    let gate = &call.pool.tokens;
    // An empty stand-in while the body is read; put back (as read) below.
    let taken = std::mem::replace(body, CallBody::Whole(Bytes::new()));
    let spec = call.pool.spec.tokens.as_ref();
    let max = spec.cloned().unwrap_or_default().max_body_bytes;
    let defaults = tokens::defaults(spec);
    let (read, estimate) = match taken {
        CallBody::Whole(bytes) => {
            let e = tokens::estimate::estimate(&bytes, defaults);
            (CallBody::Whole(bytes), e)
        }
        CallBody::Streamed(incoming)
            if crate::core::extract::content_length(&call.parts.headers) > Some(max) =>
        {
            (CallBody::Streamed(incoming), Estimate::fallback(defaults))
        }
        CallBody::Streamed(incoming) => {
            match tokens::read_body(incoming, usize::try_from(max).unwrap_or(usize::MAX)).await {
                Ok(ReadBody::Whole(bytes)) => {
                    let e = tokens::estimate::estimate(&bytes, defaults);
                    (CallBody::Whole(bytes), e)
                }
                Ok(ReadBody::Partial(read, rest)) => {
                    (CallBody::Partial(read, rest), Estimate::fallback(defaults))
                }
                Err(_) => {
                    return Err(ApiError::invalid(
                        "body",
                        "the request body could not be read",
                    ));
                }
            }
        }
        CallBody::Partial(read, rest) => {
            (CallBody::Partial(read, rest), Estimate::fallback(defaults))
        }
    };
    *body = read;
    match Charge::take(gate, &estimate, plan.priority, plan.wait_ms).await {
        Ok(charge) => {
            call.pool
                .metrics
                .admitted_tokens
                .increment(estimate.total());
            Ok(charge)
        }
        Err(refusal) => Err(tokens::refusal_error(&estimate, refusal)),
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
    let id = charge.as_ref().map(|c| c.id);
    if let Some(window) = outcome.and_then(tokens::window_of) {
        gate.observe(id, window);
    }
    if tokens::announces_split(resp.headers()) {
        tokens::observe_split(gate, id, resp.status().as_u16(), resp.headers());
    }
    let (mut parts, body) = resp.into_parts();
    mark(&mut parts.headers, gate);
    let body = match charge {
        Some(c) => {
            let max = usize::try_from(max).unwrap_or(usize::MAX);
            Body::new(UsageTap::new(body, c, max))
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
