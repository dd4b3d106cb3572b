//! Certificates rotated by SIGHUP on the real binary (SPEC §12): a proxied request still in
//! flight and a lock held on connections opened before the rotation both finish normally, and
//! new connections get the new certificate.

use std::time::Duration;

use http::Method;
use nthbouncer_testkit::binary::{free_port, server_toml, spawn, write_config};
use nthbouncer_testkit::tls::{client, get, send, write_leaf, Alpn, Ca};
use nthbouncer_testkit::{eventually, pool_toml, Upstream, ADMIN_TOKEN};

use crate::BIN;

#[tokio::test]
async fn sighup_rotates_certificates_without_dropping_a_stream_or_a_lock() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (old_ca, new_ca) = (Ca::new("old root"), Ca::new("new root"));
    let names = ["p.localhost", "api.localhost"];
    let (cert, key) = write_leaf(dir.path(), "server", &old_ca.server(&names));
    let port = free_port();
    let config = write_config(
        dir.path(),
        &format!(
            "{}admin_token = \"{ADMIN_TOKEN}\"\n[server.tls]\ncert_file = \"{cert}\"\nkey_file = \"{key}\"\n{}",
            server_toml(port, dir.path()),
            pool_toml("p", &up.url(), "limit = 4"),
        ),
    );
    let proc = spawn(
        BIN,
        &["serve", "--config", config.to_str().unwrap()],
        Some("warn"),
    );
    let old = client(&[&old_ca.pem()], None, Alpn::H2, None);
    let mut ready = false;
    for _ in 0..400 {
        if matches!(
            get(&old, "api.localhost", port, "/healthz").await,
            Ok((200, _, _))
        ) {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(ready, "the server did not come up over TLS");

    // A request held by the origin, and a lock, both on connections opened before the swap.
    let held = {
        let old = old.clone();
        tokio::spawn(async move { get(&old, "p.localhost", port, "/hold").await })
    };
    let (status, _, body) = send(
        &old,
        Method::POST,
        "api.localhost",
        port,
        "/pools/p/lock/acquire",
        "{}",
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let slot: serde_json::Value = serde_json::from_str(&body).unwrap();
    let slot = slot["slotId"].as_str().unwrap().to_string();
    eventually("the held request at the origin", async || {
        (up.in_flight() == 1).then_some(())
    })
    .await;

    write_leaf(dir.path(), "server", &new_ca.server(&names));
    let pid = proc.0.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());

    // New connections get the new certificate (once the signal is handled).
    let mut rotated = false;
    for _ in 0..400 {
        let fresh = client(&[&new_ca.pem()], None, Alpn::Http1, None);
        if matches!(
            get(&fresh, "api.localhost", port, "/healthz").await,
            Ok((200, _, _))
        ) {
            rotated = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(rotated, "new connections never got the new certificate");
    let fresh_old = client(&[&old_ca.pem()], None, Alpn::Http1, None);
    assert!(get(&fresh_old, "api.localhost", port, "/healthz")
        .await
        .is_err());

    // The open connection goes on: the lock is renewed and released, the held request ends.
    let renew = format!("/pools/p/lock/{slot}/renew");
    let (status, _, body) = send(&old, Method::POST, "api.localhost", port, &renew, "")
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    up.release(1);
    let (status, _, _) = held.await.unwrap().unwrap();
    assert_eq!(status, 200);
    let release = format!("/pools/p/lock/{slot}/release");
    let (status, _, body) = send(
        &old,
        Method::POST,
        "api.localhost",
        port,
        &release,
        "{\"status\":200}",
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"released\":true"), "{body}");
}
