//! Key changes racing pool changes (issue #12): revokes and new keys interleaved with pool
//! updates, over the real router on loopback. Whatever the interleaving, once every change has
//! been answered, the pool's in-memory key index says what the store says: a revoked key is
//! refused, a kept key works. Counts only, no timings.

use futures_util::future::join_all;
use nthbouncer_testkit::*;
use reqwest::Method;
use serde_json::{json, Value};

const KEYS: usize = 128;
/// Rounds of concurrent changes; each revokes `KEYS / 2 / ROUNDS` keys.
const ROUNDS: usize = 1;
const UPDATES: usize = 48;
const ADDS: usize = 32;

/// The pool's body for update `n`: a changing limit, and the spec's own key list changing too.
fn spec(upstream: &str, n: usize) -> Value {
    let keys: Vec<&str> = if n.is_multiple_of(2) {
        vec![KEY]
    } else {
        vec![KEY, KEY2]
    };
    json!({
        "name": "racy",
        "upstream": upstream,
        "keys": keys,
        "concurrency": {"limit": 2 + n % 5}
    })
}

/// One call with `key`, from its own client address (behind the trusted loopback proxy), so
/// the refusals of revoked keys do not throttle the checks that follow.
async fn status_with_key(gw: &Gateway, key: &str) -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let client = format!("10.{}.{}.{}", n >> 16 & 255, n >> 8 & 255, n & 255);
    send(
        gw.pool("racy", Method::GET, "/echo")
            .header("x-nthpool-key", key)
            .header("x-forwarded-for", client),
    )
    .await
    .status()
    .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_while_the_pool_is_updated_stays_revoked() {
    let up = Upstream::start().await;
    let gw = gateway("[server]\ntrusted_proxies = [\"127.0.0.1/32\"]\n").await;
    let (status, _) = gw.post("/admin/pools", spec(&up.url(), 0)).await;
    assert_eq!(status, 201);
    let mut keys = Vec::new();
    let labels: Vec<Value> = (0..KEYS)
        .map(|i| json!({"label": format!("k{i}")}))
        .collect();
    for chunk in labels.chunks(64) {
        let created = join_all(
            chunk
                .iter()
                .map(|l| gw.post("/admin/pools/racy/keys", l.clone())),
        )
        .await;
        for (status, k) in created {
            assert_eq!(status, 201, "{k}");
            keys.push((
                k["id"].as_str().unwrap().to_string(),
                k["key"].as_str().unwrap().to_string(),
            ));
        }
    }
    // Every other key is revoked, a round at a time, all of a round at once, while the pool's
    // settings change again and again and new keys are added.
    let revoked: Vec<&(String, String)> = keys.iter().step_by(2).collect();
    let kept: Vec<&(String, String)> = keys.iter().skip(1).step_by(2).collect();
    let mut added = Vec::new();
    for round in revoked.chunks(revoked.len() / ROUNDS) {
        let paths: Vec<String> = round
            .iter()
            .map(|(id, _)| format!("/admin/pools/racy/keys/{id}"))
            .collect();
        let revokes = join_all(paths.iter().map(|p| gw.delete(p)));
        let updates =
            join_all((1..=UPDATES).map(|n| gw.put("/admin/pools/racy", spec(&up.url(), n))));
        let adds = join_all((0..ADDS).map(|i| {
            gw.post(
                "/admin/pools/racy/keys",
                json!({"label": format!("late{i}")}),
            )
        }));
        let (revokes, updates, adds) = tokio::join!(revokes, updates, adds);
        for (status, body) in &revokes {
            assert_eq!(*status, 200, "revoke answered {body}");
        }
        for (status, body) in &updates {
            assert_eq!(*status, 200, "update answered {body}");
        }
        for (status, body) in &adds {
            assert_eq!(*status, 201, "key creation answered {body}");
        }
        added.extend(adds.into_iter().map(|(_, body)| body));
    }

    // The concurrent updates arrived in any order; one more settles the spec's own keys.
    assert_eq!(gw.put("/admin/pools/racy", spec(&up.url(), 0)).await.0, 200);

    let mut came_back = Vec::new();
    for (id, key) in &revoked {
        if status_with_key(&gw, key).await != 401 {
            came_back.push(id.clone());
        }
    }
    assert!(
        came_back.is_empty(),
        "revoked keys accepted again: {came_back:?}"
    );
    for (id, key) in &kept {
        assert_eq!(
            status_with_key(&gw, key).await,
            200,
            "kept key {id} refused"
        );
    }
    for body in &added {
        let key = body["key"].as_str().unwrap();
        assert_eq!(
            status_with_key(&gw, key).await,
            200,
            "a key added meanwhile is refused"
        );
    }
    // The spec's own keys follow the last update (only KEY).
    assert_eq!(status_with_key(&gw, KEY).await, 200);
    assert_eq!(status_with_key(&gw, KEY2).await, 401);

    // The admin API's list agrees with the store: every revoked key shows its revocation.
    let list = gw.admin_json("/admin/pools/racy/keys").await;
    let items = list["items"].as_array().unwrap();
    for (id, _) in &revoked {
        let item = items.iter().find(|i| i["id"] == id.as_str()).unwrap();
        assert!(item["revokedAt"].is_u64(), "{id} listed as active: {item}");
    }
}
