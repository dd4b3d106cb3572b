//! Time for the coordination layer: the only place that reads a clock or sleeps.
//!
//! Owns the [`Clock`] abstraction and its two implementations: [`SystemClock`] for production and
//! [`ManualClock`] for tests, which moves only when told and wakes sleepers when it does. Nothing
//! else in this crate may call `SystemTime::now`, `Instant::now` or `tokio::time::sleep`
//! directly, so every timing rule can be tested without waiting.
//!
//! A clock gives two readings. **Monotonic** milliseconds (from an arbitrary origin, never
//! stepped) run every deadline kept in process: leases, wait budgets, pauses, RPM windows. A
//! wall-clock step (NTP, an operator's `date`, a VM resumed) must not reclaim every held slot
//! at once or stretch a pause for hours. **Epoch** milliseconds are only for what is shown
//! (a grant's `leaseDeadline`, the pool state) and for records that outlive the process
//! (lease records, jobs, deliveries), which a monotonic origin cannot mean anything to.

// The one module that reads the system clocks (see `clippy.toml`).
#![allow(clippy::disallowed_methods)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio::time::Instant;

/// A source of epoch and monotonic millisecond time that can also wait for either.
pub trait Clock: Send + Sync + 'static {
    /// Epoch milliseconds; never decreases. For what is shown and what is stored.
    fn now_ms(&self) -> u64;
    /// Resolves once `now_ms() >= deadline_ms` (at once if it already is).
    fn sleep_until(&self, deadline_ms: u64) -> Pin<Box<dyn Future<Output = ()> + Send>>;
    /// Milliseconds from an arbitrary origin (fixed for the clock's life); never decreases and
    /// never moves with the wall clock. For every deadline kept in process.
    fn monotonic_ms(&self) -> u64;
    /// Resolves once `monotonic_ms() >= deadline_ms` (at once if it already is).
    fn sleep_until_monotonic(&self, deadline_ms: u64) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// Converts monotonic instant `t` to epoch ms, given both readings of one moment. What is shown
/// follows the wall clock: after a wall step the same monotonic deadline shows the new time.
pub fn monotonic_to_epoch(t: u64, monotonic_now: u64, epoch_now: u64) -> u64 {
    if t >= monotonic_now {
        epoch_now.saturating_add(t - monotonic_now)
    } else {
        epoch_now.saturating_sub(monotonic_now - t)
    }
}

/// Wall-clock time, made non-decreasing: if the system clock steps back, time stands still until
/// it catches up, so epoch times handed out earlier never move into the future again. Monotonic
/// time is tokio's (`Instant`), counted from the clock's creation.
#[derive(Debug)]
pub struct SystemClock {
    last: AtomicU64,
    origin: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock {
            last: AtomicU64::new(0),
            origin: Instant::now(),
        }
    }
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
        // Read first: within a millisecond every reading is the same, and a plain load keeps
        // the shared cache line shared between the connection threads, where a `fetch_max` on
        // every reading (several per request) would take it over from the other core each time.
        let previous = self.last.load(Ordering::Acquire);
        if wall <= previous {
            return previous;
        }
        self.last.fetch_max(wall, Ordering::AcqRel).max(wall)
    }

    fn sleep_until(&self, deadline_ms: u64) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        // Sleep for the remaining duration on tokio's monotonic timer: a wall-clock jump during
        // the sleep shifts the wake-up, but callers re-check the time after waking anyway.
        let remaining = deadline_ms.saturating_sub(self.now_ms());
        Box::pin(tokio::time::sleep(Duration::from_millis(remaining)))
    }

    fn monotonic_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn sleep_until_monotonic(&self, deadline_ms: u64) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        match self.origin.checked_add(Duration::from_millis(deadline_ms)) {
            Some(at) => Box::pin(tokio::time::sleep_until(at)),
            // Past what an `Instant` can express: never, for any practical purpose.
            None => Box::pin(std::future::pending()),
        }
    }
}

/// Both readings of a [`ManualClock`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Readings {
    epoch: u64,
    monotonic: u64,
}

/// A clock for tests: starts with both readings at a given time, and moves only when told.
/// [`ManualClock::advance`] and [`ManualClock::set`] move both readings, as real time passing
/// does; [`ManualClock::step_wall`] moves only the wall clock, as an NTP step would. Sleepers
/// wake as soon as the reading they wait on reaches their deadline.
#[derive(Debug)]
pub struct ManualClock {
    now: watch::Sender<Readings>,
}

impl ManualClock {
    pub fn new(start_ms: u64) -> Self {
        ManualClock {
            now: watch::Sender::new(Readings {
                epoch: start_ms,
                monotonic: start_ms,
            }),
        }
    }

    /// Lets `ms` pass: both readings move forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.now.send_modify(|now| {
            now.epoch = now.epoch.saturating_add(ms);
            now.monotonic = now.monotonic.saturating_add(ms);
        });
    }

    /// Lets time pass until the wall clock reads `ms`; a time in the past is ignored (time never
    /// goes back).
    pub fn set(&self, ms: u64) {
        self.now.send_if_modified(|now| {
            if ms > now.epoch {
                now.monotonic = now.monotonic.saturating_add(ms - now.epoch);
                now.epoch = ms;
                true
            } else {
                false
            }
        });
    }

    /// Steps only the wall clock forward by `ms`, as NTP or an operator would: monotonic time
    /// and its sleepers do not move.
    pub fn step_wall(&self, ms: u64) {
        self.now
            .send_modify(|now| now.epoch = now.epoch.saturating_add(ms));
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now.borrow().epoch
    }

    fn sleep_until(&self, deadline_ms: u64) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let mut rx = self.now.subscribe();
        Box::pin(async move {
            // An error means the clock itself is gone: nobody can advance it any more, so
            // waking is as good as anything and avoids hanging forever.
            let _ = rx.wait_for(|now| now.epoch >= deadline_ms).await;
        })
    }

    fn monotonic_ms(&self) -> u64 {
        self.now.borrow().monotonic
    }

    fn sleep_until_monotonic(&self, deadline_ms: u64) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let mut rx = self.now.subscribe();
        Box::pin(async move {
            // As in `sleep_until`: a gone clock wakes its sleepers.
            let _ = rx.wait_for(|now| now.monotonic >= deadline_ms).await;
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
        assert_eq!(c.monotonic_ms(), 9_000);
        // A wall step moves only the wall clock.
        c.step_wall(3_600_000);
        assert_eq!((c.now_ms(), c.monotonic_ms()), (3_609_000, 9_000));
        c.advance(1);
        assert_eq!((c.now_ms(), c.monotonic_ms()), (3_609_001, 9_001));
    }

    #[tokio::test]
    async fn a_wall_step_wakes_wall_sleepers_only() {
        let c = Arc::new(ManualClock::new(0));
        let wall = tokio::spawn(c.sleep_until(1_000));
        let mono = tokio::spawn(c.sleep_until_monotonic(1_000));
        c.step_wall(1_000);
        wall.await.unwrap();
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert!(!mono.is_finished());
        c.advance(1_000);
        mono.await.unwrap();
    }

    #[test]
    fn monotonic_instants_show_as_epoch_ms_of_the_same_moment() {
        assert_eq!(monotonic_to_epoch(1_500, 1_000, 50_000), 50_500);
        assert_eq!(monotonic_to_epoch(500, 1_000, 50_000), 49_500);
        assert_eq!(monotonic_to_epoch(u64::MAX, 0, 50_000), u64::MAX);
        assert_eq!(monotonic_to_epoch(0, 100_000, 50_000), 0);
    }

    #[tokio::test]
    async fn system_clock_monotonic_sleeps_until_its_deadline() {
        let c = SystemClock::new();
        c.sleep_until_monotonic(0).await;
        let deadline = c.monotonic_ms() + 5;
        c.sleep_until_monotonic(deadline).await;
        assert!(c.monotonic_ms() >= deadline);
        // A deadline no `Instant` can hold does not panic; it just never comes.
        let never = c.sleep_until_monotonic(u64::MAX);
        assert!(tokio::time::timeout(Duration::from_millis(1), never)
            .await
            .is_err());
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
