//! End-to-end proxy behaviour over loopback: what crosses to the upstream and what does not,
//! slots held by streamed bodies, clients that vanish, errors in the contract's shape.

use std::sync::atomic::Ordering;
use std::time::Duration;

use nthbouncer_testkit::*;
use reqwest::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn upstream_sees_managed_credentials_never_our_headers() {
    let headers = "authorization = \"Bearer sk-managed\"\nx-api-version = \"2024-01\"\n";
    let extra = format!("[pools.upstream_headers]\n{headers}");
    let (up, gw) = proxied_pool_with("", "limit = 2", &extra).await;
    let r = send(
        gw.get("p", "/echo?a=1&b=two")
            .header("authorization", "Bearer caller-supplied")
            .header("x-nthpool-priority", "high")
            .header("connection", "x-hop-secret")
            .header("x-hop-secret", "must-not-cross")
            .header("x-forwarded-for", "10.9.9.9")
            .header("x-custom", "kept"),
    )
    .await;
    assert_eq!(r.status(), 200);
    // The upstream's own hop-by-hop response headers do not reach the caller either.
    assert!(!r.headers().contains_key("x-upstream-hop"));
    let echo: serde_json::Value = r.json().await.unwrap();
    let h = &echo["headers"];
    assert!(
        h.get("x-nthpool-key").is_none(),
        "the pool key leaked upstream: {h}"
    );
    assert!(h.get("x-nthpool-priority").is_none());
    assert!(
        h.get("x-hop-secret").is_none(),
        "a header named in Connection crossed"
    );
    assert_eq!(
        h["authorization"], "Bearer sk-managed",
        "managed credential must override the caller's"
    );
    assert_eq!(h["x-api-version"], "2024-01");
    assert_eq!(h["x-custom"], "kept");
    assert_eq!(
        h["host"],
        up.addr.to_string(),
        "Host must be rewritten to the upstream's"
    );
    assert_eq!(h["x-forwarded-host"], "p.localhost");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-forwarded-for"], "10.9.9.9, 127.0.0.1");
    assert_eq!(echo["query"]["b"], "two");
}

#[tokio::test]
async fn pool_key_in_authorization_is_not_forwarded() {
    let auth = "[pools.auth]\naccept = [\"bearer\", \"nthbouncer\"]\n";
    let (_up, gw) = proxied_pool_with("", "", auth).await;
    // The header form is not accepted by this pool.
    let r = send(gw.get("p", "/echo")).await;
    assert_eq!(r.status(), 401);
    for scheme in ["Bearer", "Nthbouncer"] {
        let r = send(
            gw.pool("p", Method::GET, "/echo")
                .header("authorization", format!("{scheme} {KEY}")),
        )
        .await;
        assert_eq!(r.status(), 200, "{scheme}");
        let echo: serde_json::Value = r.json().await.unwrap();
        assert!(
            echo["headers"].get("authorization").is_none(),
            "pool auth leaked upstream"
        );
    }
}

#[tokio::test]
async fn upstream_base_path_is_prefixed() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &format!("{}/base/", up.url()), "")).await;
    let r = send(gw.get("p", "/x/y?z=1")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(up.seen()[0].path, "/base/x/y?z=1");
}

#[tokio::test]
async fn sse_stream_holds_its_slot_until_it_ends() {
    let (up, gw) = proxied_pool("limit = 1").await;
    let mut resp = send(gw.get("p", "/sse?n=3")).await;
    assert_eq!(resp.status(), 200);
    up.release(1);
    let first = resp.chunk().await.unwrap().unwrap();
    assert_eq!(&first[..], b"data: 0\n\n");
    // Mid-stream: the slot is still held.
    assert_eq!(gw.state("p").await["inFlight"], 1);
    assert_eq!(send(gw.no_queue("p", "/")).await.status(), 429);
    up.release(2);
    let mut rest = Vec::new();
    while let Some(c) = resp.chunk().await.unwrap() {
        rest.extend_from_slice(&c);
    }
    assert_eq!(
        String::from_utf8(rest).unwrap(),
        "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    );
    gw.wait_freed("p", "slot freed at stream end").await;
    assert_eq!(send(gw.no_queue("p", "/")).await.status(), 200);
}

#[tokio::test]
async fn a_client_killed_mid_request_frees_its_slot_when_the_upstream_answers() {
    let (up, gw) = proxied_pool("limit = 1").await;
    let req = gw.get("p", "/hold").header("x-seq", "doomed").send();
    let task = tokio::spawn(req);
    up.wait_arrivals(1).await;
    assert_eq!(gw.state("p").await["inFlight"], 1);
    task.abort();
    // The upstream is still working on the abandoned call, so it still counts: handing its
    // slot to the next caller now would put two calls on an upstream limited to one.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(up.in_flight(), 1);
    assert_eq!(send(gw.no_queue("p", "/")).await.status(), 429);
    // Its answer frees the slot, and the pool serves again.
    up.release(1);
    gw.wait_freed("p", "slot freed once the upstream answered")
        .await;
    assert_eq!(send(gw.no_queue("p", "/")).await.status(), 200);
    assert_eq!(up.max_in_flight(), 1);
}

#[tokio::test]
async fn a_client_killed_mid_request_to_a_hung_upstream_frees_its_slot_at_the_timeout() {
    let (up, gw) = proxied_pool("limit = 1\nrequest_timeout_ms = 300").await;
    let task = gw.hold("p", "doomed");
    up.wait_arrivals(1).await;
    task.abort();
    gw.wait_freed("p", "slot freed at the request timeout")
        .await;
    // The upstream call was cancelled with it.
    up.wait_in_flight(0, "upstream request cancelled").await;
    let r = send(gw.get("p", "/")).await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn a_client_killed_while_queued_leaves_the_queue() {
    let (up, gw) = proxied_pool("limit = 1").await;
    let held = gw.hold("p", "holder");
    up.wait_arrivals(1).await;
    let waiter = gw.hold("p", "waiter");
    gw.wait_queued("p", 1, "waiter parked").await;
    waiter.abort();
    gw.wait_queued("p", 0, "waiter gone").await;
    up.release(1);
    assert_eq!(held.await.unwrap().status(), 200);
    gw.wait_freed("p", "idle").await;
    // The vanished waiter never reached the upstream.
    assert_eq!(up.arrivals(), vec!["holder"]);
}

#[tokio::test]
async fn unknown_host_and_bad_keys() {
    let (up, gw) = proxied_pool("").await;
    let to_host = |host: &str| gw.client.get(format!("{}/", gw.base)).header("host", host);
    expect_error(send(to_host("nope.localhost")).await, 404, "pool_not_found").await;
    assert_eq!(send(to_host("elsewhere.example")).await.status(), 404);
    // Host matching ignores the port and case.
    let r = send(to_host("P.LocalHost:1234").header("x-nthpool-key", KEY)).await;
    assert_eq!(r.status(), 200);

    for bad in [
        None,
        Some("wrong-key-0123456789abc"),
        Some("nb_live_0000000000000000000000000000000000AAAAAA"),
        Some("x"),
    ] {
        let mut req = gw.pool("p", Method::GET, "/");
        if let Some(k) = bad {
            req = req.header("x-nthpool-key", k);
        }
        let (status, body) = call(req).await;
        assert_eq!(status, 401, "{bad:?}");
        assert_eq!(body["error"], "unauthorized");
    }
    assert!(
        up.seen().len() == 1,
        "refused requests must not reach the upstream"
    );
}

#[tokio::test]
async fn a_revoked_or_expired_key_is_refused() {
    let (_up, gw) = proxied_pool("").await;
    let create_key = |body: serde_json::Value| {
        let r = gw.api(Method::POST, "/admin/pools/p/keys").json(&body);
        async move { json_of(send(r).await).await }
    };
    let with_key = |key: &str| send(gw.pool("p", Method::GET, "/").header("x-nthpool-key", key));
    let created = create_key(serde_json::json!({"label": "ci"})).await;
    let key = created["key"].as_str().unwrap().to_string();
    assert!(key.starts_with("nb_live_"));
    assert_eq!(with_key(&key).await.status(), 200);
    let revoke = format!("/admin/pools/p/keys/{}", created["id"].as_str().unwrap());
    assert_eq!(gw.delete(&revoke).await.0, 200);
    assert_eq!(with_key(&key).await.status(), 401);
    // Revoking again: not found.
    assert_eq!(gw.delete(&revoke).await.0, 404);

    // A key that expires: valid now, and the index refuses it once past expiresAt.
    let soon = wall_ms() + 300;
    let created = create_key(serde_json::json!({"expiresAt": soon})).await;
    let key = created["key"].as_str().unwrap().to_string();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(with_key(&key).await.status(), 401);
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    let (_up, gw) = proxied_pool_with("max_body_bytes = 1024", "", "").await;
    // Declared too large: refused before admission.
    let post_body = || {
        gw.pool("p", Method::POST, "/body")
            .header("x-nthpool-key", KEY)
    };
    let r = send(post_body().body(vec![b'x'; 2048])).await;
    expect_error(r, 413, "payload_too_large").await;
    // Streamed (chunked, no length) and too large: cut off mid-stream.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..4).map(|_| Ok(vec![b'y'; 512])).collect();
    let body = reqwest::Body::wrap_stream(futures_util::stream::iter(chunks));
    let r = send(post_body().body(body)).await;
    assert_eq!(r.status(), 413);
    gw.wait_freed("p", "slot freed").await;
    // Within the limit: fine.
    let r = send(post_body().body(vec![b'x'; 1000])).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "1000");
}

#[tokio::test]
async fn request_bodies_stream_through_unbuffered() {
    let (up, gw) = proxied_pool("").await;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
    let body = reqwest::Body::wrap_stream(tokio_stream_from(rx));
    let req = gw
        .pool("p", Method::POST, "/body")
        .header("x-nthpool-key", KEY)
        .body(body)
        .send();
    let resp = tokio::spawn(req);
    tx.send(Ok(b"first".to_vec())).await.unwrap();
    // The upstream receives the first chunk while the caller has not sent the rest: nothing
    // waits for the whole body.
    until("first chunk upstream", async || {
        up.state.body_chunks.load(Ordering::SeqCst) >= 1
    })
    .await;
    tx.send(Ok(b"second".to_vec())).await.unwrap();
    drop(tx);
    let r = resp.await.unwrap().unwrap();
    assert_eq!(r.text().await.unwrap(), "11");
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Vec<u8>, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn unreachable_and_slow_upstreams() {
    // A port nobody listens on.
    let (_reserved, closed) = refused_port();
    let dead = format!("http://{closed}");
    let up = Upstream::start().await;
    let toml = format!(
        "{}{}",
        pool_toml("dead", &dead, ""),
        pool_toml("slow", &up.url(), "request_timeout_ms = 200")
    );
    let gw = gateway(&toml).await;
    expect_error(send(gw.get("dead", "/")).await, 502, "upstream_unreachable").await;
    assert_eq!(gw.state("dead").await["inFlight"], 0);

    let r = send(gw.get("slow", "/hold").header("x-seq", "h")).await;
    expect_error(r, 504, "upstream_timeout").await;
    gw.wait_freed("slow", "slot freed").await;
    up.release(1);
}

/// A body that streams past the request timeout is cut and its slot freed.
#[tokio::test]
async fn a_stream_past_the_request_timeout_is_cut() {
    let (up, gw) = proxied_pool("request_timeout_ms = 300").await;
    let mut resp = send(gw.get("p", "/sse?n=5")).await;
    up.release(1);
    assert!(resp.chunk().await.unwrap().is_some());
    // No more permits: the upstream stalls; the gateway cuts the body at the deadline.
    let mut ended = false;
    for _ in 0..100 {
        match resp.chunk().await {
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => {
                ended = true;
                break;
            }
        }
    }
    assert!(ended);
    gw.wait_freed("p", "slot freed").await;
    up.release(10);
}

async fn raw_exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).to_string()
}

/// CL+TE smuggling: a request with both headers must not let a second, hidden request reach
/// the upstream.
#[tokio::test]
async fn content_length_plus_transfer_encoding_cannot_smuggle() {
    let (up, gw) = proxied_pool("").await;
    let smuggled = format!(
        "POST /body HTTP/1.1\r\nHost: p.localhost\r\nX-Nthpool-Key: {KEY}\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: p.localhost\r\nX-Nthpool-Key: {KEY}\r\n\r\n"
    );
    let _ = raw_exchange(gw.running.addr, smuggled.as_bytes()).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        up.seen().iter().all(|s| !s.path.contains("smuggled")),
        "a smuggled request reached the upstream: {:?}",
        up.seen().iter().map(|s| &s.path).collect::<Vec<_>>()
    );
}

/// Slowloris: a client that never finishes its request head is cut off.
#[tokio::test]
async fn slow_request_heads_are_cut_off() {
    let (up, gw) = proxied_pool_with("header_read_timeout_ms = 300", "", "").await;
    let mut s = tokio::net::TcpStream::connect(gw.running.addr)
        .await
        .unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: p.localhost\r\nX-Partial: ")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the server kept a slow head open");
    assert!(up.seen().is_empty());
}

/// Pooled upstream connections are closed by our idle timer before the upstream's own
/// keep-alive timeout can bite: after an idle spell, a new connection is used.
#[tokio::test]
async fn idle_upstream_connections_are_retired() {
    let (up, gw) = proxied_pool_with("upstream_idle_timeout_ms = 100", "", "").await;
    assert_eq!(send(gw.get("p", "/")).await.status(), 200);
    assert_eq!(send(gw.get("p", "/")).await.status(), 200);
    assert_eq!(
        up.state.connections.load(Ordering::SeqCst),
        1,
        "keep-alive reuses the connection"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(send(gw.get("p", "/")).await.status(), 200);
    assert_eq!(
        up.state.connections.load(Ordering::SeqCst),
        2,
        "the idle connection was not retired"
    );
}

/// 20 concurrent callers through `limit = 2`: the upstream never sees more than 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_never_exceed_the_limit() {
    let (up, gw) = proxied_pool("limit = 2").await;
    let tasks: Vec<_> = (0..40)
        .map(|_| spawn_send(gw.get("p", "/sleep?ms=5")))
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().status(), 200);
    }
    assert!(up.max_in_flight() <= 2);
    assert_eq!(gw.state("p").await["inFlight"], 0);
}

/// A client that reads the head of a large streamed answer and then stops reading: hyper stops
/// polling the body, and before, the upstream stream stayed open past the request deadline while
/// the gate reclaimed the slot (the origin served two at once at limit 1). Now the deadline ends
/// the exchange whether or not anyone polls the body: the upstream stream is cut and the slot
/// freed, while the stalled client still holds its socket unread.
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_at_the_deadline() {
    let (up, gw) = proxied_pool("limit = 1\nrequest_timeout_ms = 500").await;
    let mut stalled = tokio::net::TcpStream::connect(gw.running.addr)
        .await
        .unwrap();
    let head =
        format!("GET /flood?mb=64 HTTP/1.1\r\nHost: p.localhost\r\nx-nthpool-key: {KEY}\r\n\r\n");
    stalled.write_all(head.as_bytes()).await.unwrap();
    let mut first = [0u8; 1024];
    let n = stalled.read(&mut first).await.unwrap();
    assert!(first[..n].starts_with(b"HTTP/1.1 200"), "the head arrived");
    // From here on nothing is read: the socket buffers fill and the body is no longer polled.
    up.wait_in_flight(0, "the upstream stream is cut at the deadline")
        .await;
    gw.wait_freed("p", "the slot is freed").await;
    let r = send(gw.get("p", "/")).await;
    assert_eq!(r.status(), 200);
    drop(stalled);
}

/// An origin that never answers: at the deadline the caller gets 504 and the call is cut, and
/// the slot goes to the next caller only once the cut call's connection is closed. Before, the
/// slot was freed as the call was dropped, while hyper closed the connection a moment later on
/// its own task. On loopback the waiter's way to the origin (gate, task, pooled connection) has
/// always been longer than that close, so this did not fail before the fix either: it holds the
/// guarantee in place, which the soak's streamed variant did catch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_call_frees_its_slot_only_once_its_connection_is_closed() {
    let (up, gw) = proxied_pool("limit = 1\nrequest_timeout_ms = 300").await;
    for round in 0..5 {
        let hung = spawn_send(gw.get("p", "/hang"));
        until("the hung call reached the origin", async || {
            up.in_flight() >= 1
        })
        .await;
        let next = spawn_send(gw.get("p", "/sleep?ms=5"));
        assert_eq!(hung.await.unwrap().status(), 504, "round {round}");
        assert_eq!(next.await.unwrap().status(), 200, "round {round}");
        assert!(
            up.max_in_flight() <= 1,
            "round {round}: the origin had {} open calls at once",
            up.max_in_flight()
        );
    }
    gw.wait_freed("p", "the slot is freed").await;
}
