//! The unfinished-job backlog, on SQLite and PostgreSQL alike: counted per pool for
//! `async.max_pending`, resumed in pages without request bodies, each body loaded when its
//! job's turn comes; and finished jobs deleted once their retention is over, however many.

use nthbouncer_store::{Finish, JobCursor, JobRequest, NewJob, UnfinishedJob};

use crate::backend::{conformance, AnyStore, Backend};

conformance!(
    the_backlog_is_counted_paged_without_bodies_and_bodies_load_on_demand,
    retention_deletes_every_due_job_and_nothing_else,
);

fn job(id: &str, pool: &str, created_at: u64, body: &[u8]) -> NewJob {
    NewJob {
        id: id.into(),
        pool: pool.into(),
        reason: "requested".into(),
        key_id: "key_1".into(),
        fairness: 1,
        priority: "normal".into(),
        created_at,
        expires_at: created_at + 86_400_000,
        retention_ms: 86_400_000,
        destinations: 0,
        request: JobRequest {
            method: "POST".into(),
            path_and_query: format!("/v1/{id}"),
            headers: vec![("content-type".into(), "application/json".into())],
            body: body.to_vec(),
        },
        request_id: None,
    }
}

async fn all_pages(store: &dyn AnyStore, limit: u32) -> Vec<Vec<UnfinishedJob>> {
    let mut pages = Vec::new();
    let mut after: Option<JobCursor> = None;
    loop {
        let page = store
            .unfinished_jobs_page(after.as_ref(), limit)
            .await
            .unwrap();
        let Some(last) = page.last() else {
            return pages;
        };
        after = Some(JobCursor::after(&last.job));
        pages.push(page);
    }
}

/// Before, the only way to resume was `unfinished_jobs`, which loads every pending job with its
/// body at once (a large backlog crash-looped a restart) and nothing counted a pool's backlog.
async fn the_backlog_is_counted_paged_without_bodies_and_bodies_load_on_demand(b: &Backend) {
    let store = b.open().await;
    // Two jobs share a creation time: the id breaks the tie.
    store
        .insert_jobs(&[
            job("job_c", "p", 1_000, b"body c"),
            job("job_a", "p", 2_000, &[7u8; 4096]),
            job("job_b", "p", 2_000, b""),
            job("job_q1", "q", 1_500, b"q one"),
            job("job_d", "p", 3_000, b"body d"),
            job("job_done", "p", 500, b"finished"),
            job("job_q2", "q", 4_000, b"q two"),
        ])
        .await
        .unwrap();
    let attempt = store.start_attempt("job_done", 600).await.unwrap().unwrap();
    assert!(store
        .finish_attempt("job_done", attempt, &Finish::Failed("x".into()), 700, &[])
        .await
        .unwrap());
    // A running job is still unfinished.
    store.start_attempt("job_d", 3_100).await.unwrap().unwrap();

    assert_eq!(store.count_unfinished_jobs("p").await.unwrap(), 4);
    assert_eq!(store.count_unfinished_jobs("q").await.unwrap(), 2);
    assert_eq!(store.count_unfinished_jobs("none").await.unwrap(), 0);
    assert_eq!(
        store.unfinished_job_counts().await.unwrap(),
        vec![("p".to_string(), 4), ("q".to_string(), 2)]
    );

    let pages = all_pages(&*store, 2).await;
    assert_eq!(
        pages.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![2, 2, 2]
    );
    let listed: Vec<&UnfinishedJob> = pages.iter().flatten().collect();
    let ids: Vec<&str> = listed.iter().map(|u| u.job.id.as_str()).collect();
    assert_eq!(
        ids,
        vec!["job_c", "job_q1", "job_a", "job_b", "job_d", "job_q2"]
    );
    for u in &listed {
        // Everything but the body, exactly as stored.
        let mut full = store
            .get_job(&u.job.pool, &u.job.id)
            .await
            .unwrap()
            .unwrap();
        let body = std::mem::take(&mut full.request.body);
        assert_eq!(u.job, full);
        assert_eq!(u.body_len, body.len() as u64);
        assert_eq!(store.job_request_body(&u.job.id).await.unwrap(), Some(body));
    }
    assert_eq!(listed[4].job.status, "running");
    assert_eq!(store.job_request_body("job_nope").await.unwrap(), None);

    // The cursor is a position: it holds even if the job it names finished meanwhile.
    let cursor = JobCursor::after(&listed[1].job);
    // An attempt starts with its body in hand (one round trip where the store can).
    let body = store.job_request_body("job_q1").await.unwrap().unwrap();
    let (attempt, started_body) = store
        .start_attempt_with_body("job_q1", 5_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((attempt, started_body), (1, body));
    assert!(store
        .finish_attempt("job_q1", attempt, &Finish::Failed("x".into()), 5_000, &[])
        .await
        .unwrap());
    // Terminal or gone: nothing to start.
    for id in ["job_q1", "job_nope"] {
        assert_eq!(
            store.start_attempt_with_body(id, 5_001).await.unwrap(),
            None
        );
    }
    let next = store.unfinished_jobs_page(Some(&cursor), 2).await.unwrap();
    let next: Vec<&str> = next.iter().map(|u| u.job.id.as_str()).collect();
    assert_eq!(next, vec!["job_a", "job_b"]);
    assert_eq!(store.count_unfinished_jobs("q").await.unwrap(), 1);

    // The old all-at-once read still works, bodies included.
    let all = store.unfinished_jobs().await.unwrap();
    assert_eq!(all.len(), 5);
    assert_eq!(all[1].request.body, vec![7u8; 4096]);

    // Several starts at once: each answered in order, as if alone (a finished job and an
    // unknown one get nothing; a running one starts its next attempt).
    let batch: Vec<(String, u64)> = [
        ("job_a", 6_000),
        ("job_q1", 6_001),
        ("job_nope", 6_002),
        ("job_d", 6_003),
        ("job_b", 6_004),
    ]
    .iter()
    .map(|(id, at)| (id.to_string(), *at))
    .collect();
    let started = store.start_attempts_with_body(&batch).await.unwrap();
    assert_eq!(
        started,
        vec![
            Some((1, vec![7u8; 4096])),
            None,
            None,
            Some((2, b"body d".to_vec())),
            Some((1, Vec::new())),
        ]
    );
    for (id, at, attempt) in [
        ("job_a", 6_000, 1),
        ("job_d", 6_003, 2),
        ("job_b", 6_004, 1),
    ] {
        let j = store.get_job("p", id).await.unwrap().unwrap();
        assert_eq!(
            (j.status.as_str(), j.attempt, j.updated_at),
            ("running", attempt, at),
            "{id}"
        );
        let last = store.job_events(id).await.unwrap().pop().unwrap();
        assert_eq!(
            (last.status.as_str(), last.at, last.attempt),
            ("running", at, attempt),
            "{id}"
        );
    }
    assert_eq!(store.start_attempts_with_body(&[]).await.unwrap(), vec![]);
}

/// More retained jobs than one delete batch (PostgreSQL deletes in bounded batches): calls
/// go on until every due one is gone, their history with them; an unfinished job and a job
/// whose retention is not over stay.
async fn retention_deletes_every_due_job_and_nothing_else(b: &Backend) {
    let store = b.open().await;
    let day = 86_400_000;
    let many: Vec<NewJob> = (0..1_200)
        .map(|i| job(&format!("job_{i:05}"), "p", 0, b""))
        .collect();
    store.insert_jobs(&many).await.unwrap();
    // All expire at `day`, terminal from then on for one more day.
    let expired = store
        .expire_jobs(day, &std::collections::HashMap::new())
        .await
        .unwrap();
    assert_eq!(expired.len(), 1_200);
    let mut late = job("job_late", "p", 0, b"");
    late.retention_ms = 3 * day;
    store.insert_jobs(&[late]).await.unwrap();
    store
        .expire_jobs(day, &std::collections::HashMap::new())
        .await
        .unwrap();
    store
        .insert_jobs(&[job("job_open", "p", day, b"")])
        .await
        .unwrap();
    assert_eq!(store.delete_retained(2 * day - 1).await.unwrap(), 0);
    let mut deleted = 0;
    for _ in 0..100 {
        match store.delete_retained(2 * day).await.unwrap() {
            0 => break,
            n => deleted += n,
        }
    }
    assert_eq!(deleted, 1_200);
    assert!(store.get_job("p", "job_00000").await.unwrap().is_none());
    assert!(store.job_events("job_00000").await.unwrap().is_empty());
    assert!(store.get_job("p", "job_late").await.unwrap().is_some());
    assert_eq!(store.count_unfinished_jobs("p").await.unwrap(), 1);
}
