//! Lock leases across a crash, against the real binary: a restart must not hand out again the
//! slots of leases whose holders may still be calling the origin. They come back once their
//! holders have had a lease term to notice (their renewals answer `404 not_found`).

use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{call, lock_pool_toml, wait_until};
use reqwest::Method;
use serde_json::{json, Value};

use crate::BIN;

async fn lock(server: &Server, path: &str, body: Value) -> (u16, Value) {
    call(
        server
            .api(Method::POST, &format!("/pools/p/lock/{path}"))
            .json(&body),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_held_at_a_crash_keep_their_slots_for_one_term_after_the_restart() {
    let rest = lock_pool_toml(
        "p",
        "limit = 3\nlease_term_ms = 1500\nrenew_interval_ms = 500",
    );
    let mut server = Server::start(BIN, "warn", reqwest::Client::new(), &rest).await;
    let (status, first) = lock(&server, "acquire", json!({})).await;
    assert_eq!(status, 200, "{first}");
    let (status, released) = lock(&server, "acquire", json!({})).await;
    assert_eq!(status, 200, "{released}");
    let released = released["slotId"].as_str().unwrap().to_string();
    let (status, _) = lock(&server, &format!("{released}/release"), json!({})).await;
    assert_eq!(status, 200);
    // A release is forgotten without waiting for the store; the next grant is answered only
    // once it is on record, and the book writes in order, so the release is on record too.
    // (Had the gateway died in between, the released slot would be held back one term too.)
    let (status, second) = lock(&server, "acquire", json!({})).await;
    assert_eq!(status, 200, "{second}");

    // Two holders are still working when the gateway dies.
    server.kill_9();
    server.restart().await;

    // Their slots are not handed out again: only the released one is free.
    let state = server.admin_json("/admin/pools/p/state").await;
    assert_eq!(state["inFlight"], 2, "{state}");
    let (status, third) = lock(&server, "acquire", json!({})).await;
    assert_eq!(status, 200, "{third}");
    let (status, refused) = lock(&server, "acquire", json!({})).await;
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"], "too_many_requests");

    // The old holders learn at their next renewal that their leases are gone.
    let old = first["slotId"].as_str().unwrap();
    let (status, body) = lock(&server, &format!("{old}/renew"), json!({})).await;
    assert_eq!((status, &body["error"]), (404, &json!("not_found")));

    // One term later the held-back slots are free again.
    let freed = wait_until(200, Duration::from_millis(50), async || {
        lock(&server, "acquire", json!({"waitMs": 0})).await.0 == 200
    })
    .await;
    assert!(freed, "the held-back slots never came back");
    let (status, _) = lock(&server, "acquire", json!({})).await;
    assert_eq!(status, 200, "both held-back slots came back");
}
