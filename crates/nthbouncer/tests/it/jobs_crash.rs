//! Durability of async jobs with the real binary: accept 500 jobs against a slow upstream,
//! `kill -9` the server mid-flight, restart it on the same data dir, and check that every
//! accepted job finishes, each reached the upstream with its `Idempotency-Key`, and only jobs
//! that were running at the kill ran twice.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{header, ok, pool_toml, serve_http, wait_until, webhook_toml};

use crate::BIN;

const JOBS: usize = 500;
const LIMIT: usize = 10;

/// Idempotency keys in order of arrival.
type Seen = Arc<Mutex<Vec<String>>>;

/// An upstream that records each request's `Idempotency-Key` and answers `done` after 30 ms.
async fn slow_upstream() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let port = serve_http(move |req| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push(header(&req, "idempotency-key"));
            tokio::time::sleep(Duration::from_millis(30)).await;
            ok(b"done")
        }
    })
    .await;
    (format!("http://{port}"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_jobs_survive_kill_9() {
    let (up, seen) = slow_upstream().await;
    // The destination is a placeholder nothing listens on: every delivery to it fails, so it
    // must not reach its deactivation streak (which would flip the pool to sync) during the test.
    let rest = format!(
        "allow_private_webhooks = true\n{}[pools.async]\nenabled = true\n{}deactivate_after = 1000000\n",
        pool_toml("p", &up, &format!("limit = {LIMIT}\nqueue_size = 10000")),
        webhook_toml("http://127.0.0.1:9/hook"),
    );
    // Every request bounded: once, under a full suite's load, this test sat for 15 minutes with
    // no connection open and its server idle; a bound turns any such wait into a failure that
    // says where.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut server = Server::start(BIN, "info", client, &rest).await;

    // Accept 500 jobs, 16 submissions at a time.
    let ids = server
        .submit_async_jobs("p", JOBS, |i| Some(format!("job {i}")))
        .await;

    // Kill -9 while jobs are running.
    wait_until(2000, Duration::from_millis(5), async || {
        seen.lock().unwrap().len() >= 60
    })
    .await;
    server.kill_9();
    let before_restart = seen.lock().unwrap().len();
    assert!(
        before_restart < JOBS,
        "every job finished before the kill; the test proves nothing"
    );

    server.restart().await;
    server.wait_completed("p", &ids, "done").await;

    let seen = seen.lock().unwrap().clone();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for k in &seen {
        *counts.entry(k.as_str()).or_default() += 1;
    }
    for id in &ids {
        assert!(
            counts.contains_key(id.as_str()),
            "job {id} never reached the upstream with its Idempotency-Key"
        );
    }
    let duplicated: Vec<&str> = counts
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, _)| *k)
        .collect();
    assert!(
        duplicated.len() <= LIMIT,
        "{} jobs ran twice; at most the {LIMIT} running at the kill may",
        duplicated.len()
    );
    // A job that ran twice was running at the kill: it took a second attempt.
    for id in duplicated {
        let v = server
            .admin_json(&format!("/admin/pools/p/jobs/{id}"))
            .await;
        assert!(v["attempt"].as_u64().unwrap() >= 2, "{v}");
    }
}
