//! Array mode against object mode, per-query overrides, command tags and row counts.

use nthbouncer_sqlhttp::{SqlRequest, WireOptions};
use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_by_default_arrays_on_request() {
    let db = database(&unique("modes"), quick_limits(1)).await;
    let q = "SELECT 1 AS a, 'x' AS b UNION ALL SELECT 2, NULL";
    let objects = run(&db, q, json!([]), WireOptions::default())
        .await
        .unwrap();
    assert_eq!(
        objects["rows"],
        json!([{"a": 1, "b": "x"}, {"a": 2, "b": null}])
    );
    assert_eq!(objects["rowAsArray"], json!(false));
    assert_eq!(objects["rowCount"], json!(2));

    let arrays = run(&db, q, json!([]), array_mode()).await.unwrap();
    assert_eq!(arrays["rows"], json!([[1, "x"], [2, null]]));
    assert_eq!(arrays["rowAsArray"], json!(true));
    assert_eq!(arrays["fields"], objects["fields"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bodys_array_mode_overrides_the_header() {
    let db = database(&unique("override"), quick_limits(1)).await;
    let body =
        br#"{"queries":[{"query":"SELECT 1 AS a","arrayMode":false},{"query":"SELECT 2 AS a"}]}"#;
    let request = SqlRequest::from_slice(body).unwrap();
    let answer = db.execute(&request, &array_mode()).await.unwrap();
    let answer: serde_json::Value = serde_json::from_slice(answer.body()).unwrap();
    assert_eq!(answer["results"][0]["rows"], json!([{"a": 1}]));
    assert_eq!(answer["results"][1]["rows"], json!([[2]]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_and_row_counts_come_from_the_tag() {
    let schema = Schema::new("tags").await;
    let s = &schema.name;
    let db = database(&unique("tags"), quick_limits(1)).await;
    let check = |answer: serde_json::Value, command: &str, count: serde_json::Value| {
        assert_eq!(answer["command"], json!(command), "{answer}");
        assert_eq!(answer["rowCount"], count, "{answer}");
    };
    let opts = WireOptions::default;
    check(
        run(
            &db,
            &format!("CREATE TABLE {s}.t (n int)"),
            json!([]),
            opts(),
        )
        .await
        .unwrap(),
        "CREATE",
        json!(null),
    );
    check(
        run(
            &db,
            &format!("INSERT INTO {s}.t SELECT generate_series(1, 5)"),
            json!([]),
            opts(),
        )
        .await
        .unwrap(),
        "INSERT",
        json!(5),
    );
    check(
        run(
            &db,
            &format!("UPDATE {s}.t SET n = n + 1 WHERE n > 3"),
            json!([]),
            opts(),
        )
        .await
        .unwrap(),
        "UPDATE",
        json!(2),
    );
    let returning = run(
        &db,
        &format!("DELETE FROM {s}.t WHERE n < 3 RETURNING n"),
        json!([]),
        opts(),
    )
    .await
    .unwrap();
    check(returning.clone(), "DELETE", json!(2));
    assert_eq!(returning["rows"], json!([{"n": 1}, {"n": 2}]));
    let empty = run(&db, "", json!([]), opts()).await.unwrap();
    check(empty.clone(), "", json!(null));
    assert_eq!(empty["fields"], json!([]));
    assert_eq!(empty["rows"], json!([]));
    schema.drop_now().await;
}
