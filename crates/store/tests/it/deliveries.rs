//! The webhook delivery side of `JobStore`, on SQLite and PostgreSQL alike (`conformance!`): due
//! deliveries, recording attempts atomically with the destination's streak and deactivation,
//! redelivery rounds, secret rotation, the attempt log; and on SQLite, the upgrade of a v2
//! database that has data in it.

use nthbouncer_store::sqlite::{SqliteStore, DB_FILE_NAME, SCHEMA_VERSION};
use nthbouncer_store::{
    AttemptEnd, AttemptQuery, AttemptRecord, DeliveryNext, Finish, JobRequest, JobResult, JobStore,
    NewJob, Redeliver, StoredDestination,
};

use crate::backend::{conformance, AnyStore, Backend};

conformance!(
    due_record_retry_and_deliver,
    streaks_deactivation_gone_and_manual,
    redelivery_rounds_are_fenced,
    undeliverable_rotation_and_retention,
    expiry_writes_history_and_outbox_and_retries_are_fenced,
    a_batch_of_attempts_applies_in_order,
    a_batch_of_deliveries_applies_in_order,
    a_job_an_earlier_version_left_accepted_is_queued_once,
    a_batch_of_finishes_is_fenced_and_recorded_as_if_each_were_alone,
);

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
        destinations: 2,
        request: JobRequest {
            method: "GET".into(),
            path_and_query: "/".into(),
            headers: vec![],
            body: vec![],
        },
        request_id: Some(format!("req-{id}")),
    }
}

fn dest(id: &str, deactivate_after: u32) -> StoredDestination {
    StoredDestination {
        id: id.into(),
        pool: "p".into(),
        url: format!("https://hooks.example.com/{id}"),
        secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into(),
        active: true,
        deactivate_after,
        consecutive_failures: 0,
        deactivated_at: None,
        managed_by: "api".into(),
        created_at: 1,
        previous_secret: None,
        previous_secret_expires_at: None,
    }
}

/// Inserts and completes `id`, with one pending delivery per destination in `dests`.
async fn finished(store: &dyn AnyStore, id: &str, now: u64, dests: &[&str]) {
    store.insert_jobs(&[job(id, now)]).await.unwrap();
    let attempt = store.start_attempt(id, now).await.unwrap().unwrap();
    let dests: Vec<String> = dests.iter().map(|d| d.to_string()).collect();
    let done = Finish::Completed(JobResult {
        status: 200,
        headers: vec![],
        body: b"ok".to_vec(),
        truncated: false,
    });
    assert!(store
        .finish_attempt(id, attempt, &done, now, &dests)
        .await
        .unwrap());
}

fn record(
    due: &nthbouncer_store::DueDelivery,
    at: u64,
    status: Option<u16>,
    next: DeliveryNext,
) -> AttemptRecord {
    AttemptRecord {
        delivery_id: due.id,
        round: due.round,
        job_id: due.job.id.clone(),
        destination_id: due.destination.id.clone(),
        pool: due.job.pool.clone(),
        attempt: due.attempts + 1,
        at,
        status_code: status,
        latency_ms: 3,
        response_body: status.map(|s| format!("answered {s}")),
        error: None,
        manual: due.manual,
        next,
        gone: status == Some(410),
    }
}

/// Records `batch`; what each record changed, as `(recorded, streak_changed, deactivated)`.
async fn applied(store: &dyn AnyStore, batch: &[AttemptRecord]) -> Vec<(bool, bool, bool)> {
    let applied = store.record_attempts(batch).await.unwrap();
    applied
        .iter()
        .map(|a| (a.recorded, a.streak_changed, a.deactivated))
        .collect()
}

/// Asserts a destination's attempt log, oldest first, as `(at, outcome)`.
async fn assert_outcomes(store: &dyn AnyStore, destination_id: &str, expected: &[(u64, &str)]) {
    let mut log = store
        .list_attempts(&AttemptQuery {
            pool: "p".into(),
            destination_id: Some(destination_id.into()),
            limit: 100,
            ..AttemptQuery::default()
        })
        .await
        .unwrap();
    log.reverse();
    let got: Vec<(u64, &str)> = log.iter().map(|a| (a.at, a.outcome.as_str())).collect();
    assert_eq!(got, expected, "the attempts to {destination_id}");
}

async fn destination(store: &dyn AnyStore, id: &str) -> StoredDestination {
    store
        .list_destinations(Some("p"))
        .await
        .unwrap()
        .into_iter()
        .find(|d| d.id == id)
        .unwrap()
}

async fn due_record_retry_and_deliver(b: &Backend) {
    let store = b.open().await;
    store.create_destination(&dest("wh_a", 20)).await.unwrap();
    store.create_destination(&dest("wh_b", 20)).await.unwrap();
    finished(&*store, "job_1", 1_000, &["wh_a", "wh_b"]).await;

    // Terminal: `destinations` is the number of deliveries; none delivered or failed yet.
    let j = store.get_job("p", "job_1").await.unwrap().unwrap();
    assert_eq!((j.destinations, j.delivered, j.failed), (2, 0, 0));

    let due = store.due_deliveries("wh_a", 1_000, 10, &[]).await.unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].job.id, "job_1");
    assert_eq!(due[0].job.result.as_ref().unwrap().body, b"ok");
    assert_eq!(
        (due[0].attempts, due[0].round_attempts, due[0].manual),
        (0, 0, false)
    );
    assert!(store
        .due_deliveries("wh_a", 999, 10, &[])
        .await
        .unwrap()
        .is_empty());

    // A failure with a retry: the streak grows, the delivery is due later.
    let applied = store
        .record_attempts(&[record(
            &due[0],
            1_000,
            Some(500),
            DeliveryNext::Retry { at: 6_000 },
        )])
        .await
        .unwrap();
    assert!(applied[0].recorded && applied[0].streak_changed && !applied[0].deactivated);
    assert_eq!(destination(&*store, "wh_a").await.consecutive_failures, 1);
    assert!(store
        .due_deliveries("wh_a", 5_999, 10, &[])
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store.next_delivery_at("wh_a", 1_000).await.unwrap(),
        Some(6_000)
    );
    assert_eq!(store.next_delivery_at("wh_a", 6_000).await.unwrap(), None);

    // Then a success: delivered, streak reset, counts true.
    let due = store.due_deliveries("wh_a", 6_000, 10, &[]).await.unwrap();
    assert_eq!((due[0].attempts, due[0].round_attempts), (1, 1));
    let applied = store
        .record_attempts(&[record(&due[0], 6_000, Some(204), DeliveryNext::Delivered)])
        .await
        .unwrap();
    assert!(applied[0].streak_changed);
    assert_eq!(destination(&*store, "wh_a").await.consecutive_failures, 0);
    let j = store.get_job("p", "job_1").await.unwrap().unwrap();
    assert_eq!((j.destinations, j.delivered, j.failed), (2, 1, 0));
    assert_eq!(j.request_id.as_deref(), Some("req-job_1"));
    let ds = store.job_deliveries("job_1").await.unwrap();
    // Each delivery carries its job's request id (#13).
    assert!(ds
        .iter()
        .all(|d| d.request_id.as_deref() == Some("req-job_1")));
    let a = ds.iter().find(|d| d.destination_id == "wh_a").unwrap();
    assert_eq!(
        (
            a.status.as_str(),
            a.attempts,
            a.delivered_at,
            a.next_attempt_at
        ),
        ("delivered", 2, Some(6_000), None)
    );
    let b = ds.iter().find(|d| d.destination_id == "wh_b").unwrap();
    assert_eq!(
        (b.status.as_str(), b.next_attempt_at),
        ("pending", Some(1_000))
    );

    // The attempt log, newest first, by job, by destination, paginated.
    let q = |job: Option<&str>, dest: Option<&str>, before: Option<u64>, limit: u32| AttemptQuery {
        pool: "p".into(),
        job_id: job.map(Into::into),
        destination_id: dest.map(Into::into),
        before,
        limit,
    };
    let all = store.list_attempts(&q(None, None, None, 10)).await.unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!((all[0].attempt, all[0].status_code), (2, Some(204)));
    assert_eq!(all[0].outcome, "delivered");
    assert_eq!(all[1].outcome, "retrying");
    assert_eq!(all[1].response_body.as_deref(), Some("answered 500"));
    let page = store
        .list_attempts(&q(Some("job_1"), Some("wh_a"), Some(all[0].id), 10))
        .await
        .unwrap();
    assert_eq!(page.len(), 1);
    assert_eq!(page[0].id, all[1].id);
    assert!(store
        .list_attempts(&q(None, Some("wh_b"), None, 10))
        .await
        .unwrap()
        .is_empty());
    let other_pool = AttemptQuery {
        pool: "q".into(),
        ..q(None, None, None, 10)
    };
    assert!(store.list_attempts(&other_pool).await.unwrap().is_empty());
}

async fn streaks_deactivation_gone_and_manual(b: &Backend) {
    let store = b.open().await;
    store.create_destination(&dest("wh_a", 2)).await.unwrap();
    store.create_destination(&dest("wh_b", 20)).await.unwrap();
    for id in ["job_1", "job_2", "job_3"] {
        finished(&*store, id, 1_000, &["wh_a", "wh_b"]).await;
    }

    // Two failures in one batch: the second reaches deactivate_after = 2 and fails every other
    // pending delivery of that destination (job_3's), and its own retry.
    let due = store.due_deliveries("wh_a", 1_000, 10, &[]).await.unwrap();
    assert_eq!(due.len(), 3);
    let retry = DeliveryNext::Retry { at: 6_000 };
    let applied = store
        .record_attempts(&[
            record(&due[0], 1_000, Some(500), retry),
            record(&due[1], 1_000, None, retry),
        ])
        .await
        .unwrap();
    assert!(!applied[0].deactivated && applied[1].deactivated);
    let a = destination(&*store, "wh_a").await;
    assert!(!a.active);
    assert_eq!((a.consecutive_failures, a.deactivated_at), (2, Some(1_000)));
    for id in ["job_1", "job_2", "job_3"] {
        let j = store.get_job("p", id).await.unwrap().unwrap();
        assert_eq!((j.delivered, j.failed), (0, 1), "{id}");
    }
    assert!(
        store
            .due_deliveries("wh_a", 10_000, 10, &[])
            .await
            .unwrap()
            .is_empty(),
        "an inactive destination has nothing due"
    );
    let attempts = store
        .list_attempts(&AttemptQuery {
            pool: "p".into(),
            destination_id: Some("wh_a".into()),
            limit: 10,
            ..AttemptQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(attempts[0].outcome, "failed", "no retry after deactivation");

    // A manual failure does not count; a 410 deactivates at once, manual or not.
    let due = store.due_deliveries("wh_b", 1_000, 10, &[]).await.unwrap();
    let mut manual = record(&due[0], 1_000, Some(500), retry);
    manual.manual = true;
    let applied = store.record_attempts(&[manual]).await.unwrap();
    assert!(!applied[0].streak_changed && !applied[0].deactivated);
    assert_eq!(destination(&*store, "wh_b").await.consecutive_failures, 0);
    let applied = store
        .record_attempts(&[record(&due[1], 1_000, Some(410), DeliveryNext::Failed)])
        .await
        .unwrap();
    assert!(applied[0].deactivated);
    let b = destination(&*store, "wh_b").await;
    assert!(!b.active);
    assert_eq!(b.consecutive_failures, 1);
}

async fn redelivery_rounds_are_fenced(b: &Backend) {
    let store = b.open().await;
    store.create_destination(&dest("wh_a", 20)).await.unwrap();
    store.create_destination(&dest("wh_b", 20)).await.unwrap();
    finished(&*store, "job_1", 1_000, &["wh_a"]).await;
    let due = store.due_deliveries("wh_a", 1_000, 10, &[]).await.unwrap();

    // Unknown and unfinished jobs.
    let ids = vec!["wh_a".to_string(), "wh_b".to_string()];
    assert_eq!(
        store
            .redeliver_job("p", "job_nope", &ids, 2_000)
            .await
            .unwrap(),
        Redeliver::NoSuchJob
    );
    assert_eq!(
        store
            .redeliver_job("q", "job_1", &ids, 2_000)
            .await
            .unwrap(),
        Redeliver::NoSuchJob,
        "another pool's job"
    );
    store.insert_jobs(&[job("job_2", 1_000)]).await.unwrap();
    assert_eq!(
        store
            .redeliver_job("p", "job_2", &ids, 2_000)
            .await
            .unwrap(),
        Redeliver::NotTerminal
    );

    // Redelivered while the first attempt runs: a new round (and a new delivery to wh_b).
    assert_eq!(
        store
            .redeliver_job("p", "job_1", &ids, 2_000)
            .await
            .unwrap(),
        Redeliver::Queued(2)
    );
    // The old round's success does not close the new round.
    store
        .record_attempts(&[record(&due[0], 2_500, Some(200), DeliveryNext::Delivered)])
        .await
        .unwrap();
    let fresh = store.due_deliveries("wh_a", 3_000, 10, &[]).await.unwrap();
    assert_eq!(fresh.len(), 1);
    assert_eq!(
        (
            fresh[0].round,
            fresh[0].round_attempts,
            fresh[0].manual,
            fresh[0].attempts
        ),
        (1, 0, true, 1)
    );
    let j = store.get_job("p", "job_1").await.unwrap().unwrap();
    assert_eq!((j.destinations, j.delivered, j.failed), (2, 0, 0));
    store
        .record_attempts(&[record(&fresh[0], 3_000, Some(200), DeliveryNext::Delivered)])
        .await
        .unwrap();
    let attempts = store
        .list_attempts(&AttemptQuery {
            pool: "p".into(),
            job_id: Some("job_1".into()),
            limit: 10,
            ..AttemptQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(attempts.len(), 2);
    assert!(attempts[0].manual && !attempts[1].manual);
    assert_eq!((attempts[0].attempt, attempts[1].attempt), (2, 1));
}

async fn undeliverable_rotation_and_retention(b: &Backend) {
    let store = b.open().await;
    store.create_destination(&dest("wh_a", 20)).await.unwrap();
    finished(&*store, "job_1", 1_000, &["wh_a", "wh_gone"]).await;

    // A delivery to a destination that is not active any more fails.
    assert_eq!(
        store
            .fail_undeliverable(&["wh_a".to_string()], 2_000)
            .await
            .unwrap(),
        1
    );
    let j = store.get_job("p", "job_1").await.unwrap().unwrap();
    assert_eq!((j.destinations, j.failed), (2, 1));

    // Rotation keeps the previous secret with its expiry; no grace drops it.
    assert!(store
        .rotate_destination_secret(
            "p",
            "wh_a",
            "whsec_bmV3LW5ldy1uZXctbmV3LW5ldy1uZXctbmV3",
            Some(9_000)
        )
        .await
        .unwrap());
    let a = destination(&*store, "wh_a").await;
    assert_eq!(a.secret, "whsec_bmV3LW5ldy1uZXctbmV3LW5ldy1uZXctbmV3");
    assert_eq!(
        a.previous_secret.as_deref(),
        Some("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    );
    assert_eq!(a.previous_secret_expires_at, Some(9_000));
    let due = store.due_deliveries("wh_a", 2_000, 10, &[]).await.unwrap();
    assert_eq!(due[0].destination.previous_secret_expires_at, Some(9_000));
    assert!(store
        .rotate_destination_secret("p", "wh_a", "whsec_other", None)
        .await
        .unwrap());
    let a = destination(&*store, "wh_a").await;
    assert_eq!(
        (a.previous_secret, a.previous_secret_expires_at),
        (None, None)
    );
    assert!(!store
        .rotate_destination_secret("q", "wh_a", "whsec_x", None)
        .await
        .unwrap());

    // Retention takes the attempt log with the job.
    store
        .record_attempts(&[record(&due[0], 2_000, Some(200), DeliveryNext::Delivered)])
        .await
        .unwrap();
    let q = AttemptQuery {
        pool: "p".into(),
        limit: 10,
        ..AttemptQuery::default()
    };
    assert_eq!(store.list_attempts(&q).await.unwrap().len(), 1);
    assert_eq!(store.delete_retained(1_000 + 86_400_000).await.unwrap(), 1);
    assert!(store.list_attempts(&q).await.unwrap().is_empty());
    assert!(store.job_deliveries("job_1").await.unwrap().is_empty());
}

/// A v2 database with a job, a destination and a pending delivery in it is upgraded in place,
/// and the delivery goes on from where it was.
#[tokio::test]
async fn upgrades_a_v2_database_with_data() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(DB_FILE_NAME);
    {
        let raw = rusqlite::Connection::open(&path).unwrap();
        // The v2 shape of the tables v3 changes or reads (as shipped; v1's are not needed here).
        raw.execute_batch(
            "CREATE TABLE jobs (id TEXT PRIMARY KEY NOT NULL, pool TEXT NOT NULL, status TEXT NOT NULL,
                reason TEXT NOT NULL, key_id TEXT NOT NULL, fairness INTEGER NOT NULL, priority TEXT NOT NULL,
                created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
                retention_ms INTEGER NOT NULL, attempt INTEGER NOT NULL DEFAULT 0,
                destinations INTEGER NOT NULL DEFAULT 0, error TEXT, request TEXT NOT NULL,
                request_body BLOB NOT NULL, result TEXT, result_body BLOB);
             CREATE TABLE job_events (job_id TEXT NOT NULL, at INTEGER NOT NULL, status TEXT NOT NULL,
                attempt INTEGER NOT NULL, detail TEXT);
             CREATE TABLE webhook_destinations (id TEXT PRIMARY KEY NOT NULL, pool TEXT NOT NULL,
                url TEXT NOT NULL, secret TEXT NOT NULL, active INTEGER NOT NULL,
                deactivate_after INTEGER NOT NULL, consecutive_failures INTEGER NOT NULL DEFAULT 0,
                deactivated_at INTEGER, managed_by TEXT NOT NULL, created_at INTEGER NOT NULL);
             CREATE TABLE deliveries (id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL,
                destination_id TEXT NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
                next_attempt_at INTEGER NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
                UNIQUE (job_id, destination_id));
             CREATE INDEX deliveries_due ON deliveries (status, next_attempt_at);
             INSERT INTO jobs VALUES ('job_old', 'p', 'expired', 'requested', 'key_1', 1, 'normal',
                1000, 2000, 2000, 86400000, 0, 1, NULL,
                '{\"method\":\"GET\",\"path_and_query\":\"/\",\"headers\":[]}', x'', NULL, NULL);
             INSERT INTO webhook_destinations VALUES ('wh_a', 'p', 'https://hooks.example.com/a',
                'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw', 1, 20, 3, NULL, 'api', 1);
             INSERT INTO deliveries (job_id, destination_id, status, attempts, next_attempt_at, created_at, updated_at)
                VALUES ('job_old', 'wh_a', 'pending', 1, 7000, 2000, 2000);
             PRAGMA user_version = 2;",
        )
        .unwrap();
    }
    let store = SqliteStore::open(&path).unwrap();
    let raw = rusqlite::Connection::open(&path).unwrap();
    let version: u32 = raw
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);

    let a = destination(&store, "wh_a").await;
    assert_eq!((a.consecutive_failures, a.previous_secret), (3, None));
    let due = store.due_deliveries("wh_a", 7_000, 10, &[]).await.unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!(
        (
            due[0].attempts,
            due[0].round_attempts,
            due[0].round,
            due[0].manual
        ),
        (1, 0, 0, false)
    );
    store
        .record_attempts(&[record(&due[0], 7_000, Some(200), DeliveryNext::Delivered)])
        .await
        .unwrap();
    let j = store.get_job("p", "job_old").await.unwrap().unwrap();
    assert_eq!((j.destinations, j.delivered, j.failed), (1, 1, 0));
    assert_eq!(destination(&store, "wh_a").await.consecutive_failures, 0);
}

/// Expiry: each job with its `expired` step and one pending delivery per active
/// destination of its pool (in order, a duplicate once, the request id copied), nothing for a
/// pool without any, nothing twice. A retry applies only while its attempt holds the job.
async fn expiry_writes_history_and_outbox_and_retries_are_fenced(b: &Backend) {
    let store = b.open().await;
    let mut late = job("job_late", 20);
    late.expires_at = 1_000;
    let mut early = job("job_early", 10);
    early.expires_at = 1_000;
    let mut other = job("job_other", 5);
    other.pool = "q".into();
    other.expires_at = 900;
    let open = job("job_open", 30);
    store
        .insert_jobs(&[late, early, other, open])
        .await
        .unwrap();
    let active = std::collections::HashMap::from([(
        "p".to_string(),
        vec!["wh_b".to_string(), "wh_a".to_string(), "wh_b".to_string()],
    )]);
    let mut expired = store.expire_jobs(1_000, &active).await.unwrap();
    expired.sort();
    assert_eq!(expired, ["job_early", "job_late", "job_other"]);
    assert!(store.expire_jobs(1_001, &active).await.unwrap().is_empty());
    for id in ["job_early", "job_late"] {
        let j = store.get_job("p", id).await.unwrap().unwrap();
        assert_eq!((j.status.as_str(), j.updated_at), ("expired", 1_000));
        let last = store.job_events(id).await.unwrap().pop().unwrap();
        assert_eq!(
            (last.status.as_str(), last.at, last.attempt),
            ("expired", 1_000, 0)
        );
        let deliveries = store.job_deliveries(id).await.unwrap();
        let to: Vec<&str> = deliveries
            .iter()
            .map(|d| d.destination_id.as_str())
            .collect();
        assert_eq!(to, ["wh_b", "wh_a"], "{id}");
        for d in &deliveries {
            assert_eq!(d.status, "pending");
            assert_eq!(d.next_attempt_at, Some(1_000));
            assert_eq!(d.request_id.as_deref(), Some(format!("req-{id}").as_str()));
        }
    }
    assert!(store.job_deliveries("job_other").await.unwrap().is_empty());
    assert_eq!(
        store
            .get_job("q", "job_other")
            .await
            .unwrap()
            .unwrap()
            .status,
        "expired"
    );
    assert_eq!(
        store
            .get_job("p", "job_open")
            .await
            .unwrap()
            .unwrap()
            .status,
        "queued"
    );

    // Retries: fenced by the attempt number and the running status.
    let attempt = store.start_attempt("job_open", 40).await.unwrap().unwrap();
    assert!(!store
        .retry_attempt("job_open", attempt + 1, 41, "refused")
        .await
        .unwrap());
    assert!(store
        .retry_attempt("job_open", attempt, 42, "connect refused")
        .await
        .unwrap());
    assert!(!store
        .retry_attempt("job_open", attempt, 43, "again")
        .await
        .unwrap());
    let j = store.get_job("p", "job_open").await.unwrap().unwrap();
    assert_eq!(
        (j.status.as_str(), j.updated_at, j.error.as_deref()),
        ("queued", 42, Some("connect refused"))
    );
    let steps = store.job_events("job_open").await.unwrap();
    let last = steps.last().unwrap();
    assert_eq!(
        (
            last.status.as_str(),
            last.at,
            last.attempt,
            last.detail.as_deref()
        ),
        ("queued", 42, attempt, Some("connect refused"))
    );
    // Inserted `queued` (both first steps with the job), started, put back by the retry.
    let statuses: Vec<&str> = steps.iter().map(|s| s.status.as_str()).collect();
    assert_eq!(statuses, ["accepted", "queued", "running", "queued"]);
    assert_eq!(
        (steps[0].detail.as_deref(), steps[1].detail.as_deref()),
        (Some("requested"), None)
    );
}

/// One batch, applied record by record as if each were recorded alone: streaks that reset and
/// climb within the batch, a deactivation midway that fails what is still pending (deliveries
/// recorded before it, after it, and not at all), a delivery after it that still lands, two
/// records of one delivery, and a record whose delivery is gone.
async fn a_batch_of_attempts_applies_in_order(b: &Backend) {
    let store = b.open().await;
    store.create_destination(&dest("wh_a", 3)).await.unwrap();
    store.create_destination(&dest("wh_c", 20)).await.unwrap();
    let jobs = ["job_1", "job_2", "job_3", "job_4", "job_5"];
    for id in jobs {
        finished(&*store, id, 1_000, &["wh_a", "wh_c"]).await;
    }
    let a = store.due_deliveries("wh_a", 1_000, 10, &[]).await.unwrap();
    let c = store.due_deliveries("wh_c", 1_000, 10, &[]).await.unwrap();
    assert_eq!((a.len(), c.len()), (5, 5));
    let retry = DeliveryNext::Retry { at: 9_000 };
    let mut gone_delivery = record(&c[1], 2_090, Some(500), retry);
    gone_delivery.delivery_id = 999_999;
    let batch = [
        record(&a[0], 2_010, Some(500), retry),
        record(&a[1], 2_020, Some(200), DeliveryNext::Delivered),
        record(&c[0], 2_030, Some(500), retry),
        record(&a[2], 2_040, Some(500), retry),
        record(&a[2], 2_050, Some(502), retry),
        record(&a[3], 2_060, Some(500), retry),
        record(&a[4], 2_070, Some(200), DeliveryNext::Delivered),
        record(&a[0], 2_080, Some(500), retry),
        gone_delivery,
    ];
    assert_eq!(
        applied(&*store, &batch).await,
        [
            (true, true, false),
            (true, true, false),
            (true, true, false),
            (true, true, false),
            (true, true, false),
            (true, true, true),
            (true, true, false),
            (true, false, false),
            (false, true, false),
        ]
    );
    let wh_a = destination(&*store, "wh_a").await;
    assert_eq!(
        (wh_a.active, wh_a.consecutive_failures, wh_a.deactivated_at),
        (false, 0, Some(2_060))
    );
    let wh_c = destination(&*store, "wh_c").await;
    assert_eq!((wh_c.active, wh_c.consecutive_failures), (true, 2));

    let to_a = async |job: &str| {
        store
            .job_deliveries(job)
            .await
            .unwrap()
            .into_iter()
            .find(|d| d.destination_id == "wh_a")
            .unwrap()
    };
    let state = |d: &nthbouncer_store::DeliveryState| {
        (
            d.status.clone(),
            d.attempts,
            d.last_status,
            d.last_error.clone(),
            d.delivered_at,
            d.updated_at,
        )
    };
    let deactivated = Some("destination deactivated".to_string());
    let failed = "failed".to_string();
    let delivered = "delivered".to_string();
    assert_eq!(
        state(&to_a("job_1").await),
        (
            failed.clone(),
            2,
            Some(500),
            deactivated.clone(),
            None,
            2_060
        )
    );
    assert_eq!(
        state(&to_a("job_2").await),
        (delivered.clone(), 1, Some(200), None, Some(2_020), 2_020)
    );
    assert_eq!(
        state(&to_a("job_3").await),
        (failed.clone(), 2, Some(502), deactivated, None, 2_060)
    );
    assert_eq!(
        state(&to_a("job_4").await),
        (failed, 1, Some(500), None, None, 2_060)
    );
    assert_eq!(
        state(&to_a("job_5").await),
        (delivered, 1, Some(200), None, Some(2_070), 2_070)
    );
    let c0 = store
        .job_deliveries("job_1")
        .await
        .unwrap()
        .into_iter()
        .find(|d| d.destination_id == "wh_c")
        .unwrap();
    assert_eq!(
        (c0.status.as_str(), c0.attempts, c0.next_attempt_at),
        ("pending", 1, Some(9_000))
    );

    // The log: every record whose delivery exists, in order, with what it left behind.
    assert_outcomes(
        &*store,
        "wh_a",
        &[
            (2_010, "retrying"),
            (2_020, "delivered"),
            (2_040, "retrying"),
            (2_050, "retrying"),
            (2_060, "failed"),
            (2_070, "delivered"),
            (2_080, "retrying"),
        ],
    )
    .await;
}

/// A batch in which every attempt was delivered (PostgreSQL records it statement by statement,
/// not with the batch statement failures need) applies as if each record were alone: a streak
/// reset once (by the destination's first record), a second record of a delivered delivery
/// counted but not applied, a record of an older round fenced, a record whose delivery is gone
/// not logged, and a delivery that had failed attempts delivered.
async fn a_batch_of_deliveries_applies_in_order(b: &Backend) {
    let store = b.open().await;
    store.create_destination(&dest("wh_a", 20)).await.unwrap();
    store.create_destination(&dest("wh_b", 20)).await.unwrap();
    for id in ["job_1", "job_2", "job_3"] {
        finished(&*store, id, 1_000, &["wh_a", "wh_b"]).await;
    }
    let a = store.due_deliveries("wh_a", 1_000, 10, &[]).await.unwrap();
    let wb = store.due_deliveries("wh_b", 1_000, 10, &[]).await.unwrap();
    assert_eq!((a.len(), wb.len()), (3, 3));
    let retry = DeliveryNext::Retry { at: 1_700 };
    let failures = [
        record(&a[2], 1_500, Some(500), retry),
        record(&a[2], 1_600, Some(503), retry),
    ];
    store.record_attempts(&failures).await.unwrap();
    assert_eq!(destination(&*store, "wh_a").await.consecutive_failures, 2);
    let wh_a = vec!["wh_a".to_string()];
    assert_eq!(
        store
            .redeliver_job("p", "job_2", &wh_a, 1_800)
            .await
            .unwrap(),
        Redeliver::Queued(1)
    );

    let delivered = DeliveryNext::Delivered;
    let mut gone_delivery = record(&wb[1], 2_040, Some(200), delivered);
    gone_delivery.delivery_id = 999_999;
    let batch = [
        record(&a[0], 2_000, Some(200), delivered),
        record(&wb[0], 2_010, Some(204), delivered),
        record(&a[0], 2_020, Some(200), delivered),
        record(&a[1], 2_030, Some(200), delivered),
        gone_delivery,
        record(&a[2], 2_050, Some(201), delivered),
    ];
    assert_eq!(
        applied(&*store, &batch).await,
        [
            (true, true, false),
            (true, false, false),
            (true, false, false),
            (true, false, false),
            (false, false, false),
            (true, false, false),
        ]
    );
    let wh_a = destination(&*store, "wh_a").await;
    assert_eq!((wh_a.active, wh_a.consecutive_failures), (true, 0));

    let to = async |job: &str, dest: &str| {
        let d = store
            .job_deliveries(job)
            .await
            .unwrap()
            .into_iter()
            .find(|d| d.destination_id == dest)
            .unwrap();
        (
            d.status,
            d.attempts,
            d.last_status,
            d.last_error,
            d.delivered_at,
            d.updated_at,
        )
    };
    let (done, pending) = ("delivered".to_string(), "pending".to_string());
    assert_eq!(
        to("job_1", "wh_a").await,
        (done.clone(), 2, Some(200), None, Some(2_000), 2_000),
        "the second record of a delivered delivery is counted, not applied"
    );
    assert_eq!(
        to("job_1", "wh_b").await,
        (done.clone(), 1, Some(204), None, Some(2_010), 2_010)
    );
    assert_eq!(
        to("job_2", "wh_a").await,
        (pending, 1, None, None, None, 1_800),
        "an older round's success does not close the redelivery"
    );
    assert_eq!(
        to("job_3", "wh_a").await,
        (done, 3, Some(201), None, Some(2_050), 2_050)
    );

    assert_outcomes(
        &*store,
        "wh_a",
        &[
            (1_500, "retrying"),
            (1_600, "retrying"),
            (2_000, "delivered"),
            (2_020, "delivered"),
            (2_030, "delivered"),
            (2_050, "delivered"),
        ],
    )
    .await;
    // No log row for a delivery that is gone.
    assert_outcomes(&*store, "wh_b", &[(2_010, "delivered")]).await;
}

/// Jobs are inserted `queued` (with both first history steps); a row an earlier version stored
/// `accepted` is still moved on by `mark_queued`, once, and nothing else is.
async fn a_job_an_earlier_version_left_accepted_is_queued_once(b: &Backend) {
    let store = b.open().await;
    store
        .insert_jobs(&[job("job_old", 1_000), job("job_new", 1_001)])
        .await
        .unwrap();
    let statuses = |steps: Vec<nthbouncer_store::JobEvent>| -> Vec<String> {
        steps.into_iter().map(|s| s.status).collect()
    };
    assert_eq!(
        statuses(store.job_events("job_new").await.unwrap()),
        ["accepted", "queued"]
    );
    // As an earlier version left it: `accepted`, its one history step.
    b.execute_raw(
        "UPDATE jobs SET status = 'accepted' WHERE id = 'job_old'; \
         DELETE FROM job_events WHERE job_id = 'job_old' AND status = 'queued';",
    )
    .await;
    let store = b.open().await;
    assert_eq!(
        store.get_job("p", "job_old").await.unwrap().unwrap().status,
        "accepted"
    );
    for at in [2_000, 2_001] {
        store.mark_queued("job_old", at).await.unwrap();
        store.mark_queued("job_new", at).await.unwrap();
    }
    for id in ["job_old", "job_new"] {
        assert_eq!(
            store.get_job("p", id).await.unwrap().unwrap().status,
            "queued"
        );
        assert_eq!(
            statuses(store.job_events(id).await.unwrap()),
            ["accepted", "queued"],
            "{id}"
        );
    }
    let old = store.job_events("job_old").await.unwrap();
    assert_eq!((old[0].at, old[1].at), (1_000, 2_000));
}

/// Several attempts finished in one call (`finish_attempts`, one statement on PostgreSQL): each
/// is fenced on its own row (a superseded attempt, a queued job and an unknown one change
/// nothing), and each finished one gets its terminal state, its history step and its outbox
/// rows (in order, a repeated destination once) as `finish_attempt` would write them alone.
async fn a_batch_of_finishes_is_fenced_and_recorded_as_if_each_were_alone(b: &Backend) {
    let store = b.open().await;
    store.create_destination(&dest("wh_a", 20)).await.unwrap();
    store.create_destination(&dest("wh_b", 20)).await.unwrap();
    let ids = ["job_ok", "job_failed", "job_superseded", "job_queued"];
    store
        .insert_jobs(&ids.map(|id| job(id, 1_000)))
        .await
        .unwrap();
    for id in &ids[..3] {
        assert_eq!(store.start_attempt(id, 1_001).await.unwrap(), Some(1));
    }
    // Restarted (as after a crash): attempt 1 no longer holds the job.
    assert_eq!(
        store.start_attempt("job_superseded", 1_002).await.unwrap(),
        Some(2)
    );

    let done = Finish::Completed(JobResult {
        status: 201,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: b"made".to_vec(),
        truncated: false,
    });
    let failed = Finish::Failed("the origin hung up".into());
    let both: Vec<String> = ["wh_b", "wh_a", "wh_b"].map(String::from).to_vec();
    let one = vec!["wh_a".to_string()];
    let end = |id, attempt, finish, now, destination_ids| AttemptEnd {
        id,
        attempt,
        finish,
        now,
        destination_ids,
    };
    let finished = store
        .finish_attempts(&[
            end("job_failed", 1, &failed, 2_000, &one),
            end("job_ok", 1, &done, 2_001, &both),
            end("job_superseded", 1, &done, 2_002, &one),
            end("job_queued", 1, &done, 2_003, &one),
            end("job_unknown", 1, &done, 2_004, &one),
        ])
        .await
        .unwrap();
    assert_eq!(finished, vec![true, true, false, false, false]);

    let ok = store.get_job("p", "job_ok").await.unwrap().unwrap();
    assert_eq!(
        (ok.status.as_str(), ok.updated_at, ok.attempt),
        ("completed", 2_001, 1)
    );
    let result = ok.result.unwrap();
    assert_eq!((result.status, result.body.as_slice()), (201, &b"made"[..]));
    assert_eq!(
        result.headers,
        vec![("content-type".into(), "text/plain".into())]
    );
    let bad = store.get_job("p", "job_failed").await.unwrap().unwrap();
    assert_eq!(
        (bad.status.as_str(), bad.updated_at, bad.error.as_deref()),
        ("failed", 2_000, Some("the origin hung up"))
    );
    assert_eq!(bad.result, None);
    for (id, at, status, detail) in [
        ("job_ok", 2_001, "completed", None),
        ("job_failed", 2_000, "failed", Some("the origin hung up")),
    ] {
        let last = store.job_events(id).await.unwrap().pop().unwrap();
        assert_eq!(
            (
                last.at,
                last.status.as_str(),
                last.attempt,
                last.detail.as_deref()
            ),
            (at, status, 1, detail),
            "{id}"
        );
    }
    // Fenced off: untouched, no history step, no delivery.
    let superseded = store.get_job("p", "job_superseded").await.unwrap().unwrap();
    assert_eq!(
        (superseded.status.as_str(), superseded.attempt),
        ("running", 2)
    );
    let queued = store.get_job("p", "job_queued").await.unwrap().unwrap();
    assert_eq!(queued.status.as_str(), "queued");
    for id in ["job_superseded", "job_queued"] {
        assert_eq!(store.job_deliveries(id).await.unwrap(), vec![], "{id}");
        let last = store.job_events(id).await.unwrap().pop().unwrap();
        assert_ne!(last.at, 2_002, "{id}");
        assert_ne!(last.at, 2_003, "{id}");
    }

    // The outbox: each finished job's destinations in its order, a repeat once, with the
    // job's request id; the batch's jobs in the batch's order.
    let ok_rows = store.job_deliveries("job_ok").await.unwrap();
    let failed_rows = store.job_deliveries("job_failed").await.unwrap();
    let mut rows: Vec<_> = failed_rows.iter().chain(&ok_rows).collect();
    rows.sort_by_key(|d| d.id);
    let seen: Vec<String> = rows
        .iter()
        .map(|d| {
            format!(
                "{} {} {} {:?} {:?}",
                d.job_id, d.destination_id, d.status, d.next_attempt_at, d.request_id
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            r#"job_failed wh_a pending Some(2000) Some("req-job_failed")"#,
            r#"job_ok wh_b pending Some(2001) Some("req-job_ok")"#,
            r#"job_ok wh_a pending Some(2001) Some("req-job_ok")"#,
        ]
    );
    assert!(store.finish_attempts(&[]).await.unwrap().is_empty());
}
