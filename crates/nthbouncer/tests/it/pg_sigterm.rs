//! A graceful stop on a shared store (issue #17): two real nodes on one Redis and one
//! PostgreSQL database, with a claim lease of a minute. Node A accepts every job (so holds every
//! claim) and is SIGTERMed while its first fetches are in flight.
//!
//! - Those fetches finish within the grace and are recorded, and A gives back the claims of the
//!   jobs it had not started before it exits. Node B takes them at its next claim pass and
//!   completes them long before A's claims would have lapsed. Every job completes once, and
//!   reaches the origin once.
//! - When the grace runs out mid-fetch instead, the jobs whose attempts were abandoned keep A's
//!   claim (their calls may still be live at the origin): B does not call the origin for them,
//!   while it runs the others at once.
//!
//! No timing is asserted as such: the waits for B are bounded well inside the lease (A renewed
//! its claims at most a claim pass, 5 s, before the stop, so they would have held for at least
//! 55 s after it), so B can only have finished in time if A gave its claims back.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::pg::{admin_client, TestDb};
use nthbouncer_testkit::{header, ok, pool_toml, serve_http, wait_until, webhook_toml};

use crate::scale_out::{redis_url, Space, SERIAL};
use crate::BIN;

/// The pool's limit, shared by both nodes through Redis.
const LIMIT: usize = 2;
/// The claim lease: long, so a job taken over on its lapse could not finish within the wait.
const LEASE_MS: u64 = 60_000;

/// Requests per `Idempotency-Key` (the job id), or per `webhook-id`.
type Seen = Arc<Mutex<HashMap<String, u64>>>;

/// An upstream that counts each request's `Idempotency-Key` on arrival and answers `done`:
/// the first `slow` requests after `slow_for`, the others after 800 ms (the SIGTERM lands
/// while A's fetches are in flight).
async fn upstream(slow: usize, slow_for: Duration) -> (String, Seen) {
    let seen: Seen = Arc::default();
    let arrived = Arc::new(AtomicUsize::new(0));
    let s = seen.clone();
    let addr = serve_http(move |req| {
        let (s, arrived) = (s.clone(), arrived.clone());
        async move {
            *s.lock()
                .unwrap()
                .entry(header(&req, "idempotency-key"))
                .or_default() += 1;
            let nth = arrived.fetch_add(1, Ordering::SeqCst);
            let sleep = if nth < slow {
                slow_for
            } else {
                Duration::from_millis(800)
            };
            tokio::time::sleep(sleep).await;
            ok(b"done")
        }
    })
    .await;
    (format!("http://{addr}"), seen)
}

/// A webhook receiver counting deliveries per `webhook-id` (the job id).
async fn receiver() -> (SocketAddr, Seen) {
    let hooks: Seen = Arc::default();
    let h = hooks.clone();
    let addr = serve_http(move |req| {
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
    (addr, hooks)
}

/// Nodes A and B on `db` and the test's Redis space, pool `p` in front of `up` with async jobs
/// delivered to `hook`, a claim lease of [`LEASE_MS`] and a shutdown grace of `grace_ms`.
async fn two_nodes(
    space: &Space,
    db: &TestDb,
    up: &str,
    hook: SocketAddr,
    grace_ms: u64,
) -> (Server, Server) {
    let server = space.server_toml(
        &redis_url(),
        &format!(
            "store = \"{}\"\nstore_claim_lease_ms = {LEASE_MS}\nshutdown_grace_ms = {grace_ms}\n\
             allow_private_webhooks = true\n",
            db.url
        ),
    );
    // Short slot leases: a slot an abandoned attempt held on A goes back within seconds.
    let pools = pool_toml(
        "p",
        up,
        &format!(
            "limit = {LIMIT}\nadaptive = false\nqueue_timeout_ms = 60000\n\
             lease_term_ms = 3000\nrenew_interval_ms = 1000"
        ),
    ) + &format!(
        "[pools.async]\nenabled = true\n{}",
        webhook_toml(&format!("http://{hook}/hook"))
    );
    let config = format!("{server}{pools}");
    let a = Server::start(BIN, "info", reqwest::Client::new(), &config).await;
    let b = Server::start(BIN, "info", reqwest::Client::new(), &config).await;
    (a, b)
}

/// Submits `n` async jobs to A, one after another; their ids.
async fn submit(a: &Server, n: usize) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
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
    ids
}

/// The node holding every job: the jobs accepted on A are claimed by A by their insert.
async fn only_claimant(pg: &tokio_postgres::Client) -> String {
    let holders: Vec<Option<String>> = pg
        .query("SELECT DISTINCT claimed_by FROM jobs", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    match holders.as_slice() {
        [Some(node)] => node.clone(),
        _ => panic!("the jobs accepted on A are not all claimed by A: {holders:?}"),
    }
}

/// SIGTERMs A once the origin has seen `started` of its fetches, and waits for it to exit.
async fn stop_mid_flight(a: &mut Server, seen: &Seen, started: usize) {
    let in_flight = wait_until(2000, Duration::from_millis(5), async || {
        seen.lock().unwrap().len() >= started
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
}

/// Waits (bounded, 40 s: well inside the lease) until `n` jobs are completed.
async fn wait_completed(pg: &tokio_postgres::Client, n: usize, b: &Server) {
    let mut last = 0;
    let done = wait_until(400, Duration::from_millis(100), async || {
        last = pg
            .query_one("SELECT COUNT(*) FROM jobs WHERE status = 'completed'", &[])
            .await
            .unwrap()
            .get::<_, i64>(0);
        last == n as i64
    })
    .await;
    assert!(
        done,
        "{last} of {n} jobs completed within 40 s of A's stop (the lease is {LEASE_MS} ms)\n\
         node B's log:\n{}",
        b.log_tail(8_000)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_sigtermed_gives_back_its_claims_and_another_finishes_its_jobs_at_once() {
    const JOBS: usize = 12;
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let db = TestDb::create().await;
    let (up, seen) = upstream(0, Duration::ZERO).await;
    let (hook, hooks) = receiver().await;
    let (mut a, b) = two_nodes(&space, &db, &up, hook, 30_000).await;
    let ids = submit(&a, JOBS).await;
    let pg = admin_client(&db.url).await;
    let node_a = only_claimant(&pg).await;
    stop_mid_flight(&mut a, &seen, 1).await;

    // A finished what it had started and kept no claim on what it had not.
    let row = pg
        .query_one(
            "SELECT COUNT(*) FILTER (WHERE status IN ('accepted', 'queued', 'running')), \
                    COUNT(*) FILTER (WHERE status IN ('accepted', 'queued', 'running') \
                                     AND claimed_by = $1) FROM jobs",
            &[&node_a],
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

    wait_completed(&pg, JOBS, &b).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_abandoned_when_the_grace_runs_out_keeps_its_claim() {
    const JOBS: usize = 6;
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let db = TestDb::create().await;
    // A's first `LIMIT` fetches outlast the half-second grace by far.
    let (up, seen) = upstream(LIMIT, Duration::from_secs(30)).await;
    let (hook, _hooks) = receiver().await;
    let (mut a, b) = two_nodes(&space, &db, &up, hook, 500).await;
    let ids = submit(&a, JOBS).await;
    let pg = admin_client(&db.url).await;
    let node_a = only_claimant(&pg).await;
    stop_mid_flight(&mut a, &seen, LIMIT).await;
    let abandoned: Vec<String> = seen.lock().unwrap().keys().cloned().collect();
    assert_eq!(abandoned.len(), LIMIT);

    // The abandoned attempts' jobs are still A's; the rest are not.
    let held: Vec<String> = pg
        .query(
            "SELECT id FROM jobs WHERE claimed_by = $1 AND status = 'running' ORDER BY id",
            &[&node_a],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut expected = abandoned.clone();
    expected.sort();
    assert_eq!(held, expected, "{}", a.log_tail(4_000));
    let others_held: i64 = pg
        .query_one(
            "SELECT COUNT(*) FROM jobs WHERE claimed_by = $1 AND status <> 'running'",
            &[&node_a],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        others_held,
        0,
        "A kept claims on jobs it had not started\n{}",
        a.log_tail(6_000)
    );

    // B runs the others at once and leaves the abandoned ones alone (their lease holds).
    wait_completed(&pg, JOBS - LIMIT, &b).await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), JOBS, "distinct jobs at the origin");
    assert!(
        seen.values().all(|n| *n == 1),
        "a job reached the origin twice: {seen:?}"
    );
    for id in &abandoned {
        let (status, attempt): (String, i64) = pg
            .query_one("SELECT status, attempt FROM jobs WHERE id = $1", &[id])
            .await
            .map(|r| (r.get(0), r.get(1)))
            .unwrap();
        assert_eq!((status.as_str(), attempt), ("running", 1), "{id}");
    }
    assert!(ids.iter().all(|id| seen.contains_key(id)));
}
