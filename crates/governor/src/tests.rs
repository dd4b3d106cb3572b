//! Rule-by-rule tests of the composed [`Governor`], at its public surface. Module-level details
//! (queue layout, window arithmetic, learning rules) are tested beside their modules.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn settings(limit: u32) -> PoolSettings {
    PoolSettings {
        limit,
        ..PoolSettings::default()
    }
}

fn ticket(id: u128) -> Ticket {
    Ticket {
        id,
        fairness_key: 0,
        priority: Priority::Normal,
        lease_ms: 30_000,
        grace_ms: 0,
    }
}

fn keyed(id: u128, key: u64, priority: Priority) -> Ticket {
    Ticket {
        id,
        fairness_key: key,
        priority,
        lease_ms: 30_000,
        grace_ms: 0,
    }
}

fn admitted(r: TryAcquire) -> Admitted {
    match r {
        TryAcquire::Admitted(a) => a,
        other => panic!("expected admission, got {other:?}"),
    }
}

fn refused(r: TryAcquire) -> (RefusalReason, Option<u64>) {
    match r {
        TryAcquire::Refused {
            reason,
            retry_after_ms,
        } => (reason, retry_after_ms),
        other => panic!("expected refusal, got {other:?}"),
    }
}

/// Releases `id` and returns the ids the caller's dispatch loop would admit next.
fn release_and_drain(g: &mut Governor, now: u64, id: u128) -> Vec<u128> {
    assert!(g.release(now, id));
    drain(g, now)
}

fn drain(g: &mut Governor, now: u64) -> Vec<u128> {
    std::iter::from_fn(|| g.dispatch(now).map(|a| a.id)).collect()
}

#[test]
fn names_and_defaults() {
    assert_eq!(Priority::parse("HIGH"), Some(Priority::High));
    assert_eq!(Priority::parse("Normal"), Some(Priority::Normal));
    assert_eq!(Priority::parse("low"), Some(Priority::Low));
    assert_eq!(Priority::parse("urgent"), None);
    assert_eq!(Priority::default().as_str(), "normal");
    let reasons = [
        RefusalReason::NoSlot,
        RefusalReason::QueueFull,
        RefusalReason::Rpm,
        RefusalReason::Paused,
    ];
    assert_eq!(
        reasons.map(RefusalReason::as_str),
        ["no_slot", "queue_full", "rpm", "paused"]
    );
    let d = PoolSettings::default();
    assert_eq!(
        (
            d.limit,
            d.queue_size,
            d.rpm,
            d.request_timeout_ms,
            d.lease_term_ms,
            d.renew_interval_ms
        ),
        (10, 1000, 0, 120_000, 30_000, 10_000)
    );
    assert!(d.adaptive && d.fair_share);
    assert_eq!(d.min_limit, 1);
}

#[test]
fn grant_deadlines_and_headers() {
    let mut g = Governor::new(PoolSettings {
        limit: 2,
        request_timeout_ms: 50_000,
        ..PoolSettings::default()
    });
    let a = admitted(g.try_acquire(1_000, ticket(1), false));
    assert_eq!(
        (a.id, a.lease_deadline, a.request_deadline),
        (1, 31_000, 51_000)
    );
    assert_eq!(
        (a.remaining_slots, a.effective_limit, a.rpm_remaining),
        (1, 2, None)
    );
    // The initial lease never runs past the request deadline.
    let b = admitted(g.try_acquire(
        1_000,
        Ticket {
            lease_ms: 999_999,
            ..ticket(2)
        },
        false,
    ));
    assert_eq!(b.lease_deadline, 51_000);
    assert_eq!(g.headers(1_000), (0, 2, None));
    assert!(g.holds(1) && g.holds(2));
    assert_eq!(g.in_flight(), 2);
}

#[test]
fn no_slot_fail_fast_and_retry_estimate_from_hold_times() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(0, ticket(1), false));
    // No release yet: no estimate.
    assert_eq!(
        refused(g.try_acquire(0, ticket(2), false)),
        (RefusalReason::NoSlot, None)
    );
    assert!(g.release(4_000, 1));
    admitted(g.try_acquire(4_000, ticket(3), false));
    // One hold of 4 s observed, one slot: about 4 s.
    assert_eq!(
        refused(g.try_acquire(4_000, ticket(4), false)),
        (RefusalReason::NoSlot, Some(4_000))
    );
    let s = g.snapshot(4_000);
    assert_eq!((s.admitted_total, s.refused_total), (2, 2));
}

#[test]
fn queue_full_and_zero_queue() {
    let mut g = Governor::new(PoolSettings {
        limit: 1,
        queue_size: 2,
        ..PoolSettings::default()
    });
    admitted(g.try_acquire(0, ticket(1), true));
    assert_eq!(g.try_acquire(0, ticket(2), true), TryAcquire::Queued);
    assert_eq!(g.try_acquire(0, ticket(3), true), TryAcquire::Queued);
    assert_eq!(
        refused(g.try_acquire(0, ticket(4), true)).0,
        RefusalReason::QueueFull
    );
    assert_eq!(
        refused(g.try_acquire(0, ticket(5), false)).0,
        RefusalReason::NoSlot
    );
    assert_eq!(g.queued(), 2);

    let mut g = Governor::new(PoolSettings {
        limit: 1,
        queue_size: 0,
        ..PoolSettings::default()
    });
    admitted(g.try_acquire(0, ticket(1), true));
    assert_eq!(
        refused(g.try_acquire(0, ticket(2), true)).0,
        RefusalReason::QueueFull
    );
    assert_eq!(g.queued(), 0);
}

#[test]
fn waiters_are_not_overtaken_by_newcomers() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(0, ticket(1), false));
    assert_eq!(g.try_acquire(0, ticket(2), true), TryAcquire::Queued);
    // The slot frees, but before the caller dispatches a newcomer arrives: it must not jump
    // the waiter, even as a high-priority fail-fast request.
    assert!(g.release(10, 1));
    let (reason, _) = refused(g.try_acquire(10, keyed(3, 9, Priority::High), false));
    assert_eq!(reason, RefusalReason::NoSlot);
    assert_eq!(g.try_acquire(10, ticket(4), true), TryAcquire::Queued);
    assert_eq!(drain(&mut g, 10), vec![2]);
    assert!(g.is_queued(4));
}

#[test]
fn fifo_within_a_key() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(0, ticket(1), false));
    for id in 2..=6 {
        assert_eq!(
            g.try_acquire(id as u64, keyed(id, 5, Priority::Normal), true),
            TryAcquire::Queued
        );
    }
    let mut order = Vec::new();
    let mut holder = 1;
    for now in 10..15 {
        let next = release_and_drain(&mut g, now, holder);
        assert_eq!(next.len(), 1);
        holder = next[0];
        order.push(holder);
    }
    assert_eq!(order, vec![2, 3, 4, 5, 6]);
}

#[test]
fn priority_overtakes_older_waiters() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(0, ticket(1), false));
    assert_eq!(
        g.try_acquire(1, keyed(2, 1, Priority::Low), true),
        TryAcquire::Queued
    );
    assert_eq!(
        g.try_acquire(2, keyed(3, 1, Priority::Normal), true),
        TryAcquire::Queued
    );
    assert_eq!(
        g.try_acquire(3, keyed(4, 2, Priority::High), true),
        TryAcquire::Queued
    );
    let s = g.snapshot(3);
    assert_eq!(
        (s.queued, s.queued_high, s.queued_normal, s.queued_low),
        (3, 1, 1, 1)
    );
    assert_eq!(release_and_drain(&mut g, 4, 1), vec![4]);
    assert_eq!(release_and_drain(&mut g, 5, 4), vec![3]);
    assert_eq!(release_and_drain(&mut g, 6, 3), vec![2]);
}

#[test]
fn two_keys_alternate_under_unequal_floods() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(0, ticket(1), false));
    // Key 7 floods with 20 waiters before key 8 sends 3.
    for id in 100..120 {
        assert_eq!(
            g.try_acquire(1, keyed(id, 7, Priority::Normal), true),
            TryAcquire::Queued
        );
    }
    for id in 200..203 {
        assert_eq!(
            g.try_acquire(2, keyed(id, 8, Priority::Normal), true),
            TryAcquire::Queued
        );
    }
    let mut order = Vec::new();
    let mut holder = 1;
    for now in 10..18 {
        holder = release_and_drain(&mut g, now, holder)[0];
        order.push(holder);
    }
    assert_eq!(order, vec![100, 200, 101, 201, 102, 202, 103, 104]);
}

#[test]
fn without_fair_share_the_flood_is_served_first() {
    let mut g = Governor::new(PoolSettings {
        limit: 1,
        fair_share: false,
        ..PoolSettings::default()
    });
    admitted(g.try_acquire(0, ticket(1), false));
    for (id, key) in [(10, 7), (11, 7), (12, 8), (13, 7)] {
        assert_eq!(
            g.try_acquire(1, keyed(id, key, Priority::Normal), true),
            TryAcquire::Queued
        );
    }
    let mut order = Vec::new();
    let mut holder = 1;
    for now in 10..14 {
        holder = release_and_drain(&mut g, now, holder)[0];
        order.push(holder);
    }
    assert_eq!(order, vec![10, 11, 12, 13]);
}

#[test]
fn rpm_admits_sixty_per_rolling_minute_then_refuses_with_retry_after() {
    let mut g = Governor::new(PoolSettings {
        limit: 100,
        rpm: 60,
        ..PoolSettings::default()
    });
    // 60 admissions spread over the first 59 s, each released at once.
    for i in 0..60u64 {
        let a = admitted(g.try_acquire(i * 1_000, ticket(u128::from(i)), false));
        assert_eq!(a.rpm_remaining, Some(59 - i as u32));
        assert!(g.release(i * 1_000, u128::from(i)));
    }
    // The 61st, half a second later, is refused until the first admission (at 0) leaves the window.
    assert_eq!(
        refused(g.try_acquire(59_500, ticket(1_000), false)),
        (RefusalReason::Rpm, Some(500))
    );
    // Refusals consume nothing: many more are refused, and the window still frees at 60 000.
    for id in 1_001..1_100 {
        refused(g.try_acquire(59_900, ticket(id), false));
    }
    assert_eq!(g.headers(59_999).2, Some(0));
    assert_eq!(g.headers(60_000).2, Some(1));
    admitted(g.try_acquire(60_000, ticket(2_000), false));
    assert_eq!(
        refused(g.try_acquire(60_000, ticket(2_001), false)),
        (RefusalReason::Rpm, Some(1_000))
    );
}

#[test]
fn rpm_blocked_waiters_wake_when_the_window_frees() {
    let mut g = Governor::new(PoolSettings {
        limit: 10,
        rpm: 2,
        ..PoolSettings::default()
    });
    admitted(g.try_acquire(0, ticket(1), true));
    admitted(g.try_acquire(5_000, ticket(2), true));
    // Leases expire at 30 000 / 35 000; without waiters the RPM window is no reason to wake.
    assert_eq!(g.next_wakeup(6_000), Some(30_000));
    assert!(g.release(6_000, 1) && g.release(6_000, 2));
    assert_eq!(g.next_wakeup(6_000), None);
    assert_eq!(g.try_acquire(7_000, ticket(3), true), TryAcquire::Queued);
    assert_eq!(g.next_wakeup(7_000), Some(60_000));
    assert_eq!(drain(&mut g, 59_999), Vec::<u128>::new());
    assert_eq!(drain(&mut g, 60_000), vec![3]);
}

#[test]
fn renew_extends_and_caps() {
    let mut g = Governor::new(PoolSettings {
        limit: 1,
        request_timeout_ms: 70_000,
        lease_term_ms: 30_000,
        ..PoolSettings::default()
    });
    let a = admitted(g.try_acquire(0, ticket(1), false));
    assert_eq!(a.lease_deadline, 30_000);
    assert_eq!(g.renew(10_000, 1), Ok(40_000));
    assert_eq!(g.renew(20_000, 1), Ok(50_000));
    assert_eq!(g.renew(45_000, 1), Ok(70_000));
    // Exactly at the cap: refused.
    assert_eq!(g.renew(46_000, 1), Err(RenewRefusal::Capped));
    assert_eq!(g.renew(46_000, 2), Err(RenewRefusal::NotFound));
    assert!(g.release(50_000, 1));
    assert_eq!(g.renew(50_000, 1), Err(RenewRefusal::NotFound));
    assert!(!g.release(50_000, 1));
}

#[test]
fn exchange_slot_is_capped_from_the_start() {
    let mut g = Governor::new(PoolSettings {
        request_timeout_ms: 5_000,
        ..PoolSettings::default()
    });
    let a = admitted(g.try_acquire(
        0,
        Ticket {
            lease_ms: 5_000,
            ..ticket(1)
        },
        false,
    ));
    assert_eq!(a.lease_deadline, a.request_deadline);
    assert_eq!(g.renew(1, 1), Err(RenewRefusal::Capped));
}

#[test]
fn exchange_slot_outlives_its_request_deadline_by_its_grace_only() {
    let mut g = Governor::new(PoolSettings {
        limit: 1,
        request_timeout_ms: 5_000,
        ..PoolSettings::default()
    });
    let a = admitted(g.try_acquire(
        0,
        Ticket {
            lease_ms: 7_000,
            grace_ms: 2_000,
            ..ticket(1)
        },
        false,
    ));
    // The holder is told the request deadline; the slot is reclaimed only after the grace.
    assert_eq!((a.request_deadline, a.lease_deadline), (5_000, 7_000));
    // At the request deadline the holder is still ending its exchange: nobody else gets in.
    assert_eq!(g.try_acquire(5_000, ticket(2), true), TryAcquire::Queued);
    assert_eq!(g.next_wakeup(5_000), Some(7_000));
    assert_eq!(g.reclaim_expired(6_999), None);
    // A holder that never frees it loses it when the grace ends.
    assert_eq!(g.reclaim_expired(7_000), Some(1));
    assert_eq!(drain(&mut g, 7_000), vec![2]);
}

#[test]
fn unrenewed_lease_is_reclaimed_within_one_term_and_its_slot_goes_to_a_waiter() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(1_000, ticket(1), false));
    assert_eq!(g.try_acquire(2_000, ticket(2), true), TryAcquire::Queued);
    assert_eq!(g.next_wakeup(2_000), Some(31_000));
    assert_eq!(g.reclaim_expired(30_999), None);
    assert_eq!(g.reclaim_expired(31_000), Some(1));
    assert_eq!(g.reclaim_expired(31_000), None);
    assert!(!g.holds(1));
    assert_eq!(drain(&mut g, 31_000), vec![2]);
    // A renew after reclaim finds nothing.
    assert_eq!(g.renew(31_001, 1), Err(RenewRefusal::NotFound));
}

#[test]
fn renew_after_expiry_reclaims() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(0, ticket(1), false));
    assert_eq!(g.try_acquire(0, ticket(2), true), TryAcquire::Queued);
    assert_eq!(g.renew(30_000, 1), Err(RenewRefusal::NotFound));
    assert_eq!(g.in_flight(), 0);
    assert_eq!(drain(&mut g, 30_000), vec![2]);
}

#[test]
fn adaptive_halving_pause_recovery() {
    let mut g = Governor::new(PoolSettings {
        limit: 8,
        min_limit: 3,
        ..PoolSettings::default()
    });
    for id in 0..8 {
        admitted(g.try_acquire(0, ticket(id), false));
    }
    assert_eq!(g.try_acquire(0, ticket(100), true), TryAcquire::Queued);
    // All eight answer 429 together: one decrease, one pause.
    let throttle = Outcome {
        status: Some(429),
        retry_after_ms: Some(2_000),
        ..Outcome::default()
    };
    for id in 0..8 {
        g.observe(100, &throttle);
        assert!(g.release(100, id));
    }
    let s = g.snapshot(100);
    assert_eq!(
        (s.effective_limit, s.configured_limit, s.learned_limit),
        (4, 8, Some(4))
    );
    assert_eq!(s.paused_until, Some(2_100));
    assert_eq!(
        s.last_throttle,
        Some(Throttle {
            at: 100,
            cause: "status 429, retry-after 2000ms".into()
        })
    );
    // Paused: nothing is dispatched, newcomers are refused as paused, and the waiter's wake-up
    // is the end of the pause.
    assert_eq!(drain(&mut g, 2_099), Vec::<u128>::new());
    assert_eq!(
        refused(g.try_acquire(2_099, ticket(101), false)),
        (RefusalReason::Paused, Some(1))
    );
    assert_eq!(g.next_wakeup(2_099), Some(2_100));
    assert_eq!(drain(&mut g, 2_100), vec![100]);
    assert_eq!(g.snapshot(2_100).paused_until, None);
    // Four admitted at effective limit 4, the fifth is refused.
    for id in 200..203 {
        admitted(g.try_acquire(2_100, ticket(id), false));
    }
    assert_eq!(
        refused(g.try_acquire(2_100, ticket(203), false)).0,
        RefusalReason::NoSlot
    );
    // A second burst halves again but not below min_limit.
    g.observe(2_200, &throttle);
    assert_eq!(g.snapshot(2_200).effective_limit, 3);
    // Recovery counts successes only while the limit is in use. 4 drew the last throttle, so
    // it is not retried before the probe period and 100 successes; after them, each window of
    // successes adds one, until the learned limit is forgotten at 8.
    for id in [100, 200, 201, 202] {
        assert!(g.release(2_200, id));
    }
    let mut next_id = 1_000;
    let mut window = |g: &mut Governor, now: u64| {
        let mut held = Vec::new();
        while let TryAcquire::Admitted(a) = g.try_acquire(now, ticket(next_id), false) {
            held.push(a.id);
            next_id += 1;
        }
        for id in held {
            g.observe_held(now, id, &ok());
            assert!(g.release(now, id));
        }
        g.snapshot(now).effective_limit
    };
    for _ in 0..34 {
        assert_eq!(window(&mut g, 5_000), 3);
    }
    let limits: Vec<u32> = (0..6).map(|_| window(&mut g, 32_200)).collect();
    assert_eq!(limits, vec![4, 5, 6, 7, 8, 8]);
    assert_eq!(g.snapshot(32_200).learned_limit, None);
}

fn ok() -> Outcome {
    Outcome {
        status: Some(200),
        ..Outcome::default()
    }
}

#[test]
fn observe_is_ignored_when_not_adaptive() {
    let mut g = Governor::new(PoolSettings {
        adaptive: false,
        ..PoolSettings::default()
    });
    g.observe(
        0,
        &Outcome {
            status: Some(429),
            ..Outcome::default()
        },
    );
    let s = g.snapshot(0);
    assert_eq!(
        (s.effective_limit, s.paused_until, s.last_throttle),
        (10, None, None)
    );
}

#[test]
fn reconfigure_raises_limit_and_clamps_learned_state() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(0, ticket(1), false));
    for id in 2..=4 {
        assert_eq!(g.try_acquire(0, ticket(id), true), TryAcquire::Queued);
    }
    g.reconfigure(settings(3), 1);
    assert_eq!(drain(&mut g, 1), vec![2, 3]);
    assert_eq!(g.queued(), 1);

    // Learned limit 5 of 10; a new limit of 4 forgets it, min_limit above limit is clamped.
    let mut g = Governor::new(settings(10));
    g.observe(
        0,
        &Outcome {
            status: Some(429),
            ..Outcome::default()
        },
    );
    assert_eq!(g.snapshot(0).effective_limit, 5);
    g.reconfigure(
        PoolSettings {
            limit: 4,
            min_limit: 9,
            ..PoolSettings::default()
        },
        0,
    );
    let s = g.snapshot(0);
    assert_eq!((s.effective_limit, s.learned_limit), (4, None));
    // Switching adaptive off drops the pause too.
    g.reconfigure(
        PoolSettings {
            limit: 4,
            adaptive: false,
            ..PoolSettings::default()
        },
        0,
    );
    assert_eq!(g.snapshot(0).paused_until, None);
}

#[test]
fn reconfigure_toggling_fair_share_keeps_waiters() {
    let mut g = Governor::new(PoolSettings {
        limit: 1,
        fair_share: false,
        ..PoolSettings::default()
    });
    admitted(g.try_acquire(0, ticket(1), false));
    for (id, key) in [(10, 7), (11, 7), (12, 8)] {
        assert_eq!(
            g.try_acquire(1, keyed(id, key, Priority::Normal), true),
            TryAcquire::Queued
        );
    }
    g.reconfigure(
        PoolSettings {
            limit: 1,
            fair_share: true,
            ..PoolSettings::default()
        },
        2,
    );
    let mut order = Vec::new();
    let mut holder = 1;
    for now in 10..13 {
        holder = release_and_drain(&mut g, now, holder)[0];
        order.push(holder);
    }
    assert_eq!(order, vec![10, 12, 11]);
}

#[test]
fn cancel_removes_a_waiter_only() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(0, ticket(1), false));
    assert_eq!(g.try_acquire(0, ticket(2), true), TryAcquire::Queued);
    assert_eq!(g.try_acquire(0, ticket(3), true), TryAcquire::Queued);
    assert!(g.cancel(2));
    assert!(!g.cancel(2));
    assert!(!g.cancel(1), "a holder is not a waiter");
    assert_eq!(release_and_drain(&mut g, 1, 1), vec![3]);
}

#[test]
fn duplicate_ids_are_refused() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(0, ticket(1), false));
    assert_eq!(g.try_acquire(0, ticket(2), true), TryAcquire::Queued);
    assert!(matches!(
        g.try_acquire(0, ticket(1), true),
        TryAcquire::Refused { .. }
    ));
    assert!(matches!(
        g.try_acquire(0, ticket(2), true),
        TryAcquire::Refused { .. }
    ));
    assert_eq!((g.in_flight(), g.queued()), (1, 1));
}

#[test]
fn next_wakeup_says_act_now_when_waiters_are_admissible() {
    let mut g = Governor::new(settings(1));
    admitted(g.try_acquire(0, ticket(1), false));
    assert_eq!(g.try_acquire(0, ticket(2), true), TryAcquire::Queued);
    assert!(g.release(5, 1));
    assert_eq!(g.next_wakeup(5), Some(5));
    assert_eq!(drain(&mut g, 5), vec![2]);
    assert_eq!(g.next_wakeup(5), Some(30_005));
}

#[test]
fn ten_thousand_parked_waiters() {
    let mut g = Governor::new(PoolSettings {
        limit: 1,
        queue_size: 20_000,
        ..PoolSettings::default()
    });
    admitted(g.try_acquire(0, ticket(0), false));
    for id in 1..=10_000u128 {
        let key = (id % 97) as u64;
        assert_eq!(
            g.try_acquire(0, keyed(id, key, Priority::Normal), true),
            TryAcquire::Queued
        );
    }
    // Cancel every other waiter, in an order unrelated to the queue's.
    for id in (1..=10_000u128).rev().step_by(2) {
        assert!(g.cancel(id));
    }
    assert_eq!(g.queued(), 5_000);
    g.reconfigure(
        PoolSettings {
            limit: 10_001,
            queue_size: 20_000,
            ..PoolSettings::default()
        },
        0,
    );
    assert_eq!(drain(&mut g, 0).len(), 5_000);
}

fn announced(limit: u64, window_ms: u64) -> Outcome {
    Outcome {
        status: Some(200),
        rate: Some(RateInfo {
            limit: Some(limit),
            window_ms: Some(window_ms),
            ..RateInfo::default()
        }),
        ..Outcome::default()
    }
}

#[test]
fn a_learned_rate_spaces_admissions_evenly() {
    let mut g = Governor::new(settings(64));
    // 60 per minute announced: paced at 97 %, 1031 ms apart, two back to back at most.
    let adj = g.observe(0, &announced(60, 60_000)).unwrap();
    assert_eq!(adj.learned_rpm, Some(58));
    let s = g.snapshot(0);
    assert_eq!(
        (s.learned_rpm, s.rpm_remaining, s.paced_until),
        (Some(58), Some(58), None)
    );
    admitted(g.try_acquire(0, ticket(1), false));
    admitted(g.try_acquire(0, ticket(2), false));
    // The third must wait for the pace; it is an RPM refusal with an exact retry estimate.
    assert_eq!(
        refused(g.try_acquire(0, ticket(3), false)),
        (RefusalReason::Rpm, Some(1_031))
    );
    assert_eq!(g.snapshot(0).paced_until, Some(1_031));
    assert_eq!(g.try_acquire(0, ticket(4), true), TryAcquire::Queued);
    assert_eq!(g.try_acquire(0, ticket(5), true), TryAcquire::Queued);
    // Waiters wake when the pace allows, one per spacing.
    assert_eq!(g.next_wakeup(0), Some(1_031));
    assert_eq!(drain(&mut g, 1_030), Vec::<u128>::new());
    assert_eq!(drain(&mut g, 1_031), vec![4]);
    assert_eq!(g.next_wakeup(1_031), Some(2_062));
    assert_eq!(drain(&mut g, 2_062), vec![5]);
    // Over a busy minute the pace, not the rolling window, is what binds.
    let mut n = 0;
    for now in 2_063..62_063 {
        while let TryAcquire::Admitted(_) = g.try_acquire(now, ticket(100 + n), false) {
            n += 1;
            let id = 100 + n - 1;
            assert!(g.release(now, id));
        }
    }
    assert!((58..=59).contains(&n), "{n} admissions in a paced minute");
}

#[test]
fn the_pace_is_off_when_adaptive_is_off_or_nothing_is_announced() {
    let mut g = Governor::new(PoolSettings {
        adaptive: false,
        ..settings(10)
    });
    assert_eq!(g.observe(0, &announced(60, 60_000)), None);
    for id in 0..10 {
        admitted(g.try_acquire(0, ticket(id), false));
    }
    // Switching adaptive off forgets a learned pace too.
    let mut g = Governor::new(settings(10));
    g.observe(0, &announced(60, 60_000));
    g.reconfigure(
        PoolSettings {
            adaptive: false,
            ..settings(10)
        },
        0,
    );
    let s = g.snapshot(0);
    assert_eq!((s.learned_rpm, s.rpm_remaining), (None, None));
    for id in 0..10 {
        admitted(g.try_acquire(0, ticket(id), false));
    }
}

#[test]
fn the_configured_rpm_still_caps_a_looser_learned_one() {
    let mut g = Governor::new(PoolSettings {
        limit: 100,
        rpm: 3,
        ..PoolSettings::default()
    });
    g.observe(0, &announced(6_000, 60_000));
    let s = g.snapshot(0);
    assert_eq!((s.learned_rpm, s.rpm_remaining), (Some(5_820), Some(3)));
    for id in 0..3 {
        admitted(g.try_acquire(u64::try_from(id).unwrap() * 100, ticket(id), false));
    }
    assert_eq!(
        refused(g.try_acquire(300, ticket(9), false)).0,
        RefusalReason::Rpm
    );
}

#[test]
fn held_observations_decrease_once_per_overshoot_and_count_growth_only_when_limited() {
    let mut g = Governor::new(settings(8));
    for id in 0..8 {
        admitted(g.try_acquire(0, ticket(id), false));
    }
    let throttle = Outcome {
        status: Some(429),
        retry_after_ms: Some(50),
        via: Some("proxy"),
        ..Outcome::default()
    };
    // Eight admitted together, eight refused: one decrease, logged once.
    let first = g.observe_held(10, 0, &throttle).unwrap();
    assert_eq!(first.effective_limit, 4);
    assert_eq!(first.paused_until, Some(60));
    assert_eq!(
        first.what,
        "limit 8 -> 4 (throttled at 8: halved); paused for 50ms; \
         cause: status 429, retry-after 50ms (proxy)"
    );
    assert!(g.release(10, 0));
    for id in 1..8 {
        assert_eq!(g.observe_held(10, id, &throttle), None);
        assert!(g.release(10, id));
    }
    assert_eq!(g.snapshot(10).effective_limit, 4);
    // Requests admitted after the decrease that are refused again are news: halve again.
    for id in 10..14 {
        admitted(g.try_acquire(100, ticket(id), false));
    }
    assert_eq!(
        g.observe_held(150, 10, &throttle).unwrap().effective_limit,
        2
    );
    for id in 10..14 {
        g.release(150, id);
    }
    // A lone success at low concurrency says nothing about the limit.
    admitted(g.try_acquire(300, ticket(20), false));
    assert_eq!(g.observe_held(400, 20, &ok()), None);
    g.release(400, 20);
    admitted(g.try_acquire(400, ticket(21), false));
    g.observe_held(500, 21, &ok());
    g.release(500, 21);
    assert_eq!(g.snapshot(500).effective_limit, 2);
    // Two admitted together fill the limit: both successes count, and the limit grows.
    admitted(g.try_acquire(600, ticket(30), false));
    admitted(g.try_acquire(600, ticket(31), false));
    assert_eq!(g.observe_held(700, 30, &ok()), None);
    g.release(700, 30);
    let grown = g.observe_held(700, 31, &ok()).unwrap();
    assert_eq!(grown.effective_limit, 3);
    assert_eq!(grown.what, "limit 2 -> 3 (2 successes in a row)");
}

#[test]
fn decay_admits_slot_blocked_waiters_without_a_call() {
    let mut g = Governor::new(settings(8));
    g.observe(
        0,
        &Outcome {
            status: Some(429),
            ..Outcome::default()
        },
    );
    for id in 0..4 {
        admitted(g.try_acquire(1_000, ticket(id), false));
    }
    assert_eq!(g.try_acquire(1_000, ticket(9), true), TryAcquire::Queued);
    // Leases expire at 31 000 (renewed below); the decay step at 120 000 raises the limit to 6.
    for id in 0..4 {
        g.renew(25_000, id).unwrap();
    }
    let wake = g.next_wakeup(25_000).unwrap();
    assert_eq!(wake, 55_000, "lease expiry first");
    for t in [50_000, 75_000, 100_000] {
        for id in 0..4 {
            g.renew(t, id).unwrap();
        }
    }
    assert_eq!(g.next_wakeup(100_000), Some(120_000));
    assert_eq!(drain(&mut g, 119_999), Vec::<u128>::new());
    assert_eq!(drain(&mut g, 120_000), vec![9]);
    assert_eq!(g.snapshot(120_000).effective_limit, 6);
}

#[test]
fn only_the_release_that_frees_a_held_slot_teaches() {
    let mut g = Governor::new(settings(8));
    let bogus = Outcome {
        status: Some(429),
        retry_after_ms: Some(900_000),
        via: Some("lock release"),
        ..Outcome::default()
    };
    // A slot id nobody holds: nothing freed, nothing learned (before the fix this paused the
    // pool for 15 minutes and halved its limit).
    assert_eq!(g.release_observed(1_000, 42, Some(&bogus)), (false, None));
    assert_eq!(g.observe_held(1_000, 42, &bogus), None);
    let s = g.snapshot(1_000);
    assert_eq!(
        (s.paused_until, s.effective_limit, s.last_throttle),
        (None, 8, None)
    );

    // A real holder's report teaches once; the repeat release re-feeds nothing.
    admitted(g.try_acquire(1_000, ticket(1), false));
    let (released, adjustment) = g.release_observed(1_100, 1, Some(&bogus));
    assert!(released);
    let adjustment = adjustment.unwrap();
    assert_eq!(adjustment.effective_limit, 4);
    // Capped at the default `max_pause_ms`, not the 900000 asked for.
    assert_eq!(adjustment.paused_until, Some(1_100 + DEFAULT_MAX_PAUSE_MS));
    let later = 1_100 + DEFAULT_MAX_PAUSE_MS;
    let before = g.snapshot(later);
    assert_eq!(before.paused_until, None);
    assert_eq!(g.release_observed(later, 1, Some(&bogus)), (false, None));
    assert_eq!(g.snapshot(later), before);
}

#[test]
fn max_pause_caps_every_pause_one_outcome_can_impose() {
    let mut g = Governor::new(PoolSettings {
        max_pause_ms: 5_000,
        ..settings(8)
    });
    // Retry-After.
    g.observe(
        0,
        &Outcome {
            status: Some(503),
            retry_after_ms: Some(3_600_000),
            ..Outcome::default()
        },
    );
    assert_eq!(g.snapshot(0).paused_until, Some(5_000));
    // A spent budget's reset.
    g.observe(
        10_000,
        &Outcome {
            status: Some(200),
            rate: Some(RateInfo {
                remaining: Some(0),
                reset_ms: Some(86_400_000),
                ..RateInfo::default()
            }),
            ..Outcome::default()
        },
    );
    assert_eq!(g.snapshot(10_000).paused_until, Some(15_000));
    // An announced pace of one a day spaces admissions at most `max_pause_ms` apart (after the
    // pacer's burst of two).
    g.observe(20_000, &announced(1, 86_400_000));
    admitted(g.try_acquire(20_000, ticket(1), false));
    admitted(g.try_acquire(20_000, ticket(2), false));
    assert_eq!(g.snapshot(20_000).paced_until, Some(25_000));
    // Retry-After of a refusal reflects the cap.
    let (reason, retry) = refused(g.try_acquire(20_000, ticket(3), false));
    assert_eq!((reason, retry), (RefusalReason::Rpm, Some(5_000)));
}

#[test]
fn lowering_max_pause_shortens_the_pause_already_running() {
    let mut g = Governor::new(settings(8));
    g.observe(
        0,
        &Outcome {
            status: Some(429),
            retry_after_ms: Some(200_000),
            ..Outcome::default()
        },
    );
    assert_eq!(g.snapshot(0).paused_until, Some(200_000));
    g.reconfigure(
        PoolSettings {
            max_pause_ms: 10_000,
            ..settings(8)
        },
        1_000,
    );
    assert_eq!(g.snapshot(1_000).paused_until, Some(11_000));
}
