//! HMAC nonces across a restart, against the real binary (SPEC §9: "Seen nonces survive a
//! restart"): a signed request captured by an attacker cannot be replayed after the gateway
//! restarts, however it stopped, while its signature window is still open.

use nthbouncer_testkit::access::{nonce, sign};
use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{pool_toml, wall_ms, Upstream};

use crate::BIN;

const SECRET: &str = "restart-signing-secret-0123456789";

/// A signed GET of `/echo` on pool `p` with `nonce` at `ts` (unix seconds): its status.
async fn signed(server: &Server, ts: u64, nonce: &str) -> u16 {
    let signature = sign(
        SECRET,
        "GET",
        "p.localhost",
        "/echo",
        &ts.to_string(),
        nonce,
        b"",
    );
    server
        .pool_get("p", "/echo")
        .header("x-nthpool-timestamp", ts.to_string())
        .header("x-nthpool-nonce", nonce)
        .header("x-nthpool-signature", format!("v1={signature}"))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_request_cannot_be_replayed_after_a_restart() {
    let up = Upstream::start().await;
    let rest = format!(
        "{}[pools.access.hmac]\nsecrets = [\"{SECRET}\"]\nwindow_s = 3600\n",
        pool_toml("p", &up.url(), "")
    );
    let mut server = Server::start(BIN, "warn", reqwest::Client::new(), &rest).await;
    // The window is an hour: the whole test runs well within it.
    let ts = wall_ms() / 1000;
    let captured = nonce();
    assert_eq!(signed(&server, ts, &captured).await, 200);
    assert_eq!(
        signed(&server, ts, &captured).await,
        401,
        "replay before the restart"
    );
    assert_eq!(up.total(), 1);

    // The harshest stop: the process dies at once.
    server.kill_9();
    server.restart().await;
    assert_eq!(
        signed(&server, ts, &captured).await,
        401,
        "the captured request replayed after a restart"
    );
    assert_eq!(
        signed(&server, ts, &nonce()).await,
        200,
        "a fresh nonce works"
    );
    assert_eq!(up.total(), 2, "the replay never reached the upstream");

    // A nonce recorded after one restart survives the next, as do those from before.
    let second = nonce();
    assert_eq!(signed(&server, ts, &second).await, 200);
    server.kill_9();
    server.restart().await;
    assert_eq!(signed(&server, ts, &second).await, 401);
    assert_eq!(signed(&server, ts, &captured).await, 401);
    assert_eq!(up.total(), 3);
}
