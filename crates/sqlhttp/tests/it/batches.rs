//! Batches: one transaction, committed or rolled back whole, with the requested settings.

use nthbouncer_sqlhttp::{IsolationLevel, WireOptions};
use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_commits_as_one_transaction() {
    let schema = Schema::new("commit").await;
    let s = &schema.name;
    let db = database(&unique("commit"), quick_limits(1)).await;
    rows(&db, &format!("CREATE TABLE {s}.t (id int PRIMARY KEY)")).await;
    let answer = run_batch(
        &db,
        json!([
            {"query": format!("INSERT INTO {s}.t VALUES ($1)"), "params": [1]},
            {"query": format!("INSERT INTO {s}.t VALUES ($1), ($2)"), "params": ["2", 3]},
            {"query": format!("SELECT count(*)::int AS n, txid_current_if_assigned() IS NOT NULL AS in_tx FROM {s}.t")},
        ]),
        WireOptions::default(),
    )
    .await
    .unwrap();
    let results = answer["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    assert_eq!(results[0]["command"], json!("INSERT"));
    assert_eq!(results[1]["rowCount"], json!(2));
    assert_eq!(results[2]["rows"], json!([{"n": 3, "in_tx": true}]));
    assert_eq!(
        rows(&db, &format!("SELECT count(*)::int AS n FROM {s}.t")).await,
        vec![json!({"n": 3})]
    );
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_error_rolls_the_whole_batch_back() {
    let schema = Schema::new("rollback").await;
    let s = &schema.name;
    let db = database(&unique("rollback"), quick_limits(1)).await;
    rows(&db, &format!("CREATE TABLE {s}.t (id int PRIMARY KEY)")).await;
    rows(&db, &format!("INSERT INTO {s}.t VALUES (1)")).await;
    let err = run_batch(
        &db,
        json!([
            {"query": format!("INSERT INTO {s}.t VALUES (2)")},
            {"query": format!("INSERT INTO {s}.t VALUES (1)")},
            {"query": format!("INSERT INTO {s}.t VALUES (3)")},
        ]),
        WireOptions::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.status(), 400);
    assert_eq!(err.db_error().unwrap().code, "23505");
    // Only the row from before the batch; and the pooled session is outside any transaction.
    assert_eq!(
        rows(
            &db,
            &format!(
                "SELECT array_agg(id)::text AS ids, txid_current_if_assigned() AS tx FROM {s}.t"
            )
        )
        .await,
        vec![json!({"ids": "{1}", "tx": null})]
    );
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolation_read_only_and_deferrable_are_honoured() {
    let db = database(&unique("isolation"), quick_limits(1)).await;
    let settings = json!([{"query": "SELECT current_setting('transaction_isolation') AS iso, \
        current_setting('transaction_read_only') AS ro, \
        current_setting('transaction_deferrable') AS def"}]);
    let cases = [
        (None, false, false, "read committed", "off", "off"),
        (
            Some(IsolationLevel::RepeatableRead),
            false,
            false,
            "repeatable read",
            "off",
            "off",
        ),
        (
            Some(IsolationLevel::ReadCommitted),
            true,
            false,
            "read committed",
            "on",
            "off",
        ),
        (
            Some(IsolationLevel::Serializable),
            true,
            true,
            "serializable",
            "on",
            "on",
        ),
    ];
    for (level, read_only, deferrable, iso, ro, def) in cases {
        let options = WireOptions {
            isolation_level: level,
            read_only,
            deferrable,
            ..WireOptions::default()
        };
        let answer = run_batch(&db, settings.clone(), options).await.unwrap();
        assert_eq!(
            answer["results"][0]["rows"][0],
            json!({"iso": iso, "ro": ro, "def": def}),
            "{level:?} read_only={read_only} deferrable={deferrable}"
        );
    }
    let read_only = WireOptions {
        read_only: true,
        ..WireOptions::default()
    };
    let err = run_batch(
        &db,
        json!([{"query": "CREATE TEMP TABLE nope (n int)"}]),
        read_only,
    )
    .await
    .unwrap_err();
    assert_eq!(err.db_error().unwrap().code, "25006");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_left_in_a_transaction_is_not_pooled() {
    let app = unique("idle");
    let db = database(&app, quick_limits(1)).await;
    let mon = monitor().await;
    let pid = |rows: Vec<serde_json::Value>| rows[0]["pid"].clone();
    let first = pid(rows(&db, "SELECT pg_backend_pid() AS pid").await);
    assert_eq!(
        first,
        pid(rows(&db, "SELECT pg_backend_pid() AS pid").await),
        "idle sessions are reused"
    );
    // A lone BEGIN leaves its session in a transaction: it must be closed, not handed on.
    rows(&db, "BEGIN").await;
    assert!(
        eventually(|| async { backends(&mon, &app, None).await == 0 }).await,
        "the session left in a transaction is still open"
    );
    assert_ne!(
        pid(rows(&db, "SELECT pg_backend_pid() AS pid").await),
        first
    );
}
