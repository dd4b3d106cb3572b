//! Scale-out (issue #16): several real nodes — separate processes of the binary, each with its
//! own data dir and the same pools and keys from its config — share each pool's limit through
//! the machine's Redis (127.0.0.1:6379, or `NB_TEST_REDIS`; `.ci/run` starts one).
//!
//! Each test works under a Redis key prefix of its own (deleted afterwards) and the tests run
//! one after another (`SERIAL`): each starts up to three nodes on a two-core machine. Counts
//! and order only: the origin's own count of calls in flight, who got in and in which order.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{call, lock_pool_toml, pool_toml, wait_until, Upstream};
use reqwest::Method;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

use crate::BIN;

/// The three-node tests run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn redis_url() -> String {
    std::env::var("NB_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/".to_owned())
}

/// One test's corner of Redis: a fresh key prefix, every key under it deleted on drop.
struct Space {
    prefix: String,
}

impl Space {
    fn new() -> Space {
        let client = redis::Client::open(redis_url()).unwrap();
        let pong: Result<String, _> = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .and_then(|mut c| redis::cmd("PING").query(&mut c));
        assert!(
            pong.is_ok(),
            "Redis is not answering at {} ({pong:?}): these tests need a real Redis",
            redis_url()
        );
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        Space {
            prefix: format!("nbscale-{}-{nanos:x}", std::process::id()),
        }
    }

    /// The `[server]` lines of a node coordinating through `url` under this space's prefix.
    fn server_toml(&self, url: &str, extra: &str) -> String {
        format!(
            "coordination = \"{url}\"\ncoordination_prefix = \"{}\"\n{extra}",
            self.prefix
        )
    }
}

impl Drop for Space {
    fn drop(&mut self) {
        let Ok(client) = redis::Client::open(redis_url()) else {
            return;
        };
        let Ok(mut c) = client.get_connection() else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", self.prefix))
            .query(&mut c)
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: Result<(), _> = redis::cmd("DEL").arg(&keys).query(&mut c);
        }
    }
}

/// Starts `n` nodes with the same `[server]` extras and pools.
async fn nodes(n: usize, server: &str, pools: &str) -> Vec<Server> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .build()
            .unwrap();
        out.push(Server::start(BIN, "warn", client, &format!("{server}{pools}")).await);
    }
    out
}

async fn state(node: &Server, pool: &str) -> Value {
    node.admin_json(&format!("/admin/pools/{pool}/state")).await
}

/// Waits (bounded) until the cluster-wide state of `pool`, read on `node`, has `queued` waiters.
async fn wait_queued(node: &Server, pool: &str, queued: u64) {
    let mut last = Value::Null;
    let ok = wait_until(1000, Duration::from_millis(20), async || {
        last = state(node, pool).await;
        last["queued"] == queued
    })
    .await;
    assert!(ok, "{pool} never had {queued} queued: {last}");
}

async fn lock(node: &Server, pool: &str, path: &str, body: Value) -> (u16, Value) {
    call(
        node.api(Method::POST, &format!("/pools/{pool}/lock/{path}"))
            .json(&body),
    )
    .await
}

/// A flood spread over three nodes at `limit = 8`: the origin never sees a ninth call, and
/// every caller is served. Then FIFO for one key across the nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_hold_one_limit_and_one_fifo_queue() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let flood = Upstream::start().await;
    let fifo = Upstream::start().await;
    let pools = pool_toml(
        "p",
        &flood.url(),
        "limit = 8\nqueue_size = 5000\nqueue_timeout_ms = 60000\nadaptive = false",
    ) + &pool_toml("f", &fifo.url(), "limit = 1\nadaptive = false");
    let nodes = Arc::new(nodes(3, &space.server_toml(&redis_url(), ""), &pools).await);

    const REQUESTS: usize = 3000;
    const CALLERS: usize = 48;
    let statuses = Arc::new(Mutex::new(Vec::with_capacity(REQUESTS)));
    let mut callers = JoinSet::new();
    for c in 0..CALLERS {
        let (nodes, statuses) = (nodes.clone(), statuses.clone());
        callers.spawn(async move {
            for i in (c..REQUESTS).step_by(CALLERS) {
                let node = &nodes[i % 3];
                let r = node.pool_get("p", "/sleep?ms=2").send().await.unwrap();
                statuses.lock().unwrap().push(r.status().as_u16());
            }
        });
    }
    while let Some(done) = callers.join_next().await {
        done.unwrap();
    }
    let statuses = statuses.lock().unwrap().clone();
    assert_eq!(statuses.len(), REQUESTS);
    assert!(statuses.iter().all(|s| *s == 200), "every caller is served");
    assert_eq!(flood.total(), REQUESTS as u64);
    assert!(
        flood.max_in_flight() <= 8,
        "the origin saw {} at once",
        flood.max_in_flight()
    );
    assert!(flood.max_in_flight() >= 2, "the flood ran in parallel");
    for node in nodes.iter() {
        node.wait_idle("p").await;
    }

    // FIFO for one key: the only slot is held (a lock on node A); callers queue one by one on
    // the nodes in turn; once it is released they reach the origin in the order they queued.
    let (status, held) = lock(&nodes[0], "f", "acquire", json!({})).await;
    assert_eq!(status, 200, "{held}");
    let mut waiters = JoinSet::new();
    for i in 0..9u64 {
        let req = nodes[(i % 3) as usize]
            .pool_get("f", "/")
            .header("x-seq", i.to_string());
        waiters.spawn(async move { req.send().await.unwrap().status().as_u16() });
        wait_queued(&nodes[1], "f", i + 1).await;
    }
    let slot = held["slotId"].as_str().unwrap();
    let (status, released) = lock(&nodes[2], "f", &format!("{slot}/release"), json!({})).await;
    assert_eq!((status, &released["released"]), (200, &json!(true)));
    while let Some(s) = waiters.join_next().await {
        assert_eq!(s.unwrap(), 200);
    }
    let order: Vec<String> = (0..9).map(|i| i.to_string()).collect();
    assert_eq!(fifo.arrivals(), order, "FIFO across the nodes");
    assert_eq!(fifo.max_in_flight(), 1);
}

/// Lock leases count across nodes; a lease taken on A renews on B and releases on C.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_taken_on_one_node_renews_and_releases_on_the_others() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let pools = lock_pool_toml("l", "limit = 2");
    let nodes = nodes(3, &space.server_toml(&redis_url(), ""), &pools).await;

    let (status, a) = lock(&nodes[0], "l", "acquire", json!({})).await;
    assert_eq!(status, 200, "{a}");
    let (status, b) = lock(&nodes[1], "l", "acquire", json!({})).await;
    assert_eq!(status, 200, "{b}");
    let (status, refused) = lock(&nodes[2], "l", "acquire", json!({})).await;
    assert_eq!(
        (status, &refused["error"]),
        (429, &json!("too_many_requests"))
    );
    assert_eq!(state(&nodes[2], "l").await["inFlight"], 2);

    let slot = a["slotId"].as_str().unwrap();
    let (status, renewed) = lock(&nodes[1], "l", &format!("{slot}/renew"), json!({})).await;
    assert_eq!(status, 200, "{renewed}");
    assert!(renewed["leaseDeadline"].as_u64().unwrap() >= a["leaseDeadline"].as_u64().unwrap());
    let (status, released) = lock(&nodes[2], "l", &format!("{slot}/release"), json!({})).await;
    assert_eq!((status, &released["released"]), (200, &json!(true)));
    let (status, again) = lock(&nodes[0], "l", &format!("{slot}/release"), json!({})).await;
    assert_eq!((status, &again["released"]), (200, &json!(false)));
    let (status, gone) = lock(&nodes[0], "l", &format!("{slot}/renew"), json!({})).await;
    assert_eq!((status, &gone["error"]), (404, &json!("not_found")));

    let (status, c) = lock(&nodes[2], "l", "acquire", json!({})).await;
    assert_eq!(status, 200, "the released slot is free on every node: {c}");
}

/// A node `kill -9`ed while its proxied call holds the pool's only slot: with a 1 s term the slot
/// comes back and the other nodes' waiters get it, in the order they queued, one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_slots_come_back_to_the_other_nodes_waiters() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let origin = Upstream::start().await;
    let pools = pool_toml(
        "k",
        &origin.url(),
        "limit = 1\nlease_term_ms = 1000\nrenew_interval_ms = 300\nadaptive = false",
    );
    let mut nodes = nodes(3, &space.server_toml(&redis_url(), ""), &pools).await;

    let holder = nodes[0].pool_get("k", "/hold");
    let holder = tokio::spawn(async move { holder.send().await.map(|r| r.status().as_u16()) });
    let held = wait_until(1000, Duration::from_millis(10), async || {
        origin.in_flight() == 1
    })
    .await;
    assert!(held, "node A never held the slot");

    let mut waiters = JoinSet::new();
    for i in 0..4u64 {
        let req = nodes[1 + (i % 2) as usize]
            .pool_get("k", "/")
            .header("x-seq", i.to_string());
        waiters.spawn(async move { req.send().await.unwrap().status().as_u16() });
        wait_queued(&nodes[1], "k", i + 1).await;
    }

    nodes[0].kill_9();
    assert!(
        holder.await.unwrap().is_err(),
        "node A's caller lost its connection"
    );
    while let Some(s) = waiters.join_next().await {
        assert_eq!(
            s.unwrap(),
            200,
            "a waiter got a slot back from the dead node"
        );
    }
    let order: Vec<String> = (0..4).map(|i| i.to_string()).collect();
    assert_eq!(origin.arrivals(), order, "FIFO across the surviving nodes");
    assert_eq!(origin.max_in_flight(), 1);
    nodes[1].wait_idle("k").await;
    origin.release(1);
}

/// A TCP forwarder to the real Redis that can be switched off (connections cut, new ones
/// refused) and on again: Redis going away and coming back, without restarting any node.
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
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let target = redis_url()
            .trim_start_matches("redis://")
            .split('/')
            .next()
            .unwrap()
            .to_owned();
        let (up2, conns2) = (up.clone(), conns.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !up2.load(Ordering::SeqCst) {
                    continue; // dropped: closed at once
                }
                let target = target.clone();
                conns2.lock().unwrap().push(tokio::spawn(async move {
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

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
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

/// Fail closed (the default): while Redis is away every node answers
/// `503 coordination_unavailable` with `Retry-After` and admits nothing; when it is back the
/// nodes admit again, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_going_away_fails_closed_and_comes_back() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let switch = Switch::start().await;
    let origin = Upstream::start().await;
    let pools = pool_toml("c", &origin.url(), "limit = 4\nadaptive = false");
    let nodes = nodes(3, &space.server_toml(&switch.url(), ""), &pools).await;
    for node in &nodes {
        assert_eq!(node.pool_get("c", "/").send().await.unwrap().status(), 200);
    }

    switch.down();
    let before = origin.total();
    for node in &nodes {
        let r = node.pool_get("c", "/").send().await.unwrap();
        assert_eq!(r.status(), 503);
        assert!(r.headers().contains_key("retry-after"));
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"], "coordination_unavailable", "{body}");
    }
    assert_eq!(
        origin.total(),
        before,
        "nothing was admitted while Redis was away"
    );

    switch.up();
    for node in &nodes {
        let back = wait_until(500, Duration::from_millis(20), async || {
            node.pool_get("c", "/")
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        })
        .await;
        assert!(back, "a node never admitted again once Redis was back");
    }
    assert!(origin.max_in_flight() <= 4);
}

/// Fail open: while Redis is away each of three nodes admits up to `limit / expected_nodes`
/// on its own, so the origin still sees no more than the limit; when Redis is back the nodes
/// share it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_going_away_fails_open_on_each_nodes_share() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let switch = Switch::start().await;
    let origin = Upstream::start().await;
    let pools = pool_toml("o", &origin.url(), "limit = 6\nadaptive = false");
    let extra = "coordination_fail = \"open\"\nexpected_nodes = 3\n";
    let nodes = nodes(3, &space.server_toml(&switch.url(), extra), &pools).await;

    switch.down();
    // Each node: two calls held at the origin, the third refused at once.
    let mut holders = JoinSet::new();
    for node in &nodes {
        for _ in 0..2 {
            let req = node.pool_get("o", "/hold");
            holders.spawn(async move { req.send().await.unwrap().status().as_u16() });
        }
    }
    let held = wait_until(1000, Duration::from_millis(10), async || {
        origin.in_flight() == 6
    })
    .await;
    assert!(held, "each node admits its share on its own");
    for node in &nodes {
        let r = node
            .pool_get("o", "/")
            .header("x-nthpool-no-queue", "1")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 429, "past the node's share");
    }
    assert_eq!(origin.max_in_flight(), 6);
    origin.release(6);
    while let Some(s) = holders.join_next().await {
        assert_eq!(s.unwrap(), 200);
    }

    switch.up();
    // Back on Redis: the shared state sees a call admitted on any node.
    let lock_pool = &nodes[0];
    let shared = wait_until(500, Duration::from_millis(20), async || {
        let req = lock_pool.pool_get("o", "/hold");
        let call = tokio::spawn(async move { req.send().await.map(|r| r.status().as_u16()) });
        let seen = wait_until(100, Duration::from_millis(10), async || {
            origin.in_flight() == 1
        })
        .await;
        let counted = seen && state(&nodes[2], "o").await["inFlight"] == 1;
        origin.release(1);
        let _ = call.await;
        counted
    })
    .await;
    assert!(
        shared,
        "the nodes never shared one count again once Redis was back"
    );
    assert!(origin.max_in_flight() <= 6);
}
