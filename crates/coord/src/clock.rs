//! Time for the coordination layer: the only place that reads a clock or sleeps.
//!
//! Owns the [`Clock`] abstraction and its two implementations: [`SystemClock`] for production and
//! [`ManualClock`] for tests, which moves only when told and wakes sleepers when it does. Nothing
//! else in this crate may call `SystemTime::now`, `Instant::now` or `tokio::time::sleep`
//! directly, so every timing rule can be tested without waiting.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

/// A source of epoch-millisecond time that can also wait for a given time.
pub trait Clock: Send + Sync + 'static {
    /// Epoch milliseconds; never decreases.
    fn now_ms(&self) -> u64;
    /// Resolves once `now_ms() >= deadline_ms` (at once if it already is).
    fn sleep_until(&self, deadline_ms: u64) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// Wall-clock time, made non-decreasing: if the system clock steps back, time stands still until
/// it catches up, so deadlines handed out earlier never move into the future again.
#[derive(Debug, Default)]
pub struct SystemClock {
    last: AtomicU64,
}

impl SystemClock {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        // Before 1970 counts as 0; later than u64 ms is not a concern.
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let previous = self.last.fetch_max(wall, Ordering::AcqRel);
        previous.max(wall)
    }

    fn sleep_until(&self, deadline_ms: u64) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        // Sleep for the remaining duration on tokio's monotonic timer: a wall-clock jump during
        // the sleep shifts the wake-up, but callers re-check the time after waking anyway.
        let remaining = deadline_ms.saturating_sub(self.now_ms());
        Box::pin(tokio::time::sleep(Duration::from_millis(remaining)))
    }
}

/// A clock for tests: starts at a given time and moves only through [`ManualClock::advance`] and
/// [`ManualClock::set`]. Sleepers wake as soon as the clock reaches their deadline.
#[derive(Debug)]
pub struct ManualClock {
    now: watch::Sender<u64>,
}

impl ManualClock {
    pub fn new(start_ms: u64) -> Self {
        ManualClock {
            now: watch::Sender::new(start_ms),
        }
    }

    /// Moves the clock forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.now.send_modify(|now| *now = now.saturating_add(ms));
    }

    /// Moves the clock to `ms`; a time in the past is ignored (the clock never goes back).
    pub fn set(&self, ms: u64) {
        self.now.send_if_modified(|now| {
            if ms > *now {
                *now = ms;
                true
            } else {
                false
            }
        });
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        *self.now.borrow()
    }

    fn sleep_until(&self, deadline_ms: u64) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let mut rx = self.now.subscribe();
        Box::pin(async move {
            // An error means the clock itself is gone: nobody can advance it any more, so
            // waking is as good as anything and avoids hanging forever.
            let _ = rx.wait_for(|&now| now >= deadline_ms).await;
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn system_clock_is_epoch_ms_and_never_decreases() {
        let c = SystemClock::new();
        let a = c.now_ms();
        // 2020-01-01 in epoch ms: a sanity bound that we are in milliseconds, not seconds.
        assert!(a > 1_577_836_800_000);
        // Pretend an earlier reading was later than the wall clock (as after a clock step back).
        c.last.store(a + 60_000, Ordering::Release);
        assert_eq!(c.now_ms(), a + 60_000);
    }

    #[tokio::test]
    async fn system_clock_sleeps_for_the_remaining_time() {
        let c = SystemClock::new();
        // A deadline in the past resolves at once; a tiny one resolves after it.
        c.sleep_until(0).await;
        let deadline = c.now_ms() + 5;
        c.sleep_until(deadline).await;
        assert!(c.now_ms() >= deadline);
    }

    #[test]
    fn manual_clock_moves_only_forward() {
        let c = ManualClock::new(1_000);
        assert_eq!(c.now_ms(), 1_000);
        c.advance(500);
        assert_eq!(c.now_ms(), 1_500);
        c.set(1_200);
        assert_eq!(c.now_ms(), 1_500);
        c.set(9_000);
        assert_eq!(c.now_ms(), 9_000);
    }

    #[tokio::test]
    async fn manual_sleep_resolves_when_the_clock_reaches_the_deadline() {
        let c = Arc::new(ManualClock::new(0));
        let sleeper = tokio::spawn(c.sleep_until(1_000));
        c.advance(999);
        // Give the sleeper ample turns to (wrongly) wake.
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert!(!sleeper.is_finished());
        c.advance(1);
        sleeper.await.unwrap();
        // Already past: resolves at once.
        c.sleep_until(500).await;
    }
}
