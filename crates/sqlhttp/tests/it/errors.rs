//! Errors: PostgreSQL's fields as Neon answers them, and the failures of our own.

use std::time::Duration;

use nthbouncer_sqlhttp::{Database, Limits, SqlHttpError, WireOptions};
use serde_json::json;

use crate::support::*;

fn body(e: &SqlHttpError) -> serde_json::Value {
    serde_json::Value::Object(e.body())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_violation_names_constraint_table_and_detail() {
    let schema = Schema::new("unique").await;
    let s = &schema.name;
    let db = database(&unique("unique"), quick_limits(1)).await;
    rows(
        &db,
        &format!("CREATE TABLE {s}.users (email text CONSTRAINT users_email_key UNIQUE)"),
    )
    .await;
    rows(&db, &format!("INSERT INTO {s}.users VALUES ('a@x')")).await;
    let err = run(
        &db,
        &format!("INSERT INTO {s}.users VALUES ($1)"),
        json!(["a@x"]),
        WireOptions::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.status(), 400);
    let b = body(&err);
    assert_eq!(b["error"], json!("sql_error"));
    assert_eq!(b["code"], json!("23505"));
    assert_eq!(b["constraint"], json!("users_email_key"));
    assert_eq!(b["table"], json!("users"));
    assert_eq!(b["schema"], json!(s));
    assert_eq!(b["detail"], json!("Key (email)=(a@x) already exists."));
    assert_eq!(b["severity"], json!("ERROR"));
    assert!(b["message"].as_str().unwrap().contains("users_email_key"));
    for present in ["file", "line", "routine"] {
        assert!(b[present].is_string(), "{present}: {b}");
    }
    // Every Neon field is in the body, null when PostgreSQL did not send it.
    for key in [
        "hint",
        "position",
        "internalPosition",
        "internalQuery",
        "where",
        "column",
        "dataType",
    ] {
        assert!(b.get(key).is_some(), "{key} missing: {b}");
    }
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn syntax_errors_give_their_position() {
    let db = database(&unique("syntax"), quick_limits(1)).await;
    let err = run(
        &db,
        "SELECT 1 FROM WHERE",
        json!([]),
        WireOptions::default(),
    )
    .await
    .unwrap_err();
    let b = body(&err);
    assert_eq!(b["code"], json!("42601"));
    assert_eq!(b["position"], json!("15"));

    // Inside dynamic SQL the position is internal, with the internal query and its context.
    let err = run(
        &db,
        "DO $$ BEGIN EXECUTE 'SELECT 1 FROM WHERE'; END $$",
        json!([]),
        WireOptions::default(),
    )
    .await
    .unwrap_err();
    let b = body(&err);
    assert_eq!(b["code"], json!("42601"));
    assert_eq!(b["position"], json!(null));
    assert_eq!(b["internalPosition"], json!("15"));
    assert_eq!(b["internalQuery"], json!("SELECT 1 FROM WHERE"));
    assert!(b["where"].as_str().unwrap().contains("EXECUTE"), "{b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_statement_timeout_applies_to_every_session() {
    let limits = Limits {
        statement_timeout: Some(Duration::from_millis(100)),
        ..quick_limits(1)
    };
    let db = database(&unique("timeout"), limits).await;
    let err = run(
        &db,
        "SELECT pg_sleep(10)",
        json!([]),
        WireOptions::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.db_error().unwrap().code, "57014");
    assert_eq!(
        rows(&db, "SHOW statement_timeout").await,
        vec![json!({"statement_timeout": "100ms"})]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_is_not_a_sql_error() {
    // Port 1 on loopback: nothing listens there.
    let db = Database::new("postgres://u:pw@127.0.0.1:1/db", quick_limits(1)).unwrap();
    let err = run(&db, "SELECT 1", json!([]), WireOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, SqlHttpError::Unreachable { .. }), "{err:?}");
    assert_eq!(err.status(), 502);
    assert_eq!(body(&err)["error"], json!("upstream_unreachable"));
    assert!(err.is_retry_safe());
    assert!(
        err.to_string().contains("postgres://u@127.0.0.1:1/db"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_connections_is_told_apart() {
    // A role allowed no connection at all gets 53300 at once, like a full server.
    let role = unique("limited");
    let admin = database("sqlhttp_admin", quick_limits(1)).await;
    rows(&admin, &format!("DROP ROLE IF EXISTS {role}")).await;
    rows(
        &admin,
        &format!("CREATE ROLE {role} LOGIN CONNECTION LIMIT 0"),
    )
    .await;
    let db = Database::new(
        &format!("postgres://{role}@127.0.0.1:5432/test"),
        quick_limits(1),
    )
    .unwrap();
    let err = run(&db, "SELECT 1", json!([]), WireOptions::default())
        .await
        .unwrap_err();
    rows(&admin, &format!("DROP ROLE {role}")).await;
    assert!(err.is_too_many_connections(), "{err:?}");
    assert!(err.is_retry_safe());
    assert_eq!(err.status(), 429);
    assert_eq!(body(&err)["code"], json!("53300"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_input_names_its_field() {
    let mut headers = http::HeaderMap::new();
    headers.insert("Neon-Batch-Isolation-Level", "Chaos".parse().unwrap());
    let err = WireOptions::from_headers(&headers).unwrap_err();
    assert_eq!(err.status(), 400);
    assert_eq!(
        body(&err),
        json!({"error": "invalid", "field": "Neon-Batch-Isolation-Level",
               "message": "must be ReadUncommitted, ReadCommitted, RepeatableRead or Serializable"})
    );
    let err =
        nthbouncer_sqlhttp::SqlRequest::from_slice(br#"{"queries":[{"query":7}]}"#).unwrap_err();
    assert_eq!(body(&err)["field"], json!("queries[0].query"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_never_shows() {
    const SECRET: &str = "Sup3r-S3cret-Pw";
    let base = base_url().await;
    let with_password = base.replacen("@", &format!(":{SECRET}@"), 1);
    let mut seen = Vec::new();

    // A working pool (trust auth ignores the password): its Debug, its SQL errors.
    let db = Database::new(
        &format!("{with_password}?application_name={}", unique("secret")),
        quick_limits(1),
    )
    .unwrap();
    seen.push(format!("{db:?}"));
    seen.push(db.redacted_url());
    let err = run(&db, "SELECT nope", json!([]), WireOptions::default())
        .await
        .unwrap_err();
    seen.push(format!("{err} {err:?} {}", body(&err)));

    // Nothing listening; a closed pool; a refused TLS requirement; an unparsable URL.
    let down = Database::new(
        &format!("postgres://u:{SECRET}@127.0.0.1:1/db"),
        quick_limits(1),
    )
    .unwrap();
    let err = down.check().await.unwrap_err();
    seen.push(format!("{err} {err:?} {}", body(&err)));
    down.close();
    let err = down.check().await.unwrap_err();
    seen.push(format!("{err} {err:?}"));
    let tls = Database::new(&format!("{with_password}?sslmode=require"), quick_limits(1)).unwrap();
    let err = tls.check().await.unwrap_err();
    seen.push(format!("{err} {err:?} {}", body(&err)));
    for bad in [
        format!("postgres://u:{SECRET}@/db"),
        format!("postgres://u:{SECRET}@h/db?sslmode=sometimes"),
        format!("http://u:{SECRET}@h/db"),
    ] {
        let err = Database::new(&bad, Limits::default()).unwrap_err();
        seen.push(format!("{err} {err:?} {}", body(&err)));
    }
    for text in seen {
        assert!(!text.contains(SECRET), "the password leaked: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_when_the_url_requires_it() {
    // The machine's PostgreSQL serves the snakeoil certificate, issued to `localhost`.
    let Ok(ca) = std::fs::read("/etc/ssl/certs/ssl-cert-snakeoil.pem") else {
        panic!("the server's certificate is not at /etc/ssl/certs/ssl-cert-snakeoil.pem");
    };
    let base = base_url().await.replace("127.0.0.1", "localhost");
    let db = Database::with_ca(&format!("{base}?sslmode=require"), quick_limits(1), &ca).unwrap();
    let answer = rows(
        &db,
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .await;
    assert_eq!(answer, vec![json!({"ssl": true})]);
    // Without that CA the certificate is not trusted, and nothing is sent in the clear.
    let untrusted = Database::new(&format!("{base}?sslmode=require"), quick_limits(1)).unwrap();
    let err = untrusted.check().await.unwrap_err();
    assert!(matches!(err, SqlHttpError::Unreachable { .. }), "{err:?}");
}
