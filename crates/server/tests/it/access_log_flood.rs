//! A flood of unauthenticated requests with huge paths (issue #12), over the real router on
//! loopback: the access log folds the refusals of the flooding address into a few rows whose
//! counts add up to the refusals, cuts their paths, keeps every admitted request's row, and
//! lock grants and admitted requests go on working. Time is a `ManualClock` (the flood falls
//! in one fold window); counts only, no timings.

use futures_util::stream::{self, StreamExt};
use nthbouncer_testkit::*;
use reqwest::Method;
use serde_json::Value;

const FLOOD: usize = 2_000;
const ADMITTED: usize = 20;
const FLOODER: &str = "10.9.8.7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_fold_and_admitted_rows_stay() {
    let up = Upstream::start().await;
    let toml = format!(
        "[server]\ntrusted_proxies = [\"127.0.0.1/32\"]\n{}",
        pool_toml("p", &up.url(), "limit = 4")
    );
    let (gw, _clock) = clocked(&toml).await;
    let long_path = format!("/{}", "a".repeat(60 * 1024));

    // The flood: no key, a 60 KiB path, one client address (behind the trusted proxy).
    let flood = stream::iter(0..FLOOD)
        .map(|_| {
            gw.pool("p", Method::GET, &long_path)
                .header("x-forwarded-for", FLOODER)
                .send()
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>();
    // Meanwhile, admitted requests from another address.
    let admitted = async {
        let mut statuses = Vec::new();
        for i in 0..ADMITTED {
            let r = send(gw.get("p", &format!("/echo?n={i}"))).await;
            statuses.push(r.status().as_u16());
        }
        statuses
    };
    let (flooded, admitted) = tokio::join!(flood, admitted);
    let mut refused = 0;
    for r in flooded {
        let status = r.unwrap().status().as_u16();
        assert!(
            status == 401 || status == 429,
            "a refusal answered {status}"
        );
        refused += 1;
    }
    assert_eq!(refused, FLOOD);
    assert!(admitted.iter().all(|s| *s == 200), "{admitted:?}");

    // Afterwards a lock grant and an admitted request still work.
    let r = gw.raw_post("/pools/p/lock/acquire").await;
    assert_eq!(r.status(), 200, "lock grant after the flood");
    let grant: Value = r.json().await.unwrap();
    let slot = grant["slotId"].as_str().unwrap();
    assert_eq!(
        gw.raw_post(&format!("/pools/p/lock/{slot}/release"))
            .await
            .status(),
        200
    );
    assert_eq!(send(gw.get("p", "/echo?after=1")).await.status(), 200);

    gw.flush_access_log().await;
    let log = gw.admin_json("/admin/pools/p/access-log?limit=1000").await;
    let items = log["items"].as_array().unwrap();
    let flooder: Vec<&Value> = items
        .iter()
        .filter(|i| i["clientAddr"] == FLOODER)
        .collect();
    // The unknown-key refusals until the throttle, then the throttled ones: two kinds of
    // refusal, each one row (the clock did not move out of the fold window).
    assert!(
        !flooder.is_empty() && flooder.len() <= 4,
        "{} rows for the flooding address",
        flooder.len()
    );
    let counted: u64 = flooder.iter().map(|i| i["count"].as_u64().unwrap()).sum();
    assert_eq!(
        counted, FLOOD as u64,
        "the folded counts add up to the refusals"
    );
    for row in &flooder {
        let route = row["route"].as_str().unwrap();
        assert!(route.len() <= 512, "a route of {} bytes kept", route.len());
        assert!(route.ends_with("…[cut]"), "{route}");
        assert!(route.starts_with("proxy GET /aaaa"), "{route}");
    }
    let admitted_rows: Vec<&Value> = items
        .iter()
        .filter(|i| i["outcome"] == "admitted")
        .collect();
    assert_eq!(
        admitted_rows.len(),
        ADMITTED + 2,
        "every admitted request and the lock grant have their own row"
    );
    assert!(admitted_rows.iter().all(|i| i["count"] == 1));
    assert_eq!(up.total(), ADMITTED as u64 + 1);
}
