//! A pool's own listener (`[[pools]] listen`, SPEC §1): everything arriving there is that pool's
//! host whatever its `Host` header, so clients that cannot set `Host` (SDKs, Node's `fetch`)
//! reach a pool with a plain base URL. Set in the config file or through the admin API.

use nthbouncer_testkit::{gateway, pool_toml, send, Upstream, KEY};
use serde_json::json;

/// A plain request to `addr`: its `Host` is that address, as any SDK would send it.
fn plain(addr: std::net::SocketAddr, path: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new().get(format!("http://{addr}{path}"))
}

#[tokio::test]
async fn a_config_pool_is_served_on_its_own_listener_whatever_the_host() {
    let up = Upstream::start().await;
    let toml = pool_toml("p", &up.url(), "limit = 2").replace(
        "[pools.concurrency]",
        "listen = \"127.0.0.1:0\"\n[pools.concurrency]",
    );
    let gw = gateway(&toml).await;
    let addr = gw
        .running
        .state
        .pools
        .listeners
        .addr("p")
        .expect("p listens");

    let r = send(plain(addr, "/v1/echo-me").header("x-nthpool-key", KEY)).await;
    assert_eq!(r.status(), 200);
    // The pool key is still required.
    let r = plain(addr, "/v1/echo-me").send().await.unwrap();
    assert_eq!(r.status(), 401);
    // Paths that look like the API host's are the pool's too, and so is the API host's name.
    let r = send(
        plain(addr, "/admin/pools")
            .header("host", "api.localhost")
            .header("x-nthpool-key", KEY),
    )
    .await;
    assert_eq!(r.status(), 200);
    let paths: Vec<String> = up.seen().iter().map(|s| s.path.clone()).collect();
    assert_eq!(paths, ["/v1/echo-me", "/admin/pools"]);
    // The main listener still routes by host.
    assert_eq!(send(gw.get("p", "/x")).await.status(), 200);
}

#[tokio::test]
async fn the_admin_api_gives_moves_and_takes_a_pool_listener() {
    let up = Upstream::start().await;
    let gw = gateway("").await;
    let body = json!({
        "name": "a", "upstream": up.url(), "keys": [KEY], "listen": "127.0.0.1:0",
    });
    let (status, created) = gw
        .admin(reqwest::Method::POST, "/admin/pools", Some(body))
        .await;
    assert_eq!(status, 201, "{created}");
    let first = gw
        .running
        .state
        .pools
        .listeners
        .addr("a")
        .expect("a listens");
    let ok = |addr| async move {
        plain(addr, "/")
            .header("x-nthpool-key", KEY)
            .send()
            .await
            .map(|r| r.status().as_u16())
    };
    assert_eq!(ok(first).await.unwrap(), 200);

    // The pool shows where it listens; a PUT that keeps the address keeps the listener.
    let (_, got) = gw.admin(reqwest::Method::GET, "/admin/pools/a", None).await;
    assert_eq!(got["listen"], "127.0.0.1:0", "{got}");
    let mut spec =
        json!({"name": "a", "upstream": up.url(), "keys": [KEY], "listen": "127.0.0.1:0"});
    let (status, v) = gw
        .admin(reqwest::Method::PUT, "/admin/pools/a", Some(spec.clone()))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(gw.running.state.pools.listeners.addr("a"), Some(first));

    // Another address: the new one serves, the old one is closed.
    let elsewhere = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let second = elsewhere.local_addr().unwrap();
    drop(elsewhere);
    spec["listen"] = json!(second.to_string());
    let (status, v) = gw
        .admin(reqwest::Method::PUT, "/admin/pools/a", Some(spec.clone()))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(ok(second).await.unwrap(), 200);
    nthbouncer_testkit::eventually("the old listener closes", async || {
        ok(first).await.is_err().then_some(())
    })
    .await;

    // An address taken (here: the main listener's) is refused, naming the field; nothing changes.
    let mut clash = spec.clone();
    clash["listen"] = json!(gw.running.addr.to_string());
    let (status, v) = gw
        .admin(reqwest::Method::PUT, "/admin/pools/a", Some(clash))
        .await;
    assert_eq!(
        (status, v["error"].as_str(), v["field"].as_str()),
        (400, Some("invalid"), Some("listen")),
        "{v}"
    );
    assert_eq!(ok(second).await.unwrap(), 200);
    let mut bad = spec.clone();
    bad["listen"] = json!("nowhere");
    let (status, v) = gw
        .admin(reqwest::Method::PUT, "/admin/pools/a", Some(bad))
        .await;
    assert_eq!((status, v["field"].as_str()), (400, Some("listen")), "{v}");

    // Deleting the pool closes its listener.
    assert_eq!(gw.delete("/admin/pools/a").await.0, 204);
    nthbouncer_testkit::eventually("the listener closes with its pool", async || {
        ok(second).await.is_err().then_some(())
    })
    .await;
    assert_eq!(up.total(), 3);
}
