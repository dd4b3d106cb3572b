//! A real upstream on loopback that counts what it sees: requests in flight (now and at most:
//! the most whose callers had not hung up, see [`UpstreamState::max_in_flight`]),
//! connections, requests in all, `x-seq` arrivals, and every request's method, path and headers.
//!
//! Routes: `/hold` (and each `/sse` event) waits for a [`Upstream::release`] permit;
//! `/sleep?ms=N` answers after N ms (50 without a query); `/hang` never answers; `/echo`
//! answers the request as JSON; `/body` counts request body chunks as they arrive;
//! `/status/N?retry_after=S` answers status N; `/respond…` answers the status and headers its
//! request names (`x-respond-status`, `x-respond-h-NAME`) and a body naming the request's
//! number (or `x-respond-body`, when sent); anything else answers `ok`.

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
use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::Semaphore;

use crate::loopback::{read_body, serve_http_counting, PeerConnection};
use crate::wait::until;

/// What the upstream saw of one request.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
}

pub struct UpstreamState {
    /// Requests whose handling has not ended.
    pub in_flight: AtomicI64,
    /// The most requests in flight at any request's arrival whose connections were still open.
    /// A request whose caller closed its connection (a cut stream) is not counted although this
    /// server's task may not have noticed yet: that lag is this server's, not the caller's.
    pub max_in_flight: AtomicI64,
    /// The connections of the requests in flight, by request number.
    open: Mutex<Vec<(u64, Option<PeerConnection>)>>,
    pub connections: AtomicU64,
    /// Requests seen in all.
    pub requests: AtomicU64,
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
            open: Mutex::new(Vec::new()),
            connections: AtomicU64::new(0),
            requests: AtomicU64::new(0),
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

struct InFlight(Arc<UpstreamState>, u64);
impl InFlight {
    fn new(s: &Arc<UpstreamState>, peer: Option<PeerConnection>) -> Self {
        s.in_flight.fetch_add(1, Ordering::SeqCst);
        let number = s.requests.fetch_add(1, Ordering::SeqCst);
        let mut open = s.open.lock();
        open.push((number, peer));
        let now = open
            .iter()
            .filter(|(_, peer)| !peer.as_ref().is_some_and(PeerConnection::gone))
            .count();
        s.max_in_flight
            .fetch_max(i64::try_from(now).unwrap_or(i64::MAX), Ordering::SeqCst);
        InFlight(s.clone(), number)
    }
}
impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.open.lock().retain(|(number, _)| *number != self.1);
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
    let guard = InFlight::new(&state, req.extensions().get::<PeerConnection>().cloned());
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
        "/hang" => std::future::pending().await,
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
            let body = read_body(req.into_body()).await;
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
        "/flood" => {
            // `mb` MiB as fast as the reader takes them; in flight until the stream ends or the
            // connection is dropped.
            let chunks: usize = q.get("mb").and_then(|v| v.parse().ok()).unwrap_or(8) * 16;
            let stream =
                futures_util::stream::unfold((0usize, Some(guard)), move |(i, g)| async move {
                    (i < chunks).then(|| {
                        let g = if i + 1 == chunks { None } else { g };
                        (Ok(Frame::data(Bytes::from(vec![b'x'; 65_536]))), (i + 1, g))
                    })
                });
            Response::new(StreamBody::new(stream).boxed())
        }
        p if p.starts_with("/respond") => {
            // Answers with what the request asks for: `x-respond-status` and, for each
            // `x-respond-h-NAME: value`, the header `NAME: value`. The body names this
            // request's number, so a test tells an origin's answer from a cached copy.
            let number = state.requests.load(Ordering::SeqCst);
            drop(guard);
            let status = req
                .headers()
                .get("x-respond-status")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .and_then(|c| StatusCode::from_u16(c).ok())
                .unwrap_or(StatusCode::OK);
            let asked = req
                .headers()
                .get("x-respond-body")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body = if status == StatusCode::NO_CONTENT {
                String::new()
            } else if let Some(asked) = asked {
                asked
            } else {
                format!("answer {number} for {}", req.uri())
            };
            let mut r = full(status, body);
            for (name, value) in req.headers() {
                if let Some(n) = name.as_str().strip_prefix("x-respond-h-") {
                    r.headers_mut().append(
                        http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                        value.clone(),
                    );
                }
            }
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
        let state = Arc::new(UpstreamState::default());
        let (st, counted) = (state.clone(), state.clone());
        let addr = serve_http_counting(
            move || {
                counted.connections.fetch_add(1, Ordering::SeqCst);
            },
            move |req| handle(st.clone(), req),
        )
        .await;
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

    /// Requests seen in all.
    pub fn total(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
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
        until(&format!("{n} upstream arrivals"), async || {
            self.state.arrivals.lock().len() >= n
        })
        .await;
    }

    /// Waits (bounded) until exactly `n` requests are in flight here (`what` says why).
    pub async fn wait_in_flight(&self, n: i64, what: &str) {
        until(what, async || self.in_flight() == n).await;
    }
}
