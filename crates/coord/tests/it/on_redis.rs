//! The Redis gate against the machine's real Redis, with several `RedisCoordination`s standing
//! in for several nodes (each has its own connection, node id and wake-up subscription). Each
//! test works under a key prefix of its own and deletes its keys afterwards. Counts and order
//! only: real time appears in short holds and bounded wait loops, never in an assertion.
//!
//! Redis must answer: a test fails loudly when it does not (`.ci/run` starts one).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nthbouncer_coord::redis::{RedisCoordination, RedisOptions};
use nthbouncer_coord::{
    AcquireRequest, Clock, Coordination, NonceKey, NonceVerdict, Outcome, PoolGate, PoolSettings,
    Priority, Refusal, RefusalReason, RenewError, SlotId, SlotKind, SystemClock,
};
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

fn redis_url() -> String {
    std::env::var("NB_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/".to_owned())
}

/// One test's corner of Redis: a fresh key prefix, deleted (every key under it) on drop, so a
/// failing test cleans up too.
struct Space {
    prefix: String,
}

impl Space {
    fn new() -> Space {
        let client = ::redis::Client::open(redis_url()).unwrap();
        let pong: Result<String, _> = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .and_then(|mut c| ::redis::cmd("PING").query(&mut c));
        assert!(
            pong.is_ok(),
            "Redis is not answering at {} ({pong:?}): these tests need a real Redis \
             (start one, or set NB_TEST_REDIS)",
            redis_url()
        );
        Space {
            prefix: format!("nbtest-{:012x}", rand::random::<u64>() >> 16),
        }
    }

    fn options(&self) -> RedisOptions {
        RedisOptions {
            key_prefix: self.prefix.clone(),
            poll_interval: Duration::from_millis(200),
            ..RedisOptions::new(redis_url())
        }
    }

    fn node(&self) -> RedisCoordination {
        RedisCoordination::new(self.options(), Arc::new(SystemClock::new())).unwrap()
    }

    /// Every key under the prefix, for checks and cleanup.
    fn keys(&self) -> Vec<String> {
        let client = ::redis::Client::open(redis_url()).unwrap();
        let mut c = client.get_connection().unwrap();
        let iter: ::redis::Iter<String> = ::redis::cmd("SCAN")
            .cursor_arg(0)
            .arg("MATCH")
            .arg(format!("{}:*", self.prefix))
            .arg("COUNT")
            .arg(1000)
            .clone()
            .iter(&mut c)
            .unwrap();
        iter.filter_map(Result::ok).collect()
    }

    fn sync_cmd<T: ::redis::FromRedisValue>(&self, cmd: &::redis::Cmd) -> T {
        let client = ::redis::Client::open(redis_url()).unwrap();
        let mut c = client.get_connection().unwrap();
        cmd.query(&mut c).unwrap()
    }
}

impl Drop for Space {
    fn drop(&mut self) {
        let keys = self.keys();
        if !keys.is_empty() {
            let _: Result<(), _> = ::redis::Client::open(redis_url())
                .and_then(|c| c.get_connection())
                .and_then(|mut c| ::redis::cmd("DEL").arg(&keys).query(&mut c));
        }
    }
}

fn req(wait_ms: u64, kind: SlotKind) -> AcquireRequest {
    AcquireRequest {
        fairness_key: 1,
        priority: Priority::Normal,
        wait_ms,
        kind,
    }
}

fn limit(n: u32) -> PoolSettings {
    PoolSettings {
        limit: n,
        ..PoolSettings::default()
    }
}

/// Polls `cond` until it holds; fails instead of hanging.
async fn until<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while !cond().await {
            tokio::time::sleep(Duration::from_millis(10)).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_never_admit_more_than_the_limit() {
    let space = Space::new();
    let nodes: Vec<RedisCoordination> = (0..3).map(|_| space.node()).collect();
    let settings = PoolSettings {
        limit: 8,
        queue_size: 1000,
        ..PoolSettings::default()
    };
    let gates: Vec<Arc<dyn PoolGate>> = nodes
        .iter()
        .map(|n| n.open("flood", settings.clone()))
        .collect();
    let in_flight = Arc::new(AtomicU32::new(0));
    let peak = Arc::new(AtomicU32::new(0));
    let served = Arc::new(AtomicU32::new(0));
    let timed_out = Arc::new(AtomicU32::new(0));
    let mut tasks: Vec<JoinHandle<()>> = Vec::new();
    for i in 0..300u64 {
        let gate = Arc::clone(&gates[usize::try_from(i % 3).unwrap()]);
        let (in_flight, peak, served, timed_out) = (
            Arc::clone(&in_flight),
            Arc::clone(&peak),
            Arc::clone(&served),
            Arc::clone(&timed_out),
        );
        tasks.push(tokio::spawn(async move {
            let r = AcquireRequest {
                fairness_key: i % 7,
                ..req(30_000, SlotKind::Exchange)
            };
            match gate.acquire(r).await {
                Ok(grant) => {
                    let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(1 + i % 3)).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    assert!(gate.release(grant.slot_id, None).await);
                    served.fetch_add(1, Ordering::SeqCst);
                }
                Err(Refusal::QueueTimeout { .. }) => {
                    timed_out.fetch_add(1, Ordering::SeqCst);
                }
                Err(other) => panic!("unexpected refusal {other:?}"),
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(
        peak.load(Ordering::SeqCst) <= 8,
        "peak {}",
        peak.load(Ordering::SeqCst)
    );
    assert_eq!(
        served.load(Ordering::SeqCst) + timed_out.load(Ordering::SeqCst),
        300
    );
    assert_eq!(
        served.load(Ordering::SeqCst),
        300,
        "a 30 s budget serves everyone"
    );
    let s = gates[0].snapshot().await;
    assert_eq!((s.in_flight, s.queued), (0, 0), "nothing leaked");
    assert_eq!(s.admitted_total, 300);
}

/// Holds the only slot on node A, queues waiters one by one across the nodes, then lets them
/// through one at a time and records who got in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_across_nodes_and_high_priority_first() {
    let space = Space::new();
    let nodes: Vec<RedisCoordination> = (0..3).map(|_| space.node()).collect();
    let gates: Vec<Arc<dyn PoolGate>> = nodes.iter().map(|n| n.open("fifo", limit(1))).collect();
    let holder = gates[0].acquire(req(0, SlotKind::Exchange)).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // Six normal waiters of one key, alternating nodes, then a high one that must pass them.
    for i in 0..7usize {
        let gate = Arc::clone(&gates[i % 3]);
        let order = Arc::clone(&order);
        let priority = if i == 6 {
            Priority::High
        } else {
            Priority::Normal
        };
        tasks.push(tokio::spawn(async move {
            let r = AcquireRequest {
                priority,
                ..req(20_000, SlotKind::Exchange)
            };
            let g = gate.acquire(r).await.unwrap();
            order.lock().push(i);
            assert!(gate.release(g.slot_id, None).await);
        }));
        queued(&gates[(i + 1) % 3], u32::try_from(i + 1).unwrap()).await;
    }
    assert!(
        gates[1].release(holder.slot_id, None).await,
        "released on another node"
    );
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock(), vec![6, 0, 1, 2, 3, 4, 5]);
}

/// With fair share, two keys take turns within a class even when one queued first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_share_takes_turns_across_keys_on_several_nodes() {
    let space = Space::new();
    let (a, b) = (space.node(), space.node());
    let ga = a.open("fair", limit(1));
    let gb = b.open("fair", limit(1));
    let holder = ga.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // Key 1 queues three (on A), then key 2 queues two (on B).
    for (n, (key, gate)) in [(1u64, &ga), (1, &ga), (1, &ga), (2, &gb), (2, &gb)]
        .into_iter()
        .enumerate()
    {
        let gate = Arc::clone(gate);
        let order = Arc::clone(&order);
        tasks.push(tokio::spawn(async move {
            let r = AcquireRequest {
                fairness_key: key,
                ..req(20_000, SlotKind::Exchange)
            };
            let g = gate.acquire(r).await.unwrap();
            order.lock().push((key, n));
            assert!(gate.release(g.slot_id, None).await);
        }));
        queued(&ga, u32::try_from(n + 1).unwrap()).await;
    }
    assert!(ga.release(holder.slot_id, None).await);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        *order.lock(),
        vec![(1, 0), (2, 3), (1, 1), (2, 4), (1, 2)],
        "round robin across keys, FIFO within each"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_taken_on_one_node_renews_and_releases_on_another() {
    let space = Space::new();
    let (a, b, c) = (space.node(), space.node(), space.node());
    let ga = a.open("lock", limit(2));
    let gb = b.open("lock", limit(2));
    let gc = c.open("lock", limit(2));
    let grant = ga.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert!(grant.lease_deadline <= grant.request_deadline);
    let renewed = gb.renew(grant.slot_id).await.unwrap();
    assert!(renewed >= grant.lease_deadline);
    assert_eq!(gc.snapshot().await.in_flight, 1);
    assert!(gc.release(grant.slot_id, None).await);
    assert!(
        !gb.release(grant.slot_id, None).await,
        "a repeat frees nothing"
    );
    assert_eq!(gb.renew(grant.slot_id).await, Err(RenewError::NotFound));
    assert_eq!(ga.snapshot().await.in_flight, 0);
}

fn throttle() -> Outcome {
    Outcome {
        status: Some(429),
        throttled: 1,
        retry_after_ms: Some(60_000),
        ..Outcome::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_release_that_freed_a_slot_teaches_and_what_it_teaches_is_shared() {
    let space = Space::new();
    let (a, b) = (space.node(), space.node());
    let ga = a.open("learn", limit(8));
    let gb = b.open("learn", limit(8));
    // An unknown slot with a throttle teaches nothing, on either node.
    assert!(!ga.release(SlotId::random(), Some(throttle())).await);
    let s = gb.snapshot().await;
    assert_eq!((s.paused_until, s.effective_limit), (None, 8));
    let free = gb.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    assert!(gb.release(free.slot_id, None).await);
    // A held slot released with a throttle on A pauses admission on B too.
    let held = ga.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert!(ga.release(held.slot_id, Some(throttle())).await);
    let s = gb.snapshot().await;
    assert!(s.paused_until.is_some(), "{s:?}");
    assert!(s.effective_limit < 8, "the limit was halved: {s:?}");
    match gb.acquire(req(0, SlotKind::Exchange)).await {
        Err(Refusal::TooManyRequests { reason, .. }) => assert_eq!(reason, RefusalReason::Paused),
        other => panic!("expected a pause, got {other:?}"),
    }
    // The pause is capped by max_pause_ms like in process (60 s hint, 5 min cap: 60 s).
    let until = s.paused_until.unwrap();
    // Redis's TIME is the wall clock here; the system clock reads it the way the gate does.
    let now_ms = u128::from(SystemClock::new().now_ms());
    assert!(u128::from(until) <= now_ms + 61_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_lease_comes_back_within_a_term_to_another_nodes_waiter() {
    let space = Space::new();
    let (a, b) = (space.node(), space.node());
    let settings = PoolSettings {
        limit: 1,
        lease_term_ms: 300,
        renew_interval_ms: 100,
        ..PoolSettings::default()
    };
    let ga = a.open("abandon", settings.clone());
    let gb = b.open("abandon", settings);
    let held = ga.acquire(req(0, SlotKind::Lease)).await.unwrap();
    // Never renewed: B's waiter gets the slot once the term is over.
    let got = gb.acquire(req(5_000, SlotKind::Lease)).await.unwrap();
    assert_ne!(got.slot_id, held.slot_id);
    assert_eq!(ga.renew(held.slot_id).await, Err(RenewError::NotFound));
    assert!(!ga.release(held.slot_id, Some(throttle())).await);
    assert!(
        gb.snapshot().await.paused_until.is_none(),
        "a reclaimed slot teaches nothing"
    );
    assert!(gb.release(got.slot_id, None).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_nodes_exchange_slots_come_back_and_a_lost_lease_fences_its_holder() {
    let space = Space::new();
    let settings = PoolSettings {
        limit: 1,
        lease_term_ms: 300,
        renew_interval_ms: 100,
        ..PoolSettings::default()
    };
    let b = space.node();
    let gb = b.open("dead", settings.clone());
    {
        // A live node keeps its exchange slot: B cannot get it while A renews.
        let a = space.node();
        let ga = a.open("dead", settings.clone());
        let held = ga.acquire(req(0, SlotKind::Exchange)).await.unwrap();
        let watch = ga
            .lease_watch(held.slot_id)
            .expect("exchange slots are watched");
        match gb.acquire(req(700, SlotKind::Exchange)).await {
            Err(Refusal::QueueTimeout { .. }) => {}
            other => panic!("A renews its slot, so B must time out: {other:?}"),
        }
        assert!(!watch.is_lost());
        // Node A dies without releasing.
        drop(ga);
        drop(a);
    }
    let got = gb.acquire(req(5_000, SlotKind::Exchange)).await.unwrap();
    let mut watch = gb.lease_watch(got.slot_id).unwrap();
    // The lease disappears behind B's back (as after a reclaim): B's holder is told.
    let leases = format!("{}:{{dead}}:leases", space.prefix);
    let removed: i64 = space.sync_cmd(
        ::redis::cmd("ZREM")
            .arg(&leases)
            .arg(got.slot_id.to_string()),
    );
    assert_eq!(removed, 1);
    tokio::time::timeout(Duration::from_secs(5), watch.lost())
        .await
        .expect("the lost lease is reported");
    assert!(!gb.release(got.slot_id, None).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_ends_in_a_timeout_or_leaves_the_queue_when_dropped() {
    let space = Space::new();
    let (a, b) = (space.node(), space.node());
    let ga = a.open("wait", limit(1));
    let gb = b.open("wait", limit(1));
    let held = ga.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    match gb.acquire(req(200, SlotKind::Exchange)).await {
        Err(Refusal::QueueTimeout { headers }) => assert_eq!(headers.effective_limit, 1),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_eq!(ga.snapshot().await.queued, 0);
    // A dropped acquire leaves the queue.
    let dropped = tokio::time::timeout(
        Duration::from_millis(200),
        gb.acquire(req(60_000, SlotKind::Exchange)),
    )
    .await;
    assert!(dropped.is_err());
    queued(&ga, 0).await;
    // Fail fast with no wait budget.
    match gb.acquire(req(0, SlotKind::Exchange)).await {
        Err(Refusal::TooManyRequests { reason, .. }) => assert_eq!(reason, RefusalReason::NoSlot),
        other => panic!("expected no slot, got {other:?}"),
    }
    assert!(ga.release(held.slot_id, None).await);
    assert_eq!(gb.snapshot().await.in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rpm_gate_is_shared_across_nodes() {
    let space = Space::new();
    let nodes: Vec<RedisCoordination> = (0..3).map(|_| space.node()).collect();
    let settings = PoolSettings {
        limit: 10,
        rpm: 3,
        ..PoolSettings::default()
    };
    let gates: Vec<Arc<dyn PoolGate>> = nodes
        .iter()
        .map(|n| n.open("rpm", settings.clone()))
        .collect();
    for (i, gate) in gates.iter().enumerate() {
        let g = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
        assert_eq!(g.headers.rpm_remaining, Some(u32::try_from(2 - i).unwrap()));
        assert!(gate.release(g.slot_id, None).await);
    }
    match gates[1].acquire(req(0, SlotKind::Exchange)).await {
        Err(Refusal::TooManyRequests {
            reason,
            retry_after_ms,
            headers,
        }) => {
            assert_eq!(reason, RefusalReason::Rpm);
            assert!(retry_after_ms.is_some_and(|ms| ms <= 60_000));
            assert_eq!(headers.rpm_remaining, Some(0));
        }
        other => panic!("expected the RPM gate, got {other:?}"),
    }
    assert_eq!(gates[2].snapshot().await.rpm_remaining, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nonces_are_set_once_across_nodes_and_expire() {
    let space = Space::new();
    let (a, b) = (space.node(), space.node());
    let (na, nb) = (a.nonces("signed"), b.nonces("signed"));
    let other = b.nonces("other");
    let n = NonceKey([7; 16]);
    assert_eq!(
        na.check_and_record(n, 1_000, 61_000).await,
        NonceVerdict::Fresh
    );
    assert_eq!(
        nb.check_and_record(n, 1_000, 61_000).await,
        NonceVerdict::Replayed
    );
    assert_eq!(
        other.check_and_record(n, 1_000, 61_000).await,
        NonceVerdict::Fresh
    );
    // A short lifetime: once Redis forgets it, the nonce is fresh again.
    let short = NonceKey([8; 16]);
    assert_eq!(na.check_and_record(short, 0, 30).await, NonceVerdict::Fresh);
    until("the nonce to expire", || async {
        nb.check_and_record(short, 0, 30).await == NonceVerdict::Fresh
    })
    .await;
    assert!(space
        .keys()
        .iter()
        .all(|k| k.contains(":{signed}:") || k.contains(":{other}:")));
}

fn closed_port_options(space: &Space) -> RedisOptions {
    RedisOptions {
        url: "redis://127.0.0.1:1/".to_owned(),
        ..space.options()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_fails_closed_by_default() {
    let space = Space::new();
    let node =
        RedisCoordination::new(closed_port_options(&space), Arc::new(SystemClock::new())).unwrap();
    let gate = node.open("down", limit(4));
    match gate.acquire(req(1_000, SlotKind::Exchange)).await {
        Err(Refusal::CoordinationUnavailable { retry_after_ms }) => assert!(retry_after_ms > 0),
        other => panic!("expected coordination_unavailable, got {other:?}"),
    }
    assert!(node.ping().await.is_err());
    let nonces = node.nonces("down");
    assert_eq!(
        nonces.check_and_record(NonceKey([1; 16]), 0, 60_000).await,
        NonceVerdict::Full,
        "an unrecorded nonce is refused, never admitted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_fails_open_up_to_the_nodes_share() {
    let space = Space::new();
    let options = RedisOptions {
        fail_open: Some(2),
        ..closed_port_options(&space)
    };
    let node = RedisCoordination::new(options, Arc::new(SystemClock::new())).unwrap();
    let gate = node.open("open", limit(5));
    // 5 / 2 nodes = 2 slots on this node.
    let first = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    let _second = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    match gate.acquire(req(0, SlotKind::Exchange)).await {
        Err(Refusal::TooManyRequests {
            reason, headers, ..
        }) => {
            assert_eq!(reason, RefusalReason::NoSlot);
            assert_eq!(headers.effective_limit, 2);
        }
        other => panic!("expected the share to be full, got {other:?}"),
    }
    assert!(gate.release(first.slot_id, None).await);
    assert!(gate.acquire(req(0, SlotKind::Exchange)).await.is_ok());
}

/// A TCP forwarder to the real Redis that can be switched off (every connection cut, new ones
/// refused) and on again: Redis going away and coming back without restarting anything.
struct Switch {
    port: u16,
    up: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Switch {
    async fn start() -> Switch {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::new(Mutex::new(Vec::new()));
        let target = redis_url()
            .trim_start_matches("redis://")
            .trim_end_matches('/')
            .split('/')
            .next()
            .unwrap()
            .to_owned();
        let (up2, conns2) = (Arc::clone(&up), Arc::clone(&conns));
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !up2.load(Ordering::SeqCst) {
                    continue; // dropped: the connection is closed at once
                }
                let target = target.clone();
                conns2.lock().push(tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                }));
            }
        });
        Switch {
            port,
            up,
            conns,
            accept,
        }
    }

    fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        for c in self.conns.lock().drain(..) {
            c.abort();
        }
    }

    fn up(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        self.accept.abort();
        self.down();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_goes_back_to_redis_when_it_answers_again() {
    let space = Space::new();
    let switch = Switch::start().await;
    let options = RedisOptions {
        url: format!("redis://127.0.0.1:{}/", switch.port),
        fail_open: Some(2),
        retry_redis_after: Duration::from_millis(100),
        ..space.options()
    };
    let node = RedisCoordination::new(options, Arc::new(SystemClock::new())).unwrap();
    let gate = node.open("flap", limit(4));
    let observer = space.node();
    let seen = observer.open("flap", limit(4));

    let shared = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert_eq!(seen.snapshot().await.in_flight, 1, "admitted through Redis");

    switch.down();
    let local = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert_eq!(
        seen.snapshot().await.in_flight,
        1,
        "admitted on the node's own share"
    );

    switch.up();
    until("admission through Redis again", || async {
        match gate.acquire(req(0, SlotKind::Lease)).await {
            Ok(g) => {
                let through_redis = seen.snapshot().await.in_flight == 2;
                gate.release(g.slot_id, None).await;
                through_redis
            }
            Err(_) => false,
        }
    })
    .await;
    // Slots taken on either side are released where they were taken.
    assert!(gate.release(local.slot_id, None).await);
    assert!(gate.release(shared.slot_id, None).await);
    assert_eq!(seen.snapshot().await.in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_of_a_pool_carries_its_hash_tag() {
    let space = Space::new();
    let node = space.node();
    let gate = node.open("tagged", limit(1));
    let held = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    let _ = gate.acquire(req(0, SlotKind::Exchange)).await;
    let keys = space.keys();
    assert!(!keys.is_empty());
    for k in &keys {
        assert!(
            k.starts_with(&format!("{}:{{tagged}}:", space.prefix)),
            "{k}"
        );
    }
    assert!(gate.release(held.slot_id, None).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_gate_refuses_its_waiters_and_leaves_the_shared_queue() {
    let space = Space::new();
    let (a, b) = (space.node(), space.node());
    let ga = a.open("close", limit(1));
    let gb = b.open("close", limit(1));
    let held = ga.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    let waiter = {
        let gb = Arc::clone(&gb);
        tokio::spawn(async move { gb.acquire(req(20_000, SlotKind::Exchange)).await })
    };
    queued(&ga, 1).await;
    gb.close().await;
    assert_eq!(waiter.await.unwrap().unwrap_err(), Refusal::PoolClosed);
    queued(&ga, 0).await;
    assert_eq!(
        gb.acquire(req(0, SlotKind::Exchange)).await.unwrap_err(),
        Refusal::PoolClosed
    );
    assert!(ga.release(held.slot_id, None).await);
}
