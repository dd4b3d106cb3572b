//! Failed-authentication throttling: failures are counted per client address within one pool;
//! an address that fails [`MAX_FAILURES`] times within [`FAILURE_WINDOW_MS`] is answered
//! `429 too_many_requests` for [`BLOCK_MS`], whatever it sends. Guessing a key, a signature or a
//! token then costs an attacker a minute per ten tries, and costs us one map lookup.
//!
//! IPv6 addresses count by their /64, the block one host is usually handed. The table is
//! bounded ([`MAX_TRACKED`] addresses per pool): when it is full of live entries, new addresses go
//! uncounted rather than evicting one that is being throttled.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

pub const MAX_FAILURES: u32 = 10;
pub const FAILURE_WINDOW_MS: u64 = 60_000;
pub const BLOCK_MS: u64 = 60_000;
pub const MAX_TRACKED: usize = 10_000;

#[derive(Clone, Copy, Debug)]
struct Entry {
    window_start: u64,
    failures: u32,
    blocked_until: u64,
}

impl Entry {
    fn live(&self, now: u64) -> bool {
        self.blocked_until > now || now < self.window_start.saturating_add(FAILURE_WINDOW_MS)
    }
}

#[derive(Default)]
struct Table {
    entries: HashMap<IpAddr, Entry>,
    /// Earliest time the next sweep of a full table may run (a sweep is O(n)).
    next_sweep: u64,
}

#[derive(Default)]
pub struct FailureThrottle {
    table: Mutex<Table>,
    /// Entries in the table: when 0 (no recent failure at all), checks skip the lock.
    len: AtomicUsize,
}

fn bucket(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
    }
}

impl FailureThrottle {
    /// If `ip` is blocked at `now`, the milliseconds until it is not.
    pub fn blocked(&self, ip: IpAddr, now: u64) -> Option<u64> {
        if self.len.load(Ordering::Acquire) == 0 {
            return None;
        }
        let table = self.table.lock();
        let e = table.entries.get(&bucket(ip))?;
        (e.blocked_until > now).then(|| e.blocked_until - now)
    }

    /// Counts one failure; returns whether `ip` is now blocked.
    pub fn record_failure(&self, ip: IpAddr, now: u64) -> bool {
        let key = bucket(ip);
        let mut table = self.table.lock();
        // Drop stale entries now and then (at most once a second), so that the table stays
        // small and checks of a pool without recent failures skip the lock.
        if now >= table.next_sweep {
            table.entries.retain(|_, e| e.live(now));
            table.next_sweep = now.saturating_add(1_000);
        }
        if !table.entries.contains_key(&key) && table.entries.len() >= MAX_TRACKED {
            self.len.store(table.entries.len(), Ordering::Release);
            tracing::warn!("failed-authentication table full; a new address goes uncounted");
            return false;
        }
        let e = table.entries.entry(key).or_insert(Entry {
            window_start: now,
            failures: 0,
            blocked_until: 0,
        });
        if now >= e.window_start.saturating_add(FAILURE_WINDOW_MS) && e.blocked_until <= now {
            e.window_start = now;
            e.failures = 0;
        }
        e.failures = e.failures.saturating_add(1);
        if e.failures >= MAX_FAILURES && e.blocked_until <= now {
            e.blocked_until = now.saturating_add(BLOCK_MS);
            // The next block needs a fresh run of failures.
            e.window_start = e.blocked_until;
            e.failures = 0;
        }
        let blocked = e.blocked_until > now;
        self.len.store(table.entries.len(), Ordering::Release);
        blocked
    }

    /// Addresses currently tracked (tests).
    pub fn tracked(&self) -> usize {
        self.table.lock().entries.len()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ten_failures_in_a_minute_block_for_a_minute() {
        let t = FailureThrottle::default();
        let a = ip("192.0.2.1");
        for i in 0..MAX_FAILURES - 1 {
            assert!(!t.record_failure(a, 1_000 + u64::from(i)));
        }
        assert_eq!(t.blocked(a, 2_000), None);
        assert!(t.record_failure(a, 2_000));
        assert_eq!(t.blocked(a, 2_000), Some(BLOCK_MS));
        assert_eq!(t.blocked(ip("192.0.2.2"), 2_000), None, "per address");
        assert_eq!(t.blocked(a, 2_000 + BLOCK_MS), None);
        // After the block, one more failure does not block again at once.
        assert!(!t.record_failure(a, 2_000 + BLOCK_MS));
    }

    #[test]
    fn failures_spread_over_more_than_the_window_do_not_block() {
        let t = FailureThrottle::default();
        let a = ip("192.0.2.1");
        for i in 0..30u64 {
            assert!(!t.record_failure(a, i * (FAILURE_WINDOW_MS / 8)));
        }
    }

    #[test]
    fn ipv6_counts_by_slash_64_and_mapped_v4_as_v4() {
        let t = FailureThrottle::default();
        for i in 0..MAX_FAILURES {
            t.record_failure(ip(&format!("2001:db8:1:2::{:x}", i + 1)), 0);
        }
        assert!(t.blocked(ip("2001:db8:1:2:ffff::1"), 1).is_some());
        assert!(t.blocked(ip("2001:db8:1:3::1"), 1).is_none());
        for _ in 0..MAX_FAILURES {
            t.record_failure(ip("::ffff:198.51.100.1"), 0);
        }
        assert!(t.blocked(ip("198.51.100.1"), 1).is_some());
    }

    #[test]
    fn stale_entries_go_and_checks_skip_the_lock_again() {
        let t = FailureThrottle::default();
        t.record_failure(ip("192.0.2.1"), 0);
        assert_eq!(t.tracked(), 1);
        t.record_failure(ip("192.0.2.2"), FAILURE_WINDOW_MS + 1);
        assert_eq!(t.tracked(), 1, "the first address aged out");
        assert_eq!(t.len.load(Ordering::Acquire), 1);
    }

    #[test]
    fn the_table_is_bounded() {
        let t = FailureThrottle::default();
        for i in 0..(MAX_TRACKED as u32 + 50) {
            t.record_failure(IpAddr::from(i.to_be_bytes()), 0);
        }
        assert_eq!(t.tracked(), MAX_TRACKED);
        // Once the entries age out, a sweep makes room.
        t.record_failure(ip("203.0.113.1"), FAILURE_WINDOW_MS + 1);
        assert_eq!(t.tracked(), 1);
    }
}
