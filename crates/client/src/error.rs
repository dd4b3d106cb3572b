//! The client's one error type: every way a lock call can fail, sorted so that a caller can
//! tell "try again later" (no slot) from "fix your setup" (auth, pool name) from "the gateway
//! is down" (transport) without reading status codes.

use std::time::Duration;

/// Why a lock call failed. More kinds may be added; match with a catch-all arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// `429 too_many_requests`: no free slot (fail-fast, or the queue was full). `retry_after`
    /// is the gateway's `Retry-After` estimate when it sent one.
    #[error("no free slot{}", retry_hint(*.retry_after))]
    NoSlot { retry_after: Option<Duration> },
    /// `504 queue_timeout`: the wait budget was spent and no slot opened. `waited` is the
    /// gateway's `x-nthpool-queued-ms` when it sent one.
    #[error("waited{} and no slot opened", waited_hint(*.waited))]
    QueueTimeout { waited: Option<Duration> },
    /// `401` (missing or invalid key, failed signature) or `403` (IP allowlist miss).
    #[error("unauthorized ({status}): {message}")]
    Unauthorized { status: u16, message: String },
    /// `404`: no pool by that name on the API host. A wrong `Host` header looks the same,
    /// since the gateway routes by host.
    #[error("pool not found (check the pool name, and the API host when connecting by IP)")]
    PoolNotFound,
    /// The gateway could not be reached, or the connection failed mid-call.
    #[error("cannot reach the gateway: {0}")]
    Http(#[source] reqwest::Error),
    /// Any other answer, or a success whose body did not parse.
    #[error("unexpected answer {status}: {body}")]
    Unexpected { status: u16, body: String },
    /// The client was built with a value that cannot be used (bad URL, key or host).
    #[error("invalid client setting: {0}")]
    Config(String),
}

impl LockError {
    /// Whether trying again later may succeed without changing anything: no slot, queue
    /// timeout, or a transport failure.
    #[must_use]
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            LockError::NoSlot { .. } | LockError::QueueTimeout { .. } | LockError::Http(_)
        )
    }
}

impl From<reqwest::Error> for LockError {
    fn from(e: reqwest::Error) -> Self {
        LockError::Http(e)
    }
}

fn retry_hint(d: Option<Duration>) -> String {
    d.map(|d| format!(" (retry after {} ms)", d.as_millis()))
        .unwrap_or_default()
}

fn waited_hint(d: Option<Duration>) -> String {
    d.map(|d| format!(" {} ms", d.as_millis()))
        .unwrap_or_default()
}
