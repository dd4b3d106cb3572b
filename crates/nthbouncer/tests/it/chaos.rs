//! Chaos, bounded in time, against the real binary: a flood of 5,000 concurrent requests at
//! `limit = 8`, clients that vanish mid-queue and mid-request, upstreams that hang or reset.
//! The upstream must never see more than the limit, every request must get an answer from the
//! contract (2xx/429/502/504), and afterwards nothing is left in flight or queued.

use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{pool_toml, send, spawn_send, unpooled_client, Upstream};

use crate::BIN;

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

/// `serve` with `pools`, talked to without keeping idle connections.
async fn start(pools: &str) -> Server {
    Server::start(BIN, "error", unpooled_client(), pools).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_5000_at_limit_8() {
    let up = Upstream::start().await;
    let server = start(&pool_toml(
        "flood",
        &up.url(),
        "limit = 8\nqueue_size = 10000\nqueue_timeout_ms = 60000",
    ))
    .await;
    let tasks: Vec<_> = (0..5000)
        .map(|_| spawn_send(server.pool_get("flood", "/sleep?ms=2")))
        .collect();
    let mut ok = 0;
    for t in tasks {
        let status = t.await.unwrap().status().as_u16();
        assert!(
            matches!(status, 200..=299 | 429 | 502 | 504),
            "status {status} is not in the contract"
        );
        if status == 200 {
            ok += 1;
        }
    }
    assert!(
        up.max_in_flight() <= 8,
        "the upstream saw {} at once",
        up.max_in_flight()
    );
    assert_eq!(
        up.total(),
        ok,
        "every 200 reached the upstream exactly once"
    );
    server.wait_idle("flood").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanishing_clients_leak_nothing() {
    let up = Upstream::start().await;
    let server = start(&pool_toml("v", &up.url(), "limit = 4\nqueue_size = 10000")).await;
    // Half give up while queued or in flight (client-side timeouts), half wait.
    let mut tasks = Vec::new();
    for i in 0..400 {
        let mut req = server.pool_get("v", "/sleep?ms=20");
        if i % 2 == 0 {
            req = req.timeout(Duration::from_millis(30 + (i % 7) as u64 * 10));
        }
        tasks.push(tokio::spawn(async move {
            req.send().await.ok().map(|r| r.status().as_u16())
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
        up.max_in_flight() <= 4,
        "the upstream saw {} at once",
        up.max_in_flight()
    );
    server.wait_idle("v").await;
    // The pool still serves at full width afterwards.
    assert_eq!(
        send(server.pool_get("v", "/sleep?ms=1")).await.status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_and_resetting_upstreams_free_their_slots() {
    let up = Upstream::start().await;
    let reset = resetting_upstream().await;
    let pools = format!(
        "{}{}",
        pool_toml("hang", &up.url(), "limit = 2\nrequest_timeout_ms = 300"),
        pool_toml("reset", &format!("http://127.0.0.1:{reset}"), "limit = 2")
    );
    let server = start(&pools).await;
    let mut tasks = Vec::new();
    for _ in 0..6 {
        tasks.push(spawn_send(server.pool_get("hang", "/hang")));
        tasks.push(spawn_send(server.pool_get("reset", "/")));
    }
    let mut statuses: Vec<u16> = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap().status().as_u16());
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
