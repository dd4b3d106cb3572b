//! Client connections over real loopback sockets (SPEC §1, issue #12): a connection must send
//! its first byte and its request head within `server.header_read_timeout_ms`, an idle
//! keep-alive (HTTP/1) or HTTP/2 connection closes after `server.idle_timeout_ms`, a connection
//! with a request in flight or a response streaming is never idle, and past
//! `server.max_connections` a new connection is answered `503 overloaded` and closed while the
//! connections already open keep being served.
//!
//! No test measures time. Where a test must know that a timeout has passed, it waits (bounded)
//! for a witness connection with the same timeout, opened later, to be closed by the server.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use nthbouncer_testkit::raw::*;
use nthbouncer_testkit::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// The HTTP/2 connection preface a client sends first.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty HTTP/2 SETTINGS frame (length 0, type 4, no flags, stream 0).
const H2_EMPTY_SETTINGS: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];

/// A counting upstream and a gateway with `server` as its `[server]` table and one pool `p`
/// in front of that upstream.
async fn gateway_with_server(server: &str) -> (Upstream, Gateway) {
    proxied_pool_with(server, "limit = 8", "").await
}

/// A short header timeout, the idle timeout far longer (so it cannot be what closes a
/// connection).
const SHORT_HEAD: &str = "header_read_timeout_ms = 300\nidle_timeout_ms = 60000";
/// The same the other way round.
const SHORT_IDLE: &str = "header_read_timeout_ms = 60000\nidle_timeout_ms = 300";

/// An HTTP/1.1 client connection: its sender and the task driving it, which ends when the
/// server closes the connection.
async fn h1(addr: SocketAddr) -> (http1::SendRequest<Empty<Bytes>>, JoinHandle<()>) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
    (sender, tokio::spawn(async move { drop(conn.await) }))
}

/// An HTTP/2 (prior knowledge, h2c) client connection: its sender and the task driving it,
/// which ends once the server sent GOAWAY and closed the connection.
async fn h2(addr: SocketAddr) -> (http2::SendRequest<Empty<Bytes>>, JoinHandle<()>) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .unwrap();
    (sender, tokio::spawn(async move { drop(conn.await) }))
}

/// A GET of `path` on `host` (with the test key), for HTTP/1 (`Host` header) or HTTP/2 (the
/// authority).
fn get(version: http::Version, host: &str, path: &str) -> Request<Empty<Bytes>> {
    let builder = if version == http::Version::HTTP_2 {
        Request::get(format!("http://{host}{path}")).version(version)
    } else {
        Request::get(path).header("host", host)
    };
    builder
        .header("x-nthpool-key", KEY)
        .body(Empty::new())
        .unwrap()
}

/// A response with its body read whole.
async fn collected(r: Response<hyper::body::Incoming>) -> Response<Bytes> {
    let (parts, body) = r.into_parts();
    Response::from_parts(parts, body.collect().await.unwrap().to_bytes())
}

/// A GET (see [`get`]) over an HTTP/1 connection, its answer read whole.
async fn h1_get(
    s: &mut http1::SendRequest<Empty<Bytes>>,
    host: &str,
    path: &str,
) -> Response<Bytes> {
    s.ready().await.unwrap();
    let answer = s.send_request(get(http::Version::HTTP_11, host, path));
    collected(answer.await.unwrap()).await
}

/// A GET (see [`get`]) over an HTTP/2 connection, its answer read whole.
async fn h2_get(
    s: &mut http2::SendRequest<Empty<Bytes>>,
    host: &str,
    path: &str,
) -> Response<Bytes> {
    s.ready().await.unwrap();
    let answer = s.send_request(get(http::Version::HTTP_2, host, path));
    collected(answer.await.unwrap()).await
}

/// Waits (bounded) until a client connection's driving task ends: the server closed it.
async fn closes(what: &str, conn: JoinHandle<()>) {
    bounded(what, conn).await.unwrap();
}

/// Waits (bounded) until a fresh HTTP/1 connection that made one request is closed by the
/// server as idle: proof that `idle_timeout_ms` has passed since this call.
async fn idle_timeout_passes(addr: SocketAddr) {
    let (mut s, conn) = h1(addr).await;
    assert_eq!(h1_get(&mut s, API_HOST, "/healthz").await.status(), 200);
    closes("the witness idle connection to be closed", conn).await;
}

/// A silent socket is closed: before the fix, hyper-util's HTTP/1-or-2 sniff waited for the
/// first byte with no timeout.
#[tokio::test]
async fn a_connection_that_never_sends_a_byte_is_closed() {
    let (_up, gw) = gateway_with_server("header_read_timeout_ms = 300").await;
    let mut s = TcpStream::connect(gw.running.addr).await.unwrap();
    let sent = closed_by_server(&mut s, "a silent connection to be closed").await;
    assert_eq!(
        sent, "",
        "nothing is answered to a connection that asked nothing"
    );
}

/// Half an HTTP/2 preface leaves the sniff undecided; half an HTTP/1 head on a kept-alive
/// connection is a head that never completes. Both are closed within the header timeout,
/// and the idle timeout (long here) does not apply to a head that has started.
#[tokio::test]
async fn half_a_request_head_is_closed() {
    let (_up, gw) = gateway_with_server(SHORT_HEAD).await;
    let addr = gw.running.addr;

    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&H2_PREFACE[..10]).await.unwrap();
    closed_by_server(&mut s, "half an HTTP/2 preface to be closed").await;

    let mut s = connect_and_send(addr, HEALTHZ).await;
    let first = bounded("the first answer", read_response(&mut s)).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: api.loc")
        .await
        .unwrap();
    let sent = closed_by_server(&mut s, "half a second HTTP/1 head to be closed").await;
    assert_eq!(sent, "", "half a head is not answered");
}

/// An HTTP/2 connection that sends its preface and settings but never a request is closed.
#[tokio::test]
async fn an_http2_connection_without_a_request_is_closed() {
    let (_up, gw) = gateway_with_server("header_read_timeout_ms = 300").await;
    let mut s = TcpStream::connect(gw.running.addr).await.unwrap();
    s.write_all(H2_PREFACE).await.unwrap();
    s.write_all(H2_EMPTY_SETTINGS).await.unwrap();
    closed_by_server(&mut s, "an HTTP/2 connection with no request to be closed").await;
}

/// An idle keep-alive connection is closed after `idle_timeout_ms` (here far shorter than the
/// header timeout, so the header timeout cannot be what closes it).
#[tokio::test]
async fn an_idle_http1_keep_alive_connection_is_closed() {
    let (_up, gw) = gateway_with_server(SHORT_IDLE).await;
    let (mut s, conn) = h1(gw.running.addr).await;
    assert_eq!(h1_get(&mut s, API_HOST, "/healthz").await.status(), 200);
    closes("the idle keep-alive connection to be closed", conn).await;
}

/// Between two requests a keep-alive connection is idle, not reading a head: the header
/// timeout does not cut it off, the idle timeout governs.
#[tokio::test]
async fn a_keep_alive_connection_outlives_the_header_timeout_while_idle() {
    let (_up, gw) = gateway_with_server(SHORT_HEAD).await;
    let addr = gw.running.addr;
    let (mut s, conn) = h1(addr).await;
    assert_eq!(h1_get(&mut s, API_HOST, "/healthz").await.status(), 200);
    // A silent connection opened after that answer is closed: the header timeout has passed.
    let mut witness = TcpStream::connect(addr).await.unwrap();
    closed_by_server(&mut witness, "the silent witness to be closed").await;
    assert!(!conn.is_finished(), "the idle connection was closed early");
    assert_eq!(h1_get(&mut s, API_HOST, "/healthz").await.status(), 200);
}

/// An idle HTTP/2 connection gets a GOAWAY and is closed.
#[tokio::test]
async fn an_idle_http2_connection_is_closed() {
    let (_up, gw) = gateway_with_server(SHORT_IDLE).await;
    let (mut s, conn) = h2(gw.running.addr).await;
    assert_eq!(h2_get(&mut s, API_HOST, "/healthz").await.status(), 200);
    closes("the idle HTTP/2 connection to be closed", conn).await;
}

/// A request in flight (a long poll) keeps its connection, HTTP/1 and HTTP/2 alike, however
/// long it waits; once answered, the connection is idle and closes.
#[tokio::test]
async fn a_connection_with_a_request_in_flight_is_not_idle() {
    let (up, gw) = gateway_with_server("header_read_timeout_ms = 300\nidle_timeout_ms = 300").await;
    let addr = gw.running.addr;
    let (mut one, one_conn) = h1(addr).await;
    let (mut two, two_conn) = h2(addr).await;
    // Each task gives its sender back: a client drops a connection whose senders are gone.
    let held1 = tokio::spawn(async move { (h1_get(&mut one, "p.localhost", "/hold").await, one) });
    let held2 = tokio::spawn(async move { (h2_get(&mut two, "p.localhost", "/hold").await, two) });
    up.wait_in_flight(2, "both requests to reach the upstream")
        .await;
    idle_timeout_passes(addr).await;
    assert!(!one_conn.is_finished() && !two_conn.is_finished());
    up.release(2);
    let ((r1, _one), (r2, _two)) = (held1.await.unwrap(), held2.await.unwrap());
    assert_eq!((r1.status(), r2.status()), (StatusCode::OK, StatusCode::OK));
    assert_eq!(r1.body().as_ref(), b"released");
    closes("the HTTP/1 connection to close once idle", one_conn).await;
    closes("the HTTP/2 connection to close once idle", two_conn).await;
}

/// A response that streams for longer than the idle timeout is not idle; once it has ended,
/// the connection is.
#[tokio::test]
async fn a_streaming_response_is_not_idle() {
    let (up, gw) = gateway_with_server(SHORT_IDLE).await;
    let addr = gw.running.addr;
    let (mut s, conn) = h1(addr).await;
    s.ready().await.unwrap();
    let r = s
        .send_request(get(http::Version::HTTP_11, "p.localhost", "/sse?n=2"))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.into_body();
    up.release(1);
    let first = bounded("the first event", body.frame())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap().as_ref(), b"data: 0\n\n");
    idle_timeout_passes(addr).await;
    assert!(
        !conn.is_finished(),
        "a streaming response was cut off as idle"
    );
    up.release(1);
    let rest = bounded("the rest of the stream", body.collect())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(rest.as_ref(), b"data: 1\n\ndata: [DONE]\n\n");
    // The client still holds the connection: the server closes it once idle.
    closes("the connection to close once idle", conn).await;
    drop(s);
}

/// Past `max_connections`, a new connection is answered `503 overloaded` with
/// `Connection: close` (HTTP/2: the answer, then GOAWAY) and closed; the connections already
/// open are still served, and once one closes a new connection is served again.
#[tokio::test]
async fn past_max_connections_a_new_connection_is_refused_cleanly() {
    let (_up, gw) = gateway_with_server("max_connections = 4").await;
    let addr = gw.running.addr;
    let (mut kept, _kept_conn) = h1(addr).await;
    assert_eq!(h1_get(&mut kept, API_HOST, "/healthz").await.status(), 200);
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }

    let mut extra = connect_and_send(addr, HEALTHZ).await;
    assert_refused_overloaded(&closed_by_server(&mut extra, "the refused one to be closed").await);

    let (mut extra2, extra2_conn) = h2(addr).await;
    let r = h2_get(&mut extra2, API_HOST, "/healthz").await;
    assert_eq!(r.status(), 503);
    let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
    assert_eq!(body["error"], "overloaded", "{body}");
    // Even a refused connection's answer names its request (#13).
    assert_eq!(
        r.headers()["x-request-id"].as_bytes(),
        body["requestId"].as_str().unwrap().as_bytes()
    );
    closes("the refused HTTP/2 connection to be closed", extra2_conn).await;

    // The connections the server has keep their answers.
    assert_eq!(h1_get(&mut kept, API_HOST, "/healthz").await.status(), 200);

    drop(silent.pop());
    eventually(
        "a new connection to be served once one closed",
        async || {
            let one_shot =
                b"GET /healthz HTTP/1.1\r\nHost: api.localhost\r\nConnection: close\r\n\r\n";
            let mut s = connect_and_send(addr, one_shot).await;
            let answer = closed_by_server(&mut s, "a one-shot connection to be closed").await;
            answer.starts_with("HTTP/1.1 200").then_some(())
        },
    )
    .await;
}

/// The graceful shutdown still drains: a request in flight is answered, and connections that
/// are silent or idle (HTTP/1 and HTTP/2) do not hold the shutdown up to its grace.
#[tokio::test]
async fn shutdown_answers_requests_in_flight_and_closes_the_rest() {
    let (up, gw) = gateway_with_server(
        "header_read_timeout_ms = 60000\nidle_timeout_ms = 60000\nshutdown_grace_ms = 60000",
    )
    .await;
    let addr = gw.running.addr;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let (mut idle1, idle1_conn) = h1(addr).await;
    assert_eq!(h1_get(&mut idle1, API_HOST, "/healthz").await.status(), 200);
    let (mut idle2, idle2_conn) = h2(addr).await;
    assert_eq!(h2_get(&mut idle2, API_HOST, "/healthz").await.status(), 200);
    let (mut held, held_conn) = h1(addr).await;
    let held = tokio::spawn(async move { (h1_get(&mut held, "p.localhost", "/hold").await, held) });
    up.wait_in_flight(1, "the held request to reach the upstream")
        .await;

    let shutdown = tokio::spawn(gw.running.shutdown());
    closes("the idle HTTP/1 connection to close", idle1_conn).await;
    closes("the idle HTTP/2 connection to close", idle2_conn).await;
    closed_by_server(&mut silent, "the silent connection to close").await;
    assert!(
        !shutdown.is_finished(),
        "the shutdown did not wait for the request in flight"
    );
    up.release(1);
    let (r, _held) = held.await.unwrap();
    assert_eq!(
        (r.status(), r.body().as_ref()),
        (StatusCode::OK, &b"released"[..])
    );
    closes("the held connection to close", held_conn).await;
    closes("the shutdown", shutdown).await;
}

/// A client socket that keeps a copy of every byte it reads: what the server wrote.
struct Recorded {
    stream: TcpStream,
    read: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl tokio::io::AsyncRead for Recorded {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.stream).poll_read(cx, buf);
        let new = buf.filled()[before..].to_vec();
        self.read.lock().unwrap().extend_from_slice(&new);
        polled
    }
}

impl tokio::io::AsyncWrite for Recorded {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The header blocks of the HEADERS frames (type 1) on request streams in `bytes`, as an
/// HTTP/2 server wrote them (its frames follow each other from the first byte).
fn header_blocks(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut blocks = Vec::new();
    let mut at = 0;
    while at + 9 <= bytes.len() {
        let len = usize::from(bytes[at]) << 16
            | usize::from(bytes[at + 1]) << 8
            | usize::from(bytes[at + 2]);
        let (kind, flags) = (bytes[at + 3], bytes[at + 4]);
        let stream =
            u32::from_be_bytes([bytes[at + 5], bytes[at + 6], bytes[at + 7], bytes[at + 8]])
                & 0x7fff_ffff;
        let Some(payload) = bytes.get(at + 9..at + 9 + len) else {
            break;
        };
        // Neither padded (0x8) nor with a priority (0x20): the block is the whole payload.
        if kind == 1 && stream != 0 {
            assert_eq!(flags & 0x28, 0, "a HEADERS frame padded or with a priority");
            blocks.push(payload.to_vec());
        }
        at += 9 + len;
    }
    blocks
}

/// An origin's `date` changes every second; indexed by HPACK, every new value would join the
/// connection's table, and h2's encoder compares each answer's with all of them (issue #20,
/// bench/RESULTS.md). Proxied HTTP/2 answers carry it as a literal never indexed, with the
/// static table's name (RFC 7541 §6.2.3: `0001` and index 33 = 15 + 18, the bytes 0x1f 0x12),
/// on a connection's first answer and on the later ones.
#[tokio::test]
async fn an_origins_date_is_never_indexed_over_http2() {
    let (_up, gw) = gateway_with_server("").await;
    let stream = TcpStream::connect(gw.running.addr).await.unwrap();
    let read = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let io = Recorded {
        stream,
        read: read.clone(),
    };
    let (mut s, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(io))
        .await
        .unwrap();
    let conn = tokio::spawn(async move { drop(conn.await) });
    for _ in 0..3 {
        let r = h2_get(&mut s, "p.localhost", "/").await;
        assert_eq!(r.status(), StatusCode::OK);
        assert!(r.headers().contains_key(http::header::DATE), "{r:?}");
    }
    drop(s);
    closes("the client connection to end", conn).await;
    let bytes = read.lock().unwrap().clone();
    // The server's preface (its SETTINGS) comes first; frames follow one another.
    let blocks = header_blocks(&bytes);
    assert_eq!(blocks.len(), 3, "one HEADERS frame per answer");
    for block in &blocks {
        assert!(
            block.windows(2).any(|w| w == [0x1f, 0x12]),
            "no never-indexed date in {block:02x?}"
        );
    }
}
