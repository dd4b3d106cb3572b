//! What only the in-process gate does, at its public boundary (the `PoolGate` trait), on a
//! `ManualClock`: exact deadlines and wait times, wall-clock steps, the ticker's life. What every
//! gate must do is in `conformance`, run on both implementations. Real tokio time appears only as a safety
//! timeout so a broken gate fails instead of hanging.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use nthbouncer_coord::in_process::InProcessCoordination;
use nthbouncer_coord::{
    Coordination, ManualClock, Outcome, PoolGate, PoolSettings, Refusal, RefusalReason, RenewError,
    SlotKind,
};

use crate::conformance::{join, limit, req, spawn_acquire};

const T0: u64 = 1_700_000_000_000;

fn manual() -> (Arc<ManualClock>, InProcessCoordination) {
    let clock = Arc::new(ManualClock::new(T0));
    let coord = InProcessCoordination::new(clock.clone());
    (clock, coord)
}

/// Lets spawned tasks (waiters, the ticker) run until `cond` holds; fails instead of hanging.
async fn until<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while !cond().await {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out waiting for {what}");
}

async fn queued(gate: &Arc<dyn PoolGate>, n: u32) {
    until(&format!("{n} queued"), || async {
        gate.snapshot().await.queued == n
    })
    .await;
}

/// Gives every ready task a few turns.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn each_waiters_queued_ms_is_its_wait_on_the_gates_clock() {
    let (clock, coord) = manual();
    let gate = coord.open("p", limit(1));
    let first = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    let mut waiters = Vec::new();
    for i in 0..5u32 {
        waiters.push(spawn_acquire(&gate, req(60_000, SlotKind::Exchange)));
        queued(&gate, i + 1).await;
    }
    let mut holder = first.slot_id;
    for (i, waiter) in waiters.into_iter().enumerate() {
        clock.advance(100);
        assert!(gate.release(holder, None).await);
        let g = join(waiter).await.unwrap();
        // Each waited from its arrival (all at T0) until its turn came, on the gate's clock.
        assert_eq!(g.headers.queued_ms, 100 * (i as u64 + 1));
        holder = g.slot_id;
    }
    let s = gate.snapshot().await;
    assert_eq!((s.in_flight, s.queued), (1, 0));
}

#[tokio::test]
async fn wait_budget_spent_is_queue_timeout() {
    let (clock, coord) = manual();
    let gate = coord.open("p", limit(1));
    let _held = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    let waiter = spawn_acquire(&gate, req(1_000, SlotKind::Exchange));
    queued(&gate, 1).await;
    clock.advance(999);
    settle().await;
    assert!(!waiter.is_finished());
    clock.advance(1);
    match join(waiter).await {
        Err(Refusal::QueueTimeout { headers }) => assert_eq!(headers.queued_ms, 1_000),
        other => panic!("expected queue timeout, got {other:?}"),
    }
    let s = gate.snapshot().await;
    assert_eq!((s.in_flight, s.queued), (1, 0));
}

#[tokio::test]
async fn unrenewed_lease_is_reclaimed_after_one_term_and_goes_to_a_waiter() {
    let (clock, coord) = manual();
    let gate = coord.open("p", limit(1));
    let lease = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert_eq!(lease.lease_deadline, T0 + 30_000);
    let waiter = spawn_acquire(&gate, req(60_000, SlotKind::Lease));
    queued(&gate, 1).await;

    clock.advance(29_999);
    settle().await;
    assert!(!waiter.is_finished());
    clock.advance(1);
    let g = join(waiter).await.unwrap();
    assert_eq!(g.headers.queued_ms, 30_000);
    assert_eq!(gate.renew(lease.slot_id).await, Err(RenewError::NotFound));
    assert!(!gate.release(lease.slot_id, None).await);
    assert_eq!(gate.snapshot().await.in_flight, 1);
}

/// Leases run on the monotonic clock: a wall-clock step (NTP, an operator's `date`) reclaims
/// nothing, while monotonic time past the term does. Before, the gate ran its leases on the wall
/// clock, and a one-hour step reclaimed every held slot at once (and handed it to a waiter).
#[tokio::test]
async fn a_wall_clock_step_reclaims_nothing_but_monotonic_time_does() {
    let (clock, coord) = manual();
    let gate = coord.open("p", limit(1));
    let held = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    let term = PoolSettings::default().lease_term_ms;
    assert_eq!(held.lease_deadline, T0 + term);
    let waiter = spawn_acquire(&gate, req(60_000, SlotKind::Lease));
    queued(&gate, 1).await;

    clock.step_wall(3_600_000);
    settle().await;
    let s = gate.snapshot().await;
    assert_eq!(
        (s.in_flight, s.queued),
        (1, 1),
        "the wall step reclaimed the lease"
    );
    assert!(!waiter.is_finished());
    // What is shown follows the wall clock: the renewed lease ends one term from the new time.
    assert_eq!(
        gate.renew(held.slot_id).await.unwrap(),
        T0 + 3_600_000 + term
    );

    // Monotonic time past the (renewed) term reclaims it, and the waiter gets the slot.
    clock.advance(term - 1);
    settle().await;
    assert!(!waiter.is_finished());
    clock.advance(1);
    let next = join(waiter).await.unwrap();
    assert_eq!(next.lease_deadline, T0 + 3_600_000 + 2 * term);
    assert_eq!(gate.renew(held.slot_id).await, Err(RenewError::NotFound));
}

/// Deadlines shown at a grant and at a later renew come from one offset between the clocks: a
/// wall clock that drifts by a millisecond between them (as the system clocks do) must not show
/// a lease renewed to its cap as ending after the request deadline. Before, each answer
/// converted on its own reading and the client saw `leaseDeadline = requestDeadline + 1`.
#[tokio::test]
async fn shown_deadlines_stay_consistent_when_the_wall_clock_jitters() {
    let (clock, coord) = manual();
    let settings = PoolSettings {
        limit: 1,
        lease_term_ms: 300,
        request_timeout_ms: 600,
        ..PoolSettings::default()
    };
    let gate = coord.open("p", settings);
    let held = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    clock.advance(250);
    clock.step_wall(1);
    assert_eq!(gate.renew(held.slot_id).await.unwrap(), T0 + 550);
    clock.advance(250);
    clock.step_wall(1);
    assert_eq!(
        gate.renew(held.slot_id).await.unwrap(),
        held.request_deadline,
        "renewed to the cap: exactly the request deadline shown at the grant"
    );
}

/// A pause and a wait budget are monotonic too: a wall step neither ends them nor stretches them,
/// and the pause is shown in epoch ms of the moment it is read.
#[tokio::test]
async fn pauses_and_wait_budgets_ignore_wall_steps() {
    let (clock, coord) = manual();
    let gate = coord.open("p", limit(1));
    gate.report(Outcome {
        status: Some(429),
        retry_after_ms: Some(2_000),
        ..Outcome::default()
    })
    .await;
    assert_eq!(gate.snapshot().await.paused_until, Some(T0 + 2_000));
    let waiter = spawn_acquire(&gate, req(10_000, SlotKind::Exchange));
    queued(&gate, 1).await;
    clock.step_wall(3_600_000);
    settle().await;
    assert!(!waiter.is_finished(), "the wall step ended the pause");
    assert_eq!(
        gate.snapshot().await.paused_until,
        Some(T0 + 3_600_000 + 2_000)
    );
    clock.advance(2_000);
    let g = join(waiter).await.unwrap();
    assert_eq!(g.headers.queued_ms, 2_000);
}

#[tokio::test]
async fn renewing_keeps_a_lease_alive_until_the_cap() {
    let (clock, coord) = manual();
    let settings = PoolSettings {
        limit: 1,
        request_timeout_ms: 45_000,
        ..PoolSettings::default()
    };
    let gate = coord.open("p", settings);
    let lease = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    clock.advance(10_000);
    assert_eq!(gate.renew(lease.slot_id).await, Ok(T0 + 40_000));
    clock.advance(10_000);
    assert_eq!(gate.renew(lease.slot_id).await, Ok(T0 + 45_000));
    assert_eq!(gate.renew(lease.slot_id).await, Err(RenewError::Capped));
    // Past the first term the renewed slot is still held.
    clock.advance(15_000);
    settle().await;
    assert_eq!(gate.snapshot().await.in_flight, 1);
    // At the request deadline it is reclaimed.
    clock.advance(10_000);
    until("reclaim at the request deadline", || async {
        gate.snapshot().await.in_flight == 0
    })
    .await;

    // An exchange slot's lease is its request deadline plus the grace its holder has to close
    // a cut exchange's upstream connection: nothing to renew.
    let exchange = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    assert_eq!(
        exchange.lease_deadline,
        exchange.request_deadline + nthbouncer_coord::EXCHANGE_GRACE_MS
    );
    assert_eq!(gate.renew(exchange.slot_id).await, Err(RenewError::Capped));
    // At its request deadline the slot is still held (its holder is ending the exchange); at
    // the end of the grace it is reclaimed.
    clock.advance(45_000);
    settle().await;
    assert_eq!(gate.snapshot().await.in_flight, 1);
    clock.advance(nthbouncer_coord::EXCHANGE_GRACE_MS);
    until("reclaim at the end of the grace", || async {
        gate.snapshot().await.in_flight == 0
    })
    .await;
}

#[tokio::test]
async fn throttle_report_pauses_and_the_ticker_resumes_at_the_pause_end() {
    let (clock, coord) = manual();
    let gate = coord.open("p", limit(4));
    let a = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    let throttle = Outcome {
        status: Some(429),
        retry_after_ms: Some(2_000),
        ..Outcome::default()
    };
    assert!(gate.release(a.slot_id, Some(throttle)).await);
    let s = gate.snapshot().await;
    assert_eq!((s.effective_limit, s.paused_until), (2, Some(T0 + 2_000)));
    assert_eq!(
        s.last_throttle.unwrap().cause,
        "status 429, retry-after 2000ms"
    );

    match gate.acquire(req(0, SlotKind::Exchange)).await {
        Err(Refusal::TooManyRequests {
            reason,
            retry_after_ms,
            ..
        }) => {
            assert_eq!(
                (reason, retry_after_ms),
                (RefusalReason::Paused, Some(2_000))
            );
        }
        other => panic!("expected paused, got {other:?}"),
    }
    let waiter = spawn_acquire(&gate, req(10_000, SlotKind::Exchange));
    queued(&gate, 1).await;
    clock.advance(1_999);
    settle().await;
    assert!(!waiter.is_finished());
    clock.advance(1);
    let g = join(waiter).await.unwrap();
    assert_eq!(g.headers.effective_limit, 2);
}

#[tokio::test]
async fn rpm_waiter_is_admitted_when_the_window_frees() {
    let (clock, coord) = manual();
    let gate = coord.open(
        "p",
        PoolSettings {
            rpm: 1,
            ..PoolSettings::default()
        },
    );
    let a = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    assert_eq!(a.headers.rpm_remaining, Some(0));
    assert!(gate.release(a.slot_id, None).await);
    let waiter = spawn_acquire(&gate, req(120_000, SlotKind::Exchange));
    queued(&gate, 1).await;
    clock.advance(59_999);
    settle().await;
    assert!(!waiter.is_finished());
    clock.advance(1);
    let g = join(waiter).await.unwrap();
    assert_eq!(
        (g.headers.queued_ms, g.headers.rpm_remaining),
        (60_000, Some(0))
    );
}

#[tokio::test]
async fn closing_the_gate_stops_its_ticker() {
    let (clock, coord) = manual();
    let clock_refs = Arc::strong_count(&clock);
    let gate = coord.open("p", limit(1));
    let held = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    // The gate and its ticker each hold the clock.
    until("ticker running", || async {
        Arc::strong_count(&clock) == clock_refs + 2
    })
    .await;
    let waiter = spawn_acquire(&gate, req(60_000, SlotKind::Exchange));
    queued(&gate, 1).await;
    gate.close().await;
    assert_eq!(join(waiter).await.unwrap_err(), Refusal::PoolClosed);
    assert_eq!(
        gate.acquire(req(0, SlotKind::Exchange)).await.unwrap_err(),
        Refusal::PoolClosed
    );
    until("ticker stopped", || async {
        Arc::strong_count(&clock) == clock_refs + 1
    })
    .await;
    assert_eq!(gate.snapshot().await.queued, 0);
    // Holders may still release into a closed gate.
    assert!(gate.release(held.slot_id, None).await);
}

#[tokio::test]
async fn dropping_the_gate_stops_its_ticker() {
    let (clock, coord) = manual();
    let clock_refs = Arc::strong_count(&clock);
    let gate = coord.open("p", limit(1));
    let _lease = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    until("ticker running", || async {
        Arc::strong_count(&clock) == clock_refs + 2
    })
    .await;
    drop(gate);
    until("ticker gone", || async {
        Arc::strong_count(&clock) == clock_refs
    })
    .await;
}

#[tokio::test]
async fn gates_opened_outside_a_runtime_start_their_ticker_on_first_use() {
    let clock = Arc::new(ManualClock::new(T0));
    let coord = InProcessCoordination::new(clock.clone());
    let gate = std::thread::spawn(move || coord.open("p", limit(1)))
        .join()
        .unwrap();
    let _lease = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    clock.advance(30_000);
    until("reclaim by the lazily started ticker", || async {
        gate.snapshot().await.in_flight == 0
    })
    .await;
}
