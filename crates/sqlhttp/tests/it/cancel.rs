//! A statement whose caller went away, or whose answer outgrew the cap, is cancelled on the
//! server and its session closed.

use std::time::Duration;

use nthbouncer_sqlhttp::{Limits, SqlHttpError, SqlRequest, WireOptions};
use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_request_cancels_its_query() {
    let app = unique("dropped");
    let db = database(&app, quick_limits(2)).await;
    let mon = monitor().await;
    let request = SqlRequest::from_slice(br#"{"query":"SELECT pg_sleep(30)"}"#).unwrap();
    let running = {
        let db = db.clone();
        tokio::spawn(async move { db.execute(&request, &WireOptions::default()).await })
    };
    assert!(
        eventually(|| async { backends(&mon, &app, Some("%pg_sleep(30)%")).await == 1 }).await,
        "the query never showed up in pg_stat_activity"
    );
    running.abort();
    assert!(running.await.unwrap_err().is_cancelled());
    assert!(
        eventually(|| async { backends(&mon, &app, None).await == 0 }).await,
        "the abandoned query's backend is still there"
    );
    // The pool gave its slot back and works.
    assert_eq!(rows(&db, "SELECT 1 AS one").await, vec![json!({"one": 1})]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_caller_cancels_its_batch() {
    let app = unique("timedout");
    let db = database(&app, quick_limits(1)).await;
    let mon = monitor().await;
    let request = SqlRequest::from_slice(
        br#"{"queries":[{"query":"SELECT 1"},{"query":"SELECT pg_sleep(30)"}]}"#,
    )
    .unwrap();
    let result = tokio::time::timeout(
        Duration::from_millis(300),
        db.execute(&request, &WireOptions::default()),
    )
    .await;
    assert!(result.is_err(), "pg_sleep(30) cannot finish in 300 ms");
    assert!(
        eventually(|| async { backends(&mon, &app, None).await == 0 }).await,
        "the abandoned transaction's backend is still there"
    );
    assert_eq!(rows(&db, "SELECT 2 AS two").await, vec![json!({"two": 2})]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_cap_the_answer_stops_and_the_query_is_cancelled() {
    let app = unique("cap");
    let limits = Limits {
        max_response_bytes: 64 * 1024,
        ..quick_limits(1)
    };
    let db = database(&app, limits).await;
    let mon = monitor().await;
    // Rows stream out of a set-returning function in the select list; unbounded but for us.
    let err = run(
        &db,
        "SELECT g, repeat('x', 100) AS pad FROM (SELECT generate_series(1, 2000000000) AS g) s",
        json!([]),
        WireOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, SqlHttpError::ResponseTooLarge { max_bytes: 65536 }),
        "{err:?}"
    );
    assert_eq!(err.status(), 507);
    assert_eq!(err.body()["error"], json!("response_too_large"));
    assert!(
        eventually(|| async { backends(&mon, &app, Some("%generate_series%")).await == 0 }).await,
        "the cancelled query still runs"
    );
    assert!(
        eventually(|| async { backends(&mon, &app, None).await == 0 }).await,
        "the session of the cancelled query is still open"
    );

    // One row larger than the cap is refused from its length alone.
    let err = run(
        &db,
        "SELECT repeat('y', 1000000) AS big",
        json!([]),
        WireOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, SqlHttpError::ResponseTooLarge { .. }),
        "{err:?}"
    );

    // A batch counts all its results together.
    let err = run_batch(
        &db,
        json!([{"query": "SELECT repeat('z', 40000) AS a"}, {"query": "SELECT repeat('z', 40000) AS b"}]),
        WireOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, SqlHttpError::ResponseTooLarge { .. }),
        "{err:?}"
    );

    // Under the cap all is well, on a fresh session.
    assert_eq!(
        rows(&db, "SELECT 3 AS three").await,
        vec![json!({"three": 3})]
    );
}
