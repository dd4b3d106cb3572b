//! Configuration reload against the real binary (SPEC §12 Reload, issue #21): the config file
//! is rewritten and reloaded through `POST /admin/reload` or SIGHUP while calls, streams and
//! leases are in flight. Counts and ordering only; every wait is bounded.

use std::sync::atomic::Ordering;
use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{lock_pool_toml, pool_toml, wait_until, Upstream};
use reqwest::Method;
use serde_json::{json, Value};

use crate::BIN;

/// The pool's governor state as the admin API shows it.
async fn state(server: &Server, pool: &str) -> Value {
    server
        .admin_json(&format!("/admin/pools/{pool}/state"))
        .await
}

/// Waits (bounded) until `pool`'s state satisfies `ok`.
async fn wait_state(server: &Server, pool: &str, what: &str, ok: impl Fn(&Value) -> bool) {
    let mut last = Value::Null;
    let reached = wait_until(1000, Duration::from_millis(20), async || {
        last = state(server, pool).await;
        ok(&last)
    })
    .await;
    assert!(reached, "{pool}: never {what}: {last}");
}

/// Waits (bounded) until the upstream has `n` requests in flight.
async fn wait_upstream_in_flight(up: &Upstream, n: i64) {
    let reached = wait_until(1000, Duration::from_millis(20), async || {
        up.in_flight() == n
    })
    .await;
    assert!(
        reached,
        "the upstream never had {n} in flight: {}",
        up.in_flight()
    );
}

/// The value of the unlabelled metric `name` in `/metrics`.
async fn metric(server: &Server, name: &str) -> Option<f64> {
    let text = server.metrics_text().await;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A lower limit applies to the next admission: the calls admitted above it finish, nobody new
/// reaches the origin until the count is under it, and from then on the origin never sees more
/// than the new limit. No call fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_limit_drains_to_the_new_limit_without_dropping_a_call() {
    let up = Upstream::start().await;
    let pool = |limit: u32| {
        pool_toml(
            "p",
            &up.url(),
            &format!("limit = {limit}\nqueue_size = 100\nqueue_timeout_ms = 120000"),
        )
    };
    let server = Server::start(BIN, "warn", reqwest::Client::new(), &pool(4)).await;
    let calls: Vec<_> = (0..10)
        .map(|_| {
            let req = server.pool_get("p", "/hold");
            tokio::spawn(async move {
                let r = req.send().await.unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            })
        })
        .collect();
    wait_upstream_in_flight(&up, 4).await;
    wait_state(&server, "p", "4 in flight and 6 queued", |s| {
        s["inFlight"] == 4 && s["queued"] == 6
    })
    .await;

    server.rewrite_config(&pool(2));
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["pools"]["changed"], json!(["p"]), "{body}");
    // Held slots and waiters are the same ones: nothing was evicted or refused.
    let s = state(&server, "p").await;
    assert_eq!(
        (&s["inFlight"], &s["queued"]),
        (&json!(4), &json!(6)),
        "{s}"
    );
    assert_eq!(s["configuredLimit"], 2, "{s}");

    // Two calls end: the pool is at the new limit, and nobody new was admitted on the way.
    up.release(2);
    wait_state(&server, "p", "down to the new limit", |s| {
        s["inFlight"] == 2
    })
    .await;
    wait_upstream_in_flight(&up, 2).await;
    assert_eq!(up.total(), 4, "a call was admitted above the new limit");
    // From now on the origin never sees more than 2 at once.
    up.state.max_in_flight.store(0, Ordering::SeqCst);
    up.release(8);
    for call in calls {
        let (status, body) = call.await.unwrap();
        assert_eq!((status, body.as_str()), (200, "released"));
    }
    assert_eq!(up.total(), 10);
    assert!(
        up.max_in_flight() <= 2,
        "the origin saw {} at once after the reload",
        up.max_in_flight()
    );
}

/// One reload adds a pool, changes one and removes one; a stream open on the removed pool
/// finishes whole while new calls to it answer `404 pool_not_found`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_adds_changes_and_removes_pools_and_open_streams_finish() {
    let up = Upstream::start().await;
    let a = |limit: u32| pool_toml("a", &up.url(), &format!("limit = {limit}"));
    let b = pool_toml("b", &up.url(), "limit = 2");
    let c = pool_toml("c", &up.url(), "limit = 3");
    let server = Server::start(BIN, "warn", reqwest::Client::new(), &(a(2) + &b)).await;
    assert_eq!(
        server.pool_get("c", "/echo").send().await.unwrap().status(),
        404
    );
    let stream = {
        let req = server.pool_get("b", "/sse?n=3");
        tokio::spawn(async move {
            let r = req.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        })
    };
    wait_upstream_in_flight(&up, 1).await;

    server.rewrite_config(&(a(5) + &c));
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["pools"]["added"], json!(["c"]), "{body}");
    assert_eq!(body["pools"]["changed"], json!(["a"]), "{body}");
    assert_eq!(body["pools"]["removed"], json!(["b"]), "{body}");

    // The removed pool takes no new call; its open stream runs to its end.
    let r = server.pool_get("b", "/echo").send().await.unwrap();
    assert_eq!(r.status(), 404);
    let refused: Value = r.json().await.unwrap();
    assert_eq!(refused["error"], "pool_not_found", "{refused}");
    up.release(3);
    let (status, text) = stream.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        text, "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n",
        "the stream on the removed pool was cut"
    );

    // The added pool serves; the changed one has its new limit.
    let r = server.pool_get("c", "/echo").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(state(&server, "a").await["configuredLimit"], 5);
    assert_eq!(state(&server, "c").await["configuredLimit"], 3);
    let listed = server.admin_json("/admin/pools").await;
    let mut names: Vec<_> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["a", "c"]);
}

/// A file with a broken rule changes nothing: `400 invalid` naming the key, the pools as they
/// were, and `/metrics` records the failed reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_file_changes_nothing_and_names_the_key() {
    let up = Upstream::start().await;
    let good = pool_toml("p", &up.url(), "limit = 3");
    let server = Server::start(BIN, "warn", reqwest::Client::new(), &good).await;

    // A good reload first: the metrics show it.
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["pools"]["unchanged"], json!(["p"]), "{body}");
    assert_eq!(
        metric(&server, "nthbouncer_config_reload_last_success").await,
        Some(1.0)
    );

    // A second pool with a broken limit, and the first one changed: neither applies.
    let bad = pool_toml("p", &up.url(), "limit = 7") + &pool_toml("q", &up.url(), "limit = 0");
    server.rewrite_config(&bad);
    let (status, body) = server.reload().await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"], "invalid", "{body}");
    assert_eq!(body["field"], "pools[1].concurrency.limit", "{body}");
    assert_eq!(state(&server, "p").await["configuredLimit"], 3);
    assert_eq!(
        server.pool_get("q", "/echo").send().await.unwrap().status(),
        404
    );
    assert_eq!(
        metric(&server, "nthbouncer_config_reload_last_success").await,
        Some(0.0)
    );
    assert!(
        metric(&server, "nthbouncer_config_reload_last_timestamp_seconds")
            .await
            .is_some_and(|t| t > 0.0)
    );

    // A file that is not TOML at all: refused the same way.
    server.rewrite_config("[[pools]\nname = ");
    let (status, body) = server.reload().await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(state(&server, "p").await["configuredLimit"], 3);
    // Without the admin token: 401, and nothing is read.
    let r = server
        .client
        .post(server.url("/admin/reload"))
        .header("host", "api.localhost")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}

/// Asks for a reload and checks it is refused as needing a restart, naming `field`.
async fn refused_for_a_restart(server: &Server, field: &str) {
    let (status, body) = server.reload().await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], field, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("needs a restart")),
        "{body}"
    );
}

/// `listen` (the server's or a pool's own) and `coordination` need a restart: a reload that
/// changes one is refused with that reason and changes nothing else in the file either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_listen_is_refused() {
    let up = Upstream::start().await;
    let pool = |limit: u32| pool_toml("p", &up.url(), &format!("limit = {limit}"));
    let server = Server::start(BIN, "warn", reqwest::Client::new(), &pool(3)).await;
    let other = nthbouncer_testkit::binary::free_port();
    server.rewrite_config_listening(&format!("127.0.0.1:{other}"), &pool(5));
    refused_for_a_restart(&server, "server.listen").await;
    assert_eq!(state(&server, "p").await["configuredLimit"], 3);

    // A pool's own listener likewise.
    let own = format!("listen = \"127.0.0.1:{other}\"\n");
    let with_own = pool(5).replacen("keys = ", &format!("{own}keys = "), 1);
    server.rewrite_config(&with_own);
    refused_for_a_restart(&server, "pools[0].listen").await;
    assert_eq!(state(&server, "p").await["configuredLimit"], 3);

    // The coordination owns the pools' shared state: the same refusal, and nothing else of
    // the file (a live key beside it) applies either.
    let redis = "coordination = \"redis://127.0.0.1:6379/0\"\nmax_body_bytes = 1\n";
    server.rewrite_config(&format!("{redis}{}", pool(5)));
    refused_for_a_restart(&server, "server.coordination").await;
    assert_eq!(state(&server, "p").await["configuredLimit"], 3);
    let r = server
        .pool("p", Method::POST, "/echo")
        .body("xy")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "max_body_bytes changed with a refused reload"
    );
}

/// SIGHUP reloads like the route. A lease held across it renews, and what the pool learned (a
/// throttle reported on release) is still there after its settings changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_and_leases_and_learned_limits_survive() {
    let pool = |queue: u32| {
        lock_pool_toml(
            "p",
            &format!("limit = 4\nqueue_size = {queue}\nlease_term_ms = 60000"),
        )
    };
    let server = Server::start(BIN, "warn", reqwest::Client::new(), &pool(10)).await;
    let lock = async |path: &str, body: Value| -> (u16, Value) {
        nthbouncer_testkit::call(
            server
                .api(Method::POST, &format!("/pools/p/lock/{path}"))
                .json(&body),
        )
        .await
    };
    let (status, held) = lock("acquire", json!({})).await;
    assert_eq!(status, 200, "{held}");
    let held = held["slotId"].as_str().unwrap().to_string();
    // Another holder reports a throttle: the pool learns a lower limit.
    let (status, taught) = lock("acquire", json!({})).await;
    assert_eq!(status, 200, "{taught}");
    let taught = taught["slotId"].as_str().unwrap().to_string();
    let report = json!({"status": 429, "throttled": 1});
    let (status, _) = lock(&format!("{taught}/release"), report).await;
    assert_eq!(status, 200);
    let before = state(&server, "p").await;
    let learned = before["learnedLimit"].as_u64();
    assert!(learned.is_some_and(|l| l < 4), "nothing learned: {before}");

    server.rewrite_config(&pool(20));
    server.sighup();
    let reloaded = wait_until(1000, Duration::from_millis(20), async || {
        metric(
            &server,
            "nthbouncer_config_reloads_total{result=\"applied\"}",
        )
        .await
        .is_some()
    })
    .await;
    assert!(reloaded, "SIGHUP did not reload");
    assert_eq!(
        metric(&server, "nthbouncer_config_reload_last_success").await,
        Some(1.0)
    );
    let got = server.admin_json("/admin/pools/p").await;
    assert_eq!(got["concurrency"]["queue_size"], 20, "{got}");

    let after = state(&server, "p").await;
    assert_eq!(
        after["inFlight"], 1,
        "the held lease is still counted: {after}"
    );
    assert!(
        after["learnedLimit"].as_u64().is_some_and(|l| l < 4),
        "the learned limit was forgotten: {after}"
    );
    let (status, renewed) = lock(&format!("{held}/renew"), json!({})).await;
    assert_eq!(status, 200, "{renewed}");
    let (status, released) = lock(&format!("{held}/release"), json!({})).await;
    assert_eq!((status, &released["released"]), (200, &json!(true)));
}

/// The `[server]` settings that own no socket apply to the next request: a new admin token
/// (the old one is refused at once) and a lower body bound; a live key (`idle_timeout_ms`) is
/// not pending. A change of the Redis coordination's settings, read only when it is opened,
/// is accepted and listed as pending a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_settings_apply_to_the_next_request() {
    let up = Upstream::start().await;
    let pool = pool_toml("p", &up.url(), "limit = 2");
    let server = Server::start(BIN, "warn", reqwest::Client::new(), &pool).await;
    let post_echo = |bytes: usize| {
        server
            .pool("p", Method::POST, "/echo")
            .body(vec![b'x'; bytes])
    };
    assert_eq!(post_echo(4096).send().await.unwrap().status(), 200);

    let token = "a-new-admin-token-0123456789";
    let rest = format!(
        "max_body_bytes = 1024\nidle_timeout_ms = 30000\ncoordination_prefix = \"other\"\n{pool}"
    );
    server.rewrite_config_with_token(token, &rest);
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["restartPending"],
        json!(["server.coordination_prefix"]),
        "{body}"
    );
    let admin = |token: &str| {
        server
            .client
            .get(server.url("/admin/pools"))
            .header("host", "api.localhost")
            .bearer_auth(token)
    };
    let old = admin(nthbouncer_testkit::ADMIN_TOKEN).send().await.unwrap();
    assert_eq!(old.status(), 401, "the old admin token still works");
    assert_eq!(admin(token).send().await.unwrap().status(), 200);
    let r = post_echo(4096).send().await.unwrap();
    assert_eq!(r.status(), 413, "the lower body bound did not apply");
    assert_eq!(post_echo(512).send().await.unwrap().status(), 200);
}

/// A pool's keys change live: a key the file no longer lists is refused at its next call, a
/// new one is taken, and neither needs a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_removed_from_the_file_is_refused_at_the_next_call() {
    use nthbouncer_testkit::{KEY, KEY2};
    let up = Upstream::start().await;
    let server = Server::start(
        BIN,
        "warn",
        reqwest::Client::new(),
        &pool_toml("p", &up.url(), "limit = 2"),
    )
    .await;
    let with_key = |key: &str| {
        server
            .client
            .get(server.url("/echo"))
            .header("host", "p.localhost")
            .header("x-nthpool-key", key)
    };
    assert_eq!(with_key(KEY2).send().await.unwrap().status(), 200);
    let only_first = pool_toml("p", &up.url(), "limit = 2").replace(&format!(", \"{KEY2}\""), "");
    assert!(!only_first.contains(KEY2), "{only_first}");
    server.rewrite_config(&only_first);
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(with_key(KEY2).send().await.unwrap().status(), 401);
    assert_eq!(with_key(KEY).send().await.unwrap().status(), 200);
}

/// A pool's webhooks follow the file: a reload that swaps a destination's URL leaves exactly
/// the new one, and one that drops them all leaves none (async falls back to sync).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_destinations_follow_the_file() {
    use nthbouncer_testkit::webhook_toml;
    let up = Upstream::start().await;
    let pool = |hooks: &[&str]| {
        let mut t = pool_toml("p", &up.url(), "limit = 2") + "[pools.async]\nenabled = true\n";
        for h in hooks {
            t += &webhook_toml(h);
        }
        t
    };
    let first = "http://127.0.0.1:9/first";
    let second = "http://127.0.0.1:9/second";
    let server = Server::start(BIN, "warn", reqwest::Client::new(), &pool(&[first])).await;
    let urls = async || -> Vec<String> {
        let list = server.admin_json("/admin/pools/p/webhooks").await;
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["url"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(urls().await, [first]);
    server.rewrite_config(&pool(&[second]));
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(urls().await, [second]);
    server.rewrite_config(&pool(&[]));
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert!(urls().await.is_empty());
}

/// `POST /admin/reload` on the API host named `host`.
async fn reload_at(server: &Server, host: &str) -> (u16, Value) {
    let r = server
        .client
        .post(server.url("/admin/reload"))
        .header("host", host)
        .bearer_auth(nthbouncer_testkit::ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// `api_host`, `pool_domain` and `public_url` apply to the next request: the API and the pool
/// answer on the new names only, and the next job's `pollUrl` is built on the new base (the
/// API host's, then the public URL once one is set). A new API host that an admin-API pool
/// already answers to is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_names_and_public_url_apply_to_the_next_request() {
    use nthbouncer_testkit::{webhook_toml, KEY};
    let up = Upstream::start().await;
    let pool = pool_toml("p", &up.url(), "limit = 4")
        + "[pools.async]\nenabled = true\n"
        + &webhook_toml("http://127.0.0.1:9/hook");
    let server = Server::start(BIN, "warn", reqwest::Client::new(), &pool).await;
    let port = server.port;
    let get = |host: &str, path: &str| {
        server
            .client
            .get(server.url(path))
            .header("host", host)
            .header("x-nthpool-key", KEY)
    };
    let poll_url = async |host: &str| -> String {
        let r = server
            .client
            .post(server.url("/work"))
            .header("host", host)
            .header("x-nthpool-key", KEY)
            .header("x-nthpool-async", "1")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        let accepted: Value = r.json().await.unwrap();
        accepted["pollUrl"].as_str().unwrap().to_string()
    };
    let first = poll_url("p.localhost").await;
    let base = format!("http://api.localhost:{port}/pools/p/jobs/job_");
    assert!(first.starts_with(&base), "{first}");

    // A name a pool created through the admin API answers to cannot become the API host.
    let api_pool = json!({"name": "q", "upstream": up.url(), "custom_domains": ["q.example.test"]});
    let r = server
        .client
        .post(server.url("/admin/pools"))
        .header("host", "api.localhost")
        .bearer_auth(nthbouncer_testkit::ADMIN_TOKEN)
        .json(&api_pool)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    server.rewrite_config(&format!("api_host = \"q.example.test\"\n{pool}"));
    let (status, body) = server.reload().await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], "server.api_host", "{body}");
    assert_eq!(
        get("api.localhost", "/healthz")
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    let names = "api_host = \"gw.test\"\npool_domain = \"pools.test\"\n";
    server.rewrite_config(&format!("{names}{pool}"));
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["restartPending"], json!([]), "{body}");
    // The old names are nobody's now; the new ones serve.
    let status = async |host: &str, path: &str| get(host, path).send().await.unwrap().status();
    assert_eq!(status("api.localhost", "/healthz").await, 404);
    assert_eq!(status("gw.test", "/healthz").await, 200);
    assert_eq!(status("p.localhost", "/echo").await, 404);
    assert_eq!(status("p.pools.test", "/echo").await, 200);
    let second = poll_url("p.pools.test").await;
    let base = format!("http://gw.test:{port}/pools/p/jobs/job_");
    assert!(second.starts_with(&base), "{second}");
    // The job is polled on the new API host.
    let path = second.trim_start_matches(&format!("http://gw.test:{port}"));
    assert_eq!(status("gw.test", path).await, 200);

    let public = "public_url = \"https://jobs.example.com\"\n";
    server.rewrite_config(&format!("{names}{public}{pool}"));
    let (code, body) = reload_at(&server, "gw.test").await;
    assert_eq!(code, 200, "{body}");
    let third = poll_url("p.pools.test").await;
    assert!(
        third.starts_with("https://jobs.example.com/pools/p/jobs/job_"),
        "{third}"
    );
}

/// A listener that accepts no more connections: its accept queue is full, so a new
/// connection's SYN is dropped and its connect hangs until the connecting side gives up. The
/// sockets filling the queue are returned with it.
async fn blackhole() -> (tokio::net::TcpListener, Vec<std::net::TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut filling = Vec::new();
    for _ in 0..16 {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
            Ok(s) => filling.push(s),
            Err(_) => return (listener, filling),
        }
    }
    panic!("the accept queue of {addr} never filled");
}

/// The upstream timeouts apply to the next upstream call: with a connect timeout longer than
/// the pool's request timeout, a call to an origin that never accepts ends at the request
/// deadline (`504 upstream_timeout`); after a reload that shortens the connect timeout, the
/// next call gives up connecting first (`502 upstream_unreachable`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_timeout_change_applies_to_the_next_call() {
    let (hole, _filling) = blackhole().await;
    let origin = format!("http://{}", hole.local_addr().unwrap());
    let pool = pool_toml("p", &origin, "limit = 4\nrequest_timeout_ms = 1500");
    let slow = format!("upstream_connect_timeout_ms = 600000\n{pool}");
    let server = Server::start(BIN, "warn", reqwest::Client::new(), &slow).await;
    let call = async || -> (u16, Value) {
        let r = server.pool_get("p", "/echo").send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    };
    let (status, body) = call().await;
    assert_eq!(
        (status, &body["error"]),
        (504, &json!("upstream_timeout")),
        "{body}"
    );

    server.rewrite_config(&format!("upstream_connect_timeout_ms = 100\n{pool}"));
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["pools"]["unchanged"], json!(["p"]), "{body}");
    let (status, body) = call().await;
    assert_eq!(
        (status, &body["error"]),
        (502, &json!("upstream_unreachable")),
        "{body}"
    );
}

/// `access_log_keep` applies at the next trim, and `shutdown_grace_ms` at the shutdown: a pool's
/// log is cut to the new bound, and with a call held by the origin a SIGTERM ends the process
/// after the new grace (it started with ten minutes, which no test would outwait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_keep_and_shutdown_grace_apply_after_a_reload() {
    let up = Upstream::start().await;
    let pool = pool_toml("p", &up.url(), "limit = 4");
    let start = format!("shutdown_grace_ms = 600000\n{pool}");
    let mut server = Server::start(BIN, "warn", reqwest::Client::new(), &start).await;
    server.rewrite_config(&format!(
        "shutdown_grace_ms = 200\naccess_log_keep = 5\n{pool}"
    ));
    let (status, body) = server.reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["restartPending"], json!([]), "{body}");

    // A pool's log is trimmed once 100 rows were added since the last trim (with a bound
    // this low): the 100th call's row makes one.
    for _ in 0..100 {
        let r = server.pool_get("p", "/echo").send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    let mut rows = usize::MAX;
    let trimmed = wait_until(1000, Duration::from_millis(20), async || {
        let log = server
            .admin_json("/admin/pools/p/access-log?limit=200")
            .await;
        rows = log["items"].as_array().map_or(usize::MAX, Vec::len);
        rows <= 5
    })
    .await;
    assert!(
        trimmed,
        "the access log kept {rows} rows past access_log_keep = 5"
    );

    let held = {
        let req = server.pool_get("p", "/hold");
        tokio::spawn(async move { req.send().await.map(|r| r.status().as_u16()) })
    };
    wait_upstream_in_flight(&up, 1).await;
    server.sigterm();
    let exited = server.exited().await;
    assert!(exited.success(), "{exited:?}");
    // The held call ends with the process, whatever its answer.
    let _ = nthbouncer_testkit::bounded("the held call to end", held).await;
}
