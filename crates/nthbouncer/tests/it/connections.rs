//! The real binary's connection bounds (SPEC §1, issue #12): past `server.max_connections` a
//! new connection is answered `503 overloaded` and closed while the ones it has are still
//! served, and a socket that never sends a byte is closed. Raw loopback sockets; no timings.

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::raw::{
    assert_refused_overloaded, closed_by_server, connect_and_send, read_response, HEALTHZ,
};
use nthbouncer_testkit::{bounded, eventually};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::BIN;

/// A connection that made one request and stays open (keep-alive). Retried while refused: the
/// readiness checks' connections may not all be closed yet.
async fn kept_alive(port: u16) -> TcpStream {
    eventually("a kept-alive connection", async || {
        let mut s = connect_and_send(("127.0.0.1", port), HEALTHZ).await;
        let answer = bounded("a /healthz answer", read_response(&mut s)).await;
        answer.starts_with("HTTP/1.1 200").then_some(s)
    })
    .await
}

#[tokio::test]
async fn the_binary_refuses_connections_past_its_limit_and_closes_silent_ones() {
    // Readiness checks must not keep connections open: they would count against the limit.
    let client = nthbouncer_testkit::unpooled_client();
    let server = Server::start(
        BIN,
        "warn",
        client,
        "header_read_timeout_ms = 300\nmax_connections = 4\n",
    )
    .await;
    let port = server.port;
    let mut kept = Vec::new();
    for _ in 0..4 {
        kept.push(kept_alive(port).await);
    }

    let mut extra = connect_and_send(("127.0.0.1", port), HEALTHZ).await;
    assert_refused_overloaded(&closed_by_server(&mut extra, "the refused one to be closed").await);

    // The connections it has are still answered.
    let first = &mut kept[0];
    first.write_all(HEALTHZ).await.unwrap();
    let again = bounded("a second answer on a kept connection", read_response(first)).await;
    assert!(again.starts_with("HTTP/1.1 200"), "{again}");

    // Once one closes, a new connection is served again.
    drop(kept.pop());
    drop(kept_alive(port).await);

    // A socket that never sends a byte is closed (served or refused, it gets nothing).
    let mut silent = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let sent = closed_by_server(&mut silent, "a silent connection to be closed").await;
    assert_eq!(sent, "");
}

/// A reload changes the connection bounds for the connections accepted after it (issue #21):
/// a lower `max_connections` refuses the next connection while those already open above it
/// are still served; a lower header timeout closes the next silent socket, and a lower idle
/// timeout the next idle keep-alive connection. Started with bounds no test would outwait
/// (10 minutes), so each close seen here is the reloaded bound's.
#[tokio::test]
async fn a_reload_applies_connection_bounds_to_the_next_connection() {
    let client = nthbouncer_testkit::unpooled_client();
    let long = "header_read_timeout_ms = 600000\nidle_timeout_ms = 600000\n";
    let server = Server::start(BIN, "warn", client, long).await;
    let port = server.port;
    let mut kept = vec![kept_alive(port).await, kept_alive(port).await];

    server.rewrite_config(
        "header_read_timeout_ms = 300\nidle_timeout_ms = 300\nmax_connections = 1\n",
    );
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["restartPending"], serde_json::json!([]), "{body}");

    // Two open, one allowed: the next connection is refused.
    let mut extra = connect_and_send(("127.0.0.1", port), HEALTHZ).await;
    let answer = closed_by_server(&mut extra, "the refused connection to be closed").await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains(r#""error":"overloaded""#), "{answer}");
    // Those already open are still served (and keep the idle timeout they were accepted with).
    for s in &mut kept {
        s.write_all(HEALTHZ).await.unwrap();
        let again = bounded(
            "an answer on a connection kept across the reload",
            read_response(s),
        )
        .await;
        assert!(again.starts_with("HTTP/1.1 200"), "{again}");
    }

    // Under the limit again, a new connection is served, and closed once idle.
    drop(kept);
    let mut idle = kept_alive(port).await;
    let sent = closed_by_server(&mut idle, "an idle connection to be closed").await;
    assert_eq!(sent, "", "nothing is sent on an idle connection's close");
    // A socket that never sends a byte is closed by the new header timeout.
    let mut silent = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let sent = closed_by_server(&mut silent, "a silent connection to be closed").await;
    assert_eq!(sent, "");
}
