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

/// A reload refused after its certificate files were read changes nothing, the certificates
/// included: they are served only once the whole file applied (issue #21). Here a new pool's
/// own listener cannot bind, which only the reload's last step finds.
#[tokio::test]
async fn a_refused_reload_leaves_the_certificates_as_they_were() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (old_ca, new_ca) = (Ca::new("old root"), Ca::new("new root"));
    let names = ["p.localhost", "api.localhost"];
    let (cert, key) = write_leaf(dir.path(), "server", &old_ca.server(&names));
    let port = free_port();
    let head = format!(
        "{}admin_token = \"{ADMIN_TOKEN}\"\n[server.tls]\ncert_file = \"{cert}\"\nkey_file = \"{key}\"\n",
        server_toml(port, dir.path()),
    );
    let pool = pool_toml("p", &up.url(), "limit = 4");
    let config = write_config(dir.path(), &format!("{head}{pool}"));
    let proc = spawn(
        BIN,
        &["serve", "--config", config.to_str().unwrap()],
        Some("warn"),
    );
    let serves = async |roots: &[&str]| {
        let fresh = client(roots, None, Alpn::Http1, None);
        matches!(
            get(&fresh, "api.localhost", port, "/healthz").await,
            Ok((200, _, _))
        )
    };
    let (old_pem, new_pem) = (old_ca.pem(), new_ca.pem());
    eventually("the server up over TLS", async || {
        serves(&[&old_pem]).await.then_some(())
    })
    .await;
    let either = client(&[&old_pem, &new_pem], None, Alpn::Http1, None);
    let reloads = async |result: &str| -> Option<f64> {
        let (_, _, text) = get(&either, "api.localhost", port, "/metrics").await.ok()?;
        let name = format!("nthbouncer_config_reloads_total{{result=\"{result}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&name)?.trim().parse().ok())
    };
    let hup = || {
        let pid = proc.0.id().to_string();
        let sent = std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap();
        assert!(sent.success());
    };

    // New certificates on disk, and a pool whose own address is taken.
    write_leaf(dir.path(), "server", &new_ca.server(&names));
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = format!("listen = \"{}\"\nkeys = ", busy.local_addr().unwrap());
    let bad = pool_toml("q", &up.url(), "limit = 1").replacen("keys = ", &taken, 1);
    write_config(dir.path(), &format!("{head}{pool}{bad}"));
    hup();
    eventually("the reload refused", async || {
        reloads("refused").await.map(drop)
    })
    .await;
    assert!(
        serves(&[&old_pem]).await,
        "a refused reload changed the certificate"
    );
    assert!(!serves(&[&new_pem]).await);

    // The same certificates with a file that applies: served from then on.
    write_config(dir.path(), &format!("{head}{pool}"));
    hup();
    eventually("the reload applied", async || {
        reloads("applied").await.map(drop)
    })
    .await;
    assert!(
        serves(&[&new_pem]).await,
        "an applied reload kept the old certificate"
    );
    assert!(!serves(&[&old_pem]).await);
}
