//! A job's upstream request is a proxied call's: the same `X-Forwarded-*`, plus its
//! `Idempotency-Key`; and a job retries only what the origin cannot have acted on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use nthbouncer_testkit::*;
use reqwest::Method;
use serde_json::Value;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

fn async_pool(upstream: &str) -> String {
    async_pool_toml(&pool_toml("p", upstream, "limit = 2"), "", NO_WEBHOOK)
}

async fn run_job(gw: &Gateway, path: &str) -> String {
    let r = gw.post_async("p", path);
    accepted_id(send(r.header("x-forwarded-for", "203.0.113.9").body("{}")).await).await
}

/// The admin view of a job once it is terminal.
async fn terminal(gw: &Gateway, job: &str) -> Value {
    for _ in 0..4000 {
        let j = gw.admin_json(&format!("/admin/pools/p/jobs/{job}")).await;
        if j["status"] == "completed" || j["status"] == "failed" {
            return j;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("job {job} never ended");
}

#[tokio::test]
async fn a_job_carries_the_forwarding_headers_of_a_proxied_call() {
    let up = Upstream::start().await;
    let gw = gateway(&async_pool(&up.url())).await;
    let job = run_job(&gw, "/echo").await;
    let done = terminal(&gw, &job).await;
    assert_eq!(done["status"], "completed", "{done}");
    let echoed: Value = serde_json::from_str(done["result"]["body"].as_str().unwrap()).unwrap();
    let sync = json_of(
        send(
            gw.pool("p", Method::POST, "/echo")
                .header("x-nthpool-key", KEY)
                .header("x-forwarded-for", "203.0.113.9")
                .body("{}"),
        )
        .await,
    )
    .await;
    for name in ["x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"] {
        assert_eq!(
            echoed["headers"][name], sync["headers"][name],
            "{name} differs between a job and a proxied call"
        );
    }
    assert_eq!(
        echoed["headers"]["x-forwarded-for"],
        "203.0.113.9, 127.0.0.1"
    );
    assert_eq!(echoed["headers"]["idempotency-key"], job.as_str());
    assert!(echoed["headers"].get("x-nthpool-key").is_none());
}

/// An origin that reads each request and hangs up without answering: it may have acted.
async fn hang_up_origin() -> (String, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let requests = Arc::new(AtomicU64::new(0));
    let seen = requests.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut got = Vec::new();
                while let Ok(n) = stream.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if got.windows(4).any(|w| w == b"\r\n\r\n") {
                        seen.fetch_add(1, Ordering::SeqCst);
                        return; // dropped: the connection closes with no answer
                    }
                }
            });
        }
    });
    (url, requests)
}

#[tokio::test]
async fn a_job_is_not_sent_again_once_the_origin_may_have_acted() {
    let (url, requests) = hang_up_origin().await;
    let gw = gateway(&async_pool(&url)).await;
    let job = run_job(&gw, "/work").await;
    let done = terminal(&gw, &job).await;
    assert_eq!(done["status"], "failed", "{done}");
    assert_eq!(done["attempt"], 1, "one attempt, no retry: {done}");
    assert_eq!(requests.load(Ordering::SeqCst), 1, "the origin saw it once");
    assert_eq!(gw.state("p").await["inFlight"], 0);
}

#[tokio::test]
async fn a_job_retries_an_origin_it_could_not_reach() {
    // A port with nothing listening: the origin never saw anything, so retrying is safe.
    let (_reserved, closed) = refused_port();
    let gw = gateway(&async_pool(&format!("http://{closed}"))).await;
    let job = run_job(&gw, "/work").await;
    let done = terminal(&gw, &job).await;
    assert_eq!(done["status"], "failed", "{done}");
    assert_eq!(done["attempt"], 3, "three connection attempts: {done}");
    assert_eq!(gw.state("p").await["inFlight"], 0);
}
