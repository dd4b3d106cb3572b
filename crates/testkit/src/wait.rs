//! Bounded polling: one loop for every wait in the tests, so that a bug fails a test instead of
//! hanging it.

use std::future::Future;
use std::time::Duration;

/// The bound of [`eventually`]: 2,000 polls 5 ms apart (about 10 s).
pub const TRIES: usize = 2000;
/// How often [`eventually`] polls.
pub const EVERY: Duration = Duration::from_millis(5);

/// Calls `f` up to `tries` times, `every` apart, until it returns `Some`; `None` if it never
/// did.
pub async fn poll<T>(
    tries: usize,
    every: Duration,
    mut f: impl AsyncFnMut() -> Option<T>,
) -> Option<T> {
    for _ in 0..tries {
        if let Some(v) = f().await {
            return Some(v);
        }
        tokio::time::sleep(every).await;
    }
    None
}

/// Calls `cond` up to `tries` times, `every` apart, until it holds; whether it did.
pub async fn wait_until(
    tries: usize,
    every: Duration,
    mut cond: impl AsyncFnMut() -> bool,
) -> bool {
    poll(tries, every, async || cond().await.then_some(()))
        .await
        .is_some()
}

/// Polls `f` (bounded, [`TRIES`] × [`EVERY`]) until it returns `Some`; panics naming `what` if
/// it never does.
pub async fn eventually<T>(what: &str, f: impl AsyncFnMut() -> Option<T>) -> T {
    poll(TRIES, EVERY, f)
        .await
        .unwrap_or_else(|| panic!("timed out waiting for {what}"))
}

/// Polls `cond` (bounded, as [`eventually`]) until it holds; panics naming `what` if it never
/// does.
pub async fn until(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    eventually(what, async || cond().await.then_some(())).await
}

/// Awaits `f` for at most 10 s: a hang is a failure naming `what`, never a stuck test (not a
/// timing assertion).
pub async fn bounded<F: Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}
