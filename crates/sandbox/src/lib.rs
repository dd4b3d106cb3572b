//! `nthbouncer sandbox`: a believable local stand-in for a rate-limited
//! origin, so nthbouncer can be tried, tested and benchmarked with no network.
//!
//! This crate owns the sandbox's behaviour: hidden limits (a concurrency
//! limit it never announces and a rolling-minute RPM limit it can announce
//! through OpenAI-style `x-ratelimit-*` headers), configurable latency, and a
//! handful of endpoints that answer like a real API:
//!
//! - `POST /v1/chat/completions`: an OpenAI-shaped completion echoing the
//!   model and a snippet of the last message; `"stream": true` streams
//!   `chat.completion.chunk` events. Any JSON is accepted; bad JSON is a 400.
//! - `/echo` and `/echo/{*rest}` (any method): JSON of what arrived:
//!   `method`, `path`, `query` (raw string, `null` if absent), `headers`
//!   (lower-case name → array of every value), `body` (lossy UTF-8) and
//!   `body_len` (bytes).
//! - `GET /stream?chunks=N&interval_ms=M` (defaults 5 and 100):
//!   `text/event-stream` with N `data: {...}` events M ms apart, then
//!   `data: [DONE]`. The request stays in flight until the stream ends or the
//!   client goes away.
//! - `/status/{code}` (200..=599, any method): answers that status;
//!   `?retry_after=S` / `?retry_after_ms=M` add `Retry-After` /
//!   `retry-after-ms`.
//! - `GET /healthz`: `200 ok`; never limited, delayed or counted. Unknown
//!   paths get a JSON 404 and are not counted either.
//!
//! With `tpm` set, chat completions also meet a hidden tokens-per-minute limit (see
//! `tokens`: prompt words plus `max_tokens`, charged on arrival, over `token_window_ms`),
//! announced with OpenAI's `x-ratelimit-*-tokens` headers.
//!
//! - `POST /v1/messages`: an Anthropic-shaped message; with `input_tpm` / `output_tpm` set,
//!   hidden input- and output-token limits apart, announced with Anthropic's
//!   `anthropic-ratelimit-{input,output}-tokens-*` headers (see `messages`).
//!
//! Refusals are `429` with `{"error":{"type":"rate_limit_error",...}}`,
//! `Retry-After` (whole seconds, at least 1) and `retry-after-ms`. Refused
//! requests answer immediately and never count as in flight; admitted ones
//! are held for the configured latency first. The command-line front end
//! lives in the `nthbouncer` binary crate.

mod config;
mod error;
mod headers;
mod messages;
mod routes;
mod sse;
mod state;
mod tokens;

#[cfg(test)]
mod tests;

use std::future::Future;
use std::sync::Arc;

pub use config::SandboxConfig;
pub use state::{Sandbox, SandboxStats};

/// Serves `sandbox` on `listener` until `shutdown` resolves, then lets
/// in-progress requests (including streams) finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    sandbox: Arc<Sandbox>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, config = ?sandbox.config(), "sandbox listening");
    }
    axum::serve(listener, sandbox.router())
        .with_graceful_shutdown(shutdown)
        .await
}

/// A sandbox with `cfg` on a free loopback port, served in the background until the runtime
/// ends (what tests and benchmarks start as their origin): its state and its base URL.
pub async fn start_on_loopback(cfg: SandboxConfig) -> std::io::Result<(Arc<Sandbox>, String)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let sandbox = Sandbox::new(cfg);
    tokio::spawn(serve(listener, sandbox.clone(), std::future::pending()));
    Ok((sandbox, format!("http://{addr}")))
}
