//! Durability of webhook delivery with the real binary: 200 jobs finish against a fast upstream
//! while the receiver answers only the first 40 deliveries and then holds every request open;
//! the server is `kill -9`ed with deliveries in flight and most of the outbox pending, restarted
//! on the same data dir with the receiver answering again, and every terminal job must reach
//! every active destination at least once. The receiver dedupes on `webhook-id`; a delivery
//! recorded as delivered before the kill is never sent again.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};

const BIN: &str = env!("CARGO_BIN_EXE_nthbouncer");
const KEY: &str = "crash-test-key-0123456789";
const ADMIN: &str = "crash-test-admin-token-0123";
const JOBS: usize = 200;
/// Deliveries the receiver answers before it starts holding requests open.
const ANSWERED_FIRST: usize = 40;
const DESTINATIONS: [&str; 2] = ["/a", "/b"];

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

/// One request the receiver got: its path, webhook-id, the body's jobId, and whether it was
/// answered 2xx (held requests never are).
#[derive(Clone, Debug)]
struct Arrival {
    path: String,
    webhook_id: String,
    body_job_id: String,
    answered: bool,
    after_restart: bool,
}

#[derive(Default)]
struct Receiver {
    arrivals: Mutex<Vec<Arrival>>,
    /// How many more requests are answered before holding starts.
    budget: AtomicUsize,
    /// Answer everything (after the restart).
    open: AtomicBool,
}

impl Receiver {
    fn delivered(&self) -> Vec<Arrival> {
        self.arrivals
            .lock()
            .unwrap()
            .iter()
            .filter(|a| a.answered)
            .cloned()
            .collect()
    }
    fn held(&self) -> usize {
        self.arrivals
            .lock()
            .unwrap()
            .iter()
            .filter(|a| !a.answered)
            .count()
    }
}

async fn serve<F, Fut>(f: F) -> u16
where
    F: Fn(hyper::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = hyper::Response<Full<Bytes>>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let f = f.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let f = f.clone();
                    async move { Ok::<_, Infallible>(f(req).await) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    port
}

async fn start_receiver(rx: Arc<Receiver>) -> u16 {
    serve(move |req: hyper::Request<hyper::body::Incoming>| {
        let rx = rx.clone();
        async move {
            let path = req.uri().path().to_string();
            let webhook_id = req
                .headers()
                .get("webhook-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let body_job_id = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["jobId"].as_str().map(str::to_string))
                .unwrap_or_default();
            let after_restart = rx.open.load(Ordering::SeqCst);
            let answered = after_restart
                || rx
                    .budget
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
            rx.arrivals.lock().unwrap().push(Arrival {
                path,
                webhook_id,
                body_job_id,
                answered,
                after_restart,
            });
            if !answered {
                // Held open until the server dies.
                std::future::pending::<()>().await;
            }
            let mut resp = hyper::Response::new(Full::new(Bytes::new()));
            *resp.status_mut() = hyper::StatusCode::NO_CONTENT;
            resp
        }
    })
    .await
}

async fn start_upstream() -> u16 {
    serve(|_req: hyper::Request<hyper::body::Incoming>| async {
        hyper::Response::new(Full::new(Bytes::from_static(b"done")))
    })
    .await
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

/// Every job of pool p, as the admin API lists them.
async fn all_jobs(client: &reqwest::Client, port: u16) -> Vec<serde_json::Value> {
    let v: serde_json::Value = client
        .get(format!(
            "http://127.0.0.1:{port}/admin/pools/p/jobs?limit=500"
        ))
        .header("host", "api.localhost")
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["items"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_terminal_job_is_delivered_after_kill_9() {
    let up_port = start_upstream().await;
    let rx = Arc::new(Receiver::default());
    rx.budget.store(ANSWERED_FIRST, Ordering::SeqCst);
    let rx_port = start_receiver(rx.clone()).await;
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("nthbouncer.toml");
    let hooks: String = DESTINATIONS
        .iter()
        .map(|path| {
            format!(
                "[[pools.webhooks]]\nurl = \"http://127.0.0.1:{rx_port}{path}\"\n\
                 secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n"
            )
        })
        .collect();
    std::fs::File::create(&config)
        .unwrap()
        .write_all(
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\ndata_dir = {:?}\nadmin_token = \"{ADMIN}\"\nallow_private_webhooks = true\n\
                 [[pools]]\nname = \"p\"\nupstream = \"http://127.0.0.1:{up_port}\"\nkeys = [\"{KEY}\"]\n\
                 [pools.concurrency]\nlimit = 10\nqueue_size = 10000\n\
                 [pools.async]\nenabled = true\n{hooks}",
                dir.path().join("data").display().to_string()
            )
            .as_bytes(),
        )
        .unwrap();
    let client = reqwest::Client::new();
    let mut server = start(&config);
    wait_ready(&client, port).await;

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
                .send()
                .await
                .unwrap();
            drop(permit);
            assert_eq!(r.status(), 202);
            let v: serde_json::Value = r.json().await.unwrap();
            v["jobId"].as_str().unwrap().to_string()
        }));
    }
    let mut ids = HashSet::new();
    for t in tasks {
        ids.insert(t.await.unwrap());
    }

    // Every job has ended (so its deliveries are in the outbox), the first deliveries were
    // answered and recorded, and the dispatcher is holding requests open at the receiver.
    let mut recorded_before: HashMap<String, u64> = HashMap::new();
    let mut ready = false;
    for _ in 0..2000 {
        let jobs = all_jobs(&client, port).await;
        let done = jobs.iter().filter(|j| j["status"] == "completed").count();
        let delivered: u64 = jobs
            .iter()
            .map(|j| j["webhook"]["delivered"].as_u64().unwrap_or(0))
            .sum();
        if done == JOBS && delivered as usize == ANSWERED_FIRST && rx.held() >= 2 {
            recorded_before = jobs
                .iter()
                .map(|j| {
                    (
                        j["jobId"].as_str().unwrap().to_string(),
                        j["webhook"]["delivered"].as_u64().unwrap_or(0),
                    )
                })
                .filter(|(_, n)| *n > 0)
                .collect();
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        ready,
        "the jobs never all ended with {ANSWERED_FIRST} deliveries recorded"
    );
    server.0.kill().unwrap();
    server.0.wait().unwrap();
    let delivered_before = rx.delivered().len();
    assert_eq!(delivered_before, ANSWERED_FIRST);
    assert!(
        delivered_before < JOBS * DESTINATIONS.len(),
        "everything was delivered before the kill; the test proves nothing"
    );

    // Restart with the receiver answering: the outbox is picked up where it was left.
    rx.open.store(true, Ordering::SeqCst);
    let _server = start(&config);
    wait_ready(&client, port).await;
    let want: HashSet<(String, String)> = ids
        .iter()
        .flat_map(|id| {
            DESTINATIONS
                .iter()
                .map(move |d| (d.to_string(), id.clone()))
        })
        .collect();
    let mut complete = false;
    for _ in 0..6000 {
        let got: HashSet<(String, String)> = rx
            .delivered()
            .into_iter()
            .map(|a| (a.path, a.webhook_id))
            .collect();
        if want.is_subset(&got) {
            complete = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let delivered = rx.delivered();
    let got: HashSet<(String, String)> = delivered
        .iter()
        .map(|a| (a.path.clone(), a.webhook_id.clone()))
        .collect();
    assert!(
        complete,
        "{} of {} (destination, job) pairs were never delivered",
        want.difference(&got).count(),
        want.len()
    );

    // The receiver can dedupe on webhook-id: it is the job id, in the header and the body alike.
    for a in &delivered {
        assert!(
            ids.contains(&a.webhook_id),
            "unknown webhook-id {}",
            a.webhook_id
        );
        assert_eq!(a.webhook_id, a.body_job_id);
    }
    let mut per_pair: HashMap<(String, String), usize> = HashMap::new();
    for a in &delivered {
        *per_pair
            .entry((a.path.clone(), a.webhook_id.clone()))
            .or_default() += 1;
    }
    assert_eq!(per_pair.len(), want.len(), "after dedupe: one per pair");
    // A delivery recorded as delivered before the kill is not sent again.
    let answered_before: Vec<&Arrival> = delivered.iter().filter(|a| !a.after_restart).collect();
    for a in &answered_before {
        if recorded_before.contains_key(&a.webhook_id) {
            let again = delivered
                .iter()
                .filter(|b| b.after_restart && b.path == a.path && b.webhook_id == a.webhook_id)
                .count();
            assert_eq!(
                again, 0,
                "{} to {} was delivered and recorded, yet sent again",
                a.webhook_id, a.path
            );
        }
    }

    // The poll body's counts agree: every job delivered to both destinations.
    for id in &ids {
        let mut ok = false;
        for _ in 0..500 {
            let v: serde_json::Value = client
                .get(format!("http://127.0.0.1:{port}/pools/p/jobs/{id}"))
                .header("host", "api.localhost")
                .header("x-nthpool-key", KEY)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if v["webhook"]["delivered"] == 2 {
                assert_eq!(v["webhook"]["destinations"], 2);
                assert_eq!(v["webhook"]["failed"], 0);
                ok = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(ok, "job {id} never showed 2 deliveries");
    }
}
