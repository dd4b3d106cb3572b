//! Token budgets (SPEC §12): a pool's tokens-per-minute budget as the serving path sees it.
//! A shared layer beside `pools` and `upstream`: it imports only `core`.
//!
//! - `estimate`: a request's cost in tokens from its JSON body, and the usage an answer reports;
//! - `gate`: the pool's [`TokenGate`] (the governor's pure `TokenBudget`, locked, with waiters
//!   and a wake-up task), shared by every settings version of the pool;
//! - `shared`: with coordination on Redis, the gate's budget is the pool's ledger there, one
//!   for every node; this node keeps its waiters and reports ends and announcements in order;
//! - here: a call's [`Charge`] (taken against the budget for an estimate, taken back if the call
//!   is not sent, settled by its answer) and its refusal as an API error, which proxied calls
//!   and async jobs share; reading a body far enough to estimate it ([`read_body`]), and the
//!   response body wrapper that reconciles the charge with the usage a streamed answer reports
//!   ([`UsageTap`]).

pub mod estimate;
pub mod gate;
mod shared;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use nthbouncer_config::{ConcurrencySpec, TokensSpec};
use nthbouncer_coord::{Outcome, Priority};
use nthbouncer_governor::{TokenPart, TokenSettings, TokenWindow, Usage};

use crate::core::error::{ApiError, ErrorCode};

pub use estimate::{Defaults, Estimate, Method};
pub use gate::{TokenGate, TokenRefusal};

/// The header every answer of a pool with a token budget carries.
pub const TPM_REMAINING_HEADER: &str = "x-nthpool-tpm-remaining";

/// The budget's settings from a pool's `concurrency` and `[pools.tokens]`.
pub fn settings(concurrency: &ConcurrencySpec, tokens: Option<&TokensSpec>) -> TokenSettings {
    let t = tokens.cloned().unwrap_or_default();
    TokenSettings {
        tpm: concurrency.tpm,
        window_ms: t.window_ms.max(1),
        hold_ms: t.hold_ms,
        learn: concurrency.adaptive,
    }
}

/// The estimate's fallbacks from `[pools.tokens]`.
pub fn defaults(tokens: Option<&TokensSpec>) -> Defaults {
    let t = tokens.cloned().unwrap_or_default();
    Defaults {
        output_tokens: t.default_output_tokens,
        cost: t.default_cost,
    }
}

/// Sets `x-nthpool-tpm-remaining` when the pool has a token budget in force.
pub fn mark(headers: &mut http::HeaderMap, gate: &TokenGate) {
    if let Some(remaining) = gate.remaining() {
        headers.insert(TPM_REMAINING_HEADER, http::HeaderValue::from(remaining));
    }
}

/// The token window an upstream outcome announced, if any.
pub fn window_of(outcome: &Outcome) -> Option<TokenWindow> {
    let rate = outcome.rate?;
    let w = TokenWindow {
        limit: rate.token_limit,
        remaining: rate.token_remaining,
        reset_ms: rate.token_reset_ms,
    };
    (w.limit.is_some() || w.remaining.is_some()).then_some(w)
}

/// The estimate of a whole request `body` for a pool with these `[pools.tokens]`: past its
/// `max_body_bytes`, the pool's default cost.
pub fn estimate_whole(body: &[u8], tokens: Option<&TokensSpec>) -> Estimate {
    let max = tokens.cloned().unwrap_or_default().max_body_bytes;
    if u64::try_from(body.len()).unwrap_or(u64::MAX) > max {
        return Estimate::fallback(defaults(tokens));
    }
    estimate::estimate(body, defaults(tokens))
}

/// A call's charge against its pool's token budget. Dropped without [`Charge::refund`] or
/// [`Charge::settle`] (its caller went away while it waited for a slot or for the answer), the
/// call is taken as ended with its estimate standing: never left in flight, where it would be
/// taken off every later announcement.
pub struct Charge {
    pub id: u128,
    pub gate: Arc<TokenGate>,
    done: bool,
}

impl Drop for Charge {
    fn drop(&mut self) {
        if !self.done {
            self.gate.finish(self.id, None);
        }
    }
}

impl Charge {
    /// Waits up to `wait_ms` for the budget to have room for `estimate`, and charges it.
    pub async fn take(
        gate: &Arc<TokenGate>,
        estimate: &Estimate,
        priority: Priority,
        wait_ms: u64,
    ) -> Result<Charge, TokenRefusal> {
        let id = rand::random::<u128>();
        gate.acquire(id, estimate.cost(), priority, wait_ms).await?;
        Ok(Charge {
            id,
            gate: gate.clone(),
            done: false,
        })
    }

    /// The call was not sent: the charge is taken back whole.
    pub fn refund(mut self) {
        self.done = true;
        self.gate.refund(self.id);
    }

    /// The call was answered with this whole `body` (if any was read): its announcement
    /// teaches the budget, and the usage it reports corrects the charge.
    pub fn settle(mut self, outcome: Option<&Outcome>, body: Option<&[u8]>) {
        self.done = true;
        if let Some(window) = outcome.and_then(window_of) {
            self.gate.observe(Some(self.id), window);
        }
        self.gate.finish(self.id, body.and_then(reported_usage));
    }
}

/// The answer to a call the budget refused (`estimate` says what it was charged for).
pub fn refusal_error(estimate: &Estimate, refusal: TokenRefusal) -> ApiError {
    match refusal {
        TokenRefusal::Exceeds {
            estimate: e,
            budget,
        } if e == estimate.total() => ApiError::new(
            ErrorCode::ExceedsTokenBudget,
            format!(
                "the request's estimated {e} tokens ({} prompt + {} output) exceed the pool's \
                 whole token budget of {budget} tokens; it could never be admitted",
                estimate.prompt, estimate.output
            ),
        ),
        // One part of a split budget (the origin announces input and output tokens apart).
        TokenRefusal::Exceeds {
            estimate: e,
            budget,
        } => {
            let part = if e == estimate.output {
                "output"
            } else {
                "input"
            };
            ApiError::new(
                ErrorCode::ExceedsTokenBudget,
                format!(
                    "the request's estimated {e} {part} tokens exceed the origin's whole \
                     {part}-token budget of {budget} tokens; it could never be admitted"
                ),
            )
        }
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
        TokenRefusal::Unavailable { retry_after_ms } => unavailable(retry_after_ms),
    }
}

/// The answer while the shared token budget's Redis is unreachable (fail closed).
pub fn unavailable(retry_after_ms: u64) -> ApiError {
    let mut e = ApiError::new(
        ErrorCode::CoordinationUnavailable,
        "the coordination store holding the pool's token budget is unreachable; nothing was \
         admitted",
    );
    e.retry_after_s = Some(retry_after_ms.div_ceil(1000).max(1));
    e
}

/// A request body read for its estimate: whole, or (past `max` bytes) the part read and the
/// rest still streaming.
pub enum ReadBody<B> {
    Whole(Bytes),
    Partial(Bytes, B),
}

/// Reads up to `max` bytes of `body`. An error of the body itself is returned as is.
pub async fn read_body<B>(mut body: B, max: usize) -> Result<ReadBody<B>, B::Error>
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut buf = BytesMut::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() > max {
                return Ok(ReadBody::Partial(buf.freeze(), body));
            }
        }
    }
    Ok(ReadBody::Whole(buf.freeze()))
}

/// An answer's body on its way to the caller: kept (up to a bound) so that the usage it reports
/// reconciles the request's charge once it has been sent, or when the caller goes away.
pub struct UsageTap<B> {
    inner: B,
    kept: Option<BytesMut>,
    max: usize,
    charge: Option<Charge>,
}

impl<B> UsageTap<B> {
    pub fn new(inner: B, charge: Charge, max: usize) -> Self {
        UsageTap {
            inner,
            kept: Some(BytesMut::new()),
            max,
            charge: Some(charge),
        }
    }

    fn finish(&mut self) {
        if let Some(charge) = self.charge.take() {
            let kept = self.kept.take();
            charge.settle(None, kept.as_deref());
        }
    }
}

/// The usage an answer reports: its JSON body's `usage`, or the last `data:` event of a
/// server-sent stream that carries one.
fn reported_usage(body: &[u8]) -> Option<Usage> {
    if let Some(u) = estimate::usage(body) {
        return Some(u);
    }
    let text = std::str::from_utf8(body).ok()?;
    text.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d.trim()).ok())
        .find_map(|v| estimate::usage_of(&v))
}

/// Whether an answer announces input and output token budgets apart (Anthropic).
pub fn announces_split(headers: &http::HeaderMap) -> bool {
    // Asked of every proxied answer: one walk over the answer's few names (stored lower case)
    // costs less than parsing and hashing both names to look them up.
    headers.keys().any(|name| {
        matches!(
            name.as_str(),
            "anthropic-ratelimit-input-tokens-remaining"
                | "anthropic-ratelimit-output-tokens-remaining"
        )
    })
}

/// Teaches `gate` the input and output budgets an answer to charge `id` announced apart, if
/// it did (an Anthropic origin).
pub fn observe_split(gate: &TokenGate, id: Option<u128>, status: u16, headers: &http::HeaderMap) {
    let now = gate.clock().now_ms();
    for (part, window) in split_windows(status, headers, now) {
        gate.observe_part(id, part, window);
    }
}

/// The input and output token windows of an answer whose origin splits its budget
/// (Anthropic's `anthropic-ratelimit-{input,output}-tokens-*`).
pub fn split_windows(
    status: u16,
    headers: &http::HeaderMap,
    now_ms: u64,
) -> Vec<(TokenPart, TokenWindow)> {
    let pairs = crate::upstream::outcome::rate_header_pairs(headers);
    let report = nthbouncer_ratelimit::parse(status, pairs, now_ms);
    [
        (TokenPart::Input, report.input_tokens),
        (TokenPart::Output, report.output_tokens),
    ]
    .into_iter()
    .filter_map(|(part, w)| {
        let w = w?;
        let window = TokenWindow {
            limit: w.limit,
            remaining: w.remaining,
            reset_ms: w.reset_ms,
        };
        (w.limit.is_some() || w.remaining.is_some()).then_some((part, window))
    })
    .collect()
}

impl<B> Drop for UsageTap<B> {
    fn drop(&mut self) {
        // A body of known length may be dropped once its last byte went out, without a last
        // poll. What was kept tells: a cut JSON body does not parse, so the estimate stands.
        self.finish();
    }
}

impl<B> Body for UsageTap<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(kept)) = (frame.data_ref(), this.kept.as_mut()) {
                    if kept.len() + data.len() > this.max {
                        this.kept = None;
                    } else {
                        kept.extend_from_slice(data);
                    }
                }
            }
            Poll::Ready(None) => this.finish(),
            Poll::Ready(Some(Err(_))) | Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::announces_split;
    use http::{HeaderMap, HeaderValue};

    #[test]
    fn a_split_is_announced_by_either_part_in_any_case() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("text/plain"));
        headers.insert(
            "anthropic-ratelimit-tokens-remaining",
            HeaderValue::from_static("10"),
        );
        assert!(!announces_split(&headers));
        for name in [
            "Anthropic-RateLimit-Input-Tokens-Remaining",
            "anthropic-ratelimit-output-tokens-remaining",
        ] {
            let mut split = headers.clone();
            let name = http::HeaderName::from_bytes(name.as_bytes()).expect("a valid name");
            split.insert(name, HeaderValue::from_static("5"));
            assert!(announces_split(&split));
        }
    }
}
