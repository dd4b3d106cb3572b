//! `nthbouncer migrate-store` end to end (issue #17): a real node on SQLite is given pools and
//! keys through its admin API and async jobs it cannot finish (the origin holds every call), and
//! is then stopped; `migrate-store` moves its store into a PostgreSQL database of the test's own;
//! two nodes started on that database and one Redis (a key prefix of the test's own) serve the
//! same pools with the same keys, and finish the migrated jobs and deliver their webhooks.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{ok, serve_http, wait_until, WEBHOOK_SECRET};
use reqwest::Method;
use serde_json::{json, Value};

use nthbouncer_testkit::pg::TestDb;

use crate::pg_store::{admin, ended_job, on_pool};
use crate::scale_out::{redis_url, Space};
use crate::BIN;

/// The jobs submitted per pool: with `limit = 1` one reaches the origin (and is held there), the
/// rest wait in the node's queue, so the store holds both running and queued jobs.
const JOBS_PER_POOL: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_store_then_two_nodes_serve_the_pools_and_finish_the_jobs() {
    let db = TestDb::create().await;
    let space = Space::new();
    // The origin holds every call while `held`, counting the calls that reached it.
    let held = Arc::new(AtomicBool::new(true));
    let reached = Arc::new(AtomicUsize::new(0));
    let (h, r) = (held.clone(), reached.clone());
    let up = serve_http(move |_req| {
        let (held, reached) = (h.clone(), r.clone());
        async move {
            reached.fetch_add(1, Ordering::SeqCst);
            while held.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            ok(b"done")
        }
    })
    .await;
    let hooks = Arc::new(AtomicUsize::new(0));
    let seen = hooks.clone();
    let hook = serve_http(move |_req| {
        let seen = seen.clone();
        async move {
            seen.fetch_add(1, Ordering::SeqCst);
            ok(b"")
        }
    })
    .await;

    let extra = "allow_private_webhooks = true\n";
    let mut old = Server::start(BIN, "warn", reqwest::Client::new(), extra).await;
    // Two pools through the admin API, each with a webhook destination (async needs one); three
    // keys.
    for name in ["alpha", "beta"] {
        let (status, body) = admin(
            &old,
            Method::POST,
            "/admin/pools",
            Some(json!({
                "name": name,
                "upstream": format!("http://{up}"),
                "concurrency": {"limit": 1},
                "async": {"enabled": true},
                "webhooks": [{"url": format!("http://{hook}/{name}"), "secret": WEBHOOK_SECRET}],
            })),
        )
        .await;
        assert_eq!(status, 201, "{body}");
    }
    let mut keys = Vec::new();
    for pool in ["alpha", "alpha", "beta"] {
        let (status, key) = admin(
            &old,
            Method::POST,
            &format!("/admin/pools/{pool}/keys"),
            None,
        )
        .await;
        assert_eq!(status, 201, "{key}");
        keys.push((pool, key["key"].as_str().unwrap().to_owned()));
    }

    // Jobs on each pool, submitted with each of its keys in turn.
    let mut jobs = Vec::new();
    for i in 0..JOBS_PER_POOL {
        for pool in ["alpha", "beta"] {
            let mine: Vec<&String> = keys
                .iter()
                .filter(|(p, _)| *p == pool)
                .map(|(_, k)| k)
                .collect();
            let key = mine[i % mine.len()].clone();
            let r = on_pool(&old, pool, &key, Method::POST, &format!("/work/{pool}/{i}"))
                .header("x-nthpool-async", "1")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 202);
            let id = r.json::<Value>().await.unwrap()["jobId"]
                .as_str()
                .unwrap()
                .to_owned();
            jobs.push((pool, key, id));
        }
    }
    // One job of each pool is at the origin, held; the node is stopped with all of them unfinished.
    let running = wait_until(1500, Duration::from_millis(20), async || {
        reached.load(Ordering::SeqCst) >= 2
    })
    .await;
    assert!(running, "the jobs never reached the origin");
    old.kill_9();
    held.store(false, Ordering::SeqCst);

    let migrate = |force: bool| {
        let mut args = vec![
            "migrate-store".to_owned(),
            "--from".to_owned(),
            old.data_dir().display().to_string(),
            "--to".to_owned(),
            db.url.clone(),
        ];
        if force {
            args.push("--force".to_owned());
        }
        std::process::Command::new(BIN)
            .args(&args)
            .output()
            .unwrap()
    };
    let out = migrate(false);
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all = 2 * JOBS_PER_POOL;
    assert!(
        said.contains(&format!(
            "moved 2 pools, 3 keys, 2 webhook destinations and {all} unfinished jobs"
        )),
        "{said}"
    );
    // A second run into the now populated database is refused.
    let again = migrate(false);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));

    // Two nodes on the database and one Redis.
    let server = space.server_toml(&redis_url(), &format!("store = \"{}\"\n{extra}", db.url));
    let a = Server::start(BIN, "warn", reqwest::Client::new(), &server).await;
    let b = Server::start(BIN, "warn", reqwest::Client::new(), &server).await;
    for node in [&a, &b] {
        for (pool, key) in &keys {
            let r = on_pool(node, pool, key, Method::GET, "/hello")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{pool} with its key on node {}", node.port);
            assert_eq!(r.text().await.unwrap(), "done");
        }
        // A key of one pool is not a key of the other.
        let beta_key = &keys[2].1;
        let r = on_pool(node, "alpha", beta_key, Method::GET, "/hello")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
    }
    // Every migrated job completes (read on either node), and its webhook is delivered.
    for (i, (pool, key, id)) in jobs.iter().enumerate() {
        let node = if i % 2 == 0 { &a } else { &b };
        let ended = ended_job(node, pool, key, id).await;
        assert_eq!(ended["status"], "completed", "{ended}");
        assert_eq!(ended["result"]["body"], "done");
    }
    for (pool, key, id) in &jobs {
        let sent = wait_until(1500, Duration::from_millis(20), async || {
            ended_job(&b, pool, key, id).await["webhook"]["delivered"] == 1
        })
        .await;
        assert!(sent, "the webhook of job {id} was never delivered");
    }
    assert!(hooks.load(Ordering::SeqCst) >= jobs.len());
}
