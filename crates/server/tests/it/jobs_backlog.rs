//! The async backlog's bound (`async.max_pending`) over loopback: past it a request that would
//! become a job gets `429 too_many_requests` with `Retry-After` before its body is read, and is
//! taken again once jobs finish; a restart resumes a backlog larger than one resume page, every
//! job of it, and counts it against the bound from the start.

use futures_util::future::join_all;
use futures_util::StreamExt;
use nthbouncer_server::jobs::sweep::RESUME_PAGE;
use nthbouncer_testkit::*;
use serde_json::Value;

/// A pool `p` with async on, `limit = 1`, and `[server]` lines `server` first. Its destination
/// is a placeholder nothing listens on, kept active however many deliveries fail.
fn backlog_pool(upstream: &str, max_pending: usize, server: &str) -> String {
    format!(
        "[server]\nallow_private_webhooks = true\n{server}{}[pools.async]\nenabled = true\nmax_pending = {max_pending}\n{}deactivate_after = 1000000\n",
        pool_toml("p", upstream, "limit = 1"),
        webhook_toml(NO_WEBHOOK),
    )
}

async fn wait_completed(gw: &Gateway, job: &str) {
    eventually(&format!("job {job} to complete"), async || {
        let (code, v) = call(gw.poll_job("p", job)).await;
        assert_eq!(code, 200, "{v}");
        assert!(v["status"] != "failed" && v["status"] != "expired", "{v}");
        (v["status"] == "completed").then_some(())
    })
    .await;
}

/// A job request refused because the backlog is full: 429, `too_many_requests`, `Retry-After`.
async fn assert_backlog_full(r: reqwest::Response) {
    assert_eq!(r.status(), 429);
    assert!(
        r.headers().get("retry-after").is_some(),
        "no Retry-After: {:?}",
        r.headers()
    );
    let v: Value = json_of(r).await;
    assert_eq!(v["error"], "too_many_requests", "{v}");
}

/// Waits (bounded) until a new job is accepted (202) again; its id.
async fn accepted_again(gw: &Gateway) -> String {
    let r = eventually("a job to be accepted again", async || {
        let r = send(gw.post_async("p", "/echo").body("again")).await;
        (r.status() == 202).then_some(r)
    })
    .await;
    accepted_id(r).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_pending_a_job_gets_429_until_the_backlog_drains() {
    let up = Upstream::start().await;
    let gw = gateway(&backlog_pool(&up.url(), 3, "")).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(
            accepted_id(send(gw.post_async("p", "/hold").body(format!("job {i}"))).await).await,
        );
    }
    // The fourth is refused before its body is read: a body that never ends still gets its
    // answer.
    let endless = futures_util::stream::once(async { Ok::<_, std::io::Error>("start") })
        .chain(futures_util::stream::pending());
    let r = bounded(
        "the refusal of a job whose body never ends",
        gw.post_async("p", "/hold")
            .body(reqwest::Body::wrap_stream(endless))
            .send(),
    )
    .await
    .unwrap();
    assert_backlog_full(r).await;
    assert_backlog_full(send(gw.post_async("p", "/hold").body("four")).await).await;

    up.release(3);
    for id in &ids {
        wait_completed(&gw, id).await;
    }
    // Their places are free again (each is given back just after its result is recorded).
    let id = accepted_again(&gw).await;
    wait_completed(&gw, &id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_a_backlog_larger_than_one_page() {
    let jobs = RESUME_PAGE as usize + 44;
    let up = Upstream::start().await;
    let data = tempfile::tempdir().unwrap();
    let server = format!(
        "data_dir = {:?}\nshutdown_grace_ms = 200\n",
        data.path().display().to_string()
    );
    let toml = backlog_pool(&up.url(), jobs, &server);
    let gw = gateway(&toml).await;
    // Every job waits: the origin holds the one running.
    let mut ids = Vec::with_capacity(jobs);
    for chunk in (0..jobs).collect::<Vec<_>>().chunks(16) {
        let sent = chunk
            .iter()
            .map(|i| send(gw.post_async("p", "/hold").body(format!("job {i}"))));
        for r in join_all(sent).await {
            ids.push(accepted_id(r).await);
        }
    }
    assert_backlog_full(send(gw.post_async("p", "/hold").body("one more")).await).await;
    gw.running.shutdown().await;

    let gw = gateway(&toml).await;
    // The resumed backlog counts against the bound from the start.
    assert_backlog_full(send(gw.post_async("p", "/hold").body("one more")).await).await;
    // Enough for every job, and for the fetch abandoned at the stop.
    up.release(jobs + 8);
    for id in &ids {
        wait_completed(&gw, id).await;
    }
    accepted_again(&gw).await;
}
