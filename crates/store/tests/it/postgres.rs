//! What only the PostgreSQL store does: its schema version and refusal of a newer one, claims
//! shared by several stores (nodes) on one database, and a database that does not answer. The
//! rest of its behaviour is the conformance suite's (`store`, `deliveries`, `backlog`).

use std::collections::HashMap;

use nthbouncer_store::postgres::{PgStore, CLAIM_LEASE_MS, SCHEMA_VERSION};
use nthbouncer_store::{
    Finish, JobRequest, JobResult, JobStore, NewJob, Store, StoreError, StoredDestination,
};

use crate::backend::TestDb;

fn job(id: &str, now: u64) -> NewJob {
    NewJob {
        id: id.into(),
        pool: "p".into(),
        reason: "requested".into(),
        key_id: "key_1".into(),
        fairness: 1,
        priority: "normal".into(),
        created_at: now,
        expires_at: now + 86_400_000,
        retention_ms: 86_400_000,
        destinations: 1,
        request: JobRequest {
            method: "POST".into(),
            path_and_query: "/v1/x".into(),
            headers: vec![],
            body: b"{}".to_vec(),
        },
        request_id: None,
    }
}

fn dest(id: &str) -> StoredDestination {
    StoredDestination {
        id: id.into(),
        pool: "p".into(),
        url: "https://hooks.example/in".into(),
        secret: "whsec_x".into(),
        active: true,
        deactivate_after: 5,
        consecutive_failures: 0,
        deactivated_at: None,
        managed_by: "api".into(),
        created_at: 1,
        previous_secret: None,
        previous_secret_expires_at: None,
    }
}

#[tokio::test]
async fn migrates_once_and_refuses_a_newer_schema() {
    let db = TestDb::create().await;
    // Two nodes starting at once on an empty database: one migrates, the other waits for it.
    let (a, b) = tokio::join!(PgStore::connect(&db.url), PgStore::connect(&db.url));
    a.unwrap().ping().await.unwrap();
    drop(b.unwrap());
    let raw = db.raw().await;
    let version: i64 = raw
        .query_one("SELECT version FROM nthbouncer_schema", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, SCHEMA_VERSION);

    raw.execute(
        "UPDATE nthbouncer_schema SET version = $1",
        &[&(SCHEMA_VERSION + 1)],
    )
    .await
    .unwrap();
    let err = PgStore::connect(&db.url).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Backend(m) if m.contains("newer")),
        "{err}"
    );
}

#[tokio::test]
async fn a_database_that_does_not_answer_fails_fast_and_names_no_password() {
    // Nothing listens on port 1.
    let err = PgStore::connect("postgres://app:hunter2-secret@127.0.0.1:1/db")
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, StoreError::Backend(_)), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
}

/// Two nodes on one database: a due delivery goes to one of them until its claim lease ends
/// (each still sees its own claims, as a single node does), and an unfinished job is taken over
/// by `claim_jobs` only when no live node holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_and_jobs_are_claimed_by_one_node_at_a_time() {
    let db = TestDb::create().await;
    let (a, b) = (db.open().await, db.open().await);
    assert_ne!(a.node_id(), b.node_id());
    a.create_destination(&dest("d")).await.unwrap();
    let now = 1_000;
    a.insert_jobs(&[job("j1", now), job("j2", now + 1)])
        .await
        .unwrap();
    for id in ["j1", "j2"] {
        let attempt = a.start_attempt(id, now).await.unwrap().unwrap();
        let done = Finish::Completed(JobResult {
            status: 200,
            headers: vec![],
            body: b"ok".to_vec(),
            truncated: false,
        });
        assert!(a
            .finish_attempt(id, attempt, &done, now + 2, &["d".into()])
            .await
            .unwrap());
    }

    let on_a = a.due_deliveries("d", now + 10, 1, &[]).await.unwrap();
    assert_eq!(on_a.len(), 1);
    let on_b = b.due_deliveries("d", now + 10, 10, &[]).await.unwrap();
    assert_eq!(on_b.len(), 1, "b gets only the delivery a did not claim");
    assert_ne!(on_a[0].id, on_b[0].id);
    // Each node is handed its own claims again; the other's stay hidden until their lease ends.
    assert_eq!(
        a.due_deliveries("d", now + 10, 10, &[])
            .await
            .unwrap()
            .len(),
        1
    );
    let later = now + 10 + CLAIM_LEASE_MS;
    assert_eq!(
        b.due_deliveries("d", later, 10, &[]).await.unwrap().len(),
        2
    );

    // Jobs: a holds what it accepted; once its claims lapse, b takes them over, once.
    b.insert_jobs(&[job("j3", now)]).await.unwrap();
    a.insert_jobs(&[job("j4", now)]).await.unwrap();
    assert!(b.claim_jobs(now + 5, 10).await.unwrap() == vec!["j3".to_string()]);
    assert_eq!(a.renew_job_claims(now + 5).await.unwrap(), 1);
    let lapse = now + 5 + CLAIM_LEASE_MS;
    assert_eq!(b.claim_jobs(lapse, 10).await.unwrap(), vec!["j3", "j4"]);
    assert!(a.claim_jobs(lapse, 10).await.unwrap().is_empty());
    let expire = a.expire_jobs(u64::MAX / 4, &HashMap::new()).await.unwrap();
    assert_eq!(expire, vec!["j3", "j4"]);
}
