//! The connection cap holds under a flood, and the cap can move.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;

use futures_util::future::join_all;
use nthbouncer_sqlhttp::WireOptions;
use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_holds_under_a_flood() {
    const CAP: usize = 3;
    let app = unique("flood");
    let db = database(&app, quick_limits(CAP)).await;
    let mon = monitor().await;

    // A watcher samples this pool's backends while the flood runs.
    let done = Arc::new(AtomicBool::new(false));
    let most_seen = Arc::new(AtomicI64::new(0));
    let watcher = {
        let (done, most_seen, app) = (done.clone(), most_seen.clone(), app.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                let n = backends(&mon, &app, None).await;
                most_seen.fetch_max(n, Ordering::Relaxed);
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
    };

    // Each query also counts its pool's backends from inside.
    let flood = (0..60).map(|i| {
        let db = db.clone();
        let app = app.clone();
        async move {
            run(
                &db,
                "SELECT (SELECT count(*) FROM pg_stat_activity WHERE application_name = $1)::int AS n, \
                 pg_sleep(0.01)::text AS slept, $2::int AS i",
                json!([app, i]),
                WireOptions::default(),
            )
            .await
            .unwrap()
        }
    });
    let answers = join_all(flood).await;
    done.store(true, Ordering::Relaxed);
    watcher.await.unwrap();

    assert_eq!(answers.len(), 60);
    for (i, answer) in answers.iter().enumerate() {
        let row = &answer["rows"][0];
        assert_eq!(row["i"], json!(i));
        let n = row["n"].as_i64().unwrap();
        assert!((1..=CAP as i64).contains(&n), "query {i} saw {n} backends");
    }
    let most = most_seen.load(Ordering::Relaxed);
    assert!(most <= CAP as i64, "the watcher saw {most} backends");
    let status = db.status();
    assert!(status.open <= CAP, "{status:?}");
    assert_eq!(status.max, CAP);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_cap_closes_the_extra_sessions() {
    let app = unique("resize");
    let db = database(&app, quick_limits(4)).await;
    let mon = monitor().await;
    let burst = (0..8).map(|_| {
        let db = db.clone();
        async move {
            run(
                &db,
                "SELECT pg_sleep(0.05)",
                json!([]),
                WireOptions::default(),
            )
            .await
            .unwrap()
        }
    });
    join_all(burst).await;
    db.set_max_connections(1);
    assert_eq!(db.status().max, 1);
    let burst = (0..4).map(|_| {
        let db = db.clone();
        let app = app.clone();
        async move {
            run(
                &db,
                "SELECT (SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state = 'active')::int AS n",
                json!([app]),
                WireOptions::default(),
            )
            .await
            .unwrap()["rows"][0]["n"]
                .as_i64()
                .unwrap()
        }
    });
    for n in join_all(burst).await {
        assert_eq!(n, 1, "only one session may be busy once the cap is 1");
    }
    assert!(
        eventually(|| async { backends(&mon, &app, None).await <= 1 }).await,
        "sessions past the lowered cap stayed open"
    );
}
