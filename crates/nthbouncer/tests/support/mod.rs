//! Support for the end-to-end tests that drive the real binary: a child-process guard,
//! `nthbouncer serve` started from a generated config and waited on, config snippets, small
//! loopback HTTP servers for upstreams and webhook receivers, and bounded polling.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_nthbouncer");

/// A webhook signing secret in the `whsec_` format.
pub const WEBHOOK_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// Kills (and reaps) the child when the test ends, whatever happens.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Spawns the binary with `args`, its output discarded. `rust_log` sets `RUST_LOG`; `None`
/// leaves the environment's.
pub fn spawn(args: &[&str], rust_log: Option<&str>) -> Proc {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdout(Stdio::null()).stderr(Stdio::null());
    if let Some(level) = rust_log {
        cmd.env("RUST_LOG", level);
    }
    Proc(cmd.spawn().unwrap())
}

/// Writes `text` as `nthbouncer.toml` in `dir` and returns its path.
pub fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("nthbouncer.toml");
    std::fs::File::create(&path)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    path
}

/// The `[server]` table's first lines: listen on `127.0.0.1:port`, data in `dir/data`.
pub fn server_toml(port: u16, dir: &Path) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\ndata_dir = {:?}\n",
        dir.join("data").display().to_string()
    )
}

/// A `[[pools]]` entry: `name` in front of a loopback upstream, one `key`, and `concurrency`
/// (TOML lines) as its `[pools.concurrency]` table.
pub fn pool_toml(name: &str, upstream_port: u16, key: &str, concurrency: &str) -> String {
    format!(
        "[[pools]]\nname = \"{name}\"\nupstream = \"http://127.0.0.1:{upstream_port}\"\nkeys = [\"{key}\"]\n[pools.concurrency]\n{concurrency}\n"
    )
}

/// A `[[pools.webhooks]]` destination at `url`, signed with [`WEBHOOK_SECRET`].
pub fn webhook_toml(url: &str) -> String {
    format!("[[pools.webhooks]]\nurl = \"{url}\"\nsecret = \"{WEBHOOK_SECRET}\"\n")
}

/// Calls `f` up to `tries` times, `every` apart, until it returns `Some`; `None` if it never
/// did.
pub async fn poll<T>(
    tries: usize,
    every: Duration,
    mut f: impl AsyncFnMut() -> Option<T>,
) -> Option<T> {
    for _ in 0..tries {
        if let Some(v) = f().await {
            return Some(v);
        }
        tokio::time::sleep(every).await;
    }
    None
}

/// Calls `cond` up to `tries` times, `every` apart, until it holds; whether it did.
pub async fn wait_until(
    tries: usize,
    every: Duration,
    mut cond: impl AsyncFnMut() -> bool,
) -> bool {
    poll(tries, every, async || cond().await.then_some(()))
        .await
        .is_some()
}

/// Waits (bounded, 10 s) until something accepts connections on `port`.
pub fn wait_listening(port: u16) {
    for _ in 0..400 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("nothing listened on port {port}");
}

/// Waits (bounded, 10 s) until `/readyz` on `port` answers 200.
pub async fn wait_ready(client: &reqwest::Client, port: u16) {
    let ready = wait_until(400, Duration::from_millis(25), async || {
        client
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .header("host", "api.localhost")
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(ready, "the server on port {port} never became ready");
}

/// GET `path` on the admin API at `base` (`http://host:port`) with the admin `token`.
pub async fn admin_get(
    client: &reqwest::Client,
    base: &str,
    token: &str,
    path: &str,
) -> reqwest::Response {
    client
        .get(format!("{base}{path}"))
        .header("host", "api.localhost")
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

/// `nthbouncer serve` on a free loopback port, from a config written in its own tempdir.
pub struct Server {
    proc: Proc,
    pub port: u16,
    /// Used for every request the helpers make, readiness checks included.
    pub client: reqwest::Client,
    admin_token: String,
    rust_log: &'static str,
    config: PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Writes a config of the `[server]` table (listen, data dir, `admin_token`) followed by
    /// `rest` (which may open with more `[server]` keys), starts `serve` with
    /// `RUST_LOG=rust_log`, and waits until it is ready.
    pub async fn start(
        admin_token: &str,
        rust_log: &'static str,
        client: reqwest::Client,
        rest: &str,
    ) -> Server {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let config = write_config(
            dir.path(),
            &format!(
                "{}admin_token = \"{admin_token}\"\n{rest}",
                server_toml(port, dir.path())
            ),
        );
        let server = Server {
            proc: Self::spawn(&config, rust_log),
            port,
            client,
            admin_token: admin_token.to_string(),
            rust_log,
            config,
            _dir: dir,
        };
        wait_ready(&server.client, port).await;
        server
    }

    fn spawn(config: &Path, rust_log: &str) -> Proc {
        spawn(
            &["serve", "--config", config.to_str().unwrap()],
            Some(rust_log),
        )
    }

    /// `kill -9`: the process dies at once, with whatever it had in flight.
    pub fn kill_9(&mut self) {
        self.proc.0.kill().unwrap();
        self.proc.0.wait().unwrap();
    }

    /// Starts `serve` again on the same config (same port, same data dir) and waits until it
    /// is ready.
    pub async fn restart(&mut self) {
        self.proc = Self::spawn(&self.config, self.rust_log);
        wait_ready(&self.client, self.port).await;
    }

    /// `http://127.0.0.1:{port}{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// GET `path` on `pool`'s host with the pool `key`.
    pub fn pool_get(&self, pool: &str, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.client
            .get(self.url(path))
            .header("host", format!("{pool}.localhost"))
            .header("x-nthpool-key", key)
    }

    /// GET `path` on the admin API, as JSON (whatever the status).
    pub async fn admin_json(&self, path: &str) -> Value {
        admin_get(&self.client, &self.url(""), &self.admin_token, path)
            .await
            .json()
            .await
            .unwrap()
    }

    /// Waits (bounded, 20 s) for `pool` to be idle: nothing in flight, nothing queued.
    pub async fn wait_idle(&self, pool: &str) {
        let mut last = Value::Null;
        let idle = wait_until(1000, Duration::from_millis(20), async || {
            let s = self.admin_json(&format!("/admin/pools/{pool}/state")).await;
            let idle = s["inFlight"] == 0 && s["queued"] == 0;
            last = s;
            idle
        })
        .await;
        assert!(idle, "pool {pool} never went idle: {last}");
    }

    /// Submits `n` async jobs to `pool` (`POST /work/{i}`, 16 at a time, with `body(i)` as the
    /// body if any); every one must be accepted with 202. Their job ids, in submission order.
    pub async fn submit_async_jobs(
        &self,
        pool: &str,
        key: &str,
        n: usize,
        body: impl Fn(usize) -> Option<String>,
    ) -> Vec<String> {
        let sem = Arc::new(tokio::sync::Semaphore::new(16));
        let mut tasks = Vec::with_capacity(n);
        for i in 0..n {
            let permit = sem.clone().acquire_owned().await.unwrap();
            let mut req = self
                .client
                .post(self.url(&format!("/work/{i}")))
                .header("host", format!("{pool}.localhost"))
                .header("x-nthpool-key", key)
                .header("x-nthpool-async", "1");
            if let Some(body) = body(i) {
                req = req.body(body);
            }
            tasks.push(tokio::spawn(async move {
                let r = req.send().await.unwrap();
                drop(permit);
                assert_eq!(r.status(), 202);
                let v: Value = r.json().await.unwrap();
                v["jobId"].as_str().unwrap().to_string()
            }));
        }
        let mut ids = Vec::with_capacity(n);
        for t in tasks {
            ids.push(t.await.unwrap());
        }
        ids
    }

    /// The job as its submitter polls it (`GET /pools/{pool}/jobs/{id}` with the pool key):
    /// the status and the JSON body.
    pub async fn job(&self, pool: &str, key: &str, id: &str) -> (u16, Value) {
        let r = self
            .client
            .get(self.url(&format!("/pools/{pool}/jobs/{id}")))
            .header("host", "api.localhost")
            .header("x-nthpool-key", key)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }
}

/// Serves HTTP/1 and HTTP/2 on a loopback port, answering every request with `f`; the port.
pub async fn serve_http<F, Fut>(f: F) -> u16
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
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

/// A 200 with `body`.
pub fn ok(body: &'static [u8]) -> Response<Full<Bytes>> {
    Response::new(Full::new(Bytes::from_static(body)))
}

/// The request header `name` as text; empty when absent or not text.
pub fn header(req: &Request<Incoming>, name: &str) -> String {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

/// How many requests an upstream has seen: at this moment, at most at once, and in all.
#[derive(Default)]
pub struct Counts {
    pub in_flight: AtomicI64,
    pub max: AtomicI64,
    pub total: AtomicI64,
}

/// Counts its request out of `in_flight` when dropped, answered or abandoned.
pub struct InFlight(Arc<Counts>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Counts {
    /// Counts a request in; hold the guard until the request is done.
    pub fn enter(self: &Arc<Self>) -> InFlight {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
        self.total.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }
}

/// An upstream that counts its requests: `/sleep?ms=N` answers `ok` after N ms (5 without a
/// query), `/hang` never answers.
pub async fn counting_upstream() -> (u16, Arc<Counts>) {
    let counts = Arc::new(Counts::default());
    let c = counts.clone();
    let port = serve_http(move |req| {
        let c = c.clone();
        async move {
            let _in_flight = c.enter();
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
            ok(b"ok")
        }
    })
    .await;
    (port, counts)
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
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
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
