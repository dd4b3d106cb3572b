//! Scale-out (issue #16): several real nodes — separate processes of the binary, each with its
//! own data dir and the same pools and keys from its config — share each pool's limit through
//! the machine's Redis (127.0.0.1:6379, or `NB_TEST_REDIS`; `.ci/run` starts one).
//!
//! Each test works under a Redis key prefix of its own (deleted afterwards) and the tests run
//! one after another (`SERIAL`): each starts up to three nodes on a two-core machine. The
//! outage tests start a `redis-server` of their own on a free port instead, kill it (`kill -9`)
//! mid-load and start it again: the machine's Redis is never stopped. Counts
//! and order only: the origin's own count of calls in flight, who got in and in which order.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{call, lock_pool_toml, pool_toml, wait_until, Upstream};
use reqwest::Method;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use crate::BIN;

/// The three-node tests run one at a time.
pub(crate) static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub(crate) fn redis_url() -> String {
    std::env::var("NB_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/".to_owned())
}

/// One test's corner of Redis: a fresh key prefix, every key under it deleted on drop.
pub(crate) struct Space {
    pub(crate) prefix: String,
}

impl Space {
    pub(crate) fn new() -> Space {
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
    pub(crate) fn server_toml(&self, url: &str, extra: &str) -> String {
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
pub(crate) async fn nodes(n: usize, server: &str, pools: &str) -> Vec<Server> {
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

pub(crate) async fn state(node: &Server, pool: &str) -> Value {
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

    // Each node's calls to Redis are timed, by script and operation, in sub-millisecond
    // buckets.
    let text = nodes[0].metrics_text().await;
    let gate_calls = redis_calls(&text, "gate");
    assert!(gate_calls >= 3.0, "{gate_calls} gate calls timed:\n{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("nthbouncer_redis_call_seconds_bucket{")
                && l.contains("script=\"gate\"")
                && l.contains("le=\"0.0001\"")),
        "no 100 µs bucket:\n{text}"
    );
}

/// How many calls of `script` (`gate`, `tokens`) to Redis a node's `/metrics` counts.
pub(crate) fn redis_calls(text: &str, script: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("nthbouncer_redis_call_seconds_count{"))
        .filter(|l| l.contains(&format!("script=\"{script}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
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

/// A node `kill -9`ed while its callers wait in the pool's queue, with a lease term (60 s) longer
/// than the other callers will wait (30 s): the slot granted to the dead node's first waiter
/// (the node still counts as alive for up to 5 s) is leased only until collected, so it comes
/// back within the node timeout, and the other nodes' waiters are served in their turn (before:
/// it stayed leased for the whole term and they timed out with 504).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_queued_waiters_hold_no_slot_for_a_lease_term() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let origin = Upstream::start().await;
    let pools = pool_toml(
        "w",
        &origin.url(),
        "limit = 1\nlease_term_ms = 60000\nqueue_timeout_ms = 30000\nadaptive = false",
    );
    let mut nodes = nodes(3, &space.server_toml(&redis_url(), ""), &pools).await;

    let holder = nodes[1].pool_get("w", "/hold");
    let holder = tokio::spawn(async move { holder.send().await.map(|r| r.status().as_u16()) });
    let held = wait_until(1000, Duration::from_millis(10), async || {
        origin.in_flight() == 1
    })
    .await;
    assert!(held, "node B never held the slot");

    let mut dying = JoinSet::new();
    let mut waiters = JoinSet::new();
    for i in 0..4u64 {
        let node = if i < 2 { 0 } else { 2 };
        let req = nodes[node]
            .pool_get("w", "/")
            .header("x-seq", i.to_string());
        let send = async move { req.send().await.map(|r| r.status().as_u16()) };
        if i < 2 {
            dying.spawn(send);
        } else {
            waiters.spawn(send);
        }
        wait_queued(&nodes[1], "w", i + 1).await;
    }

    nodes[0].kill_9();
    origin.release(1);
    assert_eq!(holder.await.unwrap().unwrap(), 200);
    while let Some(s) = dying.join_next().await {
        assert!(
            s.unwrap().is_err(),
            "node A's waiters lost their connections"
        );
    }
    while let Some(s) = waiters.join_next().await {
        assert_eq!(
            s.unwrap().unwrap(),
            200,
            "node C's waiter was served, not left behind a slot granted to the dead node"
        );
    }
    assert_eq!(
        origin.arrivals(),
        ["2", "3"],
        "only node C's waiters, in order"
    );
    assert_eq!(origin.max_in_flight(), 1);
}

/// A `redis-server` of the test's own on a free loopback port, which the test kills (`kill -9`)
/// mid-load and starts again on the same port: Redis going away and coming back without any
/// node restarting. Never the machine's shared Redis, which other tests use.
struct OwnRedis {
    port: u16,
    dir: tempfile::TempDir,
    persistent: bool,
    child: Option<std::process::Child>,
}

impl OwnRedis {
    /// `persistent`: an append-only file synced at every write, so a restarted server comes
    /// back with the leases it held (as a production Redis with persistence does).
    async fn start(persistent: bool) -> OwnRedis {
        let mut redis = OwnRedis {
            port: nthbouncer_testkit::binary::free_port(),
            dir: tempfile::tempdir().unwrap(),
            persistent,
            child: None,
        };
        redis.up().await;
        redis
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    async fn up(&mut self) {
        assert!(self.child.is_none(), "already running");
        let aof = if self.persistent { "yes" } else { "no" };
        let port = self.port.to_string();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", aof, "--appendfsync", "always"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server must be installed for this test (.ci/run installs it)");
        self.child = Some(child);
        let url = self.url();
        let answering = wait_until(500, Duration::from_millis(20), async || {
            redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(500)))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .is_ok()
        })
        .await;
        assert!(
            answering,
            "our redis-server on port {} never answered",
            self.port
        );
    }

    fn kill_9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.kill_9();
    }
}

/// `/readyz` of a node: its status and body.
async fn readyz(node: &Server) -> (u16, Option<String>, Value) {
    let r = node.api(Method::GET, "/readyz").send().await.unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (status, retry, r.json().await.unwrap_or(Value::Null))
}

/// Fail closed (the default), Redis `kill -9`ed mid-load and started again: while it is away
/// every node answers `503 coordination_unavailable` with `Retry-After` (and so does
/// `/readyz`) and admits nothing; the calls already running are kept; when it is back the nodes
/// admit again without a restart, and the kept calls still count against the shared limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_load_fails_closed_keeps_running_calls_and_comes_back() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let mut redis = OwnRedis::start(true).await;
    let origin = Upstream::start().await;
    let pools = pool_toml("c", &origin.url(), "limit = 3\nadaptive = false");
    let nodes = nodes(3, &space.server_toml(&redis.url(), ""), &pools).await;
    for node in &nodes {
        assert_eq!(readyz(node).await.2["coordination"], "ok");
    }

    // The load: two calls running at the origin, through nodes A and B.
    let mut running = JoinSet::new();
    for node in &nodes[..2] {
        let req = node.pool_get("c", "/hold").header("x-seq", "running");
        running.spawn(async move { req.send().await.unwrap().status().as_u16() });
    }
    let both = wait_until(1000, Duration::from_millis(10), async || {
        origin.in_flight() == 2
    })
    .await;
    assert!(both, "the two calls never reached the origin");

    redis.kill_9();
    let before = origin.total();
    for node in &nodes {
        let r = node.pool_get("c", "/").send().await.unwrap();
        assert_eq!(r.status(), 503);
        assert!(r.headers().contains_key("retry-after"));
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"], "coordination_unavailable", "{body}");
        let (status, retry, body) = readyz(node).await;
        assert_eq!(
            (status, &body["error"]),
            (503, &json!("coordination_unavailable"))
        );
        assert!(retry.is_some(), "readyz says when to try again");
    }
    assert_eq!(
        origin.total(),
        before,
        "nothing was admitted while Redis was away"
    );
    assert_eq!(origin.in_flight(), 2, "the running calls were kept");

    redis.up().await;
    for node in &nodes {
        let back = wait_until(500, Duration::from_millis(20), async || {
            readyz(node).await.0 == 200
        })
        .await;
        assert!(back, "a node's /readyz never recovered");
    }
    // The running calls still hold their slots in Redis: one more fits (limit 3), then none.
    let one = wait_until(500, Duration::from_millis(20), async || {
        let r = nodes[2]
            .pool_get("c", "/")
            .header("x-nthpool-no-queue", "1")
            .send()
            .await;
        r.is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(one, "the nodes never admitted again once Redis was back");
    let extra = nodes[2].pool_get("c", "/hold").header("x-seq", "after");
    let extra = tokio::spawn(async move { extra.send().await.unwrap().status().as_u16() });
    let third = wait_until(1000, Duration::from_millis(10), async || {
        origin.in_flight() == 3
    })
    .await;
    assert!(third, "the third slot was never granted");
    for node in &nodes {
        let r = node
            .pool_get("c", "/")
            .header("x-nthpool-no-queue", "1")
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            429,
            "the kept calls count against the shared limit"
        );
    }
    origin.release(3);
    while let Some(s) = running.join_next().await {
        assert_eq!(
            s.unwrap(),
            200,
            "a call running through the outage finished"
        );
    }
    assert_eq!(extra.await.unwrap(), 200);
    assert_eq!(origin.max_in_flight(), 3);
    nodes[0].wait_idle("c").await;
}

/// How many of the origin's arrivals carried `x-seq: seq`.
fn arrived(origin: &Upstream, seq: &str) -> usize {
    origin.arrivals().iter().filter(|s| *s == seq).count()
}

/// Fail open, Redis `kill -9`ed mid-load and started again (empty): while it is away each of
/// three nodes admits up to `limit / expected_nodes` on its own — counted at the origin, the
/// calls a node was already running included — and `/readyz` stays ready; when Redis is back
/// the nodes share the whole limit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_load_fails_open_on_each_nodes_share_and_comes_back() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let mut redis = OwnRedis::start(false).await;
    let origin = Upstream::start().await;
    let pools = pool_toml("o", &origin.url(), "limit = 6\nadaptive = false");
    let extra = "coordination_fail = \"open\"\nexpected_nodes = 3\n";
    let nodes = nodes(3, &space.server_toml(&redis.url(), extra), &pools).await;

    // The load: node A runs two calls (its share), admitted through Redis.
    let mut holders = JoinSet::new();
    for _ in 0..2 {
        let req = nodes[0].pool_get("o", "/hold").header("x-seq", "a-before");
        holders.spawn(async move { req.send().await.unwrap().status().as_u16() });
    }
    let running = wait_until(1000, Duration::from_millis(10), async || {
        origin.in_flight() == 2
    })
    .await;
    assert!(running, "node A's calls never reached the origin");

    redis.kill_9();
    // Each node tries three more calls, refused at once past its share.
    let mut refused = 0;
    for (node, seq) in nodes.iter().zip(["a", "b", "c"]) {
        for _ in 0..3 {
            let req = node
                .pool_get("o", "/hold")
                .header("x-seq", seq)
                .header("x-nthpool-no-queue", "1");
            let before = arrived(&origin, seq);
            let call = tokio::spawn(async move { req.send().await.unwrap().status().as_u16() });
            // Each call either reaches the origin (and is held there) or is refused.
            let settled = wait_until(1000, Duration::from_millis(10), async || {
                call.is_finished() || arrived(&origin, seq) > before
            })
            .await;
            assert!(
                settled,
                "a call on node {seq} neither reached the origin nor was refused"
            );
            if arrived(&origin, seq) > before {
                holders.spawn(async move { call.await.unwrap() });
            } else {
                assert_eq!(call.await.unwrap(), 429, "past node {seq}'s share");
                refused += 1;
            }
        }
        let (status, _, body) = readyz(node).await;
        assert_eq!(
            (status, &body["coordination"]),
            (200, &json!("unavailable"))
        );
    }
    assert_eq!(
        arrived(&origin, "a"),
        0,
        "node A's running calls fill its share"
    );
    assert_eq!(
        arrived(&origin, "b"),
        2,
        "node B admits its share on its own"
    );
    assert_eq!(
        arrived(&origin, "c"),
        2,
        "node C admits its share on its own"
    );
    assert_eq!(refused, 5);
    assert_eq!(
        origin.max_in_flight(),
        6,
        "never more than the limit at the origin"
    );
    origin.release(6);
    while let Some(s) = holders.join_next().await {
        assert_eq!(s.unwrap(), 200);
    }

    redis.up().await;
    // Back on Redis (each node tries it again a moment after its last failure): every node's
    // answers carry the whole limit again, not its share.
    for node in &nodes {
        let back = wait_until(500, Duration::from_millis(20), async || {
            let r = node.pool_get("o", "/").send().await;
            r.is_ok_and(|r| {
                r.status() == 200
                    && r.headers()
                        .get("x-nthpool-effective-limit")
                        .is_some_and(|v| v == "6")
            })
        })
        .await;
        assert!(
            back,
            "a node never went back to the shared limit once Redis was back"
        );
    }
    // Node A alone now takes the whole limit, and it is shared: the other nodes then refuse.
    let mut after = JoinSet::new();
    for i in 0..6 {
        let req = nodes[0].pool_get("o", "/hold").header("x-seq", "a-after");
        after.spawn(async move { req.send().await.unwrap().status().as_u16() });
        let seen = wait_until(1000, Duration::from_millis(10), async || {
            origin.in_flight() == i + 1
        })
        .await;
        assert!(seen, "node A never took slot {} of the limit", i + 1);
    }
    for node in &nodes {
        let r = node
            .pool_get("o", "/")
            .header("x-nthpool-no-queue", "1")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 429, "one shared limit again");
        assert_eq!(readyz(node).await.2["coordination"], "ok");
    }
    assert_eq!(state(&nodes[2], "o").await["inFlight"], 6);
    origin.release(6);
    while let Some(s) = after.join_next().await {
        assert_eq!(s.unwrap(), 200);
    }
    assert_eq!(origin.max_in_flight(), 6);
}

/// Fail open, Redis `kill -9`ed and started again empty while nodes B and C still run the calls
/// they admitted on their own: once Redis answers, those calls are registered there and count
/// against the shared limit, so a flood on node A from that moment never takes the origin past
/// the limit (before: A admitted the whole limit from the empty Redis, 10 calls at an origin of
/// limit 6), and A's calls are all served once they end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_recovery_keeps_the_limit_at_the_origin() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let mut redis = OwnRedis::start(false).await;
    let origin = Upstream::start().await;
    let pools = pool_toml("r", &origin.url(), "limit = 6\nadaptive = false");
    let extra = "coordination_fail = \"open\"\nexpected_nodes = 3\n";
    let nodes = nodes(3, &space.server_toml(&redis.url(), extra), &pools).await;

    redis.kill_9();
    // B and C each take their share (2) on their own; the calls are held at the origin.
    let mut own = JoinSet::new();
    for node in &nodes[1..] {
        for _ in 0..2 {
            let req = node.pool_get("r", "/hold").header("x-seq", "own");
            own.spawn(async move { req.send().await.unwrap().status().as_u16() });
        }
    }
    let running = wait_until(1000, Duration::from_millis(10), async || {
        origin.in_flight() == 4
    })
    .await;
    assert!(running, "B's and C's calls never reached the origin");
    // A goes on its own too, with a call that ends at once.
    let r = nodes[0].pool_get("r", "/").send().await.unwrap();
    assert_eq!(r.status(), 200);

    redis.up().await;
    let mut flood = JoinSet::new();
    for _ in 0..6 {
        let req = nodes[0].pool_get("r", "/hold").header("x-seq", "flood");
        flood.spawn(async move { req.send().await.unwrap().status().as_u16() });
    }
    // B's and C's calls are registered in Redis: with A's two, the pool is full.
    let mut last = Value::Null;
    let full = wait_until(1000, Duration::from_millis(20), async || {
        last = state(&nodes[0], "r").await;
        last["inFlight"] == 6
    })
    .await;
    assert!(
        full,
        "the calls taken on the nodes' own never counted in Redis: {last}"
    );
    assert_eq!(arrived(&origin, "flood"), 2, "A got only what B and C left");
    assert_eq!(
        origin.max_in_flight(),
        6,
        "never more than the limit at the origin"
    );

    // Every call ends as soon as it arrives from now on: A's waiting calls are all served (on
    // its share or through Redis, wherever they wait), never past the limit.
    origin.release(100);
    while let Some(s) = own.join_next().await {
        assert_eq!(s.unwrap(), 200);
    }
    while let Some(s) = flood.join_next().await {
        assert_eq!(s.unwrap(), 200);
    }
    assert_eq!(arrived(&origin, "flood"), 6);
    assert_eq!(origin.max_in_flight(), 6);
}

/// The machine's Redis at database `db` (a database of this test's own, since it is emptied
/// whole): `NB_TEST_REDIS` with its database, if any, replaced.
fn redis_db_url(db: u32) -> String {
    let base = redis_url();
    let root = base.trim_end_matches('/');
    let root = match root.rsplit_once('/') {
        Some((head, tail))
            if !head.ends_with('/')
                && !tail.is_empty()
                && tail.bytes().all(|b| b.is_ascii_digit()) =>
        {
            head
        }
        _ => root,
    };
    format!("{root}/{db}")
}

fn flushdb(url: &str) {
    let mut c = redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
        .expect("the machine's Redis answers");
    let _: () = redis::cmd("FLUSHDB").query(&mut c).expect("FLUSHDB");
}

/// Redis emptied (`FLUSHDB`, as a restart without persistence leaves it) while the pool's whole
/// limit runs at the origin, on two nodes, and a lock is held: the nodes re-assert the slots of
/// their running calls and admit nothing new meanwhile, so the callers that come after the loss
/// queue instead of reaching the origin past the limit (before: the emptied Redis granted the
/// limit a second time, 8 at an origin of limit 4); the lock's holder renews it on another node
/// and keeps it. Every call is served once the running ones end, never more than the limit at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_emptied_mid_load_never_grants_a_slot_twice() {
    let _serial = SERIAL.lock().await;
    let url = redis_db_url(12);
    flushdb(&url);
    let origin = Upstream::start().await;
    // A term long enough for every node to renew inside the quiet period on a busy machine.
    let pools = pool_toml(
        "e",
        &origin.url(),
        "limit = 4\nqueue_size = 100\nqueue_timeout_ms = 120000\nlease_term_ms = 10000\n\
         renew_interval_ms = 300\nadaptive = false",
    ) + &lock_pool_toml("l", "limit = 1");
    let server = format!("coordination = \"{url}\"\n");
    let nodes = Arc::new(nodes(3, &server, &pools).await);

    let mut running = JoinSet::new();
    for i in 0..4 {
        let req = nodes[i % 2]
            .pool_get("e", "/hold")
            .header("x-seq", "before");
        running.spawn(async move { req.send().await.unwrap().status().as_u16() });
    }
    let full = wait_until(1000, Duration::from_millis(10), async || {
        origin.in_flight() == 4
    })
    .await;
    assert!(full, "the limit never ran at the origin");
    let (status, held) = lock(&nodes[0], "l", "acquire", json!({})).await;
    assert_eq!(status, 200, "{held}");

    flushdb(&url);

    // Callers after the loss, on every node.
    let mut after = JoinSet::new();
    for i in 0..6 {
        let req = nodes[i % 3].pool_get("e", "/hold").header("x-seq", "after");
        after.spawn(async move { req.send().await.unwrap().status().as_u16() });
    }
    let mut last = Value::Null;
    let settled = wait_until(1000, Duration::from_millis(20), async || {
        last = state(&nodes[2], "e").await;
        origin.in_flight() > 4 || (last["queued"] == 6 && last["inFlight"] == 4)
    })
    .await;
    assert!(
        origin.max_in_flight() <= 4,
        "the origin saw {} at once after Redis was emptied",
        origin.max_in_flight()
    );
    assert!(
        settled,
        "the running calls never counted again, or the new callers never queued: {last}"
    );

    // The lock: nobody else gets it; its holder renews it on another node and still holds it.
    let (status, refused) = lock(&nodes[2], "l", "acquire", json!({})).await;
    assert_eq!(status, 429, "{refused}");
    let slot = held["slotId"].as_str().unwrap();
    let (status, renewed) = lock(&nodes[1], "l", &format!("{slot}/renew"), json!({})).await;
    assert_eq!(status, 200, "the lock's holder keeps it: {renewed}");
    let (status, refused) = lock(&nodes[2], "l", "acquire", json!({})).await;
    assert_eq!(status, 429, "{refused}");
    let (status, released) = lock(&nodes[2], "l", &format!("{slot}/release"), json!({})).await;
    assert_eq!((status, &released["released"]), (200, &json!(true)));

    origin.release(100);
    while let Some(s) = running.join_next().await {
        assert_eq!(s.unwrap(), 200, "a call running through the loss finished");
    }
    while let Some(s) = after.join_next().await {
        assert_eq!(s.unwrap(), 200, "a caller after the loss was served");
    }
    assert_eq!(arrived(&origin, "after"), 6);
    assert_eq!(
        origin.max_in_flight(),
        4,
        "never more than the limit at the origin"
    );
    nodes[0].wait_idle("e").await;
    flushdb(&url);
}
