//! Test support: a real upstream that counts what it sees, and a real gateway on loopback.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use nthbouncer_config::Config;
use nthbouncer_coord::Clock;
use parking_lot::Mutex;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";
/// A valid legacy-format key used by most test pools.
pub const KEY: &str = "test-key-0123456789abcdef";
pub const KEY2: &str = "test-key-second-0123456789";

/// What the upstream saw of one request.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
}

pub struct UpstreamState {
    pub in_flight: AtomicI64,
    pub max_in_flight: AtomicI64,
    pub connections: AtomicU64,
    /// `x-seq` header values in order of arrival.
    pub arrivals: Mutex<Vec<String>>,
    pub seen: Mutex<Vec<Seen>>,
    /// Permits that let `/hold` requests (and `/sse` chunks) proceed.
    pub hold: Semaphore,
    /// Chunks of `/body` requests received so far.
    pub body_chunks: AtomicU64,
}

impl Default for UpstreamState {
    fn default() -> Self {
        UpstreamState {
            in_flight: AtomicI64::new(0),
            max_in_flight: AtomicI64::new(0),
            connections: AtomicU64::new(0),
            arrivals: Mutex::new(Vec::new()),
            seen: Mutex::new(Vec::new()),
            hold: Semaphore::new(0),
            body_chunks: AtomicU64::new(0),
        }
    }
}

pub struct Upstream {
    pub addr: SocketAddr,
    pub state: Arc<UpstreamState>,
}

struct InFlight(Arc<UpstreamState>);
impl InFlight {
    fn new(s: &Arc<UpstreamState>) -> Self {
        let now = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        s.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(s.clone())
    }
}
impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

type BoxBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<BoxBody> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r
}

fn query(req: &Request<Incoming>) -> HashMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn handle(state: Arc<UpstreamState>, req: Request<Incoming>) -> Response<BoxBody> {
    let guard = InFlight::new(&state);
    if let Some(seq) = req.headers().get("x-seq") {
        state
            .arrivals
            .lock()
            .push(seq.to_str().unwrap_or("?").to_string());
    }
    state.seen.lock().push(Seen {
        method: req.method().to_string(),
        path: req
            .uri()
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default(),
        headers: req.headers().clone(),
    });
    let q = query(&req);
    let path = req.uri().path().to_string();
    match path.as_str() {
        "/hold" => {
            if let Ok(p) = state.hold.acquire().await {
                p.forget();
            }
            drop(guard);
            full(StatusCode::OK, "released")
        }
        "/sleep" => {
            let ms: u64 = q.get("ms").and_then(|v| v.parse().ok()).unwrap_or(50);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            drop(guard);
            full(StatusCode::OK, "slept")
        }
        "/echo" => {
            let headers: serde_json::Map<String, Value> = req
                .headers()
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        Value::String(v.to_str().unwrap_or("").to_string()),
                    )
                })
                .collect();
            let method = req.method().to_string();
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            drop(guard);
            let v = serde_json::json!({
                "method": method, "path": path, "query": q, "headers": headers,
                "body": String::from_utf8_lossy(&body),
            });
            let mut r = full(StatusCode::OK, v.to_string());
            r.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            r.headers_mut()
                .insert("connection", "x-upstream-hop".parse().unwrap());
            r.headers_mut()
                .insert("x-upstream-hop", "1".parse().unwrap());
            r
        }
        "/body" => {
            // Counts request body chunks as they arrive: proves streaming, not buffering.
            let mut body = req.into_body();
            let mut total = 0usize;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(f) => {
                        if let Some(d) = f.data_ref() {
                            total += d.len();
                            state.body_chunks.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    Err(_) => break,
                }
            }
            drop(guard);
            full(StatusCode::OK, total.to_string())
        }
        "/sse" => {
            let n: usize = q.get("n").and_then(|v| v.parse().ok()).unwrap_or(3);
            let st = state.clone();
            let stream = async_stream(st, n, guard);
            let mut r = Response::new(StreamBody::new(stream).boxed());
            r.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            r
        }
        p if p.starts_with("/status/") => {
            let code: u16 = p.trim_start_matches("/status/").parse().unwrap_or(500);
            drop(guard);
            let mut r = full(
                StatusCode::from_u16(code).unwrap_or(StatusCode::OK),
                "status",
            );
            if let Some(ra) = q.get("retry_after") {
                r.headers_mut().insert("retry-after", ra.parse().unwrap());
            }
            r
        }
        _ => {
            drop(guard);
            full(StatusCode::OK, "ok")
        }
    }
}

/// An SSE body that waits for one hold permit before each event; the in-flight guard lives
/// until the stream ends or is dropped.
fn async_stream(
    state: Arc<UpstreamState>,
    n: usize,
    guard: InFlight,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send + Sync + 'static {
    futures_util::stream::unfold(
        (0usize, state, Some(guard)),
        move |(i, state, guard)| async move {
            if i > n {
                drop(guard);
                return None;
            }
            if i == n {
                return Some((
                    Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n"))),
                    (i + 1, state, None),
                ));
            }
            if let Ok(p) = state.hold.acquire().await {
                p.forget();
            }
            let chunk = Bytes::from(format!("data: {i}\n\n"));
            Some((Ok(Frame::data(chunk)), (i + 1, state, guard)))
        },
    )
}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(UpstreamState::default());
        let st = state.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                st.connections.fetch_add(1, Ordering::SeqCst);
                let st2 = st.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let st3 = st2.clone();
                        async move { Ok::<_, Infallible>(handle(st3, req).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Upstream { addr, state }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn release(&self, n: usize) {
        self.state.hold.add_permits(n);
    }

    pub fn max_in_flight(&self) -> i64 {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    pub fn in_flight(&self) -> i64 {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    pub fn arrivals(&self) -> Vec<String> {
        self.state.arrivals.lock().clone()
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().clone()
    }

    /// Waits (bounded) until `n` requests carrying `x-seq` have arrived.
    pub async fn wait_arrivals(&self, n: usize) {
        wait_until(
            || self.state.arrivals.lock().len() >= n,
            &format!("{n} upstream arrivals"),
        )
        .await;
    }
}

/// Polls `cond` every 5 ms for up to 10 s; panics naming `what` if it never holds.
pub async fn wait_until(mut cond: impl FnMut() -> bool, what: &str) {
    for _ in 0..2000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("timed out waiting for {what}");
}

pub struct Gateway {
    pub running: nthbouncer_server::Running,
    pub base: String,
    pub client: reqwest::Client,
    _dir: tempfile::TempDir,
}

/// Starts a gateway from TOML (its `[server]` gets a loopback port, a temp data dir and the
/// test admin token unless the TOML sets them).
pub async fn gateway(pools_toml: &str) -> Gateway {
    gateway_with(pools_toml, None).await
}

pub async fn gateway_with(pools_toml: &str, clock: Option<Arc<dyn Clock>>) -> Gateway {
    let dir = tempfile::tempdir().unwrap();
    let mut config =
        Config::from_toml_str(pools_toml).unwrap_or_else(|e| panic!("test config: {e}"));
    config.server.listen = "127.0.0.1:0".into();
    if config.server.data_dir == nthbouncer_config::ServerSpec::default().data_dir {
        config.server.data_dir = dir.path().to_path_buf();
    }
    if config.server.admin_token.is_none() {
        config.server.admin_token = Some(ADMIN_TOKEN.into());
    }
    let running = nthbouncer_server::start(config, nthbouncer_server::Options { clock })
        .await
        .unwrap_or_else(|e| panic!("gateway start: {e}"));
    let base = format!("http://{}", running.addr);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    Gateway {
        running,
        base,
        client,
        _dir: dir,
    }
}

impl Gateway {
    /// A request to a pool's host.
    pub fn pool(&self, pool: &str, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("{}{}", self.base, path))
            .header("host", format!("{pool}.localhost"))
    }

    /// A GET through pool `pool` with the test key.
    pub fn get(&self, pool: &str, path: &str) -> reqwest::RequestBuilder {
        self.pool(pool, reqwest::Method::GET, path)
            .header("x-nthpool-key", KEY)
    }

    /// A request to the API host with the admin token.
    pub fn api(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("{}{}", self.base, path))
            .header("host", "api.localhost")
            .bearer_auth(ADMIN_TOKEN)
    }

    /// A request to the API host with no credentials at all.
    pub fn api_anon(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("{}{}", self.base, path))
            .header("host", "api.localhost")
    }

    /// A GET through pool `pool` with the test key that asks not to queue.
    pub fn no_queue(&self, pool: &str, path: &str) -> reqwest::RequestBuilder {
        self.get(pool, path).header("x-nthpool-no-queue", "1")
    }

    /// A GET through pool `pool` with the test key that asks to run as an async job.
    pub fn get_async(&self, pool: &str, path: &str) -> reqwest::RequestBuilder {
        self.get(pool, path).header("x-nthpool-async", "1")
    }

    /// An admin API call with the admin token (and `body` as JSON, if any): the status and the
    /// JSON body (`Null` when the body is empty or not JSON).
    pub async fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let rb = self.api(method, path);
        call(match body {
            Some(b) => rb.json(&b),
            None => rb,
        })
        .await
    }

    /// The JSON body of an admin GET (the status is not checked; the body must be JSON).
    pub async fn admin_json(&self, path: &str) -> Value {
        json_of(send(self.api(reqwest::Method::GET, path)).await).await
    }

    pub async fn state(&self, pool: &str) -> Value {
        let r = send(self.api(reqwest::Method::GET, &format!("/admin/pools/{pool}/state"))).await;
        assert_eq!(r.status(), 200, "state of {pool}");
        r.json().await.unwrap()
    }

    /// Waits (bounded) until the pool's live state satisfies `pred`.
    pub async fn wait_state(&self, pool: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        for _ in 0..2000 {
            let s = self.state(pool).await;
            if pred(&s) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("timed out waiting for pool {pool}: {what}");
    }
}

/// A pool table in TOML.
pub fn pool_toml(name: &str, upstream: &str, concurrency: &str) -> String {
    format!(
        "[[pools]]\nname = \"{name}\"\nupstream = \"{upstream}\"\nkeys = [\"{KEY}\", \"{KEY2}\"]\n[pools.concurrency]\n{concurrency}\n"
    )
}

/// Sends a request; a transport error fails the test.
pub async fn send(rb: reqwest::RequestBuilder) -> reqwest::Response {
    rb.send().await.unwrap()
}

/// The JSON body of a response (a body that is not JSON fails the test).
pub async fn json_of(r: reqwest::Response) -> Value {
    r.json().await.unwrap()
}

/// Sends a request: its status and JSON body (`Null` when the body is empty or not JSON).
pub async fn call(rb: reqwest::RequestBuilder) -> (u16, Value) {
    let r = send(rb).await;
    let status = r.status().as_u16();
    let bytes = r.bytes().await.unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Asserts a JSON error answer with `status` and `error` code; returns its body.
pub async fn expect_error(r: reqwest::Response, status: u16, code: &str) -> Value {
    assert_eq!(r.status(), status, "status of an expected {code}");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], code, "{body}");
    body
}
