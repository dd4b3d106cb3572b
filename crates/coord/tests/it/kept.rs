//! Kept slots on Redis (see the gate's `Keeping`): while a pool has room to spare, a node keeps
//! an exchange slot leased after its call ends and lends it to its next exchange without a call
//! to Redis. What must hold: a lent slot is the same lease (nothing new is leased), an idle one
//! goes back after a poll interval, another node short of a slot gets it back at once (a
//! reclaim, not a wait for the keeper's next check), the limit holds under load across nodes,
//! and every lent slot is counted as an admission. Counts and order only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nthbouncer_coord::redis::{RedisCoordination, RedisOptions};
use nthbouncer_coord::{
    AcquireRequest, Coordination, Outcome, PoolGate, PoolSettings, Priority, SlotKind, SystemClock,
};

use crate::conformance::{req, until};
use crate::on_redis::Space;

fn settings(limit: u32) -> PoolSettings {
    PoolSettings {
        limit,
        queue_size: 1_000,
        ..PoolSettings::default()
    }
}

fn node_polling_every(space: &Space, poll_ms: u64) -> RedisCoordination {
    let options = RedisOptions {
        poll_interval: Duration::from_millis(poll_ms),
        ..space.options()
    };
    RedisCoordination::new(options, Arc::new(SystemClock::new())).unwrap()
}

fn leases(space: &Space, pool: &str) -> Vec<String> {
    space.sync_cmd(
        ::redis::cmd("ZRANGE")
            .arg(format!("{}:{{{pool}}}:leases", space.prefix))
            .arg(0)
            .arg(-1),
    )
}

/// Acquires and releases one exchange until its slot stays leased after the release: the
/// node keeps it (the first admission asks for a check of the pool, which allows keeping).
async fn until_one_is_kept(space: &Space, pool: &str, gate: &Arc<dyn PoolGate>) {
    until("a released exchange slot is kept", || async {
        let g = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(gate.release(g.slot_id, None).await);
        leases(space, pool).len() == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_slot_is_lent_without_a_new_lease_and_goes_back_when_idle() {
    let space = Space::new();
    // Idle slots are trimmed at a poll interval: one long enough that the test's own steps
    // cannot outlast it on a busy machine.
    let node = node_polling_every(&space, 1_000);
    let gate = node.open("kept", settings(32));
    until_one_is_kept(&space, "kept", &gate).await;
    let kept = leases(&space, "kept");
    assert_eq!(
        gate.snapshot().await.in_flight,
        0,
        "an idle kept slot runs nothing"
    );

    // Lent: the same lease, under a fresh id for its holder.
    let lent = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    assert_eq!(leases(&space, "kept"), kept, "lent, not leased anew");
    assert_ne!(lent.slot_id.to_string(), kept[0]);
    assert_eq!(lent.headers.effective_limit, 32);
    assert!(
        gate.lease_watch(lent.slot_id).is_some(),
        "a lent slot is watched"
    );
    assert_eq!(gate.snapshot().await.in_flight, 1);
    // A second call at the same time gets a lease of its own.
    let second = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    assert_eq!(leases(&space, "kept").len(), 2);
    assert!(gate.release(second.slot_id, None).await);
    assert!(gate.release(lent.slot_id, None).await);
    // Released twice: the second finds nothing (the slot's id in Redis is not the holder's).
    assert!(!gate.release(lent.slot_id, None).await);

    // Idle for a poll interval: both go back.
    until("idle kept slots are freed", || async {
        leases(&space, "kept").is_empty()
    })
    .await;
    // Both admissions and the loan were counted.
    let admitted: u64 = space.sync_cmd(
        ::redis::cmd("HGET")
            .arg(format!("{}:{{kept}}:meta", space.prefix))
            .arg("admitted"),
    );
    assert!(admitted >= 3, "{admitted}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_short_of_a_slot_gets_the_slots_another_keeps_at_once() {
    let space = Space::new();
    // The keeper checks the pool only every 20 s: a waiter elsewhere that gets its slot within
    // its 3 s budget got it by the reclaim, not by the keeper's trimming or checks.
    let keeper = node_polling_every(&space, 20_000);
    let other = space.node();
    let ga = keeper.open("short", settings(16));
    let gb = other.open("short", settings(16));
    until_one_is_kept(&space, "short", &ga).await;

    // The other node takes every slot but the kept one, then waits for one.
    let mut held = Vec::new();
    for _ in 0..15 {
        held.push(gb.acquire(req(0, SlotKind::Exchange)).await.unwrap());
    }
    assert_eq!(leases(&space, "short").len(), 16);
    let last = gb
        .acquire(req(3_000, SlotKind::Exchange))
        .await
        .expect("the kept slot is reclaimed for the waiter");
    assert!(last.headers.queued_ms < 3_000);
    // The keeper stopped keeping: its own next exchange goes through Redis (and waits, the
    // pool is full).
    match ga.acquire(req(0, SlotKind::Exchange)).await {
        Err(nthbouncer_coord::Refusal::TooManyRequests { .. }) => {}
        other => panic!("the pool is full, nothing kept: {other:?}"),
    }
    held.push(last);
    for g in held {
        assert!(gb.release(g.slot_id, None).await);
    }
    until("every slot goes back", || async {
        leases(&space, "short").is_empty()
    })
    .await;
}

/// Thirty workers on three nodes, each looping acquire, a short hold, release, on a pool of 24,
/// half of them joining late (room to spare, then not): slots are kept and lent while there is
/// room and reclaimed when there is not, and still never
/// more than 24 run at once, every acquire is served, each is counted as one admission, and
/// nothing stays leased once they stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_slots_never_exceed_the_limit_and_every_loan_counts() {
    const LIMIT: u32 = 24;
    const WORKERS: u32 = 30;
    const ROUNDS: u32 = 40;
    const LATE_START_MS: u64 = 20;
    let space = Space::new();
    let nodes: Vec<_> = (0..3).map(|_| space.node()).collect();
    let gates: Vec<_> = nodes
        .iter()
        .map(|n| n.open("load", settings(LIMIT)))
        .collect();
    let holding = Arc::new(AtomicU32::new(0));
    let max_holding = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let gate = Arc::clone(&gates[usize::try_from(w % 3).unwrap()]);
        let (holding, max_holding) = (holding.clone(), max_holding.clone());
        tasks.push(tokio::spawn(async move {
            if w >= WORKERS / 2 {
                tokio::time::sleep(Duration::from_millis(LATE_START_MS)).await;
            }
            for round in 0..ROUNDS {
                let r = AcquireRequest {
                    fairness_key: u64::from(w % 4),
                    priority: Priority::Normal,
                    wait_ms: 30_000,
                    kind: SlotKind::Exchange,
                };
                let g = gate
                    .acquire(r)
                    .await
                    .unwrap_or_else(|refusal| panic!("worker {w} refused: {refusal:?}"));
                let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                max_holding.fetch_max(now, Ordering::SeqCst);
                let hold_us = u64::from((w * 37 + round * 101) % 2_000);
                tokio::time::sleep(Duration::from_micros(hold_us)).await;
                holding.fetch_sub(1, Ordering::SeqCst);
                let ok = Outcome {
                    status: Some(200),
                    ..Outcome::default()
                };
                assert!(gate.release(g.slot_id, Some(ok)).await);
            }
        }));
    }
    // Redis itself never counts more than the limit either.
    let mut seen_max = 0;
    while !tasks.iter().all(tokio::task::JoinHandle::is_finished) {
        seen_max = seen_max.max(leases(&space, "load").len());
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("workers finish")
            .unwrap();
    }
    let max = max_holding.load(Ordering::SeqCst);
    assert!(max <= LIMIT, "{max} holders at once");
    assert!(
        seen_max <= usize::try_from(LIMIT).unwrap(),
        "{seen_max} leases"
    );
    until("nothing stays leased", || async {
        leases(&space, "load").is_empty()
    })
    .await;
    let meta = format!("{}:{{load}}:meta", space.prefix);
    until("every loan is counted as an admission", || async {
        let admitted: u64 = space.sync_cmd(::redis::cmd("HGET").arg(&meta).arg("admitted"));
        admitted == u64::from(WORKERS * ROUNDS)
    })
    .await;
    let s = gates[0].snapshot().await;
    assert_eq!((s.in_flight, s.queued), (0, 0));
}

/// A TCP forwarder to the real Redis that counts the script calls (`FCALL`, or `EVALSHA`) a
/// node sends.
struct ScriptCalls {
    port: u16,
    sent: Arc<AtomicU32>,
    accept: tokio::task::JoinHandle<()>,
}

impl ScriptCalls {
    async fn start() -> ScriptCalls {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = crate::on_redis::redis_address();
        let sent = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&sent);
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let (target, counted) = (target.clone(), Arc::clone(&counted));
                tokio::spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    let (mut from_node, mut to_node) = inbound.into_split();
                    let (mut from_redis, mut to_redis) = outbound.into_split();
                    tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut from_redis, &mut to_node).await;
                    });
                    // The command name is a bulk string of its own: "$5\r\nFCALL\r\n" (a
                    // script as a function), or "$7\r\nEVALSHA\r\n" on a Redis without them.
                    // The tail of each read is kept, so a name split across two reads counts
                    // once.
                    let needles: [&[u8]; 2] = [b"\r\nFCALL\r\n", b"\r\nEVALSHA\r\n"];
                    let longest = needles.iter().map(|n| n.len()).max().unwrap_or(1);
                    let mut window: Vec<u8> = Vec::new();
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let n = match from_node.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        // Counted before Redis sees it, so before the node can have its answer:
                        // a test that reads the count after a call returns finds it there.
                        window.extend_from_slice(&buf[..n]);
                        let found: usize = needles
                            .iter()
                            .map(|needle| {
                                window
                                    .windows(needle.len())
                                    .filter(|w| w.eq_ignore_ascii_case(needle))
                                    .count()
                            })
                            .sum();
                        counted.fetch_add(u32::try_from(found).unwrap(), Ordering::SeqCst);
                        let keep = window.len().min(longest - 1);
                        window.drain(..window.len() - keep);
                        if to_redis.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        ScriptCalls { port, sent, accept }
    }
}

impl Drop for ScriptCalls {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Keeping is for exchange slots: a lock lease admitted through Redis must not ask for a check
/// of the pool (a `renew` call of its own). A lock pair on a free slot is its acquire and its
/// release, two script calls (and one probe of the pool's generation when the gate starts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_pair_costs_two_script_calls_and_asks_for_no_keeping_check() {
    let space = Space::new();
    let counter = ScriptCalls::start().await;
    let options = RedisOptions {
        url: format!("redis://127.0.0.1:{}/", counter.port),
        ..space.options()
    };
    let node = RedisCoordination::new(options, Arc::new(SystemClock::new())).unwrap();
    let gate = node.open("locks", settings(64));
    // The gate's start, before counting: its ticker probes the pool's generation at once (no
    // call has told it yet), then one pair. Waiting for the probe first keeps it from going out
    // after the pair, into the count.
    until("the gate's generation probe went out", || async {
        counter.sent.load(Ordering::SeqCst) >= 1
    })
    .await;
    let first = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert!(gate.release(first.slot_id, None).await);
    until("the gate's first calls are done", || async {
        counter.sent.load(Ordering::SeqCst) >= 3
    })
    .await;
    let before = counter.sent.load(Ordering::SeqCst);
    let pairs = 20;
    for _ in 0..pairs {
        let g = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
        assert!(gate.release(g.slot_id, None).await);
    }
    // An exchange on the same gate does ask for a check: once its `renew` call has gone out,
    // any the lock pairs asked for would have gone before it (the ticker runs them in turn).
    let g = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    let with_exchange = before + 2 * pairs + 1;
    until("the exchange's keeping check went out", || async {
        counter.sent.load(Ordering::SeqCst) > with_exchange
    })
    .await;
    assert!(gate.release(g.slot_id, None).await);
    let sent = counter.sent.load(Ordering::SeqCst) - before;
    assert!(
        sent <= 2 * pairs + 3,
        "{pairs} lock pairs and one exchange sent {sent} script calls"
    );
}

/// A hand-over to a waiter on the same node costs the waiter's enqueue and the holder's
/// release (which grants the slot and answers the grant), and nothing more: a waiter that
/// parks where nobody waited makes no collection call of its own, on a fresh gate as after
/// earlier waits (its own call just found no slot; its grant comes with the release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_on_one_node_costs_the_enqueue_and_the_release() {
    let space = Space::new();
    let counter = ScriptCalls::start().await;
    let options = RedisOptions {
        url: format!("redis://127.0.0.1:{}/", counter.port),
        // No polling fallback within the test: every call counted is one the hand-over made.
        poll_interval: Duration::from_secs(600),
        ..space.options()
    };
    let node = RedisCoordination::new(options, Arc::new(SystemClock::new())).unwrap();
    let gate = node.open("handover", settings(1));
    until("the gate's generation probe went out", || async {
        counter.sent.load(Ordering::SeqCst) >= 1
    })
    .await;
    for round in 0..3 {
        let held = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
        let before = counter.sent.load(Ordering::SeqCst);
        let waiting = Arc::clone(&gate);
        let waiter =
            tokio::spawn(async move { waiting.acquire(req(60_000, SlotKind::Lease)).await });
        until("the waiter's enqueue went out", || async {
            counter.sent.load(Ordering::SeqCst) > before
        })
        .await;
        // Room for a call the park would make (the ticker runs at once when nudged).
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(gate.release(held.slot_id, None).await);
        let granted = waiter.await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let sent = counter.sent.load(Ordering::SeqCst) - before;
        assert_eq!(
            sent, 2,
            "round {round}: the hand-over sent {sent} script calls"
        );
        assert!(gate.release(granted.slot_id, None).await);
    }
}
