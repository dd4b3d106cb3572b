//! The real binary on the PostgreSQL store (`server.store = "postgres://…"`, issue #17), each
//! test on a database of its own on the machine's PostgreSQL (127.0.0.1:5432, trust auth, user
//! `postgres` or `root`; `.ci/run` starts it), created for the test and dropped after it.
//!
//! Pools and keys created through one node's admin API, proxied calls and async jobs all live in
//! the database: a second node started on it serves the same pool with the same key, and reads
//! the first node's job.

use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::pg::{admin_client as client, TestDb};
use nthbouncer_testkit::{ok, serve_http, wait_until, ADMIN_TOKEN, API_HOST, WEBHOOK_SECRET};
use reqwest::Method;
use serde_json::{json, Value};

use crate::BIN;

pub(crate) async fn admin(
    node: &Server,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = node
        .client
        .request(method, node.url(path))
        .header("host", API_HOST)
        .bearer_auth(ADMIN_TOKEN);
    if let Some(body) = body {
        req = req.json(&body);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// A call on `pool`'s host with `key`.
pub(crate) fn on_pool(
    node: &Server,
    pool: &str,
    key: &str,
    method: Method,
    path: &str,
) -> reqwest::RequestBuilder {
    node.client
        .request(method, node.url(path))
        .header("host", format!("{pool}.localhost"))
        .header("x-nthpool-key", key)
}

/// The job as its submitter polls it, once it has ended (bounded).
pub(crate) async fn ended_job(node: &Server, pool: &str, key: &str, id: &str) -> Value {
    let mut last = Value::Null;
    let ended = wait_until(1500, Duration::from_millis(20), async || {
        let r = node
            .client
            .get(node.url(&format!("/pools/{pool}/jobs/{id}")))
            .header("host", API_HOST)
            .header("x-nthpool-key", key)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "job {id} was lost");
        last = r.json().await.unwrap();
        last["status"] != "accepted" && last["status"] != "queued" && last["status"] != "running"
    })
    .await;
    assert!(ended, "job {id} never ended: {last}");
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_on_postgres_keeps_pools_keys_and_jobs_in_the_database() {
    let db = TestDb::create().await;
    let up = serve_http(|_req| async { ok(b"done") }).await;
    // The webhook receiver counts the deliveries it is sent.
    let delivered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = delivered.clone();
    let hook = serve_http(move |_req| {
        let seen = seen.clone();
        async move {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            ok(b"")
        }
    })
    .await;
    let store = format!("store = \"{}\"\nallow_private_webhooks = true\n", db.url);
    let a = Server::start(BIN, "warn", reqwest::Client::new(), &store).await;

    // A pool and a key, through the admin API.
    let (status, created) = admin(
        &a,
        Method::POST,
        "/admin/pools",
        Some(json!({
            "name": "made",
            "upstream": format!("http://{up}"),
            "concurrency": {"limit": 2},
            "async": {"enabled": true},
            "webhooks": [{"url": format!("http://{hook}/hook"), "secret": WEBHOOK_SECRET}]
        })),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let (status, key) = admin(&a, Method::POST, "/admin/pools/made/keys", None).await;
    assert_eq!(status, 201, "{key}");
    let key = key["key"].as_str().unwrap().to_owned();

    // A proxied call, then an async job that completes.
    let r = on_pool(&a, "made", &key, Method::GET, "/hello")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "done");
    let r = on_pool(&a, "made", &key, Method::POST, "/work")
        .header("x-nthpool-async", "1")
        .body("job body")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let accepted: Value = r.json().await.unwrap();
    let job = accepted["jobId"].as_str().unwrap().to_owned();
    let ended = ended_job(&a, "made", &key, &job).await;
    assert_eq!(ended["status"], "completed", "{ended}");
    assert_eq!(ended["result"]["body"], "done");
    // Its webhook went out once, from the outbox in PostgreSQL.
    let sent = wait_until(1500, Duration::from_millis(20), async || {
        ended_job(&a, "made", &key, &job).await["webhook"]["delivered"] == 1
    })
    .await;
    assert!(sent, "the job's webhook was never delivered");
    assert_eq!(delivered.load(std::sync::atomic::Ordering::SeqCst), 1);

    // It is all in PostgreSQL, not in the node's data dir.
    let raw = client(&db.url).await;
    let count = |sql: &'static str| {
        let raw = &raw;
        async move { raw.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(
        count("SELECT COUNT(*) FROM pools WHERE name = 'made'").await,
        1
    );
    assert_eq!(
        count("SELECT COUNT(*) FROM keys WHERE pool = 'made'").await,
        1
    );
    assert_eq!(
        count("SELECT COUNT(*) FROM jobs WHERE status = 'completed'").await,
        1
    );

    // A second node on the same database serves the pool with the key, and reads the job.
    let b = Server::start(BIN, "warn", reqwest::Client::new(), &store).await;
    let r = on_pool(&b, "made", &key, Method::GET, "/again")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let read = ended_job(&b, "made", &key, &job).await;
    assert_eq!(read["status"], "completed");
    assert_eq!(read["result"]["body"], "done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_does_not_answer_stops_the_start_without_showing_the_password() {
    let dir = tempfile::tempdir().unwrap();
    let port = nthbouncer_testkit::binary::free_port();
    let config = nthbouncer_testkit::binary::write_config(
        dir.path(),
        &format!(
            "{}store = \"postgres://app:pg-secret-never-shown@127.0.0.1:1/nb\"\n",
            nthbouncer_testkit::binary::server_toml(port, dir.path())
        ),
    );
    let out = std::process::Command::new(BIN)
        .args(["serve", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("server.store"), "{said}");
    assert!(!said.contains("pg-secret-never-shown"), "{said}");
}

/// Makes the test's database refuse this node: no new connection is allowed and the open ones
/// are ended (`reachable = false`), or lets it back in. The machine's PostgreSQL keeps running for
/// every other test.
async fn database_reachable(db: &TestDb, reachable: bool) {
    let admin = client(&db.admin_url).await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS {reachable}",
            db.name
        ))
        .await
        .unwrap();
    if !reachable {
        admin
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
                &[&db.name],
            )
            .await
            .unwrap();
    }
}

/// PostgreSQL gone: an async job is refused with `503 store_unavailable` (no `202` that is not
/// durable), proxied calls go on (they need no store), and once the database is back jobs are
/// accepted again and complete, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_database_down_jobs_are_refused_and_proxying_goes_on() {
    let db = TestDb::create().await;
    let up = serve_http(|_req| async { ok(b"done") }).await;
    let pools = format!(
        "store = \"{}\"\nallow_private_webhooks = true\n{}[pools.async]\nenabled = true\n{}",
        db.url,
        nthbouncer_testkit::pool_toml("p", &format!("http://{up}"), "limit = 2"),
        nthbouncer_testkit::webhook_toml("http://127.0.0.1:9/hook"),
    );
    let node = Server::start(BIN, "warn", reqwest::Client::new(), &pools).await;
    let submit = async || {
        node.pool("p", Method::POST, "/work")
            .header("x-nthpool-async", "1")
            .send()
            .await
            .unwrap()
    };

    database_reachable(&db, false).await;
    let r = submit().await;
    assert_eq!(r.status(), 503);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"], "store_unavailable", "{e}");
    // Still in the balancer's rotation: proxying needs no store.
    let ready = node.api(Method::GET, "/readyz").send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let ready: Value = ready.json().await.unwrap();
    assert_eq!(ready["store"], "unavailable", "{ready}");
    for i in 0..5 {
        let r = node
            .pool_get("p", &format!("/sync/{i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "done");
    }

    // Back: a connection the pool still held from before may fail one more call (it is then
    // dropped); a new one is made for the next, so jobs are accepted again within a few tries.
    database_reachable(&db, true).await;
    let mut accepted = Value::Null;
    let back = wait_until(50, Duration::from_millis(20), async || {
        let r = submit().await;
        let status = r.status();
        accepted = r.json().await.unwrap();
        if status != 202 {
            assert_eq!(accepted["error"], "store_unavailable", "{accepted}");
        }
        status == 202
    })
    .await;
    assert!(
        back,
        "no job accepted after the database came back: {accepted}"
    );
    let job = accepted["jobId"].as_str().unwrap().to_owned();
    node.wait_completed("p", &[job], "done").await;
    let ready: Value = node
        .api(Method::GET, "/readyz")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready, serde_json::json!({ "status": "ready" }));
}
