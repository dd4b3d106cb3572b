//! `async.max_pending` on a shared store (issue #17): the bound is the pool's, not each node's.
//! Two real nodes on one Redis and one PostgreSQL database, in front of an origin that holds
//! every call: node A takes the pool's `max_pending` jobs, then node B starts and refuses the
//! next one with `429`, as A does (before, B counted only its own jobs and took as many again).
//!
//! B learns the others' jobs at its first claim pass, which runs before it serves: no wait
//! and no timing in the test.

use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::pg::TestDb;
use nthbouncer_testkit::{ok, pool_toml, serve_http, webhook_toml, NO_WEBHOOK};

use crate::scale_out::{redis_url, Space, SERIAL};
use crate::BIN;

const MAX_PENDING: usize = 4;

/// Posts one async job to `node`'s pool `p`: the status and the body.
async fn submit(node: &Server, i: usize) -> (u16, serde_json::Value) {
    let r = node
        .pool("p", reqwest::Method::POST, &format!("/work/{i}"))
        .header("x-nthpool-async", "1")
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    let body = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_pending_holds_across_nodes() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let db = TestDb::create().await;
    // An origin that answers nothing for longer than the test: every job stays pending.
    let up = serve_http(|_req| async {
        tokio::time::sleep(Duration::from_secs(600)).await;
        ok(b"late")
    })
    .await;
    let server = space.server_toml(
        &redis_url(),
        &format!(
            "store = \"{}\"\nstore_claim_lease_ms = 60000\nallow_private_webhooks = true\n",
            db.url
        ),
    );
    let pools = pool_toml("p", &format!("http://{up}"), "limit = 1\nadaptive = false")
        + &format!(
            "[pools.async]\nenabled = true\nmax_pending = {MAX_PENDING}\n{}",
            webhook_toml(NO_WEBHOOK)
        );
    let config = format!("{server}{pools}");

    let a = Server::start(BIN, "info", reqwest::Client::new(), &config).await;
    for i in 0..MAX_PENDING {
        let (status, body) = submit(&a, i).await;
        assert_eq!(status, 202, "{body}\n{}", a.log_tail(4_000));
    }
    let (status, body) = submit(&a, MAX_PENDING).await;
    assert_eq!(
        (status, &body["error"]),
        (429, &serde_json::json!("too_many_requests"))
    );

    // B starts after A's jobs are stored: its first claim pass (before it serves) counts them.
    let b = Server::start(BIN, "info", reqwest::Client::new(), &config).await;
    let (status, body) = submit(&b, MAX_PENDING + 1).await;
    assert_eq!(
        (status, &body["error"]),
        (429, &serde_json::json!("too_many_requests")),
        "B took a job past the pool's max_pending: {body}\n{}",
        b.log_tail(4_000)
    );
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("async.max_pending")),
        "{body}"
    );
}
