//! Even spacing of admissions under a learned rate (a generic cell rate algorithm).
//!
//! The RPM gate counts admissions in a rolling minute, which lets a whole minute's budget go
//! out in one burst — exactly what makes an origin's own window overflow. When the pool has
//! learned a rate from the origin's answers, admissions are also spaced: each one moves a
//! theoretical arrival time (`tat`) forward by the spacing, and an admission is allowed once
//! `now` is within [`BURST`]` - 1` spacings of it. So the long-run rate never exceeds one per
//! spacing, and at most [`BURST`] admissions go out back to back after an idle spell.
//!
//! Owns only `tat` and the arithmetic; the spacing is passed in (it changes with every
//! announcement, and only the [`crate::Governor`] knows whether a pace is in force). Times are
//! milliseconds (the caller's monotonic clock) outside, microseconds inside, so fast paces (under a millisecond apart)
//! average out exactly instead of rounding.

/// Admissions allowed back to back. Two, not one: two callers granted in the same millisecond
/// (a lock holder releasing and re-acquiring at once) should not be told to wait a fraction of
/// a millisecond, and a burst of two is far inside any margin a rolling window needs.
pub(crate) const BURST: u64 = 2;

#[derive(Clone, Debug, Default)]
pub(crate) struct Pacer {
    /// Theoretical arrival time of the next admission at the paced rate, in microseconds.
    tat_us: u64,
}

impl Pacer {
    /// How far ahead of `tat` an admission may be. At least a millisecond, the clock's grain:
    /// with less, paces faster than [`BURST`] per millisecond would lose their credit at every
    /// tick and run slow.
    fn tolerance_us(spacing_us: u64) -> u64 {
        spacing_us.saturating_mul(BURST - 1).max(1_000)
    }

    /// The earliest time (ms) at which an admission is allowed under `spacing_us`; `<= now`
    /// means "now".
    pub(crate) fn next_allowed(&self, spacing_us: u64) -> u64 {
        self.tat_us
            .saturating_sub(Self::tolerance_us(spacing_us))
            .div_ceil(1_000)
    }

    /// The earliest time an admission is allowed, if it is not allowed at `now`.
    pub(crate) fn blocked_until(&self, now: u64, spacing_us: u64) -> Option<u64> {
        Some(self.next_allowed(spacing_us)).filter(|&t| t > now)
    }

    /// Records one admission at `now`.
    pub(crate) fn record(&mut self, now: u64, spacing_us: u64) {
        let now_us = now.saturating_mul(1_000);
        self.tat_us = self.tat_us.max(now_us).saturating_add(spacing_us);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn spaces_admissions_after_a_burst_of_two() {
        let mut p = Pacer::default();
        let spacing = 200_000; // 200 ms
        assert_eq!(p.blocked_until(1_000, spacing), None);
        p.record(1_000, spacing);
        assert_eq!(
            p.blocked_until(1_000, spacing),
            None,
            "a second one at once"
        );
        p.record(1_000, spacing);
        assert_eq!(p.blocked_until(1_000, spacing), Some(1_200));
        p.record(1_200, spacing);
        assert_eq!(p.blocked_until(1_200, spacing), Some(1_400));
        // After an idle spell the credit is capped at the burst.
        p.record(10_000, spacing);
        p.record(10_000, spacing);
        assert_eq!(p.blocked_until(10_000, spacing), Some(10_200));
    }

    #[test]
    fn sub_millisecond_spacing_averages_out() {
        let mut p = Pacer::default();
        let spacing = 400; // 2.5 admissions per ms
        let mut admitted = 0u64;
        for now in 0..1_000u64 {
            while p.blocked_until(now, spacing).is_none() {
                p.record(now, spacing);
                admitted += 1;
            }
        }
        // 1000 ms at 2.5/ms, plus the one-millisecond allowance.
        assert!((2_500..=2_504).contains(&admitted), "{admitted}");
    }
}
