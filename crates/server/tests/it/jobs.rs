//! Async jobs end to end over loopback: the three admission modes, the fallback to sync, poll
//! through the lifecycle, expiry and retention on an injected clock, and the shared limit.

use nthbouncer_testkit::*;
use reqwest::Method;
use serde_json::{json, Value};

/// A pool with async on and one (never-contacted) webhook destination.
fn async_pool(name: &str, upstream: &str, concurrency: &str, async_extra: &str) -> String {
    async_pool_toml(
        &pool_toml(name, upstream, concurrency),
        async_extra,
        NO_WEBHOOK,
    )
}

async fn poll(gw: &Gateway, pool: &str, job: &str) -> (u16, Value) {
    call(gw.poll_job(pool, job)).await
}

async fn wait_status(gw: &Gateway, pool: &str, job: &str, want: &str) -> Value {
    eventually(&format!("job {job} to reach {want}"), async || {
        let (code, body) = poll(gw, pool, job).await;
        assert_eq!(code, 200, "{body}");
        (body["status"] == want).then_some(body)
    })
    .await
}

#[tokio::test]
async fn requested_job_runs_and_polls_through_its_lifecycle() {
    let up = Upstream::start().await;
    let gw = gateway(&async_pool("p", &up.url(), "limit = 2", "")).await;
    let r = gw
        .post_async("p", "/echo?x=1")
        .header("content-type", "application/json")
        .body("{\"prompt\":\"hi\"}");
    let (status, accepted) = call(r).await;
    assert_eq!(status, 202);
    let job = accepted["jobId"].as_str().unwrap().to_string();
    assert!(
        job.starts_with("job_")
            && job.len() == 36
            && job[4..]
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    assert_eq!(accepted["status"], "accepted");
    assert_eq!(
        accepted["pollUrl"],
        format!(
            "http://api.localhost:{}/pools/p/jobs/{job}",
            gw.running.addr.port()
        )
    );
    assert_eq!(accepted["webhook"]["destinations"], 1);

    let done = wait_status(&gw, "p", &job, "completed").await;
    assert_eq!(done["jobId"], job.as_str());
    assert_eq!(done["reason"], "requested");
    for f in ["createdAt", "updatedAt", "expiresAt"] {
        assert!(done[f].as_u64().unwrap() > 0, "{f}");
    }
    assert_eq!(done["result"]["status"], 200);
    assert_eq!(done["result"]["bodyEncoding"], "utf8");
    assert_eq!(done["result"]["truncated"], false);
    let echoed: Value = serde_json::from_str(done["result"]["body"].as_str().unwrap()).unwrap();
    assert_eq!(echoed["body"], "{\"prompt\":\"hi\"}");
    assert_eq!(echoed["method"], "POST");
    assert_eq!(echoed["query"]["x"], "1");
    assert_eq!(
        echoed["headers"]["idempotency-key"],
        job.as_str(),
        "the upstream must see Idempotency-Key: jobId"
    );
    assert!(echoed["headers"].get("x-nthpool-key").is_none());
    assert!(echoed["headers"].get("x-nthpool-async").is_none());
    assert_eq!(done["webhook"]["destinations"], 1);

    // HEAD: the same answer without a body.
    let h = send(
        gw.api(Method::HEAD, &format!("/pools/p/jobs/{job}"))
            .header("x-nthpool-key", KEY),
    )
    .await;
    assert_eq!(h.status(), 200);
    assert!(h.bytes().await.unwrap().is_empty());

    // Admin: the job and its history.
    let detail = gw.admin_json(&format!("/admin/pools/p/jobs/{job}")).await;
    let steps: Vec<&str> = detail["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["status"].as_str().unwrap())
        .collect();
    assert_eq!(steps, vec!["accepted", "queued", "running", "completed"]);
    let list = gw.admin_json("/admin/pools/p/jobs?status=completed").await;
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    let none = gw.admin_json("/admin/pools/p/jobs?status=failed").await;
    assert!(none["items"].as_array().unwrap().is_empty());
    let (status, _) = gw
        .admin(Method::GET, "/admin/pools/p/jobs?status=done", None)
        .await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn poll_needs_the_pool_and_its_key() {
    let up = Upstream::start().await;
    let toml = format!(
        "{}{}",
        async_pool("p", &up.url(), "", ""),
        pool_toml("q", &up.url(), "")
    );
    let gw = gateway(&toml).await;
    let accepted = json_of(send(gw.get_async("p", "/")).await).await;
    let job = accepted["jobId"].as_str().unwrap();
    // Another pool's job, an unknown job and a malformed id are all job_not_found.
    for (pool, id) in [
        ("q", job.to_string()),
        ("p", format!("job_{}", "0".repeat(32))),
        ("p", "job_nope".to_string()),
    ] {
        let (code, body) = poll(&gw, pool, &id).await;
        assert_eq!(code, 404, "{pool}/{id}");
        assert_eq!(body["error"], "job_not_found");
    }
    let (status, _) = gw
        .admin(Method::GET, &format!("/pools/p/jobs/{job}"), None)
        .await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn async_disabled_and_the_fallback_to_sync() {
    let up = Upstream::start().await;
    // Never enabled: 400 async_disabled.
    let gw = gateway(&format!(
        "{}{}",
        async_pool("p", &up.url(), "", ""),
        pool_toml("off", &up.url(), "")
    ))
    .await;
    expect_error(send(gw.get_async("off", "/")).await, 400, "async_disabled").await;

    // Enabled but every destination deactivated: the header is ignored, the answer is sync.
    let list = gw.admin_json("/admin/pools/p/webhooks").await;
    let dest = list["items"][0]["id"].as_str().unwrap().to_string();
    assert!(
        !list.to_string().contains(&WEBHOOK_SECRET[10..]),
        "the secret must be masked"
    );
    let dest_path = format!("/admin/pools/p/webhooks/{dest}");
    let set_active = |active: bool| gw.patch(&dest_path, json!({ "active": active }));
    assert_eq!(set_active(false).await.0, 200);
    let r = send(gw.get_async("p", "/status/201")).await;
    assert_eq!(
        r.status(),
        201,
        "with no active destination the pool serves sync"
    );
    let jobs = gw.admin_json("/admin/pools/p/jobs").await;
    assert!(
        jobs["items"].as_array().unwrap().is_empty(),
        "no job may be created in fallback"
    );

    // Re-enabled: async again.
    assert_eq!(set_active(true).await.0, 200);
    assert_eq!(send(gw.get_async("p", "/")).await.status(), 202);

    // Nothing attached at all: also sync.
    let gw2 = gateway(&format!(
        "{}[pools.async]\nenabled = true\n",
        pool_toml("bare", &up.url(), "")
    ))
    .await;
    let r = send(gw2.get_async("bare", "/status/203")).await;
    assert_eq!(r.status(), 203);
}

#[tokio::test]
async fn busy_and_wait_timeout_promote_to_jobs() {
    let up = Upstream::start().await;
    let gw = gateway(&async_pool(
        "p",
        &up.url(),
        "limit = 1",
        "on_open_wait = true\non_queue_timeout = true",
    ))
    .await;
    let held = gw.hold("p", "holder");
    up.wait_arrivals(1).await;
    // Would wait → a job (busy).
    let busy = accepted_id(send(gw.get("p", "/hold").header("x-seq", "busy")).await).await;
    // Fail-fast callers are not promoted: they asked not to wait.
    assert_eq!(send(gw.no_queue("p", "/")).await.status(), 429);
    let (_, b) = poll(&gw, "p", &busy).await;
    assert_eq!(b["reason"], "busy");
    up.release(1);
    assert_eq!(held.await.unwrap().status(), 200);
    up.wait_arrivals(2).await;
    up.release(1);
    wait_status(&gw, "p", &busy, "completed").await;

    // A wait that runs out → a job (wait_timeout), when only on_queue_timeout is set.
    let gw = gateway(&async_pool(
        "t",
        &up.url(),
        "limit = 1",
        "on_queue_timeout = true",
    ))
    .await;
    let held = spawn_send(
        gw.pool("t", Method::GET, "/hold")
            .header("x-nthpool-key", KEY)
            .header("x-seq", "h2"),
    );
    up.wait_arrivals(3).await;
    let r = send(gw.get("t", "/").header("x-nthpool-queue-timeout-ms", "50")).await;
    let job = accepted_id(r).await;
    let (_, b) = poll(&gw, "t", &job).await;
    assert_eq!(b["reason"], "wait_timeout");
    up.release(1);
    assert_eq!(held.await.unwrap().status(), 200);
}

#[tokio::test]
async fn oversized_async_bodies_get_413() {
    let up = Upstream::start().await;
    let gw = gateway(&async_pool("p", &up.url(), "", "max_body_bytes = 100")).await;
    let r = send(gw.post_async("p", "/echo").body(vec![b'x'; 101])).await;
    expect_error(r, 413, "payload_too_large").await;
    let r = send(gw.post_async("p", "/echo").body(vec![b'x'; 100])).await;
    assert_eq!(r.status(), 202);
}

#[tokio::test]
async fn results_over_the_cap_are_truncated_and_binary_is_base64() {
    let up = Upstream::start().await;
    let gw = gateway(&async_pool("p", &up.url(), "", "max_body_bytes = 64")).await;
    let big = "y".repeat(64);
    let job = json_of(send(gw.post_async("p", "/echo").body(big)).await).await;
    let done = wait_status(&gw, "p", job["jobId"].as_str().unwrap(), "completed").await;
    assert_eq!(done["result"]["truncated"], true);
    assert_eq!(done["result"]["body"].as_str().unwrap().len(), 64);
}

/// Jobs count against the limit like everyone else: the upstream never sees more than `limit`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_share_the_limit_with_sync_traffic() {
    let up = Upstream::start().await;
    let gw = gateway(&async_pool("p", &up.url(), "limit = 2", "")).await;
    let mut jobs = Vec::new();
    let mut syncs = Vec::new();
    for i in 0..12 {
        syncs.push(spawn_send(gw.get("p", "/sleep?ms=10")));
        let r = gw
            .get_async("p", "/sleep?ms=10")
            .header("x-seq", format!("job{i}"));
        jobs.push(accepted_id(send(r).await).await);
    }
    for s in syncs {
        assert_eq!(s.await.unwrap().status(), 200);
    }
    for j in &jobs {
        wait_status(&gw, "p", j, "completed").await;
    }
    assert!(
        up.max_in_flight() <= 2,
        "the upstream saw {} at once",
        up.max_in_flight()
    );
    assert_eq!(up.seen().len(), 24);
}

/// A job that cannot run before its deadline is `expired`; finished jobs are deleted once
/// their retention has passed (both on an injected clock).
#[tokio::test]
async fn expiry_and_retention_on_an_injected_clock() {
    let up = Upstream::start().await;
    let toml = format!(
        "{}{}",
        async_pool(
            "p",
            &up.url(),
            "limit = 1\nlease_term_ms = 100000",
            "retention_s = 60"
        ),
        async_pool("q", &up.url(), "", "retention_s = 60")
            .replace("[server]\nallow_private_webhooks = true\n", "")
    );
    let (gw, clock) = clocked(&toml).await;

    // Pool p: its only slot is held by a lock, so the job cannot run before its expiresAt.
    let r = gw
        .api(Method::POST, "/pools/p/lock/acquire")
        .header("x-nthpool-key", KEY);
    let lock = json_of(send(r).await).await;
    assert!(lock["slotId"].is_string(), "{lock}");
    let stuck = json_of(send(gw.get_async("p", "/")).await).await;
    let stuck_id = stuck["jobId"].as_str().unwrap().to_string();
    wait_status(&gw, "p", &stuck_id, "queued").await;

    clock.advance(30_000);
    // Pool q: a job that completes 30 s in.
    let done = json_of(send(gw.get_async("q", "/")).await).await;
    let done_id = done["jobId"].as_str().unwrap().to_string();
    wait_status(&gw, "q", &done_id, "completed").await;

    // Past the stuck job's expiresAt: expired, with no result.
    clock.advance(30_001);
    let expired = wait_status(&gw, "p", &stuck_id, "expired").await;
    assert!(expired.get("result").is_none());
    // The completed job is retained for 60 s from when it finished…
    let (code, body) = poll(&gw, "q", &done_id).await;
    assert_eq!(code, 200);
    assert_eq!(
        body["status"], "completed",
        "a terminal job keeps its status past expiresAt"
    );
    // …and is deleted once that has passed.
    clock.advance(30_000);
    for _ in 0..2000 {
        let (code, _) = poll(&gw, "q", &done_id).await;
        if code == 404 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("the retained job was never deleted");
}

#[tokio::test]
async fn destinations_crud_and_cap() {
    let up = Upstream::start().await;
    let gw = gateway(&format!(
        "[server]\nmax_destinations_per_pool = 2\n{}",
        pool_toml("p", &up.url(), "")
    ))
    .await;
    let add = |body: Value| gw.post("/admin/pools/p/webhooks", body);
    assert_eq!(
        add(json!({"url": "http://127.0.0.1:9/hook"})).await.0,
        400,
        "loopback refused unless allowed"
    );
    let (status, created) = add(json!({"url": "https://hooks.example.com/a"})).await;
    assert_eq!(status, 201);
    let secret = created["secret"].as_str().unwrap();
    assert!(
        secret.starts_with("whsec_"),
        "the secret is shown once at creation"
    );
    let list = gw.admin_json("/admin/pools/p/webhooks").await;
    assert!(!list.to_string().contains(&secret[10..]));
    let (status, e) =
        add(json!({"url": "https://hooks.example.com/b", "secret": "whsec_short"})).await;
    assert_eq!(status, 400);
    assert_eq!(e["field"], "secret");
    assert_eq!(
        add(json!({"url": "https://hooks.example.com/b"})).await.0,
        201
    );
    assert_eq!(
        add(json!({"url": "https://hooks.example.com/c"})).await.0,
        409,
        "capped by max_destinations_per_pool"
    );
    let path = format!(
        "/admin/pools/p/webhooks/{}",
        created["id"].as_str().unwrap()
    );
    assert_eq!(gw.delete(&path).await.0, 204);
    assert_eq!(gw.delete(&path).await.0, 404);
}
