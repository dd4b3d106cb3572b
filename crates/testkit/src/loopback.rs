//! Loopback HTTP servers and the request helpers every test uses.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;

/// Serves HTTP/1 and HTTP/2 on a loopback port, answering every request with `f`; its address.
pub async fn serve_http<F, Fut, B>(f: F) -> SocketAddr
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_http_counting(|| {}, f).await
}

/// A request's connection, as the server that took it can check it: still open, or closed by
/// the peer. Every request [`serve_http_counting`] serves carries one as an extension.
#[derive(Clone, Debug)]
pub struct PeerConnection(Arc<std::net::TcpStream>);

impl PeerConnection {
    /// Whether the peer has closed (or reset) the connection. On loopback the kernel knows the
    /// moment the peer's `close` returns, before this server's tasks notice: a request whose
    /// caller hung up is not one the server still serves, however late its task learns it.
    pub fn gone(&self) -> bool {
        let mut byte = [0u8; 1];
        // The duplicate shares the socket's non-blocking mode: a peek never waits.
        match self.0.peek(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        }
    }
}

/// [`serve_http`], calling `on_connection` for every connection it accepts.
pub async fn serve_http_counting<C, F, Fut, B>(on_connection: C, f: F) -> SocketAddr
where
    C: Fn() + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            on_connection();
            let peer = std::os::fd::AsFd::as_fd(&stream)
                .try_clone_to_owned()
                .ok()
                .map(|fd| PeerConnection(Arc::new(std::net::TcpStream::from(fd))));
            let f = f.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
                    if let Some(peer) = &peer {
                        req.extensions_mut().insert(peer.clone());
                    }
                    let f = f.clone();
                    async move { Ok::<_, Infallible>(f(req).await) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// A request body read to its end (empty if it broke off).
pub async fn read_body(body: Incoming) -> Bytes {
    body.collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default()
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

/// Sends a request; a transport error fails the test.
pub async fn send(rb: reqwest::RequestBuilder) -> reqwest::Response {
    rb.send().await.unwrap()
}

/// Sends a request on a task of its own; awaiting the task gives the response (a transport
/// error fails the test).
pub fn spawn_send(rb: reqwest::RequestBuilder) -> tokio::task::JoinHandle<reqwest::Response> {
    tokio::spawn(send(rb))
}

/// The JSON body of a response (a body that is not JSON fails the test).
pub async fn json_of(r: reqwest::Response) -> Value {
    r.json().await.unwrap()
}

/// The id of a job accepted from `r` (202 asserted).
pub async fn accepted_id(r: reqwest::Response) -> String {
    assert_eq!(r.status(), 202);
    json_of(r).await["jobId"].as_str().unwrap().to_string()
}

/// The item of a list answer (`{"items": […]}`) whose `field` is `value`; none fails the test.
pub fn item_where(list: &Value, field: &str, value: &str) -> Value {
    let items = list["items"].as_array().unwrap();
    let found = items.iter().find(|i| i[field] == value);
    found
        .unwrap_or_else(|| panic!("no item with {field} {value}: {list}"))
        .clone()
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

/// A loopback port nothing listens on, kept so while the returned socket lives: connections to
/// it are refused, and no other test's server can be given the port meanwhile (a listener bound
/// and dropped frees it for the next `bind` to port 0, which made such tests flaky).
pub fn refused_port() -> (tokio::net::TcpSocket, SocketAddr) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
    socket
        .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("a loopback port");
    let addr = socket.local_addr().expect("its address");
    (socket, addr)
}
