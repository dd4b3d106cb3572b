//! The RPM gate's memory: admission timestamps inside the rolling one-minute window.
//!
//! Owns only the timestamps and the arithmetic over them. It does not decide which RPM is in
//! force (configured vs. learned: the [`crate::Governor`] passes the limit in) and it never
//! records anything but admissions, which is what makes accounting exact: a refused request
//! consumes no budget, an admitted one counts whatever the upstream later answers.

use std::collections::VecDeque;

/// Length of the rolling window.
pub(crate) const WINDOW_MS: u64 = 60_000;

#[derive(Clone, Debug, Default)]
pub(crate) struct RpmWindow {
    /// Admission times, oldest first. Non-decreasing because the governor never lets its clock
    /// step back.
    admissions: VecDeque<u64>,
}

impl RpmWindow {
    /// Index of the first admission still inside the window at `now`. An admission at `t`
    /// leaves the window at `t + WINDOW_MS`.
    fn first_live(&self, now: u64) -> usize {
        self.admissions
            .partition_point(|&t| t.saturating_add(WINDOW_MS) <= now)
    }

    /// Admissions inside the window at `now`.
    pub(crate) fn count(&self, now: u64) -> usize {
        self.admissions.len() - self.first_live(now)
    }

    /// Records one admission, dropping timestamps that have left the window so memory stays
    /// bounded by the admissions of one minute.
    pub(crate) fn record(&mut self, now: u64) {
        while self
            .admissions
            .front()
            .is_some_and(|&t| t.saturating_add(WINDOW_MS) <= now)
        {
            self.admissions.pop_front();
        }
        self.admissions.push_back(now);
    }

    /// Admissions still allowed at `now` under `rpm`.
    pub(crate) fn remaining(&self, now: u64, rpm: u32) -> u32 {
        let used = u32::try_from(self.count(now)).unwrap_or(u32::MAX);
        rpm.saturating_sub(used)
    }

    /// When the next admission becomes allowed under `rpm`, if it is not allowed at `now`:
    /// the moment enough old admissions have left the window.
    pub(crate) fn next_free(&self, now: u64, rpm: u32) -> Option<u64> {
        let first = self.first_live(now);
        let live = self.admissions.len() - first;
        let rpm = usize::try_from(rpm).unwrap_or(usize::MAX);
        if live < rpm {
            return None;
        }
        // `live - rpm + 1` admissions must leave; the last of them is at this index.
        self.admissions
            .get(first + live - rpm)
            .map(|&t| t.saturating_add(WINDOW_MS))
    }

    pub(crate) fn clear(&mut self) {
        self.admissions.clear();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn window_is_rolling() {
        let mut w = RpmWindow::default();
        w.record(1_000);
        w.record(2_000);
        assert_eq!(w.count(60_999), 1 + 1);
        assert_eq!(w.count(61_000), 1);
        assert_eq!(w.count(62_000), 0);
        assert_eq!(w.remaining(61_000, 2), 1);
    }

    #[test]
    fn next_free_is_when_enough_admissions_leave() {
        let mut w = RpmWindow::default();
        for t in [0, 10, 20, 30] {
            w.record(t);
        }
        assert_eq!(w.next_free(30, 5), None);
        assert_eq!(w.next_free(30, 4), Some(60_000));
        // The RPM was lowered below what the window holds: three must leave.
        assert_eq!(w.next_free(30, 2), Some(60_020));
        assert_eq!(w.next_free(60_000, 4), None);
    }

    #[test]
    fn record_prunes_old_entries() {
        let mut w = RpmWindow::default();
        for t in 0..100 {
            w.record(t);
        }
        w.record(200_000);
        assert_eq!(w.admissions.len(), 1);
    }
}
