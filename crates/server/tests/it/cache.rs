//! The shared response cache end to end (SPEC §4, §12): the real router, a counting upstream
//! on loopback, entry ages on an injected clock. What the origin counts is the proof: a hit
//! never reaches it.

use std::sync::Arc;

use nthbouncer_testkit::*;
use reqwest::Method;
use serde_json::{json, Value};

/// A pool `name` (keys [`KEY`], [`KEY2`]) with `[pools.cache]` holding `cache` (TOML lines).
fn cache_pool(name: &str, upstream: &str, concurrency: &str, cache: &str) -> String {
    format!(
        "{}[pools.cache]\n{cache}\n",
        pool_toml(name, upstream, concurrency)
    )
}

/// A GET through the pool's cache: status, `x-nthpool-cache`, `Age` and body.
async fn fetch(rb: reqwest::RequestBuilder) -> (u16, String, Option<String>, String) {
    let r = send(rb).await;
    let status = r.status().as_u16();
    let mark = hdr(&r, "x-nthpool-cache").unwrap_or_default();
    let age = hdr(&r, "age");
    let body = r.text().await.unwrap();
    (status, mark, age, body)
}

fn hdr(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

async fn cache_state(gw: &Gateway, pool: &str) -> Value {
    gw.state(pool).await["cache"].clone()
}

#[tokio::test]
async fn hits_and_misses_and_expiry_on_the_injected_clock() {
    let up = Upstream::start().await;
    let (gw, clock) = clocked(&cache_pool("p", &up.url(), "limit = 2", "ttl_s = 10")).await;
    let (status, mark, age, first) = fetch(gw.get("p", "/respond?a=1")).await;
    assert_eq!((status, mark.as_str(), age), (200, "miss", None));
    let (status, mark, age, again) = fetch(gw.get("p", "/respond?a=1")).await;
    assert_eq!((status, mark.as_str()), (200, "hit"));
    assert_eq!((age.as_deref(), &again), (Some("0"), &first));
    // Another query is another entry.
    assert_eq!(fetch(gw.get("p", "/respond?a=2")).await.1, "miss");
    assert_eq!(up.total(), 2);

    clock.advance(4_000);
    let (_, mark, age, _) = fetch(gw.get("p", "/respond?a=1")).await;
    assert_eq!((mark.as_str(), age.as_deref()), ("hit", Some("4")));
    clock.advance(6_000);
    let (_, mark, _, fresh) = fetch(gw.get("p", "/respond?a=1")).await;
    assert_eq!(mark, "miss", "expired after ttl_s on the gateway's clock");
    assert_ne!(fresh, first);
    assert_eq!(up.total(), 3);

    // The origin's max-age shortens the entry's life (and never lengthens it).
    let short = || {
        gw.get("p", "/respond?short")
            .header("x-respond-h-cache-control", "public, max-age=2")
    };
    assert_eq!(fetch(short()).await.1, "miss");
    clock.advance(1_999);
    assert_eq!(fetch(short()).await.1, "hit");
    clock.advance(1);
    assert_eq!(fetch(short()).await.1, "miss");

    let s = cache_state(&gw, "p").await;
    assert_eq!(
        (s["hits"].as_u64(), s["misses"].as_u64()),
        (Some(3), Some(5)),
        "{s}"
    );
    assert_eq!(s["entries"], 3, "{s}");
    assert!(s["bytes"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(s["maxBytes"], 64 * 1024 * 1024, "{s}");

    // A hit is logged as one, with the answer's status and no upstream.
    gw.flush_access_log().await;
    let log = gw
        .admin_json("/admin/pools/p/access-log?outcome=cache_hit")
        .await;
    let rows = log["items"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{log}");
    for row in rows {
        assert_eq!(row["status"], 200, "{row}");
        assert_eq!(row["upstreamStatus"], Value::Null, "{row}");
        assert_eq!(row["keyId"].as_str().map(str::is_empty), Some(false));
    }
}

#[tokio::test]
async fn what_is_kept_statuses_methods_and_directives() {
    let up = Upstream::start().await;
    let gw = gateway(&cache_pool("p", &up.url(), "limit = 2", "")).await;
    let twice = async |rb: &dyn Fn() -> reqwest::RequestBuilder| {
        let first = fetch(rb()).await;
        let second = fetch(rb()).await;
        (first.0, first.1, second.1)
    };
    let with = |path: &'static str, name: &'static str, value: &'static str| {
        let gw = &gw;
        move || gw.get("p", path).header(name, value)
    };
    // Kept: 200, 203, 204, 301, 404, and HEAD answers.
    for (path, code) in [
        ("/respond/s200", "200"),
        ("/respond/s203", "203"),
        ("/respond/s204", "204"),
        ("/respond/s301", "301"),
        ("/respond/s404", "404"),
    ] {
        let (status, first, second) = twice(&with(path, "x-respond-status", code)).await;
        assert_eq!(status.to_string(), code);
        assert_eq!((first.as_str(), second.as_str()), ("miss", "hit"), "{code}");
    }
    let head = || {
        gw.pool("p", Method::HEAD, "/respond/head")
            .header("x-nthpool-key", KEY)
    };
    assert_eq!(twice(&head).await, (200, "miss".into(), "hit".into()));
    // Not kept: other statuses, the origin's no-store, private, no-cache and Set-Cookie.
    let before = up.total();
    for (name, value) in [
        ("x-respond-status", "500"),
        ("x-respond-status", "302"),
        ("x-respond-h-cache-control", "no-store"),
        ("x-respond-h-cache-control", "private, max-age=60"),
        ("x-respond-h-cache-control", "no-cache"),
        ("x-respond-h-set-cookie", "session=1"),
        ("x-respond-h-vary", "*"),
    ] {
        let (_, first, second) = twice(&with("/respond/not", name, value)).await;
        assert_eq!(
            (first.as_str(), second.as_str()),
            ("miss", "miss"),
            "{name}: {value}"
        );
    }
    assert_eq!(
        up.total(),
        before + 14,
        "every one of them reached the origin"
    );
    // The request's own no-store and private bypass the cache: neither read nor stored.
    for value in ["no-store", "private"] {
        let (_, first, second) = twice(&with("/respond/req", "cache-control", value)).await;
        assert_eq!((first.as_str(), second.as_str()), ("bypass", "bypass"));
    }
    assert_eq!(
        fetch(gw.get("p", "/respond/req")).await.1,
        "miss",
        "nothing was stored"
    );
    // The request's no-cache skips the stored answer and stores the fresh one.
    let (_, _, _, stored) = fetch(gw.get("p", "/respond/req")).await;
    let (_, mark, _, fresh) = fetch(with("/respond/req", "cache-control", "no-cache")()).await;
    assert_eq!(mark, "miss");
    assert_ne!(fresh, stored);
    assert_eq!(fetch(gw.get("p", "/respond/req")).await.3, fresh);
    // Other methods, a body, a caller's own Authorization and a refused key: bypass.
    let post = gw
        .pool("p", Method::POST, "/respond/m")
        .header("x-nthpool-key", KEY);
    assert_eq!(fetch(post).await.1, "bypass");
    let with_body = gw.get("p", "/respond/m").body("x");
    assert_eq!(fetch(with_body).await.1, "bypass");
    let authorized = gw
        .get("p", "/respond/m")
        .header("authorization", "Bearer sk-own");
    assert_eq!(fetch(authorized).await.1, "bypass");
    let refused = gw
        .pool("p", Method::GET, "/respond/m")
        .header("x-nthpool-key", "nope-nope-nope-nope");
    let (status, mark, _, _) = fetch(refused).await;
    assert_eq!((status, mark.as_str()), (401, "bypass"));
}

#[tokio::test]
async fn vary_headers_and_keys_make_separate_entries() {
    let up = Upstream::start().await;
    let toml = cache_pool("own", &up.url(), "", "vary = [\"accept-language\"]")
        + &cache_pool("shared", &up.url(), "", "shared_across_keys = true");
    let gw = gateway(&toml).await;
    let lang = |l: &'static str| gw.get("own", "/respond").header("accept-language", l);
    assert_eq!(fetch(lang("fr")).await.1, "miss");
    assert_eq!(fetch(lang("de")).await.1, "miss");
    assert_eq!(fetch(lang("fr")).await.1, "hit");
    assert_eq!(fetch(gw.get("own", "/respond")).await.1, "miss");
    // The origin's Vary: the stored answer serves only requests with the same values.
    let flavour = |f: &'static str| {
        gw.get("own", "/respond/v")
            .header("x-respond-h-vary", "X-Flavour")
            .header("x-flavour", f)
    };
    assert_eq!(fetch(flavour("mint")).await.1, "miss");
    assert_eq!(fetch(flavour("mint")).await.1, "hit");
    assert_eq!(fetch(flavour("lime")).await.1, "miss");
    // Per key by default: another key of the pool does not see the first key's entries.
    let key2 = |pool: &str| {
        gw.pool(pool, Method::GET, "/respond/k")
            .header("x-nthpool-key", KEY2)
    };
    assert_eq!(fetch(gw.get("own", "/respond/k")).await.1, "miss");
    assert_eq!(fetch(key2("own")).await.1, "miss");
    assert_eq!(fetch(gw.get("own", "/respond/k")).await.1, "hit");
    // Shared across keys: one entry serves both.
    let (_, mark, _, body) = fetch(gw.get("shared", "/respond/k")).await;
    assert_eq!(mark, "miss");
    let (_, mark, _, shared) = fetch(key2("shared")).await;
    assert_eq!((mark.as_str(), &shared), ("hit", &body));
}

/// 100 identical GETs at once: one call reaches the origin, and all 100 get its answer.
#[tokio::test]
async fn concurrent_misses_for_one_key_collapse_into_one_upstream_call() {
    const N: usize = 100;
    let up = Upstream::start().await;
    let gw = Arc::new(gateway(&cache_pool("p", &up.url(), "limit = 100", "")).await);
    let callers: Vec<_> = (0..N)
        .map(|_| {
            let gw = gw.clone();
            tokio::spawn(async move { fetch(gw.get("p", "/hold")).await })
        })
        .collect();
    gw.wait_state("p", "99 callers waiting for the first", |s| {
        s["cache"]["waiting"] == N as u64 - 1
    })
    .await;
    assert_eq!(up.total(), 1);
    up.release(1);
    let mut marks = std::collections::BTreeMap::new();
    for c in callers {
        let (status, mark, _, body) = c.await.unwrap();
        assert_eq!((status, body.as_str()), (200, "released"));
        *marks.entry(mark).or_insert(0) += 1;
    }
    assert_eq!(up.total(), 1, "one call reached the origin");
    assert_eq!(
        marks,
        [("hit".to_string(), N - 1), ("miss".to_string(), 1)].into()
    );
    let s = cache_state(&gw, "p").await;
    assert_eq!(
        (&s["hits"], &s["misses"], &s["waiting"]),
        (&json!(99), &json!(1), &json!(0))
    );
}

/// A hit takes no slot and no RPM token: with the pool's one slot held by a lock (and its one
/// RPM token spent), a cached answer still comes back while anything else is refused.
#[tokio::test]
async fn a_hit_spends_no_slot_and_no_rpm_token() {
    let up = Upstream::start().await;
    let toml = cache_pool("slot", &up.url(), "limit = 1", "")
        + &cache_pool("rpm", &up.url(), "rpm = 1", "");
    let gw = gateway(&toml).await;
    assert_eq!(fetch(gw.get("slot", "/respond/x")).await.1, "miss");
    // Waits: the miss's slot is freed once its body was handed over, which may trail the
    // client's read by a moment.
    let wait = Some(std::time::Duration::from_secs(10));
    let held = gw.lock_client("slot").acquire(wait).await.unwrap();
    assert_eq!(gw.in_flight("slot").await, 1);
    let (status, mark, _, _) = fetch(gw.no_queue("slot", "/respond/x")).await;
    assert_eq!((status, mark.as_str()), (200, "hit"));
    let (status, mark, _, _) = fetch(gw.no_queue("slot", "/respond/other")).await;
    assert_eq!((status, mark.as_str()), (429, "miss"));
    held.release(None).await.unwrap();

    assert_eq!(fetch(gw.get("rpm", "/respond/x")).await.1, "miss");
    for _ in 0..3 {
        let (status, mark, _, _) = fetch(gw.no_queue("rpm", "/respond/x")).await;
        assert_eq!((status, mark.as_str()), (200, "hit"));
    }
    let (status, _, _, _) = fetch(gw.no_queue("rpm", "/respond/other")).await;
    assert_eq!(status, 429, "the minute's one token was spent by the miss");
    let state = gw.state("rpm").await;
    assert_eq!(state["admittedTotal"], 1, "{state}");
    assert_eq!(up.total(), 2);
}

#[tokio::test]
async fn purge_by_path_prefix_through_the_admin_api() {
    let up = Upstream::start().await;
    let toml = cache_pool("p", &up.url(), "", "") + &pool_toml("plain", &up.url(), "");
    let gw = gateway(&toml).await;
    for path in ["/v1/models", "/v1/models/x", "/v2/models"] {
        let path = format!("/respond{path}");
        assert_eq!(fetch(gw.get("p", &path)).await.1, "miss");
        assert_eq!(fetch(gw.get("p", &path)).await.1, "hit");
    }
    let purge = async |pool: &str, body: Value| {
        let path = format!("/admin/pools/{pool}/cache/purge");
        gw.post(&path, body).await
    };
    let (status, v) = purge("p", json!({"prefix": "/respond/v1/models"})).await;
    assert_eq!((status, v), (200, json!({"purged": 2})));
    assert_eq!(fetch(gw.get("p", "/respond/v1/models")).await.1, "miss");
    assert_eq!(fetch(gw.get("p", "/respond/v1/models/x")).await.1, "miss");
    assert_eq!(fetch(gw.get("p", "/respond/v2/models")).await.1, "hit");
    assert_eq!(
        purge("p", json!({"prefix": "/"})).await,
        (200, json!({"purged": 3}))
    );

    let (status, v) = purge("p", json!({"prefix": "v1"})).await;
    assert_eq!(
        (status, v["error"].as_str(), v["field"].as_str()),
        (400, Some("invalid"), Some("prefix"))
    );
    let (status, v) = purge("p", json!({})).await;
    assert_eq!((status, v["error"].as_str()), (400, Some("invalid")), "{v}");
    let (status, v) = purge("plain", json!({"prefix": "/"})).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (409, Some("conflict")),
        "{v}"
    );
    let (status, v) = purge("nope", json!({"prefix": "/"})).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (404, Some("pool_not_found")),
        "{v}"
    );
    let anon = gw
        .api_anon(Method::POST, "/admin/pools/p/cache/purge")
        .json(&json!({"prefix": "/"}));
    assert_eq!(send(anon).await.status(), 401);
    let doc = gw.admin_json("/openapi.json").await;
    assert!(doc["paths"]["/admin/pools/{pool}/cache/purge"]["post"].is_object());
}

#[tokio::test]
async fn async_requests_bypass_the_cache() {
    let up = Upstream::start().await;
    let pool = cache_pool("p", &up.url(), "", "");
    let gw = gateway(&async_pool_toml(&pool, "", NO_WEBHOOK)).await;
    assert_eq!(fetch(gw.get("p", "/respond")).await.1, "miss");
    assert_eq!(fetch(gw.get("p", "/respond")).await.1, "hit");
    let (status, mark, _, _) = fetch(gw.get_async("p", "/respond")).await;
    assert_eq!((status, mark.as_str()), (202, "bypass"));
    until("the job to reach the origin", async || up.total() == 2).await;
    assert_eq!(cache_state(&gw, "p").await["bypasses"], 1);
}

/// Cache figures in `/metrics`, per pool.
#[tokio::test]
async fn metrics_show_the_hit_ratio_and_bytes() {
    let up = Upstream::start().await;
    let gw = gateway(&cache_pool("cachemetered", &up.url(), "", "")).await;
    for _ in 0..4 {
        fetch(gw.get("cachemetered", "/respond")).await;
    }
    let text = send(gw.api_anon(Method::GET, "/metrics"))
        .await
        .text()
        .await
        .unwrap();
    for line in [
        "nthbouncer_cache_requests_total{pool=\"cachemetered\",result=\"hit\"} 3",
        "nthbouncer_cache_requests_total{pool=\"cachemetered\",result=\"miss\"} 1",
        "nthbouncer_cache_hit_ratio{pool=\"cachemetered\"} 0.75",
        "nthbouncer_cache_entries{pool=\"cachemetered\"} 1",
    ] {
        assert!(text.contains(line), "{line} missing: {text}");
    }
    assert!(
        text.contains("nthbouncer_cache_bytes{pool=\"cachemetered\"}"),
        "{text}"
    );
}

/// A settings change that keeps the cache's settings keeps its entries; one that changes them
/// starts an empty cache; turning it off stops the header.
#[tokio::test]
async fn settings_changes_through_the_admin_api() {
    let up = Upstream::start().await;
    let gw = gateway("").await;
    let mut body =
        json!({"name": "p", "upstream": up.url(), "keys": [KEY], "cache": {"ttl_s": 30}});
    let (status, v) = gw.post("/admin/pools", body.clone()).await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["cache"]["ttl_s"], 30, "defaults filled in: {v}");
    assert_eq!(fetch(gw.get("p", "/respond")).await.1, "miss");
    body["concurrency"] = json!({"limit": 3});
    assert_eq!(gw.put("/admin/pools/p", body.clone()).await.0, 200);
    assert_eq!(fetch(gw.get("p", "/respond")).await.1, "hit");
    body["cache"]["ttl_s"] = json!(20);
    assert_eq!(gw.put("/admin/pools/p", body.clone()).await.0, 200);
    assert_eq!(fetch(gw.get("p", "/respond")).await.1, "miss");
    body["cache"]["max_entry_bytes"] = json!(0);
    let (status, v) = gw.put("/admin/pools/p", body.clone()).await;
    assert_eq!((status, v["error"].as_str()), (400, Some("invalid")), "{v}");
    assert!(
        v["field"]
            .as_str()
            .unwrap()
            .ends_with("cache.max_entry_bytes"),
        "{v}"
    );
    body.as_object_mut().unwrap().remove("cache");
    assert_eq!(gw.put("/admin/pools/p", body).await.0, 200);
    let r = send(gw.get("p", "/respond")).await;
    assert_eq!(hdr(&r, "x-nthpool-cache"), None);
    assert!(gw.state("p").await.get("cache").is_none());
}

/// An answer larger than `max_entry_bytes` is passed through whole and not kept.
#[tokio::test]
async fn an_answer_over_the_entry_bound_streams_through_uncached() {
    let up = Upstream::start().await;
    let toml = cache_pool("p", &up.url(), "", "max_entry_bytes = 1000");
    let gw = gateway(&toml).await;
    let r = send(gw.get("p", "/flood?mb=1")).await;
    assert_eq!(hdr(&r, "x-nthpool-cache").as_deref(), Some("miss"));
    assert_eq!(r.bytes().await.unwrap().len(), 1 << 20);
    assert_eq!(fetch(gw.get("p", "/flood?mb=1")).await.1, "miss");
    assert_eq!(cache_state(&gw, "p").await["entries"], 0);
}
