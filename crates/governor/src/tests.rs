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
    }
}

fn keyed(id: u128, key: u64, priority: Priority) -> Ticket {
    Ticket {
        id,
        fairness_key: key,
        priority,
        lease_ms: 30_000,
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
    // Recovery: 3 successes -> 4, then 4 -> 5, ... until the learned limit is forgotten at 8.
    let ok = Outcome {
        status: Some(200),
        ..Outcome::default()
    };
    for _ in 0..(3 + 4 + 5 + 6 + 7) {
        g.observe(5_000, &ok);
    }
    let s = g.snapshot(5_000);
    assert_eq!((s.effective_limit, s.learned_limit), (8, None));
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
