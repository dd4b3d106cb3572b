//! The server's one reader of the monotonic timer, for request deadlines and latencies. It is
//! tokio's, so a test runtime with paused time moves it; admission times, shown times and
//! records use the injected `Clock` instead. `clippy.toml` refuses clock reads anywhere else.
#![allow(clippy::disallowed_methods)]

use std::time::Duration;

use tokio::time::Instant;

/// Now, on the monotonic timer.
pub fn now() -> Instant {
    Instant::now()
}

/// `ms` milliseconds from now, on the monotonic timer.
pub fn deadline_in(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}
