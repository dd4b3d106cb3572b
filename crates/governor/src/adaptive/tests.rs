//! The control law on an injected clock: every rule of the module docs, one test each.

use super::*;

const B: Bounds = Bounds {
    limit: 10,
    min_limit: 2,
    max_pause_ms: 300_000,
};

/// In use: as many in flight as the limit could be, so successes count towards growth.
const BUSY: Context = Context {
    limited: true,
    admitted_at: None,
    admitted_seq: None,
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

fn rate(rate: RateInfo) -> Outcome {
    Outcome {
        status: Some(200),
        rate: Some(rate),
        ..Outcome::default()
    }
}

fn per_minute(limit: u64) -> RateInfo {
    RateInfo {
        limit: Some(limit),
        window_ms: Some(60_000),
        ..RateInfo::default()
    }
}

/// `n` successes at `now`, in use.
fn successes(a: &mut Adaptive, now: u64, n: u32) {
    for _ in 0..n {
        a.observe(now, &status(200), B, BUSY);
    }
}

fn limit(a: &Adaptive, now: u64) -> u32 {
    a.effective_limit(B, now)
}

#[test]
fn throttle_halves_pauses_and_records_cause() {
    let mut a = Adaptive::default();
    let note = a.observe(1_000, &throttle(2_000), B, Context::default());
    assert_eq!(a.learned_limit(B, 1_000), Some(5));
    assert_eq!(limit(&a, 1_000), 5);
    assert_eq!(a.paused_until(1_000), Some(3_000));
    assert_eq!(a.paused_until(2_999), Some(3_000));
    assert_eq!(a.paused_until(3_000), None);
    let t = a.last_throttle().unwrap();
    assert_eq!(t.at, 1_000);
    assert_eq!(t.cause, "status 429, retry-after 2000ms");
    assert_eq!(
        note.as_deref(),
        Some(
            "limit 10 -> 5 (throttled at 10: halved); paused for 2000ms; \
             cause: status 429, retry-after 2000ms"
        )
    );
}

#[test]
fn cause_names_who_saw_it_and_which_headers_spoke() {
    let mut a = Adaptive::default();
    let proxied = Outcome {
        via: Some("proxy"),
        ..throttle(2_000)
    };
    a.observe(0, &proxied, B, Context::default());
    assert_eq!(
        a.last_throttle().unwrap().cause,
        "status 429, retry-after 2000ms (proxy)"
    );
    let spent = Outcome {
        via: Some("lock release"),
        dialect: Some("openai"),
        rate: Some(RateInfo {
            remaining: Some(0),
            reset_ms: Some(7_000),
            ..RateInfo::default()
        }),
        ..status(200)
    };
    a.observe(5_000, &spent, B, Context::default());
    let t = a.last_throttle().unwrap();
    assert_eq!(t.at, 5_000);
    assert_eq!(
        t.cause,
        "requests budget spent, resets in 7000ms (lock release, openai)"
    );
}

#[test]
fn burst_of_throttles_decreases_once_per_pause() {
    let mut a = Adaptive::default();
    for i in 0..8 {
        a.observe(1_000 + i, &throttle(2_000), B, Context::default());
    }
    assert_eq!(a.learned_limit(B, 1_000), Some(5));
    // The pause was extended by the later hints.
    assert_eq!(a.paused_until(1_000), Some(3_007));
    // After the pause a new throttle decreases again, and the floor holds.
    a.observe(3_007, &throttle(100), B, Context::default());
    assert_eq!(a.learned_limit(B, 3_007), Some(2));
    a.observe(10_000, &throttle(100), B, Context::default());
    assert_eq!(a.learned_limit(B, 10_000), Some(2));
}

#[test]
fn throttles_of_requests_admitted_before_the_decrease_are_not_new_evidence() {
    let mut a = Adaptive::default();
    let admitted = |at| Context {
        limited: true,
        admitted_at: Some(at),
        admitted_seq: None,
    };
    // Ten requests admitted at 0 all come back 429 with a short hint: one decrease.
    for i in 0..10 {
        a.observe(5 + i, &throttle(50), B, admitted(0));
    }
    assert_eq!(limit(&a, 20), 5);
    // A request admitted after the decrease and throttled is new evidence, even within the
    // minimum spacing that applies to reports without a slot.
    a.observe(200, &throttle(50), B, admitted(100));
    assert_eq!(limit(&a, 200), 2);
    // Without a slot, the time rule applies: within 1 s of the last decrease, no decrease.
    let mut a = Adaptive::default();
    a.observe(0, &throttle(50), B, Context::default());
    a.observe(500, &throttle(50), B, Context::default());
    assert_eq!(limit(&a, 500), 5);
    a.observe(1_000, &throttle(50), B, Context::default());
    assert_eq!(limit(&a, 1_000), 2);
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
        Context::default(),
    );
    assert_eq!(a.learned_limit(B, 0), Some(5));
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
        Context::default(),
    );
    assert_eq!(a.learned_limit(B, 0), Some(5));
    assert_eq!(a.paused_until(0), Some(DEFAULT_PAUSE_MS));
    assert_eq!(
        a.last_throttle().unwrap().cause,
        "status 200, 2 throttled, no retry hint, paused 1000ms"
    );

    // A 503 without a hint is an ordinary failure.
    let mut a = Adaptive::default();
    assert_eq!(a.observe(0, &status(503), B, Context::default()), None);
    assert_eq!(a.learned_limit(B, 0), None);
    assert_eq!(a.paused_until(0), None);
}

#[test]
fn pause_is_capped() {
    let mut a = Adaptive::default();
    a.observe(0, &throttle(u64::MAX), B, Context::default());
    assert_eq!(a.paused_until(0), Some(B.max_pause_ms));
}

#[test]
fn recovery_returns_fast_to_below_the_ceiling_then_probes_after_a_while() {
    let mut a = Adaptive::default();
    a.observe(0, &throttle(0), B, Context::default());
    assert_eq!(limit(&a, 0), 5);
    // A window of successes at 5 closes half the gap to ceiling - 1 = 9: 5 -> 7.
    successes(&mut a, 1, 4);
    assert_eq!(limit(&a, 1), 5);
    successes(&mut a, 1, 1);
    assert_eq!(limit(&a, 1), 7);
    // A neutral failure neither grows nor breaks the streak; a throttle would.
    a.observe(1, &status(500), B, BUSY);
    successes(&mut a, 1, 7);
    assert_eq!(limit(&a, 1), 8);
    successes(&mut a, 1, 8);
    assert_eq!(limit(&a, 1), 9);
    // 10 drew the throttle: it is not retried before the probe period has passed...
    successes(&mut a, 1, 9 * 12);
    assert_eq!(limit(&a, 1), 9);
    successes(&mut a, PROBE_AFTER_MS, 9);
    assert_eq!(limit(&a, PROBE_AFTER_MS), 10);
    assert_eq!(
        a.learned_limit(B, PROBE_AFTER_MS),
        None,
        "back at the configuration"
    );
}

#[test]
fn probing_waits_for_enough_successes_too() {
    // Slow answers: the probe period passes long before a hundred successes.
    let mut a = Adaptive::default();
    a.observe(0, &throttle(0), B, Context::default());
    successes(&mut a, 1, 5 + 7 + 8);
    assert_eq!(limit(&a, 1), 9);
    let later = 3 * PROBE_AFTER_MS;
    successes(&mut a, later, 9 * 8);
    assert_eq!(limit(&a, later), 9, "92 successes since the throttle");
    successes(&mut a, later, 9);
    assert_eq!(limit(&a, later), 10);
}

#[test]
fn successes_at_low_concurrency_do_not_grow_the_limit() {
    let mut a = Adaptive::default();
    a.observe(0, &throttle(0), B, Context::default());
    let idle = Context {
        limited: false,
        admitted_at: None,
        admitted_seq: None,
    };
    for _ in 0..100 {
        a.observe(1, &status(200), B, idle);
    }
    assert_eq!(limit(&a, 1), 5);
    for _ in 0..5 {
        a.observe(1, &status(200), B, BUSY);
    }
    assert_eq!(limit(&a, 1), 7);
}

#[test]
fn a_probe_that_fails_steps_back_to_the_last_good_level_instead_of_halving() {
    let b = Bounds {
        limit: 64,
        min_limit: 1,
        max_pause_ms: 300_000,
    };
    let mut a = Adaptive::default();
    // Converged at 8 (good), probing 9 fails: back to 8, not 4.
    a.observe(0, &throttle(0), b, Context::default());
    a.set_learned(8, b);
    for _ in 0..8 {
        a.observe(1, &status(200), b, BUSY);
    }
    assert_eq!(a.good, Some(8));
    a.set_learned(9, b);
    let note = a.observe(2_000, &throttle(100), b, Context::default());
    assert_eq!(a.effective_limit(b, 2_000), 8);
    assert!(note
        .unwrap()
        .starts_with("limit 9 -> 8 (throttled at 9: back to 8, the last level that held)"),);
    // If the origin got tighter, the good level is refused too: halve and forget it.
    a.observe(4_000, &throttle(100), b, Context::default());
    assert_eq!(a.effective_limit(b, 4_000), 4);
    assert_eq!(a.good, None);
}

#[test]
fn rate_throttles_pause_and_leave_the_concurrency_limit_alone() {
    let mut a = Adaptive::default();
    a.observe(0, &rate(per_minute(300)), B, BUSY);
    assert_eq!(a.learned_rpm(B, 0), Some(291));
    let spent = Outcome {
        status: Some(429),
        retry_after_ms: Some(150),
        rate: Some(RateInfo {
            remaining: Some(0),
            reset_ms: Some(150),
            ..per_minute(300)
        }),
        ..Outcome::default()
    };
    let note = a.observe(10, &spent, B, BUSY).unwrap();
    assert_eq!(a.learned_limit(B, 10), None, "concurrency is innocent");
    assert_eq!(a.paused_until(10), Some(160));
    // The spent budget holds admission back until its reset (no pace meanwhile); after it, the
    // sustainable pace rules until an answer says how much came back.
    assert_eq!(a.budget_blocked_until(10), Some(160));
    assert_eq!(a.learned_rpm(B, 10), None);
    assert_eq!(a.budget_state(160), BudgetState::Refilling);
    assert_eq!(a.learned_rpm(B, 160), Some(291));
    assert_eq!(
        note,
        "paused for 150ms; cause: status 429, retry-after 150ms; \
         requests budget spent, resets in 150ms"
    );
    // A token budget refusal is a rate refusal too.
    let tokens = Outcome {
        status: Some(429),
        rate: Some(RateInfo {
            token_remaining: Some(0),
            token_reset_ms: Some(2_000),
            ..RateInfo::default()
        }),
        ..Outcome::default()
    };
    a.observe(5_000, &tokens, B, BUSY);
    assert_eq!(a.learned_limit(B, 5_000), None);
    assert_eq!(a.paused_until(5_000), Some(7_000));
}

#[test]
fn pace_from_an_announced_window_when_no_budget_is_announced() {
    let mut a = Adaptive::default();
    // 300 per minute, used at 97 %: 206 ms apart, 291 rpm.
    let note = a.observe(0, &rate(per_minute(300)), B, BUSY);
    assert_eq!(a.pace_us(B, 0), Some(206_185));
    assert_eq!(a.learned_rpm(B, 0), Some(291));
    assert_eq!(a.budget_state(0), BudgetState::Unknown);
    assert_eq!(
        note.as_deref(),
        Some("pace 291 rpm (from 300 requests per 60000ms)")
    );
    // Small changes are not worth a note; big ones are.
    assert_eq!(a.observe(1, &rate(per_minute(310)), B, BUSY), None);
    assert!(a
        .observe(2, &rate(per_minute(150)), B, BUSY)
        .unwrap()
        .starts_with("pace 146 rpm"));
    // Remaining without a reset is no budget to mirror: the pace stays.
    let no_reset = rate(RateInfo {
        remaining: Some(20),
        ..per_minute(150)
    });
    a.observe(3, &no_reset, B, BUSY);
    assert_eq!(a.learned_rpm(B, 3), Some(146));
    // The slowest pace is capped like a pause.
    let mut a = Adaptive::default();
    a.observe(
        0,
        &rate(RateInfo {
            limit: Some(1),
            window_ms: Some(u64::MAX),
            ..RateInfo::default()
        }),
        B,
        BUSY,
    );
    assert_eq!(a.pace_us(B, 0), Some(B.max_pause_ms * 1_000));
    assert_eq!(a.learned_rpm(B, 0), Some(1));
}

fn budget(remaining: u64, reset_ms: u64) -> Outcome {
    rate(RateInfo {
        remaining: Some(remaining),
        reset_ms: Some(reset_ms),
        ..per_minute(300)
    })
}

/// Admits `n` (as the governor does for every grant).
fn admit(a: &mut Adaptive, n: u64) {
    for _ in 0..n {
        a.admitted();
    }
}

#[test]
fn an_announced_budget_with_room_is_spent_without_any_pace() {
    let mut a = Adaptive::default();
    // 240 left for a minute, 300 per minute: nothing holds admission back, whatever the rate.
    let note = a.observe(0, &budget(240, 60_000), B, BUSY);
    assert_eq!(
        note.as_deref(),
        Some("spending the announced budget (240 requests left, resets in 60000ms)")
    );
    assert_eq!(a.budget_state(0), BudgetState::Room);
    assert_eq!((a.pace_us(B, 0), a.learned_rpm(B, 0)), (None, None));
    // 240 less the margin (1 % of 300: 3) go out at once.
    admit(&mut a, 236);
    assert_eq!(a.budget_state(0), BudgetState::Room);
    assert_eq!(a.budget_blocked_until(0), None);
    admit(&mut a, 1);
    assert_eq!(a.budget_state(0), BudgetState::SpentUntil(60_000));
    assert_eq!(a.budget_blocked_until(59_999), Some(60_000));
}

#[test]
fn a_spent_estimate_holds_back_until_the_reset_then_the_window_pace_rules() {
    let mut a = Adaptive::default();
    a.observe(0, &budget(10, 5_000), B, BUSY);
    admit(&mut a, 7);
    assert_eq!(a.budget_blocked_until(100), Some(5_000));
    // Held back by the budget, not by a pace (nothing to note each time the margin is crossed).
    assert_eq!(a.learned_rpm(B, 100), None);
    // Reset passed, nothing announced since: it refilled by an unknown amount, so the
    // sustainable pace (300 per minute) rules until an answer says more.
    assert_eq!(a.budget_state(5_000), BudgetState::Refilling);
    assert_eq!(a.budget_blocked_until(5_000), None);
    assert_eq!(a.learned_rpm(B, 5_000), Some(291));
    // Without a window length there is no pace: a fixed window refilled whole at its reset.
    let mut a = Adaptive::default();
    let fixed = rate(RateInfo {
        limit: Some(5_000),
        remaining: Some(1),
        reset_ms: Some(100_000),
        ..RateInfo::default()
    });
    a.observe(0, &fixed, B, BUSY);
    assert_eq!(a.budget_blocked_until(0), Some(100_000));
    assert_eq!(a.budget_state(100_000), BudgetState::Refilling);
    assert_eq!(a.pace_us(B, 100_000), None);
    // The pause a spent budget imposes is capped like any other.
    let mut a = Adaptive::default();
    a.observe(0, &budget(1, u64::MAX), B, BUSY);
    assert_eq!(a.budget_blocked_until(0), Some(B.max_pause_ms));
}

#[test]
fn a_fresh_announcement_rebases_the_estimate() {
    let mut a = Adaptive::default();
    a.observe(0, &budget(10, 60_000), B, BUSY);
    admit(&mut a, 7);
    assert_eq!(a.budget_blocked_until(10), Some(60_000));
    // A later answer says more is left (a rolling window let some age out): room again.
    a.observe(20, &budget(50, 1_000), B, BUSY);
    assert_eq!(a.budget_state(20), BudgetState::Room);
    // An answer to a request admitted before the last 4 admissions: the origin may not have
    // counted those yet, so they come off what it announced.
    let seq = a.admissions();
    admit(&mut a, 4);
    let ctx = Context {
        admitted_seq: Some(seq),
        ..BUSY
    };
    a.observe(30, &budget(8, 2_000), B, ctx);
    // 8 - 4 = 4 left, margin 3: one more admission, then held back until the reset.
    assert_eq!(a.budget_state(30), BudgetState::Room);
    admit(&mut a, 1);
    assert_eq!(a.budget_state(30), BudgetState::SpentUntil(2_030));
    // A mirrored budget lapses like a pace when nobody repeats it.
    assert_eq!(a.budget_state(30 + RATE_STALE_MS), BudgetState::Unknown);
}

#[test]
fn an_announced_pace_lapses_when_nobody_repeats_it() {
    let mut a = Adaptive::default();
    a.observe(0, &rate(per_minute(60)), B, BUSY);
    assert_eq!(a.learned_rpm(B, RATE_STALE_MS - 1), Some(58));
    assert_eq!(a.learned_rpm(B, RATE_STALE_MS), None);
    let note = a.observe(RATE_STALE_MS, &status(200), B, BUSY);
    assert_eq!(note.as_deref(), Some("pace lifted"));
}

#[test]
fn learned_limit_decays_towards_the_configuration_when_the_origin_is_quiet() {
    let b = Bounds {
        limit: 64,
        min_limit: 1,
        max_pause_ms: 300_000,
    };
    let mut a = Adaptive::default();
    a.observe(0, &throttle(0), b, Context::default());
    a.observe(2_000, &throttle(0), b, Context::default());
    a.observe(4_000, &throttle(0), b, Context::default());
    assert_eq!(a.effective_limit(b, 4_000), 8);
    // Decay is visible without any call (admission reads it), half the gap per quiet period.
    assert_eq!(a.effective_limit(b, 4_000 + QUIET_MS - 1), 8);
    assert_eq!(a.effective_limit(b, 4_000 + QUIET_MS), 36);
    assert_eq!(a.effective_limit(b, 4_000 + 2 * QUIET_MS), 50);
    assert_eq!(a.next_decay(b, 4_000), Some(4_000 + QUIET_MS));
    assert_eq!(
        a.next_decay(b, 4_000 + QUIET_MS + 5),
        Some(4_000 + 2 * QUIET_MS)
    );
    // An observation writes it back and says so; a throttle restarts the quiet period.
    let note = a.observe(4_000 + QUIET_MS, &status(200), b, Context::default());
    assert_eq!(
        note.as_deref(),
        Some("limit 8 -> 36 (no throttle for 120s: decayed towards the configured 64)")
    );
    assert_eq!(a.effective_limit(b, 4_000 + 2 * QUIET_MS), 50);
    a.observe(4_000 + 2 * QUIET_MS, &throttle(0), b, Context::default());
    assert_eq!(a.effective_limit(b, 4_000 + 2 * QUIET_MS), 25);
    assert_eq!(a.effective_limit(b, 4_000 + 3 * QUIET_MS - 1), 25);
    // Enough quiet and everything learned is gone.
    assert_eq!(a.effective_limit(b, 4_000 + 100 * QUIET_MS), 64);
    assert_eq!(a.learned_limit(b, 4_000 + 100 * QUIET_MS), None);
    assert_eq!(a.next_decay(b, 4_000 + 100 * QUIET_MS), None);
}

#[test]
fn decay_forgets_the_ceiling() {
    let mut a = Adaptive::default();
    a.observe(0, &throttle(0), B, Context::default());
    assert_eq!(a.ceiling, Some(10));
    a.observe(QUIET_MS, &status(200), B, BUSY);
    assert_eq!(a.ceiling, None);
    assert_eq!(limit(&a, QUIET_MS), 8);
}

#[test]
fn exhausted_rate_budget_pauses_until_reset() {
    let mut a = Adaptive::default();
    let spent = RateInfo {
        remaining: Some(0),
        reset_ms: Some(7_000),
        ..RateInfo::default()
    };
    a.observe(100, &rate(spent), B, BUSY);
    assert_eq!(a.paused_until(100), Some(7_100));
    assert_eq!(a.learned_limit(B, 100), None);
    assert!(a
        .last_throttle()
        .unwrap()
        .cause
        .contains("requests budget spent"));

    let mut a = Adaptive::default();
    let tokens = RateInfo {
        token_remaining: Some(0),
        token_reset_ms: Some(300),
        ..RateInfo::default()
    };
    a.observe(
        100,
        &Outcome {
            rate: Some(tokens),
            ..Outcome::default()
        },
        B,
        BUSY,
    );
    assert_eq!(a.paused_until(100), Some(400));

    let mut a = Adaptive::default();
    let left = RateInfo {
        remaining: Some(3),
        reset_ms: Some(7_000),
        ..RateInfo::default()
    };
    a.observe(100, &rate(left), B, BUSY);
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
            min_limit: 3,
            max_pause_ms: 300_000,
        }
    );
    let mut a = Adaptive::default();
    a.observe(0, &throttle(0), b, Context::default());
    assert_eq!(a.learned_limit(b, 0), None);
    assert_eq!(a.effective_limit(b, 0), 3);

    // Never below min_limit, however many throttles.
    let mut a = Adaptive::default();
    for i in 0..50 {
        a.observe(i * 2_000, &throttle(0), B, Context::default());
        assert!(limit(&a, i * 2_000) >= B.min_limit);
    }
    assert_eq!(limit(&a, 100_000), B.min_limit);
    // Never above limit, however many successes.
    for _ in 0..10_000 {
        a.observe(200_000, &status(200), B, BUSY);
        assert!(limit(&a, 200_000) <= B.limit);
    }

    // A learned limit outside new bounds is refitted.
    let mut a = Adaptive::default();
    a.observe(0, &throttle(0), B, Context::default());
    assert_eq!(a.learned_limit(B, 0), Some(5));
    a.rebound(
        Bounds {
            limit: 4,
            min_limit: 1,
            max_pause_ms: 300_000,
        },
        0,
    );
    assert_eq!(a.learned_limit(B, 0), None);
    let mut a = Adaptive::default();
    a.observe(0, &throttle(0), B, Context::default());
    let wider = Bounds {
        limit: 20,
        min_limit: 6,
        max_pause_ms: 300_000,
    };
    a.rebound(wider, 0);
    assert_eq!(a.learned_limit(wider, 0), Some(6));
}

#[test]
fn forget_keeps_only_the_record() {
    let mut a = Adaptive::default();
    a.observe(0, &rate(per_minute(60)), B, BUSY);
    a.observe(0, &throttle(5_000), B, Context::default());
    a.forget();
    assert_eq!(
        (
            a.learned_limit(B, 0),
            a.learned_rpm(B, 0),
            a.paused_until(0)
        ),
        (None, None, None)
    );
    assert!(a.last_throttle().is_some());
}
