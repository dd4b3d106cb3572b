//! Async jobs when the store fails for a while, made real: the test takes SQLite's write lock on
//! the gateway's own database file (`BEGIN EXCLUSIVE` from another connection) while a job's
//! fetch is at the origin, so recording its result fails, and releases the lock later. The job
//! must still reach its terminal state without a restart.

use std::time::Duration;

use nthbouncer_testkit::*;

/// Longer than the store's `busy_timeout` (5 s): a write waiting for the lock gives up and fails
/// while the test holds it. This only makes the fault happen; nothing asserts on time.
const HOLD_LOCK: Duration = Duration::from_secs(7);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_result_cannot_be_written_for_a_while_still_ends() {
    let up = Upstream::start().await;
    let pool = pool_toml("p", &up.url(), "limit = 1");
    let gw = gateway(&async_pool_toml(&pool, "", NO_WEBHOOK)).await;
    let job = accepted_id(send(gw.post_async("p", "/hold").body("work")).await).await;
    // The attempt has started (its row says so) and the origin is working on it.
    up.wait_in_flight(1, "the job's fetch to reach the origin")
        .await;

    let db = gw.dir().join("nthbouncer.db");
    let locker = std::thread::spawn(move || {
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.busy_timeout(Duration::from_secs(30)).unwrap();
        conn.execute_batch("BEGIN EXCLUSIVE").unwrap();
        conn
    });
    let conn = tokio::task::spawn_blocking(move || locker.join().unwrap())
        .await
        .unwrap();
    // The origin answers; recording the result now fails until the lock is released.
    up.release(1);
    tokio::time::sleep(HOLD_LOCK).await;
    tokio::task::spawn_blocking(move || conn.execute_batch("ROLLBACK").unwrap())
        .await
        .unwrap();

    let done = eventually(&format!("job {job} to complete"), async || {
        let (code, v) = call(gw.poll_job("p", &job)).await;
        assert_eq!(code, 200, "{v}");
        assert!(v["status"] != "failed" && v["status"] != "expired", "{v}");
        (v["status"] == "completed").then_some(v)
    })
    .await;
    assert_eq!(done["result"]["status"], 200);
    assert_eq!(up.total(), 1, "the origin saw the job once");
    // The slot went back: the pool is idle again.
    gw.wait_freed("p", "idle").await;
}
