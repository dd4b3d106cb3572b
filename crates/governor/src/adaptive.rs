//! Adaptive learning: what the upstream's answers teach us about its real limits.
//!
//! Owns the learned concurrency limit, the learned RPM, the admission pause and the record of the
//! last throttle. Its interface is deliberately small — [`Adaptive::observe`] in, a few getters
//! out — so the learning rules can be refined without touching admission. It never admits,
//! queues or frees anything; the [`crate::Governor`] reads the effective limit and the pause from
//! here and applies them.
//!
//! Rules (basic version, SPEC §3 "Adaptive learning"):
//! - throttle = status 429, or `throttled > 0`, or status 503 with a retry hint;
//! - on throttle: multiplicative decrease (halve the effective limit, never below `min_limit`) at
//!   most once per pause period, and pause admission for the hint (1 s without one);
//! - a rate report saying a budget is spent (`remaining == 0` with a reset time) pauses until the
//!   reset;
//! - additive increase: after `effective limit` consecutive successes the learned limit grows by
//!   one; reaching the configured limit forgets it.
//!
//! The learned RPM is part of the interface but this version does not learn one yet (a rate
//! header's window length is not known here); exhausted request budgets are handled by pausing.

use crate::{Outcome, PoolSettings, Throttle};

/// Pause after a throttle that carried no retry hint, and the shortest spacing between two
/// decreases (so a burst of 429s with `Retry-After: 0` still decreases only once).
pub(crate) const DEFAULT_PAUSE_MS: u64 = 1_000;

/// Longest pause any single report can impose. Hints come from upstreams and from lock callers'
/// release reports; a bogus hint must not freeze a pool for days. A longer real limit simply
/// re-pauses on the next throttle.
pub(crate) const MAX_PAUSE_MS: u64 = 15 * 60_000;

/// The configured range the learned limit lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) limit: u32,
    /// Already clamped to `limit`.
    pub(crate) min_limit: u32,
}

impl Bounds {
    pub(crate) fn of(settings: &PoolSettings) -> Self {
        Bounds {
            limit: settings.limit,
            min_limit: settings.min_limit.min(settings.limit),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Adaptive {
    /// `None` means "no lower than configured". Always `< limit` and `>= min_limit` when set.
    learned_limit: Option<u32>,
    learned_rpm: Option<u32>,
    /// Consecutive successes since the last change of the learned limit or the last throttle.
    successes: u32,
    paused_until: Option<u64>,
    /// A throttle before this instant does not decrease the limit again: it belongs to the same
    /// burst as the one that already did.
    no_decrease_before: u64,
    last_throttle: Option<Throttle>,
}

impl Adaptive {
    pub(crate) fn effective_limit(&self, b: Bounds) -> u32 {
        self.learned_limit
            .map_or(b.limit, |l| l.min(b.limit))
            .max(b.min_limit)
    }

    pub(crate) fn learned_limit(&self) -> Option<u32> {
        self.learned_limit
    }

    pub(crate) fn learned_rpm(&self) -> Option<u32> {
        self.learned_rpm
    }

    /// The end of the admission pause, if admission is paused at `now`.
    pub(crate) fn paused_until(&self, now: u64) -> Option<u64> {
        self.paused_until.filter(|&until| until > now)
    }

    pub(crate) fn last_throttle(&self) -> Option<&Throttle> {
        self.last_throttle.as_ref()
    }

    /// Learns from one upstream outcome.
    pub(crate) fn observe(&mut self, now: u64, outcome: &Outcome, b: Bounds) {
        let mut causes: Vec<String> = Vec::new();

        let throttled = outcome.status == Some(429)
            || outcome.throttled > 0
            || (outcome.status == Some(503) && outcome.retry_after_ms.is_some());
        if throttled {
            let pause_ms = outcome
                .retry_after_ms
                .unwrap_or(DEFAULT_PAUSE_MS)
                .min(MAX_PAUSE_MS);
            let until = now.saturating_add(pause_ms);
            self.pause(until);
            if now >= self.no_decrease_before {
                let halved = self.effective_limit(b) / 2;
                self.set_learned(halved, b);
                self.no_decrease_before = until.max(now.saturating_add(DEFAULT_PAUSE_MS));
            }
            self.successes = 0;
            causes.push(throttle_cause(outcome, pause_ms));
        }

        if let Some(rate) = &outcome.rate {
            let budgets = [
                ("requests", rate.remaining, rate.reset_ms),
                ("tokens", rate.token_remaining, rate.token_reset_ms),
            ];
            for (what, remaining, reset_ms) in budgets {
                if let (Some(0), Some(reset_ms)) = (remaining, reset_ms) {
                    if reset_ms > 0 {
                        let pause_ms = reset_ms.min(MAX_PAUSE_MS);
                        self.pause(now.saturating_add(pause_ms));
                        causes.push(format!("{what} budget spent, resets in {pause_ms}ms"));
                    }
                }
            }
        }

        if !causes.is_empty() {
            self.last_throttle = Some(Throttle {
                at: now,
                cause: causes.join("; "),
            });
        }

        let success =
            !throttled && outcome.throttled == 0 && outcome.status.is_none_or(|s| s < 400);
        if success {
            if let Some(learned) = self.learned_limit {
                self.successes += 1;
                if self.successes >= self.effective_limit(b) {
                    self.successes = 0;
                    self.set_learned(learned.saturating_add(1), b);
                }
            }
        }
        // Other outcomes (a 404, a 500 without a hint) say nothing about the upstream's capacity:
        // they neither grow the limit nor reset the success streak.
    }

    /// Re-fits learned state into new bounds after a reconfigure.
    pub(crate) fn rebound(&mut self, b: Bounds) {
        if let Some(learned) = self.learned_limit {
            self.set_learned(learned, b);
        }
    }

    /// Drops everything learned (adaptive switched off): the configured settings rule alone.
    pub(crate) fn forget(&mut self) {
        self.learned_limit = None;
        self.learned_rpm = None;
        self.successes = 0;
        self.paused_until = None;
        self.no_decrease_before = 0;
    }

    fn pause(&mut self, until: u64) {
        self.paused_until = Some(
            self.paused_until
                .map_or(until, |current| current.max(until)),
        );
    }

    fn set_learned(&mut self, value: u32, b: Bounds) {
        let value = value.max(b.min_limit);
        // A learned limit at (or above) the configured one says nothing: forget it.
        self.learned_limit = if value >= b.limit { None } else { Some(value) };
        if self.learned_limit.is_none() {
            self.successes = 0;
        }
    }
}

fn throttle_cause(outcome: &Outcome, pause_ms: u64) -> String {
    let mut parts = Vec::new();
    if let Some(status) = outcome.status {
        parts.push(format!("status {status}"));
    }
    if outcome.throttled > 0 {
        parts.push(format!("{} throttled", outcome.throttled));
    }
    match outcome.retry_after_ms {
        Some(ms) => parts.push(format!("retry-after {ms}ms")),
        None => parts.push(format!("no retry hint, paused {pause_ms}ms")),
    }
    parts.join(", ")
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::RateInfo;

    const B: Bounds = Bounds {
        limit: 10,
        min_limit: 2,
    };

    fn status(s: u16) -> Outcome {
        Outcome {
            status: Some(s),
            ..Outcome::default()
        }
    }

    fn throttle(retry: u64) -> Outcome {
        Outcome {
            status: Some(429),
            retry_after_ms: Some(retry),
            ..Outcome::default()
        }
    }

    #[test]
    fn throttle_halves_pauses_and_records_cause() {
        let mut a = Adaptive::default();
        a.observe(1_000, &throttle(2_000), B);
        assert_eq!(a.learned_limit(), Some(5));
        assert_eq!(a.effective_limit(B), 5);
        assert_eq!(a.paused_until(1_000), Some(3_000));
        assert_eq!(a.paused_until(3_000), None);
        let t = a.last_throttle().unwrap();
        assert_eq!(t.at, 1_000);
        assert_eq!(t.cause, "status 429, retry-after 2000ms");
    }

    #[test]
    fn burst_of_throttles_decreases_once_per_pause() {
        let mut a = Adaptive::default();
        for i in 0..8 {
            a.observe(1_000 + i, &throttle(2_000), B);
        }
        assert_eq!(a.learned_limit(), Some(5));
        // The pause was extended by the later hints.
        assert_eq!(a.paused_until(1_000), Some(3_007));
        // After the pause a new throttle decreases again, and the floor holds.
        a.observe(3_007, &throttle(100), B);
        assert_eq!(a.learned_limit(), Some(2));
        a.observe(10_000, &throttle(100), B);
        assert_eq!(a.learned_limit(), Some(2));
    }

    #[test]
    fn other_throttle_signals() {
        let mut a = Adaptive::default();
        a.observe(
            0,
            &Outcome {
                status: Some(503),
                retry_after_ms: Some(500),
                ..Outcome::default()
            },
            B,
        );
        assert_eq!(a.learned_limit(), Some(5));
        assert_eq!(a.paused_until(0), Some(500));

        let mut a = Adaptive::default();
        a.observe(
            0,
            &Outcome {
                status: Some(200),
                throttled: 2,
                ..Outcome::default()
            },
            B,
        );
        assert_eq!(a.learned_limit(), Some(5));
        assert_eq!(a.paused_until(0), Some(DEFAULT_PAUSE_MS));
        assert_eq!(
            a.last_throttle().unwrap().cause,
            "status 200, 2 throttled, no retry hint, paused 1000ms"
        );

        // A 503 without a hint is an ordinary failure.
        let mut a = Adaptive::default();
        a.observe(0, &status(503), B);
        assert_eq!(a.learned_limit(), None);
        assert_eq!(a.paused_until(0), None);
    }

    #[test]
    fn pause_is_capped() {
        let mut a = Adaptive::default();
        a.observe(0, &throttle(u64::MAX), B);
        assert_eq!(a.paused_until(0), Some(MAX_PAUSE_MS));
    }

    #[test]
    fn success_grows_back_and_forgets_at_the_limit() {
        let mut a = Adaptive::default();
        a.observe(0, &throttle(0), B);
        assert_eq!(a.learned_limit(), Some(5));
        // Five successes at effective limit 5 grow it to 6, then six more to 7, ...
        for _ in 0..4 {
            a.observe(1, &status(200), B);
        }
        assert_eq!(a.learned_limit(), Some(5));
        a.observe(1, &status(200), B);
        assert_eq!(a.learned_limit(), Some(6));
        // A neutral failure does not break the streak; a throttle would.
        a.observe(1, &status(500), B);
        for _ in 0..6 {
            a.observe(1, &Outcome::default(), B);
        }
        assert_eq!(a.learned_limit(), Some(7));
        for _ in 0..(7 + 8 + 9) {
            a.observe(2, &status(204), B);
        }
        assert_eq!(a.learned_limit(), None);
        assert_eq!(a.effective_limit(B), 10);
    }

    #[test]
    fn exhausted_rate_budget_pauses_until_reset() {
        let mut a = Adaptive::default();
        let rate = RateInfo {
            remaining: Some(0),
            reset_ms: Some(7_000),
            ..RateInfo::default()
        };
        a.observe(
            100,
            &Outcome {
                status: Some(200),
                rate: Some(rate),
                ..Outcome::default()
            },
            B,
        );
        assert_eq!(a.paused_until(100), Some(7_100));
        assert_eq!(a.learned_limit(), None);
        assert!(a
            .last_throttle()
            .unwrap()
            .cause
            .contains("requests budget spent"));

        let mut a = Adaptive::default();
        let rate = RateInfo {
            token_remaining: Some(0),
            token_reset_ms: Some(300),
            ..RateInfo::default()
        };
        a.observe(
            100,
            &Outcome {
                rate: Some(rate),
                ..Outcome::default()
            },
            B,
        );
        assert_eq!(a.paused_until(100), Some(400));

        let mut a = Adaptive::default();
        let rate = RateInfo {
            remaining: Some(3),
            reset_ms: Some(7_000),
            ..RateInfo::default()
        };
        a.observe(
            100,
            &Outcome {
                rate: Some(rate),
                ..Outcome::default()
            },
            B,
        );
        assert_eq!(a.paused_until(100), None);
        assert!(a.last_throttle().is_none());
    }

    #[test]
    fn clamping() {
        // min_limit above limit is clamped to limit.
        let b = Bounds::of(&PoolSettings {
            limit: 3,
            min_limit: 8,
            ..PoolSettings::default()
        });
        assert_eq!(
            b,
            Bounds {
                limit: 3,
                min_limit: 3
            }
        );
        let mut a = Adaptive::default();
        a.observe(0, &throttle(0), b);
        assert_eq!(a.learned_limit(), None);
        assert_eq!(a.effective_limit(b), 3);

        // A learned limit outside new bounds is refitted.
        let mut a = Adaptive::default();
        a.observe(0, &throttle(0), B);
        assert_eq!(a.learned_limit(), Some(5));
        a.rebound(Bounds {
            limit: 4,
            min_limit: 1,
        });
        assert_eq!(a.learned_limit(), None);
        let mut a = Adaptive::default();
        a.observe(0, &throttle(0), B);
        a.rebound(Bounds {
            limit: 20,
            min_limit: 6,
        });
        assert_eq!(a.learned_limit(), Some(6));
    }
}
