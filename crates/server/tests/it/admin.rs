//! The admin API and the ops routes over loopback: CRUD applied without restart, config pools
//! read-only, keys, state, the access log, metrics, OpenAPI.

use nthbouncer_testkit::*;
use reqwest::Method;
use serde_json::{json, Value};

#[tokio::test]
async fn admin_needs_the_token() {
    let (_up, gw) = proxied_pool("").await;
    let anon = || gw.api_anon(Method::GET, "/admin/pools");
    expect_error(send(anon()).await, 401, "unauthorized").await;
    let r = send(anon().bearer_auth("wrong-token-0123456789")).await;
    assert_eq!(r.status(), 401);
    // Unknown routes on the API host: JSON 404.
    expect_error(send(gw.api(Method::GET, "/nope")).await, 404, "not_found").await;
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
    let (status, created) = gw.post("/admin/pools", body.clone()).await;
    assert_eq!(status, 201);
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
    assert_eq!(send(gw.get("made", "/echo")).await.status(), 200);
    assert_eq!(gw.state("made").await["configuredLimit"], 2);

    // Duplicate → 409; invalid → 400 naming the field.
    let create = |b: Value| gw.post("/admin/pools", b);
    assert_eq!(create(body.clone()).await.0, 409);
    let (status, e) =
        create(json!({"name": "bad", "upstream": up.url(), "concurrency": {"limit": 0}})).await;
    assert_eq!(status, 400);
    assert_eq!(e["error"], "invalid");
    assert_eq!(e["field"], "concurrency.limit");
    let (status, e) =
        create(json!({"name": "bad", "upstream": up.url(), "concurrency": {"limit": "lots"}}))
            .await;
    assert_eq!(status, 400);
    assert_eq!(e["field"], "concurrency.limit");
    let r = send(gw.api(Method::POST, "/admin/pools").body("{not json")).await;
    assert_eq!(r.status(), 400);

    // Update: the new limit applies to the live gate.
    let mut updated = body.clone();
    updated["concurrency"]["limit"] = json!(5);
    let (status, _) = gw.put("/admin/pools/made", updated).await;
    assert_eq!(status, 200);
    assert_eq!(gw.state("made").await["configuredLimit"], 5);
    assert_eq!(
        send(gw.get("made", "/")).await.status(),
        200,
        "keys survive an update"
    );

    // List shows both, with who owns them.
    let list = gw.admin_json("/admin/pools").await;
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
    let page = gw.admin_json("/admin/pools?limit=1").await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert_eq!(page["next"], "fromfile");

    // Config pools are read-only.
    let r = send(
        gw.api(Method::PUT, "/admin/pools/fromfile")
            .json(&json!({"upstream": up.url()})),
    );
    expect_error(r.await, 409, "managed_by_config").await;
    assert_eq!(gw.delete("/admin/pools/fromfile").await.0, 409);

    // Delete: gone at once.
    assert_eq!(gw.delete("/admin/pools/made").await.0, 204);
    expect_error(send(gw.get("made", "/")).await, 404, "pool_not_found").await;
    let (status, _) = gw.admin(Method::GET, "/admin/pools/made", None).await;
    assert_eq!(status, 404);
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
    let pool = json!({"name": "kept", "upstream": up.url()});
    assert_eq!(gw.post("/admin/pools", pool).await.0, 201);
    let key = json_of(send(gw.api(Method::POST, "/admin/pools/kept/keys")).await).await;
    let key = key["key"].as_str().unwrap().to_string();
    gw.running.shutdown().await;

    let gw = gateway(&toml).await;
    let r = send(
        gw.pool("kept", Method::GET, "/")
            .header("x-nthpool-key", &key),
    )
    .await;
    assert_eq!(r.status(), 200);
    let keys = gw.admin_json("/admin/pools/kept/keys").await;
    assert_eq!(keys["items"].as_array().unwrap().len(), 1);
    assert!(
        keys["items"][0].get("key").is_none(),
        "the plaintext is shown only once"
    );
}

#[tokio::test]
async fn keys_on_a_config_pool() {
    let (_up, gw) = proxied_pool("").await;
    let r = send(
        gw.api(Method::POST, "/admin/pools/p/keys")
            .json(&json!({"label": "worker-1"})),
    );
    let created = json_of(r.await).await;
    assert_eq!(created["label"], "worker-1");
    let list = gw.admin_json("/admin/pools/p/keys").await;
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 3, "two config keys and one API key: {list}");
    let config_key = items.iter().find(|k| k["managedBy"] == "config").unwrap();
    let path = format!("/admin/pools/p/keys/{}", config_key["id"].as_str().unwrap());
    assert_eq!(
        gw.delete(&path).await.0,
        409,
        "config keys are revoked by editing the file"
    );
    let create_key = |b: Value| gw.post("/admin/pools/p/keys", b);
    let (status, e) = create_key(json!({"expiresAt": 1})).await;
    assert_eq!(status, 400);
    assert_eq!(e["field"], "expiresAt");
    assert_eq!(create_key(json!({"colour": "red"})).await.0, 400);
}

#[tokio::test]
async fn access_log_records_admitted_and_refused() {
    let (_up, gw) = proxied_pool("limit = 1").await;
    assert_eq!(send(gw.get("p", "/status/201")).await.status(), 201);
    let wrong_key = gw
        .pool("p", Method::GET, "/")
        .header("x-nthpool-key", "wrong-key-0123456789");
    assert_eq!(send(wrong_key).await.status(), 401);
    gw.flush_access_log().await;
    let log = gw.admin_json("/admin/pools/p/access-log").await;
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
    let only = gw.admin_json("/admin/pools/p/access-log?outcome=401").await;
    assert_eq!(only["items"].as_array().unwrap().len(), 1);
    let page = gw.admin_json("/admin/pools/p/access-log?limit=1").await;
    let next = page["next"].as_str().unwrap();
    let page2 = gw
        .admin_json(&format!("/admin/pools/p/access-log?limit=1&cursor={next}"))
        .await;
    assert_eq!(page2["items"][0]["outcome"], "admitted");
}

#[tokio::test]
async fn ops_routes() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("metered", &up.url(), "limit = 4")).await;
    assert_eq!(send(gw.get("metered", "/")).await.status(), 200);
    let ops = |path: &str| send(gw.api_anon(Method::GET, path));
    assert_eq!(ops("/healthz").await.status(), 200);
    assert_eq!(ops("/readyz").await.status(), 200);
    let m = ops("/metrics").await;
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
    let doc = json_of(ops("/openapi.json").await).await;
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

/// Query parameters, path parameters and numbers out of range are `400 invalid` in JSON, naming
/// the parameter: never axum's plain text, never a store error.
#[tokio::test]
async fn bad_parameters_are_json_400s_naming_the_field() {
    let gw = gateway(&pool_toml("p", NO_UPSTREAM, "limit = 1")).await;
    for (path, field) in [
        ("/admin/pools?limit=-817", "limit"),
        ("/admin/pools?limit=abc", "limit"),
        ("/admin/pools/p/access-log?limit=99999999999", "limit"),
        (
            "/admin/pools/p/access-log?since=99999999999999999999",
            "since",
        ),
        (
            "/admin/pools/p/access-log?until=9223372036854775808",
            "until",
        ),
        ("/admin/pools/p/jobs?limit=-1", "limit"),
        ("/admin/pools/p/deliveries?limit=x", "limit"),
    ] {
        let r = send(gw.api(Method::GET, path)).await;
        assert_eq!(r.status(), 400, "{path}");
        let v: Value = r
            .json()
            .await
            .unwrap_or_else(|e| panic!("{path}: not JSON: {e}"));
        assert_eq!(v["error"], "invalid", "{path}: {v}");
        assert_eq!(v["field"], field, "{path}: {v}");
        assert!(
            v["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{path}: {v}"
        );
    }
    // A key expiring past what the store can hold.
    let (status, v) = gw
        .post(
            "/admin/pools/p/keys",
            json!({"expiresAt": 9_223_372_036_854_775_808u64}),
        )
        .await;
    assert_eq!(
        (status, v["field"].as_str()),
        (400, Some("expiresAt")),
        "{v}"
    );
    // The largest allowed still works.
    let (status, v) = gw
        .post(
            "/admin/pools/p/keys",
            json!({"expiresAt": 253_402_300_799_999u64}),
        )
        .await;
    assert_eq!(status, 201, "{v}");
}

/// A pool's GET body, PUT back unchanged, changes nothing: masked values (keys shown as short
/// hashes, header values, webhook and HMAC secrets) mean "keep", and the read-only fields a GET
/// adds are ignored. The pool's key and its managed credential still work afterwards.
#[tokio::test]
async fn a_pools_get_body_put_back_changes_nothing() {
    let up = Upstream::start().await;
    let gw = gateway("").await;
    let bodies = [
        json!({"name": "plain", "upstream": up.url(), "keys": [KEY]}),
        json!({
            "name": "full", "upstream": format!("{}/v1", up.url()), "keys": [KEY, KEY2],
            "custom_domains": ["full.example.test"], "listen": "127.0.0.1:0",
            "upstream_headers": {"authorization": "Bearer sk-managed-credential-123"},
            "auth": {"accept": ["header", "bearer"]},
            "concurrency": {"limit": 3, "queue_timeout_ms": 1000},
            "async": {"enabled": true},
            "webhooks": [{"url": "https://hooks.example.test/nb", "secret": "whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0"}],
            "access": {"hmac": {"secrets": ["an-hmac-secret-of-some-length"]}, "ip_allow": ["127.0.0.0/8"]},
            "cache": {"ttl_s": 30, "vary": ["accept-language"], "shared_across_keys": true},
        }),
        // A database pool: its upstream's password is shown masked and kept on the way back.
        json!({
            "name": "db", "kind": "database", "keys": [KEY],
            "upstream": "postgres://app:db-password-never-shown@127.0.0.1:5432/test?sslmode=disable",
            "listen": "127.0.0.1:0",
            "concurrency": {"limit": 2},
            "async": {"enabled": true},
            "database": {"max_response_bytes": 4096, "statement_timeout_ms": 5000},
        }),
    ];
    for body in bodies {
        let name = body["name"].as_str().unwrap().to_string();
        let (status, created) = gw.post("/admin/pools", body).await;
        assert_eq!(status, 201, "{created}");
        let path = format!("/admin/pools/{name}");
        let (_, before) = gw.admin(Method::GET, &path, None).await;
        assert!(
            !before.to_string().contains("db-password-never-shown"),
            "{before}"
        );
        let (status, put) = gw.put(&path, before.clone()).await;
        assert_eq!(status, 200, "{name}: {put}");
        let (_, after) = gw.admin(Method::GET, &path, None).await;
        let strip = |mut v: Value| {
            v.as_object_mut().unwrap().remove("updatedAt");
            v
        };
        assert_eq!(
            strip(after),
            strip(before),
            "{name}: the round trip changed the pool"
        );
    }
    // The plain pool's key still opens it; the full pool's origin still gets the credential
    // (not its mask).
    let r = send(gw.get("plain", "/x")).await;
    assert_eq!(r.status(), 200);
    let (_, full) = gw.admin(Method::GET, "/admin/pools/full", None).await;
    let mut changed = full.clone();
    changed["concurrency"]["limit"] = json!(4);
    changed["access"] = json!({});
    let (status, v) = gw.put("/admin/pools/full", changed).await;
    assert_eq!(status, 200, "{v}");
    let r = send(gw.get("full", "/echo")).await;
    assert_eq!(r.status(), 200);
    let auth = up
        .seen()
        .last()
        .and_then(|s| s.headers.get("authorization").cloned());
    assert_eq!(
        auth.as_ref().and_then(|v| v.to_str().ok()),
        Some("Bearer sk-managed-credential-123")
    );
    // The database pool kept its password (the mask was not taken for a new one).
    let db = gw.running.state.pools.get("db").unwrap();
    assert!(db.spec.upstream.contains(":db-password-never-shown@"));
    // A shortened hash that is none of the pool's keys cannot be turned back into a key.
    let mut bogus = full.clone();
    bogus["keys"] = json!(["sha256:0000000000…"]);
    let (status, v) = gw.put("/admin/pools/full", bogus).await;
    assert_eq!((status, v["field"].as_str()), (400, Some("keys[0]")), "{v}");
}

/// A pool body's webhooks pass the same address guard as destinations added on their own.
#[tokio::test]
async fn a_pool_bodys_private_webhook_is_refused() {
    let gw = gateway("").await;
    let body = json!({
        "name": "p", "upstream": NO_UPSTREAM, "async": {"enabled": true},
        "webhooks": [{"url": "http://127.0.0.1:9/hook", "secret": WEBHOOK_SECRET}],
    });
    let (status, v) = gw.post("/admin/pools", body).await;
    assert_eq!(
        (status, v["field"].as_str()),
        (400, Some("webhooks[0].url")),
        "{v}"
    );
    assert_eq!(gw.admin(Method::GET, "/admin/pools/p", None).await.0, 404);
}

/// What GET /admin/pools/{pool} answers conforms to the schema the document gives it: every
/// field it shows is a property of `PoolView`, the read-only fields are marked so, and the
/// schema does not forbid them (before, `PoolView` was `allOf` a `PoolSpec` that forbade any
/// property but the settings).
#[tokio::test]
async fn a_pool_answer_conforms_to_its_documented_schema() {
    let gw = gateway(&pool_toml("p", NO_UPSTREAM, "limit = 1")).await;
    let doc = gw.admin_json("/openapi.json").await;
    let view = &doc["components"]["schemas"]["PoolView"];
    assert!(view.get("allOf").is_none(), "{view}");
    assert_ne!(view["additionalProperties"], json!(false), "{view}");
    let pool = gw.admin_json("/admin/pools/p").await;
    for field in pool.as_object().unwrap().keys() {
        assert!(
            view["properties"].get(field).is_some(),
            "{field} is shown but not in the PoolView schema: {view}"
        );
    }
    for read_only in ["managedBy", "createdAt", "updatedAt"] {
        assert_eq!(
            view["properties"][read_only]["readOnly"], true,
            "{read_only}"
        );
    }
    // Routes with query parameters document their 400.
    let list = &doc["paths"]["/admin/pools"]["get"]["responses"];
    assert!(list.get("400").is_some(), "{list}");
}
