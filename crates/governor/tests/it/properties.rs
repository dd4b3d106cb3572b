//! Property tests: random interleavings of every governor operation against a small model.
//!
//! The model tracks only what the caller can know (who holds, who waits and in which order they
//! were parked, when admissions happened); the properties are the governor's invariants:
//! - no admission makes `in_flight` exceed the effective limit, and none happens while paused
//!   or while the learned pace or a spent announced budget holds admissions back;
//! - an announced budget with room never delays an admission;
//! - the effective limit stays within `[min(min_limit, limit), limit]` whatever is observed;
//! - the RPM gate never lets more than `rpm` admissions into a rolling minute;
//! - FIFO within one fairness key and class, and no waiter served while a higher class waits;
//! - no starvation: after a dispatch drain, waiters remain only if something really blocks, and
//!   then a wake-up time exists (unless the limit is 0);
//! - no leaks: releasing every holder and cancelling every waiter leaves an empty governor;
//! - the admitted/refused counters match what the caller saw.

use std::collections::{HashMap, VecDeque};

use nthbouncer_governor::{
    Admitted, Governor, Outcome, PoolSettings, Priority, RateInfo, RefusalReason, RenewRefusal,
    Ticket, TryAcquire, DEFAULT_MAX_PAUSE_MS,
};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        key: u64,
        priority: Priority,
        may_wait: bool,
        lease_ms: u64,
    },
    Dispatch,
    Release(usize),
    Cancel(usize),
    Renew(usize),
    Reclaim,
    Observe(u8, u64),
    /// The outcome of a held slot, observed before its release (the proxy and lock path).
    ObserveHeld(usize, u8, u64),
    Advance(u64),
    Reconfigure {
        limit: u32,
        queue_size: u32,
        rpm: u32,
        min_limit: u32,
        adaptive: bool,
        fair_share: bool,
    },
}

fn priority() -> impl Strategy<Value = Priority> {
    prop_oneof![
        Just(Priority::High),
        Just(Priority::Normal),
        Just(Priority::Low)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..3, priority(), any::<bool>(), 0u64..50_000)
            .prop_map(|(key, priority, may_wait, lease_ms)| Op::Acquire { key, priority, may_wait, lease_ms }),
        3 => Just(Op::Dispatch),
        3 => any::<usize>().prop_map(Op::Release),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => any::<usize>().prop_map(Op::Renew),
        1 => Just(Op::Reclaim),
        2 => (0u8..9, 0u64..5_000).prop_map(|(kind, ms)| Op::Observe(kind, ms)),
        2 => (any::<usize>(), 0u8..9, 0u64..5_000)
            .prop_map(|(i, kind, ms)| Op::ObserveHeld(i, kind, ms)),
        3 => prop_oneof![0u64..100, 0u64..5_000, 0u64..70_000].prop_map(Op::Advance),
        1 => (0u32..5, 0u32..6, 0u32..6, 0u32..4, any::<bool>(), any::<bool>()).prop_map(
            |(limit, queue_size, rpm, min_limit, adaptive, fair_share)| Op::Reconfigure {
                limit, queue_size, rpm, min_limit, adaptive, fair_share,
            }
        ),
    ]
}

fn outcome(kind: u8, ms: u64) -> Outcome {
    match kind {
        0 => Outcome {
            status: Some(429),
            retry_after_ms: Some(ms),
            ..Outcome::default()
        },
        1 => Outcome {
            status: Some(429),
            ..Outcome::default()
        },
        2 => Outcome {
            status: Some(200),
            ..Outcome::default()
        },
        3 => Outcome {
            status: Some(503),
            retry_after_ms: Some(ms),
            ..Outcome::default()
        },
        4 => Outcome {
            status: Some(200),
            rate: Some(RateInfo {
                remaining: Some(0),
                reset_ms: Some(ms),
                ..RateInfo::default()
            }),
            ..Outcome::default()
        },
        // An announced window: a pace of `limit` per window.
        5 => Outcome {
            status: Some(200),
            rate: Some(RateInfo {
                limit: Some(ms % 7 + 1),
                window_ms: Some(ms + 1),
                ..RateInfo::default()
            }),
            ..Outcome::default()
        },
        // A budget: mirrored, spent down to its margin, then held back until the reset.
        6 => Outcome {
            status: Some(200),
            rate: Some(RateInfo {
                remaining: Some(ms % 5),
                reset_ms: Some(ms),
                ..RateInfo::default()
            }),
            ..Outcome::default()
        },
        // A rate-blamed throttle.
        7 => Outcome {
            status: Some(429),
            retry_after_ms: Some(ms),
            rate: Some(RateInfo {
                limit: Some(3),
                remaining: Some(0),
                reset_ms: Some(ms),
                window_ms: Some(10_000),
                ..RateInfo::default()
            }),
            ..Outcome::default()
        },
        _ => Outcome::default(),
    }
}

fn class(p: Priority) -> usize {
    match p {
        Priority::High => 0,
        Priority::Normal => 1,
        Priority::Low => 2,
    }
}

struct Model {
    g: Governor,
    now: u64,
    next_id: u128,
    held: Vec<u128>,
    /// Parked ids per (fairness key, class), in the order they were parked.
    waiting: HashMap<(u64, usize), VecDeque<u128>>,
    where_waiting: HashMap<u128, (u64, usize)>,
    /// Admission times since the RPM gate was last switched on (`None` while it is off).
    rpm_admissions: Option<Vec<u64>>,
    admitted: u64,
    refused: u64,
}

impl Model {
    fn new(settings: PoolSettings) -> Self {
        let rpm_admissions = (settings.rpm > 0).then(Vec::new);
        Model {
            g: Governor::new(settings),
            now: 1_000_000,
            next_id: 1,
            held: Vec::new(),
            waiting: HashMap::new(),
            where_waiting: HashMap::new(),
            rpm_admissions,
            admitted: 0,
            refused: 0,
        }
    }

    fn on_admitted(&mut self, a: &Admitted, blocked_before: bool) {
        assert!(!blocked_before, "admitted while paused or paced");
        let s = self.g.snapshot(self.now);
        assert!(
            s.in_flight <= s.effective_limit,
            "admission over the limit: {s:?}"
        );
        assert_eq!(a.effective_limit, s.effective_limit);
        assert_eq!(a.remaining_slots, s.effective_limit - s.in_flight);
        assert!(a.lease_deadline <= a.request_deadline);
        assert_eq!(
            a.request_deadline,
            self.now + self.g.settings().request_timeout_ms
        );
        if let Some(times) = &mut self.rpm_admissions {
            times.push(self.now);
            let rpm = self.g.settings().rpm as usize;
            let in_window = times.iter().filter(|&&t| t + 60_000 > self.now).count();
            assert!(
                in_window <= rpm,
                "{in_window} admissions in a minute under rpm {rpm}"
            );
        }
        self.held.push(a.id);
        self.admitted += 1;
    }

    fn drain(&mut self) {
        loop {
            let paused = self.held_back();
            let Some(a) = self.g.dispatch(self.now) else {
                break;
            };
            let (key, c) = self
                .where_waiting
                .remove(&a.id)
                .expect("dispatched an id that was not waiting");
            for higher in 0..c {
                assert!(
                    self.waiting
                        .iter()
                        .all(|((_, cl), q)| *cl != higher || q.is_empty()),
                    "class {c} served while class {higher} waits"
                );
            }
            let front = self
                .waiting
                .get_mut(&(key, c))
                .and_then(VecDeque::pop_front);
            assert_eq!(front, Some(a.id), "FIFO broken within key {key} class {c}");
            self.on_admitted(&a, paused);
        }
        self.check_no_starvation();
    }

    /// Paused, or the learned pace holds the next admission back.
    fn held_back(&self) -> bool {
        let s = self.g.snapshot(self.now);
        s.paused_until.is_some() || s.paced_until.is_some()
    }

    fn check_no_starvation(&self) {
        let s = self.g.snapshot(self.now);
        if s.queued > 0 {
            let blocked = s.in_flight >= s.effective_limit
                || s.rpm_remaining == Some(0)
                || s.paused_until.is_some()
                || s.paced_until.is_some();
            assert!(blocked, "waiters left behind with nothing blocking: {s:?}");
            if s.effective_limit > 0 {
                let wake = self.g.next_wakeup(self.now);
                assert!(wake.is_some(), "waiters blocked with no wake-up: {s:?}");
            }
        }
    }

    fn sync_held(&mut self) {
        let g = &self.g;
        self.held.retain(|&id| g.holds(id));
    }

    fn check_books(&self) {
        let s = self.g.snapshot(self.now);
        let settings = self.g.settings();
        assert!(
            s.effective_limit <= settings.limit,
            "above the limit: {s:?}"
        );
        assert!(
            s.effective_limit >= settings.min_limit.min(settings.limit),
            "below min_limit: {s:?}"
        );
        if !settings.adaptive {
            assert_eq!(s.effective_limit, settings.limit);
            assert_eq!((s.learned_rpm, s.paced_until), (None, None));
        }
        assert_eq!(self.g.in_flight() as usize, self.held.len());
        assert_eq!(self.g.queued() as usize, self.where_waiting.len());
        for &id in &self.held {
            assert!(self.g.holds(id));
        }
        for &id in self.where_waiting.keys() {
            assert!(self.g.is_queued(id));
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Acquire {
                key,
                priority,
                may_wait,
                lease_ms,
            } => {
                let id = self.next_id;
                self.next_id += 1;
                let ticket = Ticket {
                    id,
                    fairness_key: key,
                    priority,
                    lease_ms,
                    grace_ms: 0,
                };
                let had_waiters = self.g.queued() > 0;
                let paused = self.held_back();
                match self.g.try_acquire(self.now, ticket, may_wait) {
                    TryAcquire::Admitted(a) => {
                        assert!(!had_waiters, "a newcomer overtook waiters");
                        self.on_admitted(&a, paused);
                    }
                    TryAcquire::Queued => {
                        assert!(may_wait);
                        self.waiting
                            .entry((key, class(priority)))
                            .or_default()
                            .push_back(id);
                        self.where_waiting.insert(id, (key, class(priority)));
                    }
                    TryAcquire::Refused { .. } => self.refused += 1,
                }
            }
            Op::Dispatch => self.drain(),
            Op::Release(i) => {
                if !self.held.is_empty() {
                    let id = self.held.swap_remove(i % self.held.len());
                    assert!(self.g.release(self.now, id));
                    assert!(!self.g.release(self.now, id), "release is idempotent");
                }
            }
            Op::Cancel(i) => {
                let ids: Vec<u128> = self.where_waiting.keys().copied().collect();
                if let Some(&id) = ids.iter().min_by_key(|&&id| id.wrapping_mul(i as u128 | 1)) {
                    assert!(self.g.cancel(id));
                    let loc = self.where_waiting.remove(&id).unwrap();
                    self.waiting.get_mut(&loc).unwrap().retain(|&w| w != id);
                    assert!(!self.g.cancel(id));
                }
            }
            Op::Renew(i) => {
                if !self.held.is_empty() {
                    let id = self.held[i % self.held.len()];
                    match self.g.renew(self.now, id) {
                        Ok(deadline) => assert!(deadline > self.now),
                        Err(RenewRefusal::Capped) => assert!(self.g.holds(id)),
                        Err(RenewRefusal::NotFound) => assert!(!self.g.holds(id)),
                    }
                    self.sync_held();
                }
            }
            Op::Reclaim => {
                while let Some(id) = self.g.reclaim_expired(self.now) {
                    assert!(self.held.contains(&id));
                }
                self.sync_held();
            }
            Op::Observe(kind, ms) => {
                self.g.observe(self.now, &outcome(kind, ms));
            }
            Op::ObserveHeld(i, kind, ms) => {
                if !self.held.is_empty() {
                    let id = self.held.swap_remove(i % self.held.len());
                    self.g.observe_held(self.now, id, &outcome(kind, ms));
                    assert!(self.g.release(self.now, id));
                }
            }
            Op::Advance(ms) => self.now += ms,
            Op::Reconfigure {
                limit,
                queue_size,
                rpm,
                min_limit,
                adaptive,
                fair_share,
            } => {
                let settings = PoolSettings {
                    limit,
                    queue_size,
                    rpm,
                    min_limit,
                    adaptive,
                    fair_share,
                    request_timeout_ms: 60_000,
                    lease_term_ms: 20_000,
                    ..PoolSettings::default()
                };
                if rpm == 0 {
                    self.rpm_admissions = None;
                } else if self.rpm_admissions.is_none() {
                    self.rpm_admissions = Some(Vec::new());
                }
                self.g.reconfigure(settings, self.now);
            }
        }
        self.check_books();
    }
}

fn initial() -> impl Strategy<Value = PoolSettings> {
    (1u32..5, 0u32..6, 0u32..6, any::<bool>()).prop_map(|(limit, queue_size, rpm, fair_share)| {
        PoolSettings {
            limit,
            queue_size,
            rpm,
            fair_share,
            request_timeout_ms: 60_000,
            lease_term_ms: 20_000,
            ..PoolSettings::default()
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_for_any_interleaving(settings in initial(), ops in prop::collection::vec(op(), 1..200)) {
        let mut m = Model::new(settings);
        for op in ops {
            m.apply(op);
        }
        m.drain();

        // No leaks: everyone out, and the governor is empty.
        for id in std::mem::take(&mut m.held) {
            prop_assert!(m.g.release(m.now, id));
        }
        for id in m.where_waiting.keys().copied().collect::<Vec<_>>() {
            prop_assert!(m.g.cancel(id));
        }
        prop_assert_eq!(m.g.in_flight(), 0);
        prop_assert_eq!(m.g.queued(), 0);
        prop_assert_eq!(m.g.next_wakeup(m.now), None);
        let s = m.g.snapshot(m.now);
        prop_assert_eq!((s.queued_high, s.queued_normal, s.queued_low), (0, 0, 0));
        prop_assert_eq!((s.admitted_total, s.refused_total), (m.admitted, m.refused));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Whatever one outcome says (any hint, any reset, any announced rate), it holds admission
    /// back for at most `max_pause_ms`: as a pause, and as the spacing of a learned pace.
    #[test]
    fn no_single_outcome_pauses_past_max_pause(
        max_pause_ms in 1_000u64..2_000_000,
        kind in 0u8..9,
        ms in 0u64..u64::MAX - 1,
        held in any::<bool>(),
        now in 0u64..1 << 42,
    ) {
        let mut g = Governor::new(PoolSettings { limit: 4, max_pause_ms, ..PoolSettings::default() });
        let o = outcome(kind, ms);
        if held {
            let t = Ticket { id: 1, fairness_key: 0, priority: Priority::Normal, lease_ms: 1_000, grace_ms: 0 };
            prop_assert!(matches!(g.try_acquire(now, t, false), TryAcquire::Admitted(_)));
            prop_assert!(g.release_observed(now, 1, Some(&o)).0);
        } else {
            g.observe(now, &o);
        }
        let s = g.snapshot(now);
        if let Some(until) = s.paused_until {
            prop_assert!(until - now <= max_pause_ms, "paused {}ms", until - now);
        }
        if let Some(until) = s.paced_until {
            // A spent budget holds back until its reset, capped like a pause.
            prop_assert!(until - now <= max_pause_ms, "paced {}ms", until - now);
        }
        if let Some(rpm) = s.learned_rpm {
            // One admission per `max_pause_ms` at the slowest, rounded to whole requests/minute.
            prop_assert!(u64::from(rpm) * max_pause_ms >= 30_000, "pace {rpm} rpm");
        }
        // Whatever holds a newcomer back, its Retry-After stays within the cap too.
        let t = Ticket { id: 2, fairness_key: 0, priority: Priority::Normal, lease_ms: 1_000, grace_ms: 0 };
        if let TryAcquire::Refused { retry_after_ms: Some(retry), .. } = g.try_acquire(now, t, false) {
            prop_assert!(retry <= max_pause_ms, "retry after {retry}ms");
        }
    }

    /// A report on a slot nobody holds — never granted, or already released — changes nothing.
    #[test]
    fn reports_on_slots_nobody_holds_teach_nothing(kind in 0u8..9, ms in 0u64..10_000_000, stale in any::<bool>()) {
        let mut g = Governor::new(PoolSettings { limit: 4, ..PoolSettings::default() });
        let id = if stale {
            let t = Ticket { id: 7, fairness_key: 0, priority: Priority::Normal, lease_ms: 1_000, grace_ms: 0 };
            prop_assert!(matches!(g.try_acquire(1_000, t, false), TryAcquire::Admitted(_)));
            prop_assert_eq!(g.release_observed(1_000, 7, None), (true, None));
            7
        } else {
            99
        };
        let before = g.snapshot(2_000);
        prop_assert_eq!(g.release_observed(2_000, id, Some(&outcome(kind, ms))), (false, None));
        prop_assert_eq!(g.observe_held(2_000, id, &outcome(kind, ms)), None);
        prop_assert_eq!(g.snapshot(2_000), before);
    }

    /// "A pool never makes a caller wait when the origin's announced budget has room": after an
    /// announcement of `remaining` with its `reset` (with or without a window, at any pace the
    /// window implies), every admission up to the budget less its margin goes through at once,
    /// with slots to spare; the next one waits for the reset, and no longer.
    #[test]
    fn an_announced_budget_with_room_never_delays_an_admission(
        remaining in 2u64..400,
        reset_ms in 1u64..1_000_000,
        limit in prop::option::of(400u64..100_000),
        window_ms in prop::option::of(1u64..10_000_000),
        now in 0u64..1 << 42,
    ) {
        let max_pause_ms = DEFAULT_MAX_PAUSE_MS;
        let mut g = Governor::new(PoolSettings { limit: 1_000, ..PoolSettings::default() });
        g.observe(now, &Outcome {
            status: Some(200),
            rate: Some(RateInfo {
                limit,
                remaining: Some(remaining),
                reset_ms: Some(reset_ms),
                window_ms,
                ..RateInfo::default()
            }),
            ..Outcome::default()
        });
        let margin = (limit.unwrap_or(remaining) / 100).max(1);
        let free = remaining.saturating_sub(margin);
        for id in 0..u128::from(free) {
            let t = Ticket { id, fairness_key: 0, priority: Priority::Normal, lease_ms: 1_000, grace_ms: 0 };
            let got = g.try_acquire(now, t, false);
            prop_assert!(matches!(got, TryAcquire::Admitted(_)), "admission {id} of {free}: {got:?}");
        }
        let t = Ticket { id: u128::MAX, fairness_key: 0, priority: Priority::Normal, lease_ms: 1_000, grace_ms: 0 };
        let reset_at = now + reset_ms.min(max_pause_ms);
        prop_assert_eq!(
            g.try_acquire(now, t, false),
            TryAcquire::Refused { reason: RefusalReason::Rpm, retry_after_ms: Some(reset_at - now) }
        );
        prop_assert_eq!(g.snapshot(now).paced_until, Some(reset_at));
    }
}
