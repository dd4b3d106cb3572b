//! Shared sandbox state: request counters, exact in-flight accounting and the
//! rolling RPM window, plus the admission decision that ties them together.
//!
//! Admission (concurrency check, RPM check, and the in-flight increment) runs
//! under one small mutex so two requests can never both take the last slot.
//! Releasing a slot is a lock-free decrement done by [`InFlightGuard`]'s
//! `Drop`, so a slot is freed however the request ends: answered, streamed to
//! completion, or abandoned by a client that hung up.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::Rng;
use serde::Serialize;

use crate::config::SandboxConfig;

/// Length of the rolling window the RPM limit is counted over.
pub(crate) const RPM_WINDOW: Duration = Duration::from_secs(60);

/// A point-in-time copy of the sandbox's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SandboxStats {
    /// Requests that reached a governed endpoint (everything except
    /// `/healthz` and unknown paths), admitted or not.
    pub requests: u64,
    /// Governed requests answered with a 2xx status.
    pub ok: u64,
    /// Governed requests answered with 429: the hidden limits' refusals plus
    /// any explicit `/status/429`.
    pub throttled: u64,
    /// Highest number of requests ever in flight at once.
    pub max_in_flight: u64,
    /// Requests currently in flight (admitted and not yet finished).
    pub in_flight: u64,
}

/// A local stand-in for a rate-limited origin. Build it with
/// [`Sandbox::new`], then mount [`Sandbox::router`] or run [`crate::serve`].
#[derive(Debug)]
pub struct Sandbox {
    cfg: SandboxConfig,
    /// The RPM window length; 60 s in real use, shortened by unit tests so
    /// recovery can be observed without waiting a minute.
    window_len: Duration,
    requests: AtomicU64,
    ok: AtomicU64,
    throttled: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    next_id: AtomicU64,
    /// Admission times of accepted requests still inside the RPM window,
    /// oldest first. Also serialises admission (see module docs).
    window: Mutex<VecDeque<Instant>>,
    /// The hidden token limit, when `tpm` is set.
    pub(crate) tokens: Option<crate::tokens::TokenBucket>,
    /// The hidden input- and output-token limits of `/v1/messages`, when set.
    pub(crate) input_tokens: Option<crate::tokens::TokenBucket>,
    pub(crate) output_tokens: Option<crate::tokens::TokenBucket>,
}

/// What `x-ratelimit-*-requests` headers should say for one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RateView {
    pub(crate) limit: u32,
    pub(crate) remaining: u32,
    /// Time until the oldest request in the window ages out, i.e. until
    /// `remaining` next goes up. Zero when the window is empty.
    pub(crate) reset: Duration,
}

/// Which hidden limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RefusalKind {
    Concurrency,
    Rpm { used: u32 },
}

/// A refused request: what to tell the client.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Refusal {
    pub(crate) kind: RefusalKind,
    pub(crate) retry_after: Duration,
    pub(crate) rate: Option<RateView>,
}

/// An admitted request: it holds a slot until the guard is dropped.
#[derive(Debug)]
pub(crate) struct Admission {
    pub(crate) guard: InFlightGuard,
    pub(crate) rate: Option<RateView>,
}

/// Holds one in-flight slot; dropping it frees the slot.
#[derive(Debug)]
pub(crate) struct InFlightGuard {
    sandbox: Arc<Sandbox>,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.sandbox.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Sandbox {
    /// Creates a sandbox with the given hidden limits and latency.
    pub fn new(cfg: SandboxConfig) -> Arc<Self> {
        Self::with_window(cfg, RPM_WINDOW)
    }

    /// Like [`Sandbox::new`] but with a custom RPM window length, so tests can
    /// watch the window free up without waiting a real minute.
    pub(crate) fn with_window(cfg: SandboxConfig, window_len: Duration) -> Arc<Self> {
        let bucket = |tpm: u64| {
            (tpm > 0).then(|| {
                crate::tokens::TokenBucket::new(tpm, Duration::from_millis(cfg.token_window_ms))
            })
        };
        let (tokens, input_tokens, output_tokens) = (
            bucket(cfg.tpm),
            bucket(cfg.input_tpm),
            bucket(cfg.output_tpm),
        );
        Arc::new(Self {
            cfg,
            window_len,
            requests: AtomicU64::new(0),
            ok: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            window: Mutex::new(VecDeque::new()),
            tokens,
            input_tokens,
            output_tokens,
        })
    }

    /// The configuration this sandbox was built with.
    pub fn config(&self) -> &SandboxConfig {
        &self.cfg
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SandboxStats {
        SandboxStats {
            requests: self.requests.load(Ordering::Relaxed),
            ok: self.ok.load(Ordering::Relaxed),
            throttled: self.throttled.load(Ordering::Relaxed),
            max_in_flight: self.max_in_flight.load(Ordering::Acquire),
            in_flight: self.in_flight.load(Ordering::Acquire),
        }
    }

    /// Decides whether a governed request may proceed, counting it either way.
    pub(crate) fn admit(self: &Arc<Self>) -> Result<Admission, Refusal> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let mut window = self.window.lock();
        prune(&mut window, now, self.window_len);

        // RPM is checked first: when both limits are hit, the RPM refusal is
        // the more informative one (its Retry-After is exact).
        if self.cfg.rpm > 0 && window.len() >= self.cfg.rpm as usize {
            let retry_after = window.front().map_or(Duration::ZERO, |oldest| {
                time_left(*oldest, now, self.window_len)
            });
            let used = u32::try_from(window.len()).unwrap_or(u32::MAX);
            return Err(Refusal {
                kind: RefusalKind::Rpm { used },
                retry_after,
                rate: self.rate_view(&window, now),
            });
        }

        // Increments only ever happen here, under the window lock, so this
        // check-then-increment cannot overshoot `limit`. Concurrent
        // decrements can only make the check more conservative.
        let current = self.in_flight.load(Ordering::Acquire);
        if self.cfg.limit > 0 && current >= u64::from(self.cfg.limit) {
            return Err(Refusal {
                kind: RefusalKind::Concurrency,
                retry_after: self.concurrency_retry_hint(),
                rate: self.rate_view(&window, now),
            });
        }

        if self.cfg.rpm > 0 {
            window.push_back(now);
        }
        let now_in_flight = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        self.max_in_flight
            .fetch_max(now_in_flight, Ordering::AcqRel);
        let rate = self.rate_view(&window, now);
        drop(window);

        Ok(Admission {
            guard: InFlightGuard {
                sandbox: Arc::clone(self),
            },
            rate,
        })
    }

    /// Counts a governed answer by the status actually sent.
    pub(crate) fn record_status(&self, status: u16) {
        if (200..300).contains(&status) {
            self.ok.fetch_add(1, Ordering::Relaxed);
        } else if status == 429 {
            self.throttled.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A fresh id for chat completion responses.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// How long to hold an admitted request: fixed latency plus uniform jitter.
    pub(crate) fn latency(&self) -> Duration {
        let jitter = if self.cfg.latency_jitter_ms > 0 {
            rand::thread_rng().gen_range(0..=self.cfg.latency_jitter_ms)
        } else {
            0
        };
        Duration::from_millis(self.cfg.latency_ms.saturating_add(jitter))
    }

    /// The sandbox cannot know when a concurrency slot frees, so it suggests
    /// the typical request duration, as an origin with a fixed service time
    /// would.
    fn concurrency_retry_hint(&self) -> Duration {
        let typical = self
            .cfg
            .latency_ms
            .saturating_add(self.cfg.latency_jitter_ms / 2);
        Duration::from_millis(typical.max(1))
    }

    fn rate_view(&self, window: &VecDeque<Instant>, now: Instant) -> Option<RateView> {
        if !self.cfg.announce || self.cfg.rpm == 0 {
            return None;
        }
        let used = u32::try_from(window.len()).unwrap_or(u32::MAX);
        Some(RateView {
            limit: self.cfg.rpm,
            remaining: self.cfg.rpm.saturating_sub(used),
            reset: window.front().map_or(Duration::ZERO, |oldest| {
                time_left(*oldest, now, self.window_len)
            }),
        })
    }
}

/// Drops admission times that have left the rolling window.
fn prune(window: &mut VecDeque<Instant>, now: Instant, window_len: Duration) {
    while let Some(oldest) = window.front() {
        if now.saturating_duration_since(*oldest) >= window_len {
            window.pop_front();
        } else {
            break;
        }
    }
}

/// Time until an entry admitted at `at` leaves the window.
fn time_left(at: Instant, now: Instant, window_len: Duration) -> Duration {
    window_len.saturating_sub(now.saturating_duration_since(at))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn cfg(limit: u32, rpm: u32) -> SandboxConfig {
        SandboxConfig {
            limit,
            rpm,
            latency_ms: 0,
            latency_jitter_ms: 0,
            announce: true,
            tpm: 0,
            token_window_ms: 60_000,
            input_tpm: 0,
            output_tpm: 0,
        }
    }

    #[test]
    fn concurrency_slots_are_exact_and_freed_on_drop() {
        let sb = Sandbox::new(cfg(2, 0));
        let a = sb.admit().unwrap();
        let b = sb.admit().unwrap();
        let refused = sb.admit().unwrap_err();
        assert_eq!(refused.kind, RefusalKind::Concurrency);
        assert!(refused.retry_after >= Duration::from_millis(1));
        assert_eq!(sb.stats().in_flight, 2);
        drop(a);
        assert_eq!(sb.stats().in_flight, 1);
        let c = sb.admit().unwrap();
        drop((b, c));
        let stats = sb.stats();
        assert_eq!(stats.in_flight, 0);
        assert_eq!(stats.max_in_flight, 2);
        assert_eq!(stats.requests, 4);
    }

    #[test]
    fn rpm_window_refuses_then_frees() {
        let sb = Sandbox::with_window(cfg(0, 2), Duration::from_millis(50));
        let first = sb.admit().unwrap();
        assert_eq!(first.rate.map(|r| r.remaining), Some(1));
        let second = sb.admit().unwrap();
        assert_eq!(second.rate.map(|r| r.remaining), Some(0));
        let refused = sb.admit().unwrap_err();
        assert_eq!(refused.kind, RefusalKind::Rpm { used: 2 });
        assert!(refused.retry_after <= Duration::from_millis(50));
        assert_eq!(refused.rate.map(|r| r.remaining), Some(0));
        std::thread::sleep(Duration::from_millis(60));
        assert!(sb.admit().is_ok());
    }

    #[test]
    fn no_rate_view_without_rpm_or_announce() {
        let sb = Sandbox::new(cfg(0, 0));
        assert!(sb.admit().unwrap().rate.is_none());
        let quiet = Sandbox::new(SandboxConfig {
            announce: false,
            tpm: 0,
            token_window_ms: 60_000,
            input_tpm: 0,
            output_tpm: 0,
            ..cfg(0, 5)
        });
        assert!(quiet.admit().unwrap().rate.is_none());
    }

    #[test]
    fn latency_stays_within_jitter_bounds() {
        let sb = Sandbox::new(SandboxConfig {
            latency_ms: 10,
            latency_jitter_ms: 5,
            ..cfg(0, 0)
        });
        for _ in 0..200 {
            let d = sb.latency();
            assert!(d >= Duration::from_millis(10) && d <= Duration::from_millis(15));
        }
    }
}
