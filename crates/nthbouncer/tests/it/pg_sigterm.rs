//! A graceful stop on a shared store (issue #17): two real nodes on one Redis and one
//! PostgreSQL database, with a claim lease of a minute. Node A accepts every job (so holds every
//! claim) and is SIGTERMed while its first fetches are in flight: those finish and are recorded,
//! and A gives back the claims of the jobs it had not started before it exits. Node B takes
//! them at its next claim pass and completes them long before A's claims would have lapsed.
//! Every job completes once, and reaches the origin once.
//!
//! No timing is asserted as such: the wait for B is bounded well inside the lease (A renewed
//! its claims at most a claim pass, 5 s, before the stop, so they would have held for at least
//! 55 s after it), so B can only have finished in time if A gave its claims back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::pg::{admin_client, TestDb};
use nthbouncer_testkit::{header, ok, pool_toml, serve_http, wait_until, webhook_toml};

use crate::scale_out::{redis_url, Space, SERIAL};
use crate::BIN;

const JOBS: usize = 12;
/// The pool's limit, shared by both nodes through Redis.
const LIMIT: usize = 2;
/// The claim lease: long, so a job taken over on its lapse could not finish within the wait.
const LEASE_MS: u64 = 60_000;

/// Requests per `Idempotency-Key` (the job id).
type Seen = Arc<Mutex<HashMap<String, u64>>>;

/// An upstream that counts each request's `Idempotency-Key` on arrival and answers `done`
/// 800 ms later: the SIGTERM lands while A's fetches are in flight.
async fn slow_upstream() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let addr = serve_http(move |req| {
        let s = s.clone();
        async move {
            *s.lock()
                .unwrap()
                .entry(header(&req, "idempotency-key"))
                .or_default() += 1;
            tokio::time::sleep(Duration::from_millis(800)).await;
            ok(b"done")
        }
    })
    .await;
    (format!("http://{addr}"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_sigtermed_gives_back_its_claims_and_another_finishes_its_jobs_at_once() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let db = TestDb::create().await;
    let (up, seen) = slow_upstream().await;
    let hooks: Seen = Arc::default();
    let h = hooks.clone();
    let hook = serve_http(move |req| {
        let h = h.clone();
        async move {
            *h.lock()
                .unwrap()
                .entry(header(&req, "webhook-id"))
                .or_default() += 1;
            ok(b"")
        }
    })
    .await;
    let server = space.server_toml(
        &redis_url(),
        &format!(
            "store = \"{}\"\nstore_claim_lease_ms = {LEASE_MS}\nshutdown_grace_ms = 30000\n\
             allow_private_webhooks = true\n",
            db.url
        ),
    );
    let pools = pool_toml(
        "p",
        &up,
        &format!("limit = {LIMIT}\nadaptive = false\nqueue_timeout_ms = 60000"),
    ) + &format!(
        "[pools.async]\nenabled = true\n{}",
        webhook_toml(&format!("http://{hook}/hook"))
    );
    let config = format!("{server}{pools}");
    let mut a = Server::start(BIN, "info", reqwest::Client::new(), &config).await;
    let b = Server::start(BIN, "info", reqwest::Client::new(), &config).await;

    let mut ids = Vec::with_capacity(JOBS);
    for i in 0..JOBS {
        let r = a
            .pool("p", reqwest::Method::POST, &format!("/work/{i}"))
            .header("x-nthpool-async", "1")
            .send()
            .await;
        let (status, body) = match r {
            Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
            Err(e) => (0, e.to_string()),
        };
        assert_eq!(status, 202, "{body}\nnode A's log:\n{}", a.log_tail(6_000));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        ids.push(v["jobId"].as_str().unwrap().to_owned());
    }
    let pg = admin_client(&db.url).await;
    // Every job accepted on A is claimed by A (by its insert).
    let holders: Vec<Option<String>> = pg
        .query("SELECT DISTINCT claimed_by FROM jobs", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let [Some(node_a)] = holders.as_slice() else {
        panic!("the jobs accepted on A are not all claimed by A: {holders:?}");
    };

    // SIGTERM once A's first fetches are at the origin; the other jobs wait in its gate.
    let in_flight = wait_until(2000, Duration::from_millis(5), async || {
        !seen.lock().unwrap().is_empty()
    })
    .await;
    assert!(in_flight, "the jobs never reached the origin");
    a.sigterm();
    let exit = a.exited().await;
    assert!(
        exit.success(),
        "exit status {exit:?}\n{}",
        a.log_tail(4_000)
    );

    // A finished what it had started and kept no claim on what it had not.
    let row = pg
        .query_one(
            "SELECT COUNT(*) FILTER (WHERE status IN ('accepted', 'queued', 'running')), \
                    COUNT(*) FILTER (WHERE status IN ('accepted', 'queued', 'running') \
                                     AND claimed_by = $1) FROM jobs",
            &[node_a],
        )
        .await
        .unwrap();
    let (unfinished, still_held): (i64, i64) = (row.get(0), row.get(1));
    assert!(
        unfinished > 0,
        "A finished every job before it stopped; the test proves nothing"
    );
    assert_eq!(
        still_held,
        0,
        "A kept claims on jobs it did not run\n{}",
        a.log_tail(4_000)
    );

    // B completes them within 40 s of the stop: A's claims would have held for 55 s at least.
    let mut last = 0;
    let done = wait_until(400, Duration::from_millis(100), async || {
        last = pg
            .query_one("SELECT COUNT(*) FROM jobs WHERE status = 'completed'", &[])
            .await
            .unwrap()
            .get::<_, i64>(0);
        last == JOBS as i64
    })
    .await;
    assert!(
        done,
        "{last} of {JOBS} jobs completed within 40 s of A's stop (the lease is {LEASE_MS} ms)\n\
         node B's log:\n{}",
        b.log_tail(8_000)
    );
    b.wait_completed("p", &ids, "done").await;

    // Once each: one completed step, one attempt, one call at the origin.
    let seen = seen.lock().unwrap().clone();
    for r in pg
        .query(
            "SELECT id, attempt, (SELECT COUNT(*) FROM job_events e \
               WHERE e.job_id = jobs.id AND e.status = 'completed') FROM jobs",
            &[],
        )
        .await
        .unwrap()
    {
        let (id, attempt, completed): (String, i64, i64) = (r.get(0), r.get(1), r.get(2));
        assert_eq!(completed, 1, "job {id} completed {completed} times");
        assert_eq!(attempt, 1, "job {id} was attempted {attempt} times");
        assert_eq!(seen.get(&id), Some(&1), "job {id} at the origin: {seen:?}");
    }
    assert_eq!(seen.len(), JOBS, "distinct jobs at the origin");

    // And every job's webhook went out (B sends those A had not).
    let mut got = 0;
    let delivered = wait_until(400, Duration::from_millis(100), async || {
        let hooks = hooks.lock().unwrap();
        got = ids.iter().filter(|id| hooks.contains_key(*id)).count();
        got == JOBS
    })
    .await;
    assert!(delivered, "{got} of {JOBS} webhooks delivered");
}
