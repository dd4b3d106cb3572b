//! Durability of async jobs with the real binary: accept 500 jobs against a slow upstream,
//! `kill -9` the server mid-flight, restart it on the same data dir, and check that every
//! accepted job finishes, each reached the upstream with its `Idempotency-Key`, and only jobs
//! that were running at the kill ran twice.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};

const BIN: &str = env!("CARGO_BIN_EXE_nthbouncer");
const KEY: &str = "crash-test-key-0123456789";
const ADMIN: &str = "crash-test-admin-token-0123";
const JOBS: usize = 500;
const LIMIT: usize = 10;

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Idempotency keys in order of arrival.
type Seen = Arc<Mutex<Vec<String>>>;

async fn slow_upstream() -> (u16, Seen) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let s = s.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let s = s.clone();
                        async move {
                            let key = req
                                .headers()
                                .get("idempotency-key")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_string();
                            s.lock().unwrap().push(key);
                            tokio::time::sleep(Duration::from_millis(30)).await;
                            Ok::<_, Infallible>(hyper::Response::new(Full::new(
                                Bytes::from_static(b"done"),
                            )))
                        }
                    },
                );
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (port, seen)
}

fn start(config: &std::path::Path) -> Proc {
    Proc(
        Command::new(BIN)
            .args(["serve", "--config", config.to_str().unwrap()])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

async fn wait_ready(client: &reqwest::Client, port: u16) {
    for _ in 0..400 {
        let r = client
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .header("host", "api.localhost")
            .send()
            .await;
        if r.is_ok_and(|r| r.status() == 200) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the server never became ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_jobs_survive_kill_9() {
    let (up_port, seen) = slow_upstream().await;
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("nthbouncer.toml");
    // The destination is a placeholder nothing listens on: every delivery to it fails, so it
    // must not reach its deactivation streak (which would flip the pool to sync) during the test.
    std::fs::File::create(&config)
        .unwrap()
        .write_all(
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\ndata_dir = {:?}\nadmin_token = \"{ADMIN}\"\nallow_private_webhooks = true\n\
                 [[pools]]\nname = \"p\"\nupstream = \"http://127.0.0.1:{up_port}\"\nkeys = [\"{KEY}\"]\n\
                 [pools.concurrency]\nlimit = {LIMIT}\nqueue_size = 10000\n\
                 [pools.async]\nenabled = true\n\
                 [[pools.webhooks]]\nurl = \"http://127.0.0.1:9/hook\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n\
                 deactivate_after = 1000000\n",
                dir.path().join("data").display().to_string()
            )
            .as_bytes(),
        )
        .unwrap();
    let client = reqwest::Client::new();
    let mut server = start(&config);
    wait_ready(&client, port).await;

    // Accept 500 jobs, 16 submissions at a time.
    let mut ids = Vec::with_capacity(JOBS);
    let sem = Arc::new(tokio::sync::Semaphore::new(16));
    let mut tasks = Vec::new();
    for i in 0..JOBS {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let c = client.clone();
        tasks.push(tokio::spawn(async move {
            let r = c
                .post(format!("http://127.0.0.1:{port}/work/{i}"))
                .header("host", "p.localhost")
                .header("x-nthpool-key", KEY)
                .header("x-nthpool-async", "1")
                .body(format!("job {i}"))
                .send()
                .await
                .unwrap();
            drop(permit);
            assert_eq!(r.status(), 202);
            let v: serde_json::Value = r.json().await.unwrap();
            v["jobId"].as_str().unwrap().to_string()
        }));
    }
    for t in tasks {
        ids.push(t.await.unwrap());
    }

    // Kill -9 while jobs are running.
    for _ in 0..2000 {
        if seen.lock().unwrap().len() >= 60 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.0.kill().unwrap();
    server.0.wait().unwrap();
    let before_restart = seen.lock().unwrap().len();
    assert!(
        before_restart < JOBS,
        "every job finished before the kill; the test proves nothing"
    );

    let _server = start(&config);
    wait_ready(&client, port).await;
    for id in &ids {
        let mut finished = false;
        for _ in 0..3000 {
            let r = client
                .get(format!("http://127.0.0.1:{port}/pools/p/jobs/{id}"))
                .header("host", "api.localhost")
                .header("x-nthpool-key", KEY)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "job {id} was lost");
            let v: serde_json::Value = r.json().await.unwrap();
            if v["status"] == "completed" {
                assert_eq!(v["result"]["body"], "done");
                finished = true;
                break;
            }
            assert!(v["status"] != "failed" && v["status"] != "expired", "{v}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(finished, "job {id} never completed");
    }

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
        let v: serde_json::Value = client
            .get(format!("http://127.0.0.1:{port}/admin/pools/p/jobs/{id}"))
            .header("host", "api.localhost")
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert!(v["attempt"].as_u64().unwrap() >= 2, "{v}");
    }
}
