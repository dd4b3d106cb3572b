//! Chaos, bounded in time, against the real binary: a flood of 5,000 concurrent requests at
//! `limit = 8`, clients that vanish mid-queue and mid-request, upstreams that hang or reset.
//! The upstream must never see more than the limit, every request must get an answer from the
//! contract (2xx/429/502/504), and afterwards nothing is left in flight or queued.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};

const BIN: &str = env!("CARGO_BIN_EXE_nthbouncer");
const KEY: &str = "chaos-test-key-0123456789";
const ADMIN: &str = "chaos-test-admin-token-0123";

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[derive(Default)]
struct Counts {
    in_flight: AtomicI64,
    max: AtomicI64,
    total: AtomicI64,
}

/// `/sleep?ms=N` answers after N ms; `/hang` never answers. Counts concurrent requests.
async fn upstream() -> (u16, Arc<Counts>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let counts = Arc::new(Counts::default());
    let c = counts.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let c = c.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let c = c.clone();
                        async move {
                            let now = c.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                            c.max.fetch_max(now, Ordering::SeqCst);
                            c.total.fetch_add(1, Ordering::SeqCst);
                            struct Dec(Arc<Counts>);
                            impl Drop for Dec {
                                fn drop(&mut self) {
                                    self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
                                }
                            }
                            let _dec = Dec(c.clone());
                            if req.uri().path() == "/hang" {
                                std::future::pending::<()>().await;
                            }
                            let ms: u64 = req
                                .uri()
                                .query()
                                .and_then(|q| q.strip_prefix("ms="))
                                .and_then(|v| v.parse().ok())
                                .unwrap_or(5);
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                            Ok::<_, Infallible>(hyper::Response::new(Full::new(
                                Bytes::from_static(b"ok"),
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
    (port, counts)
}

/// Accepts connections and closes them without an answer (the client sees the connection end).
async fn resetting_upstream() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            if let Ok((mut s, _)) = listener.accept().await {
                // Read the request head, then hang up without answering.
                let mut buf = [0u8; 4096];
                let _ = tokio::io::AsyncReadExt::read(&mut s, &mut buf).await;
                drop(s);
            }
        }
    });
    port
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Server {
    _proc: Proc,
    port: u16,
    client: reqwest::Client,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start(pools: &str) -> Server {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("nthbouncer.toml");
        std::fs::File::create(&config)
            .unwrap()
            .write_all(
                format!(
                    "[server]\nlisten = \"127.0.0.1:{port}\"\ndata_dir = {:?}\nadmin_token = \"{ADMIN}\"\n{pools}",
                    dir.path().join("data").display().to_string()
                )
                .as_bytes(),
            )
            .unwrap();
        let proc = Proc(
            Command::new(BIN)
                .args(["serve", "--config", config.to_str().unwrap()])
                .env("RUST_LOG", "error")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        for _ in 0..400 {
            let r = client
                .get(format!("http://127.0.0.1:{port}/readyz"))
                .header("host", "api.localhost")
                .send()
                .await;
            if r.is_ok_and(|r| r.status() == 200) {
                return Server {
                    _proc: proc,
                    port,
                    client,
                    _dir: dir,
                };
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("server did not start");
    }

    fn get(&self, pool: &str, path: &str) -> reqwest::RequestBuilder {
        self.client
            .get(format!("http://127.0.0.1:{}{path}", self.port))
            .header("host", format!("{pool}.localhost"))
            .header("x-nthpool-key", KEY)
    }

    /// Waits (bounded) for the pool to be idle: nothing in flight, nothing queued.
    async fn wait_idle(&self, pool: &str) {
        let mut last = serde_json::Value::Null;
        for _ in 0..1000 {
            let s: serde_json::Value = self
                .client
                .get(format!(
                    "http://127.0.0.1:{}/admin/pools/{pool}/state",
                    self.port
                ))
                .header("host", "api.localhost")
                .bearer_auth(ADMIN)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if s["inFlight"] == 0 && s["queued"] == 0 {
                return;
            }
            last = s;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("pool {pool} never went idle: {last}");
    }
}

fn pool(name: &str, port: u16, concurrency: &str) -> String {
    format!("[[pools]]\nname = \"{name}\"\nupstream = \"http://127.0.0.1:{port}\"\nkeys = [\"{KEY}\"]\n[pools.concurrency]\n{concurrency}\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_5000_at_limit_8() {
    let (up, counts) = upstream().await;
    let server = Server::start(&pool(
        "flood",
        up,
        "limit = 8\nqueue_size = 10000\nqueue_timeout_ms = 60000",
    ))
    .await;
    let server = Arc::new(server);
    let mut tasks = Vec::with_capacity(5000);
    for _ in 0..5000 {
        let s = server.clone();
        tasks.push(tokio::spawn(async move {
            match s.get("flood", "/sleep?ms=2").send().await {
                Ok(r) => r.status().as_u16(),
                Err(e) => panic!("no answer: {e}"),
            }
        }));
    }
    let mut ok = 0;
    for t in tasks {
        let status = t.await.unwrap();
        assert!(
            matches!(status, 200..=299 | 429 | 502 | 504),
            "status {status} is not in the contract"
        );
        if status == 200 {
            ok += 1;
        }
    }
    assert!(
        counts.max.load(Ordering::SeqCst) <= 8,
        "the upstream saw {} at once",
        counts.max.load(Ordering::SeqCst)
    );
    assert_eq!(
        counts.total.load(Ordering::SeqCst),
        ok,
        "every 200 reached the upstream exactly once"
    );
    server.wait_idle("flood").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanishing_clients_leak_nothing() {
    let (up, counts) = upstream().await;
    let server = Arc::new(Server::start(&pool("v", up, "limit = 4\nqueue_size = 10000")).await);
    // Half give up while queued or in flight (client-side timeouts), half wait.
    let mut tasks = Vec::new();
    for i in 0..400 {
        let s = server.clone();
        tasks.push(tokio::spawn(async move {
            let mut req = s.get("v", "/sleep?ms=20");
            if i % 2 == 0 {
                req = req.timeout(Duration::from_millis(30 + (i % 7) as u64 * 10));
            }
            match req.send().await {
                Ok(r) => Some(r.status().as_u16()),
                Err(_) => None,
            }
        }));
    }
    for t in tasks {
        if let Some(status) = t.await.unwrap() {
            assert!(matches!(status, 200 | 429 | 502 | 504), "{status}");
        }
    }
    // A caller that vanished mid-call still counts until the upstream answered: the upstream
    // never sees more than the limit, abandoned calls included.
    assert!(
        counts.max.load(Ordering::SeqCst) <= 4,
        "the upstream saw {} at once",
        counts.max.load(Ordering::SeqCst)
    );
    server.wait_idle("v").await;
    // The pool still serves at full width afterwards.
    assert_eq!(
        server
            .get("v", "/sleep?ms=1")
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_and_resetting_upstreams_free_their_slots() {
    let (up, _) = upstream().await;
    let reset = resetting_upstream().await;
    let pools = format!(
        "{}{}",
        pool("hang", up, "limit = 2\nrequest_timeout_ms = 300"),
        pool("reset", reset, "limit = 2")
    );
    let server = Arc::new(Server::start(&pools).await);
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let s = server.clone();
        tasks.push(tokio::spawn(async move {
            s.get("hang", "/hang")
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }));
        let s = server.clone();
        tasks.push(tokio::spawn(async move {
            s.get("reset", "/").send().await.unwrap().status().as_u16()
        }));
    }
    let mut statuses: Vec<u16> = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 504).count(),
        6,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 502).count(),
        6,
        "{statuses:?}"
    );
    server.wait_idle("hang").await;
    server.wait_idle("reset").await;
}
