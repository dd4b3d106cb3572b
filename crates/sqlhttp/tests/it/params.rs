//! Parameters as the driver sends them: text, with types the server infers.

use nthbouncer_sqlhttp::{SqlRequest, WireOptions};
use serde_json::json;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_of_every_json_kind() {
    let db = database(&unique("params"), quick_limits(1)).await;
    // Written by hand: the big number must reach us with all its digits.
    let body = r#"{"query": "SELECT $1::int4 + $2::int4 AS sum, $3::text IS NULL AS null_is_null, $4 AS quoted, $5::bool AS flag, $6::numeric AS big, $7::jsonb -> 'k' AS obj, $8::int4[] AS arr, $9::text[] AS texts, $10::bytea AS bin",
        "params": ["40", 2, null, "it's \"quoted\" \\", true, 12345678901234567890123,
                   {"k": [1, 2]}, [1, null, 3], ["a,b", "NULL", null, "x\"y"], "\\x0102"]}"#;
    let request = SqlRequest::from_slice(body.as_bytes()).unwrap();
    let answer = db.execute(&request, &WireOptions::default()).await.unwrap();
    let answer: serde_json::Value = serde_json::from_slice(answer.body()).unwrap();
    assert_eq!(
        answer["rows"][0],
        json!({
            "sum": 42, "null_is_null": true, "quoted": "it's \"quoted\" \\", "flag": true,
            "big": "12345678901234567890123", "obj": [1, 2], "arr": [1, null, 3],
            "texts": ["a,b", "NULL", null, "x\"y"], "bin": "\\x0102",
        })
    );
    // An untyped parameter is inferred as text by the server.
    let type_of = |i: usize| answer["fields"][i]["dataTypeID"].clone();
    assert_eq!(type_of(1), json!(16));
    assert_eq!(type_of(2), json!(25));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parameter_count_mismatch_is_postgres_error() {
    let db = database(&unique("paramcount"), quick_limits(1)).await;
    let err = run(&db, "SELECT $1::int", json!([1, 2]), WireOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.status(), 400);
    assert_eq!(err.db_error().unwrap().code, "08P01");
    // The session is still fine for the next caller.
    assert_eq!(rows(&db, "SELECT 1 AS one").await, vec![json!({"one": 1})]);
}
