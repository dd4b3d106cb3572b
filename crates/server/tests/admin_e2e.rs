//! The admin API and the ops routes over loopback: CRUD applied without restart, config pools
//! read-only, keys, state, the access log, metrics, OpenAPI.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use reqwest::Method;
use serde_json::{json, Value};
use support::*;

#[tokio::test]
async fn admin_needs_the_token() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "")).await;
    let url = format!("{}/admin/pools", gw.base);
    let r = gw
        .client
        .get(&url)
        .header("host", "api.localhost")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "unauthorized");
    let r = gw
        .client
        .get(&url)
        .header("host", "api.localhost")
        .bearer_auth("wrong-token-0123456789")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // Unknown routes on the API host: JSON 404.
    let r = gw.api(Method::GET, "/nope").send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "not_found");
}

#[tokio::test]
async fn pools_crud_applies_without_restart() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("fromfile", &up.url(), "")).await;

    // Create through the API; serve at once.
    let body = json!({
        "name": "made",
        "upstream": up.url(),
        "keys": [KEY],
        "upstream_headers": {"authorization": "Bearer sk-secret-credential"},
        "concurrency": {"limit": 2}
    });
    let r = gw
        .api(Method::POST, "/admin/pools")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let created: Value = r.json().await.unwrap();
    assert_eq!(created["managedBy"], "api");
    assert_eq!(created["concurrency"]["limit"], 2);
    assert_eq!(
        created["concurrency"]["queue_size"], 1000,
        "defaults filled in"
    );
    let shown = created.to_string();
    assert!(
        !shown.contains("sk-secret-credential"),
        "secret echoed back: {shown}"
    );
    assert!(!shown.contains(KEY), "plaintext key echoed back");
    assert_eq!(gw.get("made", "/echo").send().await.unwrap().status(), 200);
    assert_eq!(gw.state("made").await["configuredLimit"], 2);

    // Duplicate → 409; invalid → 400 naming the field.
    let r = gw
        .api(Method::POST, "/admin/pools")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let r = gw
        .api(Method::POST, "/admin/pools")
        .json(&json!({"name": "bad", "upstream": up.url(), "concurrency": {"limit": 0}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"], "invalid");
    assert_eq!(e["field"], "concurrency.limit");
    let r = gw
        .api(Method::POST, "/admin/pools")
        .json(&json!({"name": "bad", "upstream": up.url(), "concurrency": {"limit": "lots"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["field"],
        "concurrency.limit"
    );
    let r = gw
        .api(Method::POST, "/admin/pools")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    // Update: the new limit applies to the live gate.
    let mut updated = body.clone();
    updated["concurrency"]["limit"] = json!(5);
    let r = gw
        .api(Method::PUT, "/admin/pools/made")
        .json(&updated)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(gw.state("made").await["configuredLimit"], 5);
    assert_eq!(
        gw.get("made", "/").send().await.unwrap().status(),
        200,
        "keys survive an update"
    );

    // List shows both, with who owns them.
    let list: Value = gw
        .api(Method::GET, "/admin/pools")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names: Vec<(&str, &str)> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                p["managedBy"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(names, vec![("fromfile", "config"), ("made", "api")]);
    assert!(list["next"].is_null());
    let page: Value = gw
        .api(Method::GET, "/admin/pools?limit=1")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert_eq!(page["next"], "fromfile");

    // Config pools are read-only.
    let r = gw
        .api(Method::PUT, "/admin/pools/fromfile")
        .json(&json!({"upstream": up.url()}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"],
        "managed_by_config"
    );
    let r = gw
        .api(Method::DELETE, "/admin/pools/fromfile")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);

    // Delete: gone at once.
    let r = gw
        .api(Method::DELETE, "/admin/pools/made")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = gw.get("made", "/").send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "pool_not_found");
    let r = gw
        .api(Method::GET, "/admin/pools/made")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

#[tokio::test]
async fn api_pools_and_keys_survive_a_restart() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "[server]\ndata_dir = {:?}\n",
        dir.path().display().to_string()
    );
    let gw = gateway(&toml).await;
    let r = gw
        .api(Method::POST, "/admin/pools")
        .json(&json!({"name": "kept", "upstream": up.url()}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let key: Value = gw
        .api(Method::POST, "/admin/pools/kept/keys")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let key = key["key"].as_str().unwrap().to_string();
    gw.running.shutdown().await;

    let gw = gateway(&toml).await;
    let r = gw
        .pool("kept", Method::GET, "/")
        .header("x-nthpool-key", &key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let keys: Value = gw
        .api(Method::GET, "/admin/pools/kept/keys")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(keys["items"].as_array().unwrap().len(), 1);
    assert!(
        keys["items"][0].get("key").is_none(),
        "the plaintext is shown only once"
    );
}

#[tokio::test]
async fn keys_on_a_config_pool() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "")).await;
    let created: Value = gw
        .api(Method::POST, "/admin/pools/p/keys")
        .json(&json!({"label": "worker-1"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(created["label"], "worker-1");
    let list: Value = gw
        .api(Method::GET, "/admin/pools/p/keys")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 3, "two config keys and one API key: {list}");
    let config_key = items.iter().find(|k| k["managedBy"] == "config").unwrap();
    let r = gw
        .api(
            Method::DELETE,
            &format!("/admin/pools/p/keys/{}", config_key["id"].as_str().unwrap()),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        409,
        "config keys are revoked by editing the file"
    );
    let r = gw
        .api(Method::POST, "/admin/pools/p/keys")
        .json(&json!({"expiresAt": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["field"], "expiresAt");
    let r = gw
        .api(Method::POST, "/admin/pools/p/keys")
        .json(&json!({"colour": "red"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn access_log_records_admitted_and_refused() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "limit = 1")).await;
    assert_eq!(
        gw.get("p", "/status/201").send().await.unwrap().status(),
        201
    );
    assert_eq!(
        gw.pool("p", Method::GET, "/")
            .header("x-nthpool-key", "wrong-key-0123456789")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    gw.running.state.access_log.flush().await;
    let log: Value = gw
        .api(Method::GET, "/admin/pools/p/access-log")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let items = log["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{log}");
    // Newest first.
    assert_eq!(items[0]["outcome"], "401");
    assert!(items[0]["keyId"].is_null());
    assert_eq!(items[0]["reason"], "unknown pool key");
    assert_eq!(items[1]["outcome"], "admitted");
    assert_eq!(items[1]["upstreamStatus"], 201);
    assert_eq!(items[1]["route"], "proxy GET /status/201");
    assert!(items[1]["keyId"].as_str().unwrap().starts_with("key_"));
    assert!(
        !log.to_string().contains(KEY),
        "the key itself must never be logged"
    );
    let only: Value = gw
        .api(Method::GET, "/admin/pools/p/access-log?outcome=401")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(only["items"].as_array().unwrap().len(), 1);
    let page: Value = gw
        .api(Method::GET, "/admin/pools/p/access-log?limit=1")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let next = page["next"].as_str().unwrap();
    let page2: Value = gw
        .api(
            Method::GET,
            &format!("/admin/pools/p/access-log?limit=1&cursor={next}"),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page2["items"][0]["outcome"], "admitted");
}

#[tokio::test]
async fn ops_routes() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("metered", &up.url(), "limit = 4")).await;
    assert_eq!(gw.get("metered", "/").send().await.unwrap().status(), 200);
    let h = gw
        .client
        .get(format!("{}/healthz", gw.base))
        .header("host", "api.localhost")
        .send()
        .await
        .unwrap();
    assert_eq!(h.status(), 200);
    let r = gw
        .client
        .get(format!("{}/readyz", gw.base))
        .header("host", "api.localhost")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let m = gw
        .client
        .get(format!("{}/metrics", gw.base))
        .header("host", "api.localhost")
        .send()
        .await
        .unwrap();
    assert_eq!(m.status(), 200);
    let text = m.text().await.unwrap();
    assert!(
        text.contains("nthbouncer_pool_effective_limit{pool=\"metered\"} 4"),
        "{text}"
    );
    assert!(
        text.contains("nthbouncer_admitted_total{pool=\"metered\",route=\"proxy\"}"),
        "{text}"
    );
    assert!(
        text.contains("nthbouncer_queue_wait_seconds_bucket{pool=\"metered\""),
        "histograms have buckets: {text}"
    );
    let doc: Value = gw
        .client
        .get(format!("{}/openapi.json", gw.base))
        .header("host", "api.localhost")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    for path in [
        "/admin/pools",
        "/admin/pools/{pool}/state",
        "/admin/pools/{pool}/keys",
        "/healthz",
    ] {
        assert!(
            doc["paths"].get(path).is_some(),
            "{path} missing from the OpenAPI document"
        );
    }
}
