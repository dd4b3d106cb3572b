//! What only the PostgreSQL store does: its schema version and refusal of a newer one, claims
//! shared by several stores (nodes) on one database, and a database that does not answer. The
//! rest of its behaviour is the conformance suite's (`store`, `deliveries`, `backlog`).

use std::collections::HashMap;

use nthbouncer_store::postgres::{PgStore, CLAIM_LEASE_MS, SCHEMA_VERSION};
use nthbouncer_store::{
    Finish, JobRequest, JobResult, JobStore, NewJob, Store, StoreError, StoredDestination,
    StoredKey, StoredPool, UnfinishedJob,
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

/// One node's store on the test database, claiming with [`CLAIM_LEASE_MS`].
async fn node(db: &TestDb) -> PgStore {
    PgStore::connect_node(&db.url, CLAIM_LEASE_MS)
        .await
        .unwrap()
}

/// A job's attempt finished: 200, body `ok`.
fn completed_ok() -> Finish {
    Finish::Completed(JobResult {
        status: 200,
        headers: vec![],
        body: b"ok".to_vec(),
        truncated: false,
    })
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

/// The joins the store makes between jobs, their events, deliveries and destinations can use
/// an index. Columns compared across tables must share a collation: a "C" key against a column
/// in the database's collation is compared in "C", and no index in the other collation answers
/// it (every job read used to scan all of `deliveries`). With sequential scans priced out, a
/// plan that still scans a table has no index it could use.
#[tokio::test]
async fn joins_between_jobs_and_their_deliveries_use_indexes() {
    let db = TestDb::create().await;
    let store = node(&db).await;
    store.create_destination(&dest("wh_1")).await.unwrap();
    store.insert_jobs(&[job("job_1", 1)]).await.unwrap();
    let raw = db.raw().await;
    let collations = raw
        .query(
            "SELECT table_name || '.' || column_name, COALESCE(collation_name, 'default') \
             FROM information_schema.columns WHERE table_schema = current_schema() AND \
             column_name IN ('job_id', 'destination_id', 'pool', 'id') AND data_type = 'text' \
             ORDER BY 1",
            &[],
        )
        .await
        .unwrap();
    let collations: Vec<(String, String)> =
        collations.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert!(collations.len() >= 10, "{collations:?}");
    for (column, collation) in &collations {
        assert_eq!(collation, "C", "{column} (all: {collations:?})");
    }

    raw.execute("SET enable_seqscan = off", &[]).await.unwrap();
    for (what, sql) in [
        (
            "a job with its delivery counts",
            "SELECT j.id, (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = j.id) \
             FROM jobs j WHERE j.id = ANY('{job_1}'::TEXT[])",
        ),
        (
            "the events of retained jobs",
            "DELETE FROM job_events WHERE job_id IN (SELECT id FROM jobs WHERE id = 'job_1')",
        ),
        (
            "a destination's next due delivery",
            "SELECT MIN(next_attempt_at) FROM deliveries \
             WHERE destination_id = 'wh_1' AND status = 'pending' AND next_attempt_at > 5",
        ),
        (
            "the attempts of a job",
            "SELECT a.id FROM jobs j JOIN delivery_attempts a ON a.job_id = j.id \
             WHERE j.id = 'job_1'",
        ),
        (
            "deliveries with their destination",
            "SELECT d.id FROM webhook_destinations w JOIN deliveries d \
             ON d.destination_id = w.id WHERE w.id = 'wh_1'",
        ),
    ] {
        let plan: Vec<String> = raw
            .query(&format!("EXPLAIN {sql}"), &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(
            !plan.iter().any(|line| line.contains("Seq Scan")),
            "{what}: {}",
            plan.join("\n")
        );
    }
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
    let (a, b) = (node(&db).await, node(&db).await);
    assert_ne!(a.node_id(), b.node_id());
    a.create_destination(&dest("d")).await.unwrap();
    let now = 1_000;
    a.insert_jobs(&[job("j1", now), job("j2", now + 1)])
        .await
        .unwrap();
    for id in ["j1", "j2"] {
        let attempt = a.start_attempt(id, now).await.unwrap().unwrap();
        let done = completed_ok();
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

    // Jobs: each node holds what it accepted; what a node runs it renews; a claim that lapsed
    // is taken over by one node, and the other may not start the job meanwhile.
    b.insert_jobs(&[job("j3", now)]).await.unwrap();
    a.insert_jobs(&[job("j4", now)]).await.unwrap();
    let ids = |page: Option<Vec<UnfinishedJob>>| -> Vec<String> {
        page.unwrap().into_iter().map(|u| u.job.id).collect()
    };
    assert!(ids(b.claim_jobs(now + 5, &[], 10).await.unwrap()).is_empty());
    let held = ["j4".to_string()];
    assert!(ids(a.claim_jobs(now + 5, &held, 10).await.unwrap()).is_empty());
    // b stopped renewing j3 (as if dead): a takes it over, j4 stays a's.
    let lapse = now + CLAIM_LEASE_MS;
    assert_eq!(ids(a.claim_jobs(lapse, &held, 10).await.unwrap()), ["j3"]);
    assert!(ids(b.claim_jobs(lapse, &[], 10).await.unwrap()).is_empty());
    assert_eq!(
        b.start_attempt("j3", lapse).await.unwrap(),
        None,
        "a holds it"
    );
    // The same in a batch: neither of a's jobs starts on b.
    let both = [("j3".to_string(), lapse), ("j4".to_string(), lapse)];
    assert_eq!(
        b.start_attempts_with_body(&both).await.unwrap(),
        vec![None, None]
    );
    assert_eq!(a.start_attempt("j3", lapse).await.unwrap(), Some(1));
    // a dies: once its claims lapse, b takes both over, once.
    let later = lapse + CLAIM_LEASE_MS + 10;
    assert_eq!(
        ids(b.claim_jobs(later, &[], 10).await.unwrap()),
        ["j3", "j4"]
    );
    assert!(ids(a.claim_jobs(later, &[], 10).await.unwrap()).is_empty());
    assert_eq!(b.start_attempt("j3", later).await.unwrap(), Some(2));
    let expire = a.expire_jobs(u64::MAX / 4, &HashMap::new()).await.unwrap();
    assert_eq!(expire, vec!["j3", "j4"]);

    // What a tool inserts (`migrate-store`) no node holds: the first claim pass takes it.
    let tool = PgStore::connect(&db.url).await.unwrap();
    tool.insert_jobs(&[job("j5", later)]).await.unwrap();
    assert_eq!(ids(a.claim_jobs(later, &[], 10).await.unwrap()), ["j5"]);
}

/// A node stopping gracefully gives back its claims on the jobs it has not started and (when
/// asked) on its pending deliveries, so another node takes them at once; a job of its still
/// `running` keeps its claim, and another node's claims are not touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_node_gives_back_the_claims_of_what_it_has_not_started() {
    let db = TestDb::create().await;
    let (a, b) = (node(&db).await, node(&db).await);
    a.create_destination(&dest("d")).await.unwrap();
    let now = 1_000;
    // On a: j1 and j2 queued (as inserted), j3 running, j4 completed (its delivery claimed); on
    // b: j5.
    a.insert_jobs(&[job("j1", now), job("j2", now + 1), job("j3", now + 2)])
        .await
        .unwrap();
    a.insert_jobs(&[job("j4", now + 3)]).await.unwrap();
    b.insert_jobs(&[job("j5", now + 4)]).await.unwrap();
    assert_eq!(a.start_attempt("j3", now + 5).await.unwrap(), Some(1));
    let attempt = a.start_attempt("j4", now + 5).await.unwrap().unwrap();
    let done = completed_ok();
    assert!(a
        .finish_attempt("j4", attempt, &done, now + 6, &["d".into()])
        .await
        .unwrap());
    assert_eq!(
        a.due_deliveries("d", now + 7, 10, &[]).await.unwrap().len(),
        1
    );
    let ids = |page: Option<Vec<UnfinishedJob>>| -> Vec<String> {
        page.unwrap().into_iter().map(|u| u.job.id).collect()
    };
    assert!(ids(b.claim_jobs(now + 8, &[], 10).await.unwrap()).is_empty());
    assert!(b
        .due_deliveries("d", now + 8, 10, &[])
        .await
        .unwrap()
        .is_empty());

    // Deliveries stay claimed unless asked for; b's own job is not a's to give back.
    let released = a.release_claims(false).await.unwrap();
    assert_eq!((released.jobs, released.deliveries), (2, 0));
    assert!(b
        .due_deliveries("d", now + 9, 10, &[])
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        ids(b.claim_jobs(now + 9, &[], 10).await.unwrap()),
        ["j1", "j2"],
        "b takes what a gave back at once; j3's attempt may still be live on a"
    );
    assert_eq!(b.start_attempt("j3", now + 9).await.unwrap(), None);
    let released = a.release_claims(true).await.unwrap();
    assert_eq!((released.jobs, released.deliveries), (0, 1));
    assert_eq!(
        b.due_deliveries("d", now + 10, 10, &[])
            .await
            .unwrap()
            .len(),
        1
    );
    // Released again by b (its claims now): nothing of a's left, j3 still a's.
    let released = b.release_claims(true).await.unwrap();
    assert_eq!((released.jobs, released.deliveries), (3, 1));
    assert!(ids(b.claim_jobs(now + 11, &[], 10).await.unwrap()).len() == 3);
    assert_eq!(b.start_attempt("j3", now + 11).await.unwrap(), None);
}

/// The settings version moves with every change to pools, keys and destinations (so the other
/// nodes re-read them), and not with jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_settings_version_moves_with_pools_keys_and_destinations() {
    let db = TestDb::create().await;
    let s = PgStore::connect(&db.url).await.unwrap();
    let version = async || s.settings_version().await.unwrap().unwrap();
    let v0 = version().await;
    let pool = StoredPool {
        name: "p".into(),
        spec: serde_json::json!({"name": "p"}),
        created_at: 1,
        updated_at: 1,
    };
    s.create_pool(&pool).await.unwrap();
    let v1 = version().await;
    assert!(v1 > v0);
    let key = StoredKey {
        id: "key_1".into(),
        pool: "p".into(),
        hash: "00".into(),
        label: None,
        created_at: 1,
        expires_at: None,
        revoked_at: None,
    };
    s.create_key(&key).await.unwrap();
    let v2 = version().await;
    assert!(v2 > v1);
    assert!(s.revoke_key("p", "key_1", 2).await.unwrap());
    let v3 = version().await;
    assert!(v3 > v2);
    s.create_destination(&dest("d")).await.unwrap();
    let v4 = version().await;
    assert!(v4 > v3);
    s.insert_jobs(&[job("j1", 10)]).await.unwrap();
    assert_eq!(version().await, v4, "jobs are no settings");
    assert!(s
        .update_pool("p", &serde_json::json!({"name": "p", "x": 1}), 3)
        .await
        .unwrap());
    assert!(version().await > v4);
}

/// `sslmode=verify-ca|verify-full` against the machine's PostgreSQL, when it serves TLS with
/// Debian's self-signed "snakeoil" certificate (named by host name, never by address): the
/// server's own certificate as `sslrootcert` passes `verify-ca` on 127.0.0.1 but not
/// `verify-full` (the address is not a name it carries), and a CA that did not sign it passes
/// neither. Skipped (saying so) on a server without TLS or with another certificate.
#[tokio::test]
async fn verify_modes_check_the_real_servers_certificate() {
    let db = TestDb::create().await;
    let raw = db.raw().await;
    let show = async |what: &str| -> String {
        raw.query_one(&format!("SHOW {what}"), &[])
            .await
            .unwrap()
            .get(0)
    };
    let cert_file = show("ssl_cert_file").await;
    if show("ssl").await != "on" || !cert_file.contains("snakeoil") {
        eprintln!("skipped: the local PostgreSQL does not serve TLS with a snakeoil certificate");
        return;
    }
    if std::fs::metadata(&cert_file).is_err() {
        eprintln!("skipped: cannot read the server's certificate {cert_file}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let stranger = dir.path().join("stranger.pem");
    std::fs::write(
        &stranger,
        nthbouncer_testkit::tls::Ca::new("stranger").pem(),
    )
    .unwrap();
    let url = |mode: &str, root: &std::path::Path| {
        format!("{}?sslmode={mode}&sslrootcert={}", db.url, root.display())
    };
    let ours = std::path::Path::new(&cert_file);

    let store = PgStore::connect(&url("verify-ca", ours)).await;
    assert!(
        store.is_ok(),
        "verify-ca with the server's own CA: {:?}",
        store.err()
    );
    let ssl_used: bool = raw
        .query_one(
            "SELECT bool_or(ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a ON a.pid = s.pid \
             WHERE a.datname = current_database() AND a.application_name = 'nthbouncer'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, Option<bool>>(0)
        .unwrap_or(false);
    assert!(ssl_used, "the store's connections are not encrypted");
    drop(store);

    for (mode, root) in [
        ("verify-full", ours),
        ("verify-full", stranger.as_path()),
        ("verify-ca", stranger.as_path()),
        (
            "require",
            ours.parent().unwrap().join("nothing.pem").as_path(),
        ),
    ] {
        let refused = PgStore::connect(&url(mode, root)).await;
        assert!(refused.is_err(), "{mode} with {} connected", root.display());
    }
}
