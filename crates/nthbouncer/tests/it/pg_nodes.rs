//! Three real nodes on one Redis (coordination, under a key prefix of the test's own) and one
//! PostgreSQL database (the store, a database of the test's own): async jobs accepted on any
//! node run once, a node `kill -9`ed mid-flight loses nothing (another node takes its jobs and
//! deliveries over once its claims lapse), and what one node's admin API changes serves on the
//! others without a restart (issue #17).
//!
//! At-least-once, exactly where it must be: a job whose upstream call was in flight on the node
//! that was killed (its result not yet committed) is run again by the node that takes it over,
//! so the origin sees that job's `Idempotency-Key` twice. That can only be a job whose attempt
//! was started on the killed node: at most the pool's limit of them (a slot is held until the
//! result commits), each seen at most twice, each with two attempts in the store. Every other
//! job reaches the origin exactly once, and every job completes exactly once in the store (one
//! `completed` step in its history).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::pg::{admin_client, TestDb};
use nthbouncer_testkit::{ok, pool_toml, serve_http, wait_until, Upstream, WEBHOOK_SECRET};
use reqwest::Method;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use crate::pg_store::admin;
use crate::scale_out::{redis_url, Space, SERIAL};
use crate::BIN;

const JOBS: usize = 1000;
/// The pool's limit, shared by the three nodes through Redis.
const LIMIT: usize = 16;
/// The claim lease the nodes run with: how long a dead node's jobs wait for another node.
const LEASE_MS: u64 = 5_000;

/// Webhook deliveries received, by job id (`webhook-id`).
type Received = Arc<Mutex<HashMap<String, u32>>>;

async fn webhook_receiver() -> (std::net::SocketAddr, Received) {
    let received: Received = Arc::default();
    let seen = received.clone();
    let addr = serve_http(move |req| {
        let seen = seen.clone();
        async move {
            let id = nthbouncer_testkit::header(&req, "webhook-id");
            *seen.lock().unwrap().entry(id).or_default() += 1;
            ok(b"")
        }
    })
    .await;
    (addr, received)
}

/// A call on `pool`'s host with `key`; its status (0 if the node did not answer within 5 s).
async fn pool_status(node: &Server, pool: &str, key: &str) -> u16 {
    pool_answer(node, pool, key).await.0
}

/// [`pool_status`] with the answer's body, for a failure's message.
async fn pool_answer(node: &Server, pool: &str, key: &str) -> (u16, String) {
    let sent = node
        .client
        .get(node.url("/hello"))
        .header("host", format!("{pool}.localhost"))
        .header("x-nthpool-key", key)
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    match sent {
        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
        Err(e) => (0, e.to_string()),
    }
}

async fn count(db: &tokio_postgres::Client, sql: &str) -> i64 {
    db.query_one(sql, &[]).await.unwrap().get::<_, i64>(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_on_postgres_run_every_job_once_through_a_kill_and_share_admin_changes() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let db = TestDb::create().await;
    let up = Upstream::start().await;
    let (hook, received) = webhook_receiver().await;
    let server = space.server_toml(
        &redis_url(),
        &format!(
            "store = \"{}\"\nstore_claim_lease_ms = {LEASE_MS}\nallow_private_webhooks = true\n",
            db.url
        ),
    );
    let pools = pool_toml(
        "p",
        &up.url(),
        &format!(
            "limit = {LIMIT}\nadaptive = false\nqueue_size = 5000\nqueue_timeout_ms = 60000\n\
             lease_term_ms = 3000\nrenew_interval_ms = 1000"
        ),
    ) + &format!(
        "[pools.async]\nenabled = true\n[[pools.webhooks]]\nurl = \"http://{hook}/hook\"\n\
         secret = \"{WEBHOOK_SECRET}\"\n"
    );
    let mut nodes = Vec::new();
    for _ in 0..3 {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(32)
            .build()
            .unwrap();
        nodes.push(Server::start(BIN, "info", client, &format!("{server}{pools}")).await);
    }

    // A pool and a key made through node A's admin API serve on node C, without a restart;
    // a key revoked on C stops working on A.
    let made_up = Upstream::start().await;
    let (status, created) = admin(
        &nodes[0],
        Method::POST,
        "/admin/pools",
        Some(json!({"name": "made", "upstream": made_up.url(), "concurrency": {"limit": 2}})),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let (status, key) = admin(&nodes[0], Method::POST, "/admin/pools/made/keys", None).await;
    assert_eq!(status, 201, "{key}");
    let (key_id, key) = (
        key["id"].as_str().unwrap().to_owned(),
        key["key"].as_str().unwrap().to_owned(),
    );
    // A probe every 250 ms, not faster (each answer before the change arrives may count as a
    // failed authentication on C, and ten within a minute throttle the address), for up to 75 s:
    // twice in CI (one run in five or so) C answered 429 for the whole of a 20 s wait, cause not
    // yet known; a throttle or a pause outlasts 20 s, and the message below now carries the
    // answer's body and C's pool state to tell which.
    let last = std::sync::Mutex::new((0, String::new()));
    let served = wait_until(300, Duration::from_millis(250), async || {
        let answer = pool_answer(&nodes[2], "made", &key).await;
        let ok = answer.0 == 200;
        *last.lock().unwrap() = answer;
        ok
    })
    .await;
    assert!(
        served,
        "the pool made on node A never served on node C (last answer {:?}; its state there: {})\n\
         node A's log:\n{}\nnode C's log:\n{}",
        last.into_inner().unwrap(),
        nodes[2].admin_json("/admin/pools/made/state").await,
        nodes[0].log_tail(8_000),
        nodes[2].log_tail(8_000)
    );
    let (status, revoked) = admin(
        &nodes[2],
        Method::DELETE,
        &format!("/admin/pools/made/keys/{key_id}"),
        None,
    )
    .await;
    assert!(status == 200 || status == 204, "{status} {revoked}");
    let refused = wait_until(1000, Duration::from_millis(20), async || {
        pool_status(&nodes[0], "made", &key).await == 401
    })
    .await;
    assert!(refused, "the key revoked on node C still worked on node A");

    // 1,000 jobs accepted across the three nodes.
    let nodes = Arc::new(nodes);
    let accepted: Arc<Mutex<Vec<(usize, String)>>> = Arc::default();
    let mut submitters = JoinSet::new();
    const SUBMITTERS: usize = 48;
    for s in 0..SUBMITTERS {
        let (nodes, accepted) = (nodes.clone(), accepted.clone());
        submitters.spawn(async move {
            for i in (s..JOBS).step_by(SUBMITTERS) {
                let n = i % 3;
                let r = nodes[n]
                    .pool("p", Method::POST, &format!("/sleep?ms=10&job={i}"))
                    .header("x-nthpool-async", "1")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 202);
                let v: Value = r.json().await.unwrap();
                let id = v["jobId"].as_str().unwrap().to_owned();
                accepted.lock().unwrap().push((n, id));
            }
        });
    }
    while let Some(done) = submitters.join_next().await {
        done.unwrap();
    }
    let accepted = accepted.lock().unwrap().clone();
    assert_eq!(accepted.len(), JOBS);

    // Mid-flight, node B dies.
    let started = wait_until(1500, Duration::from_millis(10), async || up.total() >= 100).await;
    assert!(started, "the jobs never reached the origin");
    let mut nodes = Arc::into_inner(nodes).unwrap();
    nodes[1].kill_9();
    let pg = admin_client(&db.url).await;
    let on_b: Vec<String> = accepted
        .iter()
        .filter(|(n, _)| *n == 1)
        .map(|(_, id)| id.clone())
        .collect();
    let unfinished_on_b: i64 = pg
        .query_one(
            "SELECT COUNT(*) FROM jobs WHERE id = ANY($1) \
             AND status IN ('accepted', 'queued', 'running')",
            &[&on_b],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        unfinished_on_b > 0,
        "node B had finished its jobs before it was killed"
    );

    // Every job completes, once, in the store; the survivors took B's over.
    let mut last = 0;
    let done = wait_until(1200, Duration::from_millis(100), async || {
        last = count(&pg, "SELECT COUNT(*) FROM jobs WHERE status = 'completed'").await;
        last == JOBS as i64
    })
    .await;
    assert!(done, "{last} of {JOBS} jobs completed");
    let ids: Vec<String> = accepted.iter().map(|(_, id)| id.clone()).collect();
    let completed_steps: Vec<(String, i64)> = pg
        .query(
            "SELECT job_id, COUNT(*) FROM job_events WHERE status = 'completed' \
             AND job_id = ANY($1) GROUP BY job_id",
            &[&ids],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        completed_steps.len(),
        JOBS,
        "every job has its completed step"
    );
    assert!(
        completed_steps.iter().all(|(_, n)| *n == 1),
        "a job completed twice"
    );
    let attempts: HashMap<String, i64> = pg
        .query("SELECT id, attempt FROM jobs", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    // At the origin: every job, once, but for those in flight on B when it died.
    let mut calls: HashMap<String, u32> = HashMap::new();
    for seen in up.seen() {
        if let Some(key) = seen.headers.get("idempotency-key") {
            *calls.entry(key.to_str().unwrap().to_owned()).or_default() += 1;
        }
    }
    let expected: HashSet<&String> = ids.iter().collect();
    assert_eq!(calls.len(), JOBS, "distinct jobs at the origin");
    assert!(calls.keys().all(|k| expected.contains(k)));
    let twice: Vec<(&String, &u32)> = calls.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.len() <= LIMIT,
        "{} jobs reached the origin twice (at most the {LIMIT} in flight on B): {twice:?}",
        twice.len()
    );
    for (id, n) in &twice {
        assert_eq!(**n, 2, "{id} reached the origin {n} times");
        assert_eq!(attempts[*id], 2, "{id} was called twice but attempted once");
    }

    // Every job's webhook reached the receiver at least once.
    let mut got = 0;
    let delivered = wait_until(3000, Duration::from_millis(20), async || {
        let received = received.lock().unwrap();
        got = ids.iter().filter(|id| received.contains_key(*id)).count();
        got == JOBS
    })
    .await;
    assert!(delivered, "{got} of {JOBS} webhooks delivered");
    drop(nodes);
}
