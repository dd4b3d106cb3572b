//! Durability of webhook delivery with the real binary: 200 jobs finish against a fast upstream
//! while the receiver answers only the first 40 deliveries and then holds every request open;
//! the server is `kill -9`ed with deliveries in flight and most of the outbox pending, restarted
//! on the same data dir with the receiver answering again, and every terminal job must reach
//! every active destination at least once. The receiver dedupes on `webhook-id`; a delivery
//! recorded as delivered before the kill is never sent again.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::body::Incoming;
use hyper::Request;
use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{
    header, ok, poll, pool_toml, read_body, serve_http, wait_until, webhook_toml,
};
use serde_json::Value;

use crate::BIN;

const JOBS: usize = 200;
/// Deliveries the receiver answers before it starts holding requests open.
const ANSWERED_FIRST: usize = 40;
const DESTINATIONS: [&str; 2] = ["/a", "/b"];

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

async fn start_receiver(rx: Arc<Receiver>) -> u16 {
    serve_http(move |req| {
        let rx = rx.clone();
        async move {
            let Delivery {
                path,
                webhook_id,
                body_job_id,
            } = Delivery::read(req).await;
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
    .port()
}

async fn start_upstream() -> String {
    format!("http://{}", serve_http(|_req| async { ok(b"done") }).await)
}

/// Every job of pool p, as the admin API lists them.
async fn all_jobs(server: &Server) -> Vec<serde_json::Value> {
    let v = server.admin_json("/admin/pools/p/jobs?limit=500").await;
    v["items"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_terminal_job_is_delivered_after_kill_9() {
    let up = start_upstream().await;
    let rx = Arc::new(Receiver::default());
    rx.budget.store(ANSWERED_FIRST, Ordering::SeqCst);
    let rx_port = start_receiver(rx.clone()).await;
    let hooks: String = DESTINATIONS
        .iter()
        .map(|path| webhook_toml(&format!("http://127.0.0.1:{rx_port}{path}")))
        .collect();
    let rest = format!(
        "allow_private_webhooks = true\n{}[pools.async]\nenabled = true\n{hooks}",
        pool_toml("p", &up, "limit = 10\nqueue_size = 10000"),
    );
    let mut server = Server::start(BIN, "warn", reqwest::Client::new(), &rest).await;

    let ids: HashSet<String> = server
        .submit_async_jobs("p", JOBS, |_| None)
        .await
        .into_iter()
        .collect();

    // Every job has ended (so its deliveries are in the outbox), the first deliveries were
    // answered and recorded, and the dispatcher is holding requests open at the receiver.
    let recorded_before = poll(2000, Duration::from_millis(10), async || {
        let jobs = all_jobs(&server).await;
        let done = jobs.iter().filter(|j| j["status"] == "completed").count();
        let delivered: u64 = jobs
            .iter()
            .map(|j| j["webhook"]["delivered"].as_u64().unwrap_or(0))
            .sum();
        if done == JOBS && delivered as usize == ANSWERED_FIRST && rx.held() >= 2 {
            let recorded: HashMap<String, u64> = jobs
                .iter()
                .map(|j| {
                    (
                        j["jobId"].as_str().unwrap().to_string(),
                        j["webhook"]["delivered"].as_u64().unwrap_or(0),
                    )
                })
                .filter(|(_, n)| *n > 0)
                .collect();
            return Some(recorded);
        }
        None
    })
    .await;
    let Some(recorded_before) = recorded_before else {
        panic!("the jobs never all ended with {ANSWERED_FIRST} deliveries recorded");
    };
    server.kill_9();
    let delivered_before = rx.delivered().len();
    assert_eq!(delivered_before, ANSWERED_FIRST);
    assert!(
        delivered_before < JOBS * DESTINATIONS.len(),
        "everything was delivered before the kill; the test proves nothing"
    );

    // Restart with the receiver answering: the outbox is picked up where it was left.
    rx.open.store(true, Ordering::SeqCst);
    server.restart().await;
    let want: HashSet<(String, String)> = ids
        .iter()
        .flat_map(|id| {
            DESTINATIONS
                .iter()
                .map(move |d| (d.to_string(), id.clone()))
        })
        .collect();
    let complete = wait_until(6000, Duration::from_millis(10), async || {
        let got: HashSet<(String, String)> = rx
            .delivered()
            .into_iter()
            .map(|a| (a.path, a.webhook_id))
            .collect();
        want.is_subset(&got)
    })
    .await;
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

    // The store's counts agree: every job delivered to both destinations. One listing per
    // poll, so a job whose count never gets there fails the test within seconds, by name.
    let mut short: Vec<Value> = Vec::new();
    let all_counted = wait_until(1000, Duration::from_millis(10), async || {
        short = all_jobs(&server)
            .await
            .into_iter()
            .filter(|j| j["webhook"]["delivered"] != 2)
            .collect();
        short.is_empty()
    })
    .await;
    assert!(
        all_counted,
        "{} jobs never showed 2 deliveries, e.g. {}",
        short.len(),
        short[0]
    );
    // And the poll body, which the job's submitter reads, says the same.
    for id in &ids {
        let (status, v) = server.job("p", id).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["webhook"]["delivered"], 2, "{v}");
        assert_eq!(v["webhook"]["destinations"], 2, "{v}");
        assert_eq!(v["webhook"]["failed"], 0, "{v}");
    }
}

/// What a webhook receiver reads of one delivery.
pub struct Delivery {
    /// The destination's path.
    pub path: String,
    /// The `webhook-id` header.
    pub webhook_id: String,
    /// The body's `jobId`; empty if the body is not JSON or has none.
    pub body_job_id: String,
}

impl Delivery {
    /// Reads the delivery, body included.
    pub async fn read(req: Request<Incoming>) -> Delivery {
        let path = req.uri().path().to_string();
        let webhook_id = header(&req, "webhook-id");
        let body = read_body(req.into_body()).await;
        let body_job_id = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v["jobId"].as_str().map(str::to_string))
            .unwrap_or_default();
        Delivery {
            path,
            webhook_id,
            body_job_id,
        }
    }
}
