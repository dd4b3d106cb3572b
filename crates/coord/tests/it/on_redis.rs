//! What only the Redis gate does, against the machine's real Redis, with several
//! `RedisCoordination`s standing in for several nodes (each has its own connection, node id and
//! wake-up subscription): a dead node's slots, self-fencing, nonces, Redis unreachable in both
//! fail modes, the key layout. What every gate must do is in `conformance`, run on both. Each
//! test works under a key prefix of its own ([`Space`]) and deletes its keys afterwards. Counts
//! and order only: real time appears in short holds and bounded wait loops, never in an
//! assertion.
//!
//! Redis must answer: a test fails loudly when it does not (`.ci/run` starts one).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nthbouncer_coord::redis::{RedisCoordination, RedisOptions};
use nthbouncer_coord::{
    Coordination, NonceKey, NonceVerdict, PoolSettings, Refusal, RefusalReason, SlotKind,
    SystemClock,
};
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::conformance::{limit, req, until};

/// `host:port` of the test Redis, for forwarders that stand between a node and it.
pub fn redis_address() -> String {
    redis_url()
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .split('/')
        .next()
        .unwrap()
        .to_owned()
}

fn redis_url() -> String {
    std::env::var("NB_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/".to_owned())
}

/// One test's corner of Redis: a fresh key prefix, deleted (every key under it) on drop, so a
/// failing test cleans up too.
pub struct Space {
    pub prefix: String,
    url: String,
}

impl Space {
    /// On the machine's Redis.
    pub fn new() -> Space {
        Space::on(redis_url())
    }

    /// On the Redis at `url`.
    pub fn on(url: String) -> Space {
        let client = ::redis::Client::open(url.as_str()).unwrap();
        let pong: Result<String, _> = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .and_then(|mut c| ::redis::cmd("PING").query(&mut c));
        assert!(
            pong.is_ok(),
            "Redis is not answering at {url} ({pong:?}): these tests need a real Redis \
             (start one, or set NB_TEST_REDIS)",
        );
        Space {
            prefix: format!("nbtest-{:012x}", rand::random::<u64>() >> 16),
            url,
        }
    }

    pub fn options(&self) -> RedisOptions {
        RedisOptions {
            key_prefix: self.prefix.clone(),
            poll_interval: Duration::from_millis(200),
            ..RedisOptions::new(self.url.clone())
        }
    }

    pub fn node(&self) -> RedisCoordination {
        RedisCoordination::new(self.options(), Arc::new(SystemClock::new())).unwrap()
    }

    /// Every key under the prefix, for checks and cleanup.
    fn keys(&self) -> Vec<String> {
        let client = ::redis::Client::open(self.url.as_str()).unwrap();
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

    pub fn sync_cmd<T: ::redis::FromRedisValue>(&self, cmd: &::redis::Cmd) -> T {
        let client = ::redis::Client::open(self.url.as_str()).unwrap();
        let mut c = client.get_connection().unwrap();
        cmd.query(&mut c).unwrap()
    }
}

/// A `redis-server` of the test's own on a free port, stopped on drop. `functions: false` renames
/// them away (`FCALL`, `FUNCTION`), so that it answers them as Redis 6 does (`unknown command`):
/// the gate runs its operations as scripts there.
pub struct OwnRedis {
    child: std::process::Child,
    pub url: String,
}

impl OwnRedis {
    pub fn start(functions: bool) -> OwnRedis {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let mut command = std::process::Command::new("redis-server");
        command
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"]);
        if !functions {
            command.args(["--rename-command", "FCALL", ""]).args([
                "--rename-command",
                "FUNCTION",
                "",
            ]);
        }
        let child = command
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server must be installed for this test (.ci/run installs it)");
        let server = OwnRedis {
            child,
            url: format!("redis://127.0.0.1:{port}/"),
        };
        for _ in 0..250 {
            if server.cmd::<String>(&::redis::cmd("PING")).is_ok() {
                return server;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("our redis-server at {} never answered", server.url);
    }

    pub fn cmd<T: ::redis::FromRedisValue>(&self, cmd: &::redis::Cmd) -> ::redis::RedisResult<T> {
        ::redis::Client::open(self.url.as_str())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
            .and_then(|mut c| cmd.query(&mut c))
    }

    /// How many times `command` ran (its `INFO commandstats` line; 0 if never).
    pub fn calls(&self, command: &str) -> u64 {
        let info: String = self.cmd(::redis::cmd("INFO").arg("commandstats")).unwrap();
        let line = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Space {
    fn drop(&mut self) {
        let keys = self.keys();
        if !keys.is_empty() {
            let _: Result<(), _> = ::redis::Client::open(self.url.as_str())
                .and_then(|c| c.get_connection())
                .and_then(|mut c| ::redis::cmd("DEL").arg(&keys).query(&mut c));
        }
    }
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
    /// Connections forwarded so far.
    forwarded: Arc<AtomicUsize>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Switch {
    async fn start() -> Switch {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let forwarded = Arc::new(AtomicUsize::new(0));
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::new(Mutex::new(Vec::new()));
        let target = redis_address();
        let (up2, conns2, forwarded2) =
            (Arc::clone(&up), Arc::clone(&conns), Arc::clone(&forwarded));
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !up2.load(Ordering::SeqCst) {
                    continue; // dropped: the connection is closed at once
                }
                forwarded2.fetch_add(1, Ordering::SeqCst);
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
            forwarded,
            conns,
            accept,
        }
    }

    fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.cut();
    }

    /// Closes every connection open now; new ones are still taken (Redis up, its connections
    /// closed: its idle `timeout`, `CLIENT KILL`).
    fn cut(&self) {
        for c in self.conns.lock().drain(..) {
            c.abort();
        }
    }

    fn up(&self) {
        self.up.store(true, Ordering::SeqCst);
    }

    fn forwarded(&self) -> usize {
        self.forwarded.load(Ordering::SeqCst)
    }

    /// `space`'s options for a node that reaches Redis through this forwarder, and tries
    /// Redis again 100 ms after a failure.
    fn options(&self, space: &Space) -> RedisOptions {
        RedisOptions {
            url: format!("redis://127.0.0.1:{}/", self.port),
            retry_redis_after: Duration::from_millis(100),
            ..space.options()
        }
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
        fail_open: Some(2),
        ..switch.options(&space)
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
    // Back on Redis, the slot taken on the node's own counts there too (see the next test).
    until("admission through Redis again", || async {
        match gate.acquire(req(0, SlotKind::Lease)).await {
            Ok(g) => {
                let through_redis = seen.snapshot().await.in_flight == 3;
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

/// The node's connection belongs to the node's runtime, whichever runtime made its first call:
/// a call from another runtime (in the server, a connection thread's, which a stopping server
/// ends first) that then ends leaves the node's calls working. (The connection's driver task
/// used to be spawned on the runtime of the call that made the connection, and died with it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nodes_connection_outlives_the_runtime_of_its_first_call() {
    let space = Space::new();
    let node = Arc::new(space.node());
    let first = Arc::clone(&node);
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(first.ping()).unwrap();
        // The runtime ends here, and every task it runs with it.
    })
    .join()
    .unwrap();
    node.ping()
        .await
        .expect("the connection made on the other runtime still works");
    let gate = node.open("home", limit(1));
    let g = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert!(gate.release(g.slot_id, None).await);
}

/// A gate's own tasks run on its node's runtime, whichever runtime opened it (in the server, a
/// pool added through the admin API opens its gate on a connection thread): opened from a
/// runtime that then ends, the gate still collects a grant another node's release makes to its
/// waiter. (Its ticker, which collects such grants, used to run on the opener's runtime.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_opened_from_another_runtime_keeps_collecting_grants() {
    let space = Space::new();
    let (a, b) = (Arc::new(space.node()), space.node());
    let opener = Arc::clone(&a);
    let ga = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move { opener.open("opened", limit(1)) })
        // The runtime ends here, and every task it runs with it.
    })
    .join()
    .unwrap();
    let gb = b.open("opened", limit(1));
    let held = gb.acquire(req(0, SlotKind::Lease)).await.unwrap();
    let waiter = tokio::spawn(async move { ga.acquire(req(60_000, SlotKind::Lease)).await });
    until("A's caller queued", || async {
        gb.snapshot().await.queued == 1
    })
    .await;
    assert!(gb.release(held.slot_id, None).await);
    let granted = crate::conformance::join(waiter).await;
    assert!(
        granted.is_ok(),
        "A's waiter never got the slot B freed: {granted:?}"
    );
}

/// A connection Redis closes while the node is idle (Redis's `timeout`, `CLIENT KILL`, a proxy's
/// idle cut) costs no caller anything: the node connects again at once, before its next call,
/// which succeeds. (When it learned of the cut from that call, the call failed: a caller
/// refused with Redis up all along.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_redis_closes_is_made_again_before_the_next_call() {
    let space = Space::new();
    let switch = Switch::start().await;
    let options = switch.options(&space);
    let node = RedisCoordination::new(options, Arc::new(SystemClock::new())).unwrap();
    let gate = node.open("cut", limit(2));
    let g = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert!(gate.release(g.slot_id, None).await);
    // The calls' connection and the wake-up subscription's.
    until("both connections made", || async {
        switch.forwarded() >= 2
    })
    .await;
    let before = switch.forwarded();

    // Cut, not down then up: a node that tried again in between (this thread may be
    // preempted there) would find Redis away, which is another test.
    switch.cut();
    until("both connections made again", || async {
        switch.forwarded() >= before + 2
    })
    .await;
    for _ in 0..3 {
        let g = gate
            .acquire(req(0, SlotKind::Lease))
            .await
            .expect("admitted: Redis never went away");
        assert!(gate.release(g.slot_id, None).await);
    }
}

/// A release Redis did not confirm (the node's connection cut, Redis away) is made again once
/// Redis answers: the slots come back then, not a lease term later (60 s here; the wait is
/// bounded by `until`'s 10 s). Fail closed, the default: a lock lease and an exchange slot,
/// released while the forwarder is down, are both gone from Redis once it is up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_redis_missed_is_made_again_when_it_answers() {
    let space = Space::new();
    let switch = Switch::start().await;
    let options = switch.options(&space);
    let settings = PoolSettings {
        lease_term_ms: 60_000,
        ..limit(2)
    };
    let node = RedisCoordination::new(options, Arc::new(SystemClock::new())).unwrap();
    let gate = node.open("missed", settings.clone());
    let observer = space.node();
    let seen = observer.open("missed", settings);

    let lease = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    let exchange = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    assert_eq!(seen.snapshot().await.in_flight, 2);

    switch.down();
    assert!(
        !gate.release(lease.slot_id, None).await,
        "a release with Redis away is not confirmed"
    );
    assert!(!gate.release(exchange.slot_id, None).await);
    assert_eq!(seen.snapshot().await.in_flight, 2, "Redis saw neither");

    switch.up();
    until("the missed releases made again", || async {
        seen.snapshot().await.in_flight == 0
    })
    .await;
    // Both slots are free for anyone again.
    let a = seen.acquire(req(0, SlotKind::Lease)).await.unwrap();
    let b = seen.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert!(seen.release(a.slot_id, None).await);
    assert!(seen.release(b.slot_id, None).await);
}

/// Fail open, Redis away and back: what a node admitted on its own while Redis was away still
/// counts once it answers again, on every node. Two nodes, limit 4, two expected (a share of 2
/// each): A's two calls taken on its own are still running when Redis comes back, and B, which
/// also went on its own, asks for slots over and over from that moment: B never holds more than
/// the 2 that A leaves, and gets the rest once A's calls end. (Before the fix, B got all 4 from
/// an empty Redis: 6 running at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_recovery_counts_the_calls_admitted_on_each_nodes_own() {
    let space = Space::new();
    let switch = Switch::start().await;
    let options = RedisOptions {
        fail_open: Some(2),
        ..switch.options(&space)
    };
    let node = |o: &RedisOptions| RedisCoordination::new(o.clone(), Arc::new(SystemClock::new()));
    let (a, b) = (node(&options).unwrap(), node(&options).unwrap());
    let (ga, gb) = (a.open("back", limit(4)), b.open("back", limit(4)));
    let observer = space.node();
    let seen = observer.open("back", limit(4));
    assert_eq!(seen.snapshot().await.in_flight, 0);

    switch.down();
    let mut a_held = Vec::new();
    for _ in 0..2 {
        a_held.push(ga.acquire(req(0, SlotKind::Exchange)).await.unwrap());
    }
    assert!(
        ga.acquire(req(0, SlotKind::Exchange)).await.is_err(),
        "A's share is full"
    );
    let b_own = gb.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    assert!(gb.release(b_own.slot_id, None).await);
    assert_eq!(seen.snapshot().await.in_flight, 0, "nothing reached Redis");

    switch.up();
    // B tries from the moment Redis is back, through A registering its calls there and past
    // the period in which a node that was on its own keeps to its share (2 × 200 ms here).
    let mut b_held = Vec::new();
    let mut registered = 0;
    for _ in 0..400 {
        if let Ok(g) = gb.acquire(req(0, SlotKind::Exchange)).await {
            b_held.push(g);
        }
        assert!(
            b_held.len() <= 2,
            "B holds {} while A's 2 calls still run: over the limit of 4",
            b_held.len()
        );
        if seen.snapshot().await.in_flight == 4 {
            registered += 1;
            if registered == 100 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        registered, 100,
        "A's calls and B's never all counted in Redis"
    );
    assert_eq!(b_held.len(), 2);

    // A's calls end: B gets the rest of the limit.
    for g in a_held {
        assert!(ga.release(g.slot_id, None).await);
    }
    until("B takes the slots A freed", || async {
        seen.snapshot().await.in_flight == 2
    })
    .await;
    for _ in 0..2 {
        b_held.push(gb.acquire(req(5_000, SlotKind::Exchange)).await.unwrap());
    }
    assert!(gb.acquire(req(0, SlotKind::Exchange)).await.is_err());
    for g in b_held {
        assert!(gb.release(g.slot_id, None).await);
    }
    assert_eq!(seen.snapshot().await.in_flight, 0);
}

/// An exchange admitted at once has no `held` entry in Redis (its node keeps its grant time and
/// its cap, and passes them back): renewed by its node, it still ends at its cap; released, it
/// still teaches the hold-time mean. A lock lease, which any node may renew or release, keeps
/// its entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_admitted_at_once_is_untracked_and_still_capped() {
    let space = Space::new();
    let settings = PoolSettings {
        limit: 3,
        lease_term_ms: 300,
        renew_interval_ms: 100,
        request_timeout_ms: 200,
        ..PoolSettings::default()
    };
    let node = space.node();
    let gate = node.open("untracked", settings);
    let key = |name: &str| format!("{}:{{untracked}}:{name}", space.prefix);
    let in_held = |slot: &nthbouncer_coord::SlotId| -> bool {
        space.sync_cmd(
            ::redis::cmd("HEXISTS")
                .arg(key("held"))
                .arg(slot.to_string()),
        )
    };
    let lease_of = |slot: &nthbouncer_coord::SlotId| -> Option<u64> {
        let score: Option<u64> = space.sync_cmd(
            ::redis::cmd("ZSCORE")
                .arg(key("leases"))
                .arg(slot.to_string()),
        );
        score
    };
    let leased = |slot: &nthbouncer_coord::SlotId| lease_of(slot).is_some();

    let exchange = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    let lease = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert!(leased(&exchange.slot_id) && leased(&lease.slot_id));
    assert!(
        !in_held(&exchange.slot_id),
        "an exchange admitted at once is untracked"
    );
    assert!(in_held(&lease.slot_id), "a lock lease is tracked");
    // (Its holder, this test, does not renew it: released before its term ends.)
    assert!(gate.release(lease.slot_id, None).await);
    assert!(!in_held(&lease.slot_id) && !leased(&lease.slot_id));

    // Renewed by its node past several lease terms, up to its request deadline plus the hold
    // grace, then no further: the lease ends and its holder is told.
    let mut watch = gate.lease_watch(exchange.slot_id).unwrap();
    let cap = exchange.request_deadline + nthbouncer_coord::EXCHANGE_GRACE_MS;
    assert!(cap > exchange.lease_deadline + 3 * 300);
    let mut latest = exchange.lease_deadline;
    for _ in 0..200 {
        if let Some(deadline) = lease_of(&exchange.slot_id) {
            latest = latest.max(deadline);
        }
        if tokio::time::timeout(Duration::from_millis(50), watch.lost())
            .await
            .is_ok()
        {
            break;
        }
    }
    assert!(watch.is_lost(), "its holder is told once the lease ends");
    assert!(latest > exchange.lease_deadline, "its node renewed it");
    assert!(latest <= cap, "never past its cap: {latest} > {cap}");
    // A call past its deadline in Redis sweeps it. (Its node tells the holder up to one call's
    // transit before that deadline: it fences early, never late. So the very next call may
    // still find it leased.)
    until("a call past the lease's deadline sweeps it", || async {
        let next = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
        let swept = !leased(&exchange.slot_id);
        assert!(gate.release(next.slot_id, None).await);
        swept
    })
    .await;
    assert!(!gate.release(exchange.slot_id, None).await);

    // Released by its node: freed, and its hold time counted, without a `held` entry.
    let meta = key("meta");
    let _: i64 = space.sync_cmd(::redis::cmd("HDEL").arg(&meta).arg("hold"));
    let second = gate.acquire(req(0, SlotKind::Exchange)).await.unwrap();
    assert!(!in_held(&second.slot_id));
    assert!(gate.release(second.slot_id, None).await);
    assert!(!leased(&second.slot_id));
    let hold: Option<u64> = space.sync_cmd(::redis::cmd("HGET").arg(&meta).arg("hold"));
    assert!(hold.is_some(), "the release taught the hold-time mean");

    let held: u64 = space.sync_cmd(::redis::cmd("HLEN").arg(key("held")));
    assert_eq!(held, 0);
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

/// Many callers of one node take turns on a small limit: a slot freed on this node goes to its
/// own waiter in the reply of the release, which may come back before that waiter's own
/// queueing reply has been read. The grant is kept for it, not freed as nobody's (before: the
/// waiter lost its place and its grant, and waited out its whole budget), so every caller is
/// served and every slot comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_beats_its_waiters_queueing_reply_is_kept_for_it() {
    let space = Space::new();
    let node = space.node();
    let gate = node.open("race", limit(2));
    let gate: Arc<dyn nthbouncer_coord::PoolGate> = gate;
    let mut tasks = Vec::new();
    for _ in 0..24 {
        let gate = Arc::clone(&gate);
        tasks.push(tokio::spawn(async move {
            let mut failed = Vec::new();
            for _ in 0..40 {
                match gate.acquire(req(20_000, SlotKind::Lease)).await {
                    Ok(g) => {
                        tokio::task::yield_now().await;
                        assert!(gate.release(g.slot_id, None).await, "held until released");
                    }
                    Err(refusal) => failed.push(format!("{refusal:?}")),
                }
            }
            failed
        }));
    }
    let mut failed = Vec::new();
    for t in tasks {
        failed.extend(t.await.unwrap());
    }
    assert!(failed.is_empty(), "callers not served: {failed:?}");
    let snap = gate.snapshot().await;
    assert_eq!((snap.in_flight, snap.queued), (0, 0));
}

/// One pool's token budget on two nodes is one budget: what one charges, the other sees; a
/// usage report or a refund on one gives back to both; an announcement observed by one binds
/// both, less what was admitted after the request it answered; a waiter that holds the budget
/// keeps everyone else out until it is admitted or lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_budget_is_one_across_nodes() {
    use nthbouncer_coord::redis::SharedAdmit;
    use nthbouncer_governor::{
        BudgetSource, TokenCost, TokenPart, TokenSettings, TokenWindow, Usage,
    };
    let space = Space::new();
    let (a, b) = (space.node(), space.node());
    let (ta, tb) = (a.token_ledger("p"), b.token_ledger("p"));
    let s = TokenSettings {
        tpm: 1_000,
        window_ms: 600_000,
        ..TokenSettings::default()
    };
    let admitted = |r: SharedAdmit| match r {
        SharedAdmit::Admitted(v) => v.remaining,
        other => panic!("not admitted: {other:?}"),
    };
    assert_eq!(
        admitted(ta.admit(&s, 1, 600.into(), false).await.unwrap()),
        Some(400)
    );
    match tb.admit(&s, 2, 500.into(), false).await.unwrap() {
        SharedAdmit::Refused {
            view,
            retry_after_ms,
        } => {
            assert_eq!(view.remaining, Some(400));
            assert!(retry_after_ms.is_some_and(|r| r > 0), "{retry_after_ms:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        tb.admit(&s, 3, 1_001.into(), false).await.unwrap(),
        SharedAdmit::Exceeds {
            estimate: 1_001,
            budget: 1_000
        }
    );
    assert_eq!(
        admitted(tb.admit(&s, 4, 400.into(), false).await.unwrap()),
        Some(0)
    );
    // Node A's request used 100 of its 600: both see 500 come back.
    assert_eq!(
        tb.finish(&s, 1, Some(Usage::Total(100)))
            .await
            .unwrap()
            .remaining,
        Some(500)
    );
    let v = ta.peek(&s).await.unwrap();
    assert_eq!((v.remaining, v.admitted_tokens), (Some(500), 500));
    assert_eq!(v.source, Some(BudgetSource::Configured));
    // Which calls were charged, asked for several at once: not 99 (never admitted) nor 3
    // (refused), but 1 and 4.
    assert_eq!(
        tb.charged(&[99, 1, 3, 4]).await.unwrap(),
        [false, true, false, true]
    );
    assert!(tb.charged(&[]).await.unwrap().is_empty());
    // A charge the ledger never had (a lease granted with no budget in force) is not finished
    // by a node's reporter (see `charged` above), so the view stays; one it has is finished.
    let v = ta.peek(&s).await.unwrap();
    assert_eq!((v.remaining, v.admitted_tokens), (Some(500), 500));
    let v = tb.finish(&s, 1, Some(Usage::Total(200))).await.unwrap();
    assert_eq!(v.remaining, Some(400));
    let v = tb.finish(&s, 1, Some(Usage::Total(100))).await.unwrap();
    assert_eq!(v.remaining, Some(500));
    assert_eq!(ta.refund(&s, 4).await.unwrap().remaining, Some(900));

    // An announcement (no configured budget): what was admitted after the answered request is
    // taken off it, on every node.
    let s = TokenSettings { tpm: 0, ..s };
    let pool = "q";
    let (ta, tb) = (a.token_ledger(pool), b.token_ledger(pool));
    assert_eq!(
        admitted(ta.admit(&s, 10, 100.into(), false).await.unwrap()),
        None
    );
    assert_eq!(
        admitted(tb.admit(&s, 11, 300.into(), false).await.unwrap()),
        None
    );
    let w = TokenWindow {
        limit: Some(2_000),
        remaining: Some(1_000),
        reset_ms: Some(3_600_000),
    };
    let v = ta.observe(&s, Some(10), TokenPart::Total, w).await.unwrap();
    assert_eq!(v.source, Some(BudgetSource::Announced));
    assert_eq!(v.budget, Some(2_000));
    let r = v.remaining.unwrap();
    assert!((700..=701).contains(&r), "1000 less node B's 300: {r}");

    // Node B's waiter holds the budget: node A's small one may not pass it, until B lets go.
    match tb.admit(&s, 12, 1_900.into(), true).await.unwrap() {
        SharedAdmit::Refused { view, .. } => assert!(!view.held, "it holds, not another"),
        other => panic!("{other:?}"),
    }
    match ta.admit(&s, 13, 10.into(), false).await.unwrap() {
        SharedAdmit::Refused { view, .. } => assert!(view.held),
        other => panic!("{other:?}"),
    }
    tb.unhold(&s, 12).await.unwrap();
    assert!(matches!(
        ta.admit(&s, 13, 10.into(), false).await.unwrap(),
        SharedAdmit::Admitted(_)
    ));

    // An origin that splits its budget (input, output): each part binds on every node.
    let (ta, tb) = (a.token_ledger("r"), b.token_ledger("r"));
    let w = |limit| TokenWindow {
        limit: Some(limit),
        remaining: Some(limit),
        reset_ms: Some(3_600_000),
    };
    ta.observe(&s, None, TokenPart::Input, w(5_000))
        .await
        .unwrap();
    let v = ta
        .observe(&s, None, TokenPart::Output, w(500))
        .await
        .unwrap();
    assert_eq!(
        (v.input_remaining, v.output_remaining),
        (Some(5_000), Some(500))
    );
    let cost = |input, output| TokenCost { input, output };
    assert_eq!(
        tb.admit(&s, 20, cost(10, 600), false).await.unwrap(),
        SharedAdmit::Exceeds {
            estimate: 600,
            budget: 500
        }
    );
    assert!(matches!(
        tb.admit(&s, 21, cost(100, 400), false).await.unwrap(),
        SharedAdmit::Admitted(_)
    ));
    // The output has 100 left: a prompt-heavy call passes, one wanting 200 out does not.
    assert!(matches!(
        ta.admit(&s, 22, cost(200, 200), false).await.unwrap(),
        SharedAdmit::Refused { .. }
    ));
    assert!(matches!(
        ta.admit(&s, 23, cost(4_000, 50), false).await.unwrap(),
        SharedAdmit::Admitted(_)
    ));
    // Call 21 used 300 in and 100 out: 300 output back for everyone.
    let u = Usage::Split(cost(300, 100));
    let v = ta.finish(&s, 21, Some(u)).await.unwrap();
    assert_eq!(
        (v.input_remaining, v.output_remaining),
        (Some(700), Some(350))
    );
}

/// The shared ledger's script mirrors the pure `TokenBudget`: the same admissions, ends,
/// refunds and announcements (total and split; refills too slow to matter within the test)
/// leave both with the same remainders after every step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_ledger_agrees_with_the_pure_budget() {
    use nthbouncer_coord::redis::SharedAdmit;
    use nthbouncer_governor::{
        Priority, TokenAdmit, TokenBudget, TokenCost, TokenPart, TokenSettings, TokenWindow, Usage,
    };
    let space = Space::new();
    let node = space.node();
    let s = TokenSettings {
        tpm: 20_000,
        window_ms: 3_600_000,
        ..TokenSettings::default()
    };
    let ledger = node.token_ledger("diff");
    let mut pure = TokenBudget::new(s);
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    let mut live: Vec<u128> = Vec::new();
    for step in 0..300u128 {
        let op = next(10);
        if op < 5 || live.is_empty() {
            let cost = TokenCost {
                input: 1 + next(800),
                output: next(400),
            };
            let p = pure.try_admit(0, step, cost, Priority::Normal, false);
            let r = ledger.admit(&s, step, cost, false).await.unwrap();
            match (p, r) {
                (TokenAdmit::Admitted { .. }, SharedAdmit::Admitted(_)) => live.push(step),
                (TokenAdmit::Refused { .. }, SharedAdmit::Refused { .. }) => {}
                (TokenAdmit::Exceeds { estimate, budget }, e @ SharedAdmit::Exceeds { .. }) => {
                    assert_eq!(e, SharedAdmit::Exceeds { estimate, budget });
                }
                other => panic!("step {step}: {other:?}"),
            }
        } else if op < 8 {
            let id = live.remove(next(live.len() as u64) as usize);
            let usage = match next(3) {
                0 => None,
                1 => Some(Usage::Total(next(1_000))),
                _ => Some(Usage::Split(TokenCost {
                    input: next(800),
                    output: next(300),
                })),
            };
            pure.finish_usage(0, id, usage);
            ledger.finish(&s, id, usage).await.unwrap();
        } else if op < 9 {
            let id = live.remove(next(live.len() as u64) as usize);
            pure.refund(id);
            ledger.refund(&s, id).await.unwrap();
        } else {
            let part = [TokenPart::Total, TokenPart::Input, TokenPart::Output][next(3) as usize];
            let limit = [30_000, 12_000, 4_000][next(3) as usize];
            let w = TokenWindow {
                limit: Some(limit),
                remaining: Some(limit / 2 + next(limit / 2)),
                reset_ms: Some(1_000_000_000_000),
            };
            let id = (next(2) == 0).then(|| live.last().copied()).flatten();
            pure.observe_part(0, id, part, w);
            ledger.observe(&s, id, part, w).await.unwrap();
        }
        let v = ledger.peek(&s).await.unwrap();
        let snap = pure.snapshot(0);
        assert_eq!(
            (v.remaining, v.input_remaining, v.output_remaining, v.budget),
            (
                snap.remaining,
                snap.input_remaining,
                snap.output_remaining,
                snap.budget
            ),
            "step {step} (op {op})"
        );
        assert_eq!(v.admitted_tokens, snap.admitted_tokens, "step {step}");
    }
}

/// A charge as the ledger's hash stores it: (seq, at, input, output, finishedSeq).
type StoredCharge = (u64, u64, u64, u64, i64);
type Fields = std::collections::HashMap<String, String>;
type Scored = Vec<(String, f64)>;

/// A repeatable stream of numbers below `n` (xorshift), for the randomized ledger tests.
fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |n| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    }
}

/// What a full reread of one pool's token ledger gives, beside the sums its script keeps.
struct LedgerRead {
    /// The script's clock at its last call (what its last reply was computed at).
    clock: u64,
    charges: std::collections::HashMap<String, StoredCharge>,
    meta: Fields,
    order: Scored,
    ends: Scored,
    blocks: Fields,
}

impl Space {
    fn read_ledger(&self, pool: &str) -> LedgerRead {
        let key = |name: &str| format!("{}:{{{pool}}}:tok:{name}", self.prefix);
        let client = ::redis::Client::open(self.url.as_str()).unwrap();
        let mut c = client.get_connection().unwrap();
        let (flat, meta, order, ends, blocks): (Fields, Fields, Scored, Scored, Fields) =
            ::redis::pipe()
                .hgetall(key("charges"))
                .hgetall(key("meta"))
                .zrange_withscores(key("order"), 0, -1)
                .zrange_withscores(key("ends"), 0, -1)
                .hgetall(key("blocks"))
                .query(&mut c)
                .unwrap();
        let charges = flat
            .into_iter()
            .map(|(id, v)| {
                let n: Vec<i64> = v.split(':').map(|x| x.parse().unwrap()).collect();
                let u = |i: usize| u64::try_from(n[i]).unwrap();
                (id, (u(0), u(1), u(2), u(3), n[4]))
            })
            .collect();
        LedgerRead {
            clock: meta.get("clock").map_or(0, |c| c.parse().unwrap()),
            charges,
            meta,
            order,
            ends,
            blocks,
        }
    }
}

impl LedgerRead {
    fn sum(&self, field: &str) -> Option<u64> {
        self.meta.get(field).map(|v| v.parse().unwrap())
    }

    /// The script's running sums and indexes are what rereading every charge gives.
    fn check(&self, window_ms: u64, step: u64) {
        let part = |c: &StoredCharge, p: &str| match p {
            "i" => c.2,
            "o" => c.3,
            _ => c.2 + c.3,
        };
        let in_window: u64 = self
            .charges
            .values()
            .filter(|c| c.1 + window_ms > self.clock)
            .map(|c| part(c, "t"))
            .sum();
        assert_eq!(
            self.sum("win_t"),
            Some(in_window),
            "step {step}: window sum"
        );
        for p in ["t", "i", "o"] {
            let Some(basis) = self.sum(&format!("{p}_basis")) else {
                continue;
            };
            let after: u64 = self
                .charges
                .values()
                .filter(|c| c.0 > basis)
                .map(|c| part(c, p))
                .sum();
            assert_eq!(
                self.sum(&format!("{p}_aft")),
                Some(after),
                "step {step}: the charges after part {p}'s announcement"
            );
        }
        let mut by_seq: Scored = self
            .charges
            .iter()
            .map(|(id, c)| (id.clone(), c.0 as f64))
            .collect();
        by_seq.sort_by(|a, b| a.1.total_cmp(&b.1));
        assert_eq!(self.order, by_seq, "step {step}: the admission order");
        let mut ends: Scored = self
            .charges
            .iter()
            .map(|(id, c)| {
                let score = if c.4 < 0 {
                    2_251_799_813_685_248.0 + c.1 as f64
                } else {
                    c.4 as f64
                };
                (id.clone(), score)
            })
            .collect();
        ends.sort_by(|a, b| a.1.total_cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
        assert_eq!(self.ends, ends, "step {step}: the ends");
        // Per block of 32 sequence numbers and of 1,024, by admission and by end; the rest in
        // flight.
        let mut blocks: std::collections::HashMap<String, i64> = Default::default();
        let mut flying = (0, 0);
        for c in self.charges.values() {
            let mut add = |kind: &str, key: u64| {
                for (level, span) in [(1, 32), (2, 1_024)] {
                    for (part, v) in [("i", c.2), ("o", c.3)] {
                        *blocks
                            .entry(format!("{kind}{level}:{}:{part}", key / span))
                            .or_default() += i64::try_from(v).unwrap();
                    }
                }
            };
            add("s", c.0);
            match u64::try_from(c.4) {
                Ok(fin) => add("f", fin),
                Err(_) => flying = (flying.0 + c.2, flying.1 + c.3),
            }
        }
        blocks.insert("n".to_owned(), self.charges.len() as i64);
        blocks.retain(|_, v| *v != 0);
        let stored: std::collections::HashMap<String, i64> = self
            .blocks
            .iter()
            .map(|(k, v)| (k.clone(), v.parse().unwrap()))
            .collect();
        assert_eq!(stored, blocks, "step {step}: the block sums");
        assert_eq!(
            (self.sum("fl_i"), self.sum("fl_o")),
            (Some(flying.0), Some(flying.1)),
            "step {step}: the charges in flight"
        );
    }
}

/// As charges leave a short window, the ledger keeps its running sums: after every step they
/// are what a full reread of its charges gives, and its answers are the pure `TokenBudget`'s
/// fed the script's own clock (the same verdicts, retry hints and remainders, refills
/// included). Sleeps only let the window roll: what is asserted holds however long they took,
/// save the mix of admissions and refusals, whose check leaves a wide margin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_ledger_keeps_its_sums_as_charges_leave_the_window() {
    use nthbouncer_coord::redis::{SharedAdmit, TokenView};
    use nthbouncer_governor::{
        Priority, TokenAdmit, TokenBudget, TokenCost, TokenPart, TokenSettings, TokenWindow, Usage,
    };
    let space = Space::new();
    let node = space.node();
    let s = TokenSettings {
        tpm: 6_000,
        window_ms: 120,
        ..TokenSettings::default()
    };
    let ledger = node.token_ledger("roll");
    let mut pure = TokenBudget::new(s);
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    let same = |v: TokenView, pure: &TokenBudget, now: u64, step: u64| {
        let snap = pure.snapshot(now);
        assert_eq!(
            (v.remaining, v.input_remaining, v.output_remaining, v.budget),
            (
                snap.remaining,
                snap.input_remaining,
                snap.output_remaining,
                snap.budget
            ),
            "step {step}"
        );
        assert_eq!(v.admitted_tokens, snap.admitted_tokens, "step {step}");
    };
    let mut live: Vec<u128> = Vec::new();
    let (mut admitted, mut refused, mut left) = (0, 0, 0);
    for step in 0..400u64 {
        if next(2) == 0 {
            tokio::time::sleep(Duration::from_millis(next(25))).await;
        }
        let op = next(10);
        let view = if op < 5 || live.is_empty() {
            let id = u128::from(step);
            let cost = TokenCost {
                input: 1 + next(600),
                output: next(300),
            };
            let r = ledger.admit(&s, id, cost, false).await.unwrap();
            let now = space.read_ledger("roll").clock;
            match (pure.try_admit(now, id, cost, Priority::Normal, false), r) {
                (TokenAdmit::Admitted { .. }, SharedAdmit::Admitted(v)) => {
                    admitted += 1;
                    live.push(id);
                    v
                }
                (
                    TokenAdmit::Refused { retry_after_ms },
                    SharedAdmit::Refused {
                        view,
                        retry_after_ms: shared,
                    },
                ) => {
                    refused += 1;
                    assert_eq!(shared, retry_after_ms, "step {step}: the retry hint");
                    view
                }
                other => panic!("step {step}: {other:?}"),
            }
        } else if op < 8 {
            let id = live.remove(next(live.len() as u64) as usize);
            let usage = match next(3) {
                0 => None,
                1 => Some(Usage::Total(next(900))),
                _ => Some(Usage::Split(TokenCost {
                    input: next(600),
                    output: next(300),
                })),
            };
            let v = ledger.finish(&s, id, usage).await.unwrap();
            pure.finish_usage(space.read_ledger("roll").clock, id, usage);
            v
        } else if op < 9 {
            let id = live.remove(next(live.len() as u64) as usize);
            let v = ledger.refund(&s, id).await.unwrap();
            pure.refund(id);
            v
        } else {
            let part = [TokenPart::Total, TokenPart::Input, TokenPart::Output][next(3) as usize];
            let limit = [60_000, 30_000, 12_000][next(3) as usize];
            // Full again within a second: the refill is compared too (its integer division is
            // exact in the script's doubles at these sizes).
            let w = TokenWindow {
                limit: Some(limit),
                remaining: Some(limit / 2 + next(limit / 2)),
                reset_ms: Some(200 + next(800)),
            };
            // None, the latest charge, or any other: in flight, ended, or gone.
            let id = match next(4) {
                0 => None,
                1 => live.last().copied(),
                _ => Some(u128::from(next(step + 1))),
            };
            let v = ledger.observe(&s, id, part, w).await.unwrap();
            pure.observe_part(space.read_ledger("roll").clock, id, part, w);
            v
        };
        let read = space.read_ledger("roll");
        same(view, &pure, read.clock, step);
        read.check(s.window_ms, step);
        if read.sum("win_seq").unwrap_or(0) > 1 {
            left += 1;
        }
    }
    // The run went through each case the sums must follow.
    assert!(
        admitted > 30 && refused > 10,
        "{admitted} admitted, {refused} refused"
    );
    assert!(left > 0, "no charge ever left the window");
    // Then every charge ends, the window goes by, one more is admitted, and announcements
    // without a request come (their basis the newest): every charge before that one is
    // settled, out of the window and in every announcement, so the ledger drops them all.
    for id in live.drain(..) {
        ledger.finish(&s, id, None).await.unwrap();
    }
    let announce = || async {
        for part in [TokenPart::Total, TokenPart::Input, TokenPart::Output] {
            let w = TokenWindow {
                limit: Some(60_000),
                remaining: Some(60_000),
                reset_ms: Some(1_000),
            };
            ledger.observe(&s, None, part, w).await.unwrap();
        }
    };
    announce().await;
    tokio::time::sleep(Duration::from_millis(s.window_ms + 20)).await;
    let last = TokenCost {
        input: 1,
        output: 0,
    };
    let admitted_last = ledger.admit(&s, 1_000_000, last, false).await.unwrap();
    assert!(
        matches!(admitted_last, SharedAdmit::Admitted(_)),
        "{admitted_last:?}"
    );
    announce().await;
    let read = space.read_ledger("roll");
    read.check(s.window_ms, 400);
    assert_eq!(
        read.charges.keys().collect::<Vec<_>>(),
        [&format!("{:032x}", 1_000_000)],
        "of {admitted} charges, all but the last one dropped"
    );
}

/// An announcement answered by a charge admitted long ago reads sums per block, not the charges
/// since: across both levels of blocks (32 and 1,024 sequence numbers) and at their edges, what
/// it takes off (the charges after its request, and those out when its request was admitted) is
/// what a reread of every charge gives, and the pure `TokenBudget` agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_announcement_from_long_ago_reads_block_sums() {
    use nthbouncer_governor::{
        Priority, TokenAdmit, TokenBudget, TokenCost, TokenPart, TokenSettings, TokenWindow, Usage,
    };
    let space = Space::new();
    let node = space.node();
    let s = TokenSettings {
        tpm: 0,
        window_ms: 3_600_000,
        ..TokenSettings::default()
    };
    let ledger = node.token_ledger("deep");
    let mut pure = TokenBudget::new(s);
    let mut next = xorshift(0x1234_5678_9abc_def1);
    // Charge `id` is admitted with sequence number id + 1; about half end (at a later one).
    let mut live: Vec<u128> = Vec::new();
    for id in 0..2_100u128 {
        let cost = TokenCost {
            input: 1 + next(50),
            output: next(20),
        };
        assert!(matches!(
            pure.try_admit(0, id, cost, Priority::Normal, false),
            TokenAdmit::Admitted { .. }
        ));
        ledger.admit(&s, id, cost, false).await.unwrap();
        live.push(id);
        if next(2) == 0 {
            let done = live.remove(next(live.len() as u64) as usize);
            let usage = Some(Usage::Total(next(80)));
            pure.finish_usage(0, done, usage);
            ledger.finish(&s, done, usage).await.unwrap();
        }
    }
    let field = |id: u128| format!("{id:032x}");
    for (k, answered) in [
        0u128, 4, 30, 31, 32, 33, 1_022, 1_023, 1_024, 1_100, 2_046, 2_099,
    ]
    .into_iter()
    .enumerate()
    {
        let part = [TokenPart::Total, TokenPart::Input, TokenPart::Output][k % 3];
        let w = TokenWindow {
            limit: Some(1_000_000),
            remaining: Some(900_000),
            reset_ms: Some(1_000_000_000_000),
        };
        let v = ledger.observe(&s, Some(answered), part, w).await.unwrap();
        pure.observe_part(0, Some(answered), part, w);
        let snap = pure.snapshot(0);
        assert_eq!(
            (v.remaining, v.input_remaining, v.output_remaining),
            (snap.remaining, snap.input_remaining, snap.output_remaining),
            "answered by {answered}"
        );
        let read = space.read_ledger("deep");
        read.check(s.window_ms, k as u64);
        let p = ["t", "i", "o"][k % 3];
        let of = |c: &StoredCharge| match p {
            "i" => c.2,
            "o" => c.3,
            _ => c.2 + c.3,
        };
        let basis = read.charges[&field(answered)].0;
        let out_then: u64 = read
            .charges
            .iter()
            .filter(|(id, c)| {
                c.0 < basis && **id != field(answered) && (c.4 < 0 || c.4 >= basis as i64)
            })
            .map(|(_, c)| of(c))
            .sum();
        assert_eq!(read.sum(&format!("{p}_basis")), Some(basis));
        assert_eq!(
            read.sum(&format!("{p}_ift")),
            Some(out_then),
            "answered by {answered}: the charges out when it was admitted"
        );
    }
}

/// Reports sent together (the node's reporter sends all it has at hand in one call) leave the
/// ledger as the same reports sent one by one: the same view, sums and charges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_sent_together_count_as_sent_one_by_one() {
    use nthbouncer_coord::redis::TokenReport;
    use nthbouncer_governor::{TokenCost, TokenPart, TokenSettings, TokenWindow, Usage};
    let space = Space::new();
    let node = space.node();
    let s = TokenSettings {
        tpm: 50_000,
        window_ms: 3_600_000,
        ..TokenSettings::default()
    };
    let (apart, together) = (node.token_ledger("apart"), node.token_ledger("together"));
    for id in 0..40u128 {
        let cost = TokenCost {
            input: 100 + 7 * (id as u64),
            output: 50,
        };
        for l in [&apart, &together] {
            assert!(matches!(
                l.admit(&s, id, cost, false).await.unwrap(),
                nthbouncer_coord::redis::SharedAdmit::Admitted(_)
            ));
        }
    }
    let w = |remaining| TokenWindow {
        limit: Some(40_000),
        remaining: Some(remaining),
        reset_ms: Some(1_000_000_000_000),
    };
    let reports = [
        TokenReport::Finish(3, Some(Usage::Total(90))),
        TokenReport::Observe(Some(3), TokenPart::Total, w(30_000)),
        TokenReport::Refund(7),
        TokenReport::Finish(
            12,
            Some(Usage::Split(TokenCost {
                input: 300,
                output: 20,
            })),
        ),
        TokenReport::Finish(99, None),
        TokenReport::Unhold(5),
        TokenReport::Finish(20, None),
        TokenReport::Observe(Some(20), TokenPart::Input, w(25_000)),
        TokenReport::Observe(None, TokenPart::Output, w(39_000)),
        TokenReport::Finish(39, Some(Usage::Total(1_000))),
    ];
    let mut one_by_one = None;
    for r in &reports {
        one_by_one = Some(apart.report(&s, std::slice::from_ref(r)).await.unwrap());
    }
    let batched = together.report(&s, &reports).await.unwrap();
    assert_eq!(Some(batched), one_by_one);
    let (a, t) = (space.read_ledger("apart"), space.read_ledger("together"));
    a.check(s.window_ms, 0);
    t.check(s.window_ms, 1);
    assert_eq!(a.charges.len(), t.charges.len());
    for (id, c) in &a.charges {
        let other = t.charges[id];
        // Admitted and ended at the same sequence numbers, for the same tokens.
        assert_eq!(
            (c.0, c.2, c.3, c.4),
            (other.0, other.2, other.3, other.4),
            "{id}"
        );
    }
    for f in [
        "t_aft", "t_ift", "i_aft", "i_ift", "o_aft", "o_ift", "fl_i", "fl_o", "win_t",
    ] {
        assert_eq!(a.meta.get(f), t.meta.get(f), "{f}");
    }
}

/// A ledger written by the earlier script (its charges hash and meta only, no indexes) is
/// indexed by the first call that finds it: the charges in the window count, one in flight for
/// longer than a charge may be ends and goes; a charge taken out behind the indexes (as a node
/// of the earlier version does) is seen at the next call; so is any one of the ledger's keys
/// lost (as Redis evicts keys when it runs out of memory with an evicting policy), the meta
/// included: sequence numbers go on after the charges'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_of_the_earlier_layout_is_indexed_once() {
    use nthbouncer_governor::TokenSettings;
    let space = Space::new();
    let node = space.node();
    let s = TokenSettings {
        tpm: 10_000,
        window_ms: 60_000,
        ..TokenSettings::default()
    };
    let key = |name: &str| format!("{}:{{old}}:tok:{name}", space.prefix);
    let time: Vec<String> = space.sync_cmd(&::redis::cmd("TIME"));
    let now = time[0].parse::<u64>().unwrap() * 1000 + time[1].parse::<u64>().unwrap() / 1000;
    let stale = format!("1:{}:700:200:-1", now - 700_000);
    let settled = format!("2:{}:300:100:2", now - 1_000);
    let flying = format!("3:{}:1000:500:-1", now - 500);
    let _: () = space.sync_cmd(
        ::redis::cmd("HSET")
            .arg(key("charges"))
            .arg("a")
            .arg(settled)
            .arg("b")
            .arg(stale)
            .arg("c")
            .arg(flying),
    );
    let _: () = space.sync_cmd(
        ::redis::cmd("HSET")
            .arg(key("meta"))
            .arg("seq")
            .arg(3)
            .arg("admitted")
            .arg(2_800),
    );
    let ledger = node.token_ledger("old");
    let v = ledger.peek(&s).await.unwrap();
    assert_eq!(v.remaining, Some(10_000 - 400 - 1_500));
    assert_eq!(v.admitted_tokens, 2_800);
    let read = space.read_ledger("old");
    assert_eq!(read.meta.get("v").map(String::as_str), Some("3"));
    assert!(
        !read.charges.contains_key("b"),
        "the stale charge out of the window ended and went"
    );
    read.check(s.window_ms, 0);

    // An older node refunds "a" (it knows nothing of the indexes).
    let _: () = space.sync_cmd(::redis::cmd("HDEL").arg(key("charges")).arg("a"));
    let v = ledger.peek(&s).await.unwrap();
    assert_eq!(v.remaining, Some(10_000 - 1_500));
    space.read_ledger("old").check(s.window_ms, 1);

    for (step, lost) in ["blocks", "ends", "order", "meta"].into_iter().enumerate() {
        let _: () = space.sync_cmd(::redis::cmd("DEL").arg(key(lost)));
        let v = ledger.peek(&s).await.unwrap();
        assert_eq!(v.remaining, Some(10_000 - 1_500), "{lost} lost");
        space.read_ledger("old").check(s.window_ms, 2 + step as u64);
    }
    use nthbouncer_coord::redis::SharedAdmit;
    use nthbouncer_governor::TokenCost;
    let cost = TokenCost {
        input: 100,
        output: 0,
    };
    assert!(matches!(
        ledger.admit(&s, 7, cost, false).await.unwrap(),
        SharedAdmit::Admitted(_)
    ));
    let read = space.read_ledger("old");
    read.check(s.window_ms, 9);
    assert_eq!(
        read.charges[&format!("{:032x}", 7)].0,
        4,
        "after the meta was lost, the next charge's sequence number follows the charges'"
    );
}

/// A pair on a free slot, through a node on `server`.
async fn one_pair(server: &OwnRedis) {
    pair_at(server.url.clone()).await;
}

/// A pair on a free slot, through a node on the Redis at `url`.
async fn pair_at(url: String) {
    let space = Space::on(url);
    let node = space.node();
    let gate = node.open("fn", limit(2));
    let g = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert!(gate.release(g.slot_id, None).await);
}

/// On Redis 7 the gate's operations are the functions of its library, loaded by the first call
/// that finds it missing, at the start and again after Redis lost it (`FUNCTION FLUSH`, a
/// restart without persistence); on a Redis without functions (as Redis 6) they go as scripts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_calls_functions_where_redis_has_them_and_scripts_where_not() {
    let with = OwnRedis::start(true);
    one_pair(&with).await;
    let functions = with.calls("fcall");
    assert!(functions >= 2, "{functions} function calls for a pair");
    assert_eq!(with.calls("evalsha"), 0);
    // Loaded by the first calls that found it missing (the gate's first two go at once).
    let loads = with.calls("function|load");
    assert!(loads >= 1);
    one_pair(&with).await;
    assert!(with.calls("fcall") >= functions + 2);
    assert_eq!(
        with.calls("function|load"),
        loads,
        "loaded only when missing"
    );
    let _: String = with.cmd(::redis::cmd("FUNCTION").arg("FLUSH")).unwrap();
    one_pair(&with).await;
    assert!(
        with.calls("function|load") > loads,
        "loaded again once lost"
    );
    assert_eq!(with.calls("evalsha"), 0);

    // A user whose ACL does not allow functions gets scripts too.
    let _: String = with
        .cmd(
            ::redis::cmd("ACL")
                .arg("SETUSER")
                .arg("scripts")
                .arg("on")
                .arg(">secret")
                .arg("~*")
                .arg("&*")
                .arg("+@all")
                .arg("-fcall")
                .arg("-function"),
        )
        .unwrap();
    let evalsha = with.calls("evalsha");
    pair_at(with.url.replace("redis://", "redis://scripts:secret@")).await;
    assert!(with.calls("evalsha") >= evalsha + 2);

    let without = OwnRedis::start(false);
    one_pair(&without).await;
    assert!(without.calls("evalsha") >= 2);
    one_pair(&without).await;
    assert!(without.calls("evalsha") >= 4);
}

/// A node's Redis tasks run on a thread of its own, which ends with the node: nothing of a
/// dropped coordination keeps running (a server started and stopped many times in one process,
/// as the tests do, leaves no thread behind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_thread_ends_when_the_node_is_dropped() {
    let space = Space::new();
    let node = space.node();
    let home = node.token_ledger("ends").runtime().clone();
    let gate = node.open("ends", limit(1));
    let g = gate.acquire(req(0, SlotKind::Lease)).await.unwrap();
    assert!(gate.release(g.slot_id, None).await);
    assert!(
        home.spawn(async {}).await.is_ok(),
        "the node's runtime runs while the node is there"
    );
    drop(gate);
    drop(node);
    until("the node's runtime is shut down", || {
        let probe = home.spawn(async {});
        async move { probe.await.is_err_and(|e| e.is_cancelled()) }
    })
    .await;
}

/// A Redis that may evict keys to stay under a memory limit is told apart from one that may not
/// (the server warns at start): every coordination key expires, so `volatile-*` policies count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_may_evict_keys_is_told_apart() {
    let own = OwnRedis::start(true);
    let node = Space::on(own.url.clone()).node();
    assert_eq!(node.eviction_risk().await.unwrap(), None, "no maxmemory");
    let set = |key: &str, value: &str| {
        let _: () = own
            .cmd(::redis::cmd("CONFIG").arg("SET").arg(key).arg(value))
            .unwrap();
    };
    set("maxmemory", "100mb");
    set("maxmemory-policy", "noeviction");
    assert_eq!(node.eviction_risk().await.unwrap(), None, "noeviction");
    for policy in ["volatile-lru", "allkeys-lru", "volatile-ttl"] {
        set("maxmemory-policy", policy);
        assert_eq!(
            node.eviction_risk().await.unwrap(),
            Some((100 * 1024 * 1024, policy.to_owned()))
        );
    }
}
