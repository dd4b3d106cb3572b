//! A graceful stop with the real binary: SIGTERM while async jobs' fetches are in flight lets
//! those fetches finish and records their results before the process exits, starts no new
//! attempt, and the jobs left waiting run once after a restart. The origin sees every job's
//! `Idempotency-Key` exactly as many times as the job records attempts: once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{header, ok, pool_toml, serve_http, wait_until, webhook_toml};

use crate::BIN;

const JOBS: usize = 8;
const LIMIT: usize = 4;

/// Requests per `Idempotency-Key`.
type Seen = Arc<Mutex<HashMap<String, u64>>>;

/// An upstream that counts each request's `Idempotency-Key` on arrival and answers `done`
/// about 1.5 s later: a SIGTERM lands while its requests are in flight.
async fn slow_upstream() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let port = serve_http(move |req| {
        let s = s.clone();
        async move {
            *s.lock()
                .unwrap()
                .entry(header(&req, "idempotency-key"))
                .or_default() += 1;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            ok(b"done")
        }
    })
    .await;
    (format!("http://{port}"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_running_jobs_finish_and_runs_none_twice() {
    let (up, seen) = slow_upstream().await;
    let rest = format!(
        "allow_private_webhooks = true\nshutdown_grace_ms = 30000\n{}[pools.async]\nenabled = true\n{}deactivate_after = 1000000\n",
        pool_toml("p", &up, &format!("limit = {LIMIT}")),
        webhook_toml("http://127.0.0.1:9/hook"),
    );
    let mut server = Server::start(BIN, "warn", reqwest::Client::new(), &rest).await;
    let ids = server
        .submit_async_jobs("p", JOBS, |i| Some(format!("job {i}")))
        .await;

    // SIGTERM once the origin holds `LIMIT` fetches; the other jobs wait in the gate.
    let in_flight = wait_until(2000, Duration::from_millis(5), async || {
        seen.lock().unwrap().len() >= LIMIT
    })
    .await;
    assert!(in_flight, "the jobs never reached the origin");
    server.sigterm();
    let exit = server.exited().await;
    assert!(exit.success(), "exit status {exit:?}");
    let at_exit = seen.lock().unwrap().len();
    assert!(
        at_exit < JOBS,
        "every job ran before the stop; the test proves nothing"
    );

    server.restart().await;
    server.wait_completed("p", &ids, "done").await;
    let seen = seen.lock().unwrap().clone();
    for id in &ids {
        let detail = server
            .admin_json(&format!("/admin/pools/p/jobs/{id}"))
            .await;
        let attempts = detail["attempt"].as_u64().unwrap();
        let arrived = seen.get(id.as_str()).copied().unwrap_or(0);
        assert_eq!(
            arrived, attempts,
            "job {id}: the origin saw its key {arrived} times, the job records {attempts} attempts"
        );
        assert_eq!(arrived, 1, "job {id} ran {arrived} times: {detail}");
    }
}
