//! The client against a real gateway on loopback: grants, outcomes, renewals, caps, drops,
//! lost leases, queueing and the error kinds.

use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use nthbouncer_client::{AcquireOptions, LeaseState, LockClient, LockError, Outcome, Priority};
use nthbouncer_testkit::{bounded, gateway, lock_pool_toml as pool, API_HOST, KEY};

/// Short leases keep the renewal tests fast (the smallest term is 100 ms).
const FAST: &str = "limit = 1\nlease_term_ms = 300\nrenew_interval_ms = 100";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_reports_the_grant_and_release_reports_the_outcome() {
    let gw = gateway(&pool(
        "p",
        "limit = 2\nlease_term_ms = 5000\nrenew_interval_ms = 1000",
    ))
    .await;
    let guard = gw.lock_client("p").acquire(None).await.unwrap();
    let grant = guard.grant().clone();
    assert!(!grant.slot_id.is_empty());
    assert_eq!(guard.slot_id(), grant.slot_id);
    assert_eq!((grant.term_ms, grant.renew_interval_ms), (5000, 1000));
    assert!(grant.lease_deadline <= grant.request_deadline);
    assert_eq!(guard.request_deadline(), grant.request_deadline);
    assert_eq!(grant.effective_limit, Some(2));
    assert_eq!(grant.remaining_slots, Some(1));
    assert_eq!(guard.state(), LeaseState::Held);
    assert_eq!(gw.in_flight("p").await, 1);

    let throttled = Outcome {
        retry_after_ms: Some(2000),
        ..Outcome::from_status(429)
    };
    assert!(guard.release(throttled).await.unwrap());
    let state = gw.state("p").await;
    assert_eq!(state["inFlight"], 0);
    // The governor learned from the report: the limit halved and admission paused.
    assert_eq!(state["learnedLimit"], 1, "{state}");
    assert!(!state["pausedUntil"].is_null(), "{state}");
    let cause = state["lastThrottle"]["cause"].as_str().unwrap_or_default();
    assert!(
        cause.contains("status 429") && cause.contains("retry-after 2000ms"),
        "{state}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_from_response_headers_reach_the_governor() {
    let gw = gateway(&pool("p", "limit = 2")).await;
    let guard = gw.lock_client("p").acquire(None).await.unwrap();
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("x-ratelimit-limit-requests", HeaderValue::from_static("60"));
    headers.insert(
        "x-ratelimit-remaining-requests",
        HeaderValue::from_static("0"),
    );
    headers.insert("x-ratelimit-reset-requests", HeaderValue::from_static("1s"));
    let outcome = Outcome::from_response(200, &headers);
    assert_eq!(outcome.headers.len(), 3, "only rate headers are copied");
    assert!(guard.release(outcome).await.unwrap());
    let state = gw.state("p").await;
    let cause = state["lastThrottle"]["cause"].as_str().unwrap_or_default();
    assert!(
        cause.contains("requests budget spent"),
        "the raw headers were parsed by the gateway: {state}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_keep_the_slot_across_several_terms() {
    let gw = gateway(&pool("p", FAST)).await;
    let holder = gw.lock_client("p").acquire(None).await.unwrap();
    let first_deadline = holder.lease_deadline();
    let other = gw.lock_client("p");
    // About three terms of work; meanwhile the pool stays full.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let refused = other.acquire(None).await;
        assert!(
            matches!(refused, Err(LockError::NoSlot { .. })),
            "the slot is still held: {refused:?}"
        );
        assert_eq!(gw.in_flight("p").await, 1);
    }
    assert_eq!(holder.state(), LeaseState::Held);
    assert!(holder.lease_deadline() > first_deadline, "renewed");
    assert!(holder.release(None).await.unwrap(), "still ours to release");
    assert_eq!(gw.in_flight("p").await, 0);
    let next = other.acquire(None).await.unwrap();
    assert!(next.release(Outcome::from_status(200)).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_at_its_request_deadline_is_capped_then_reclaimed() {
    let gw = gateway(&pool(
        "p",
        "limit = 1\nrequest_timeout_ms = 600\nlease_term_ms = 300\nrenew_interval_ms = 100",
    ))
    .await;
    let holder = gw.lock_client("p").acquire(None).await.unwrap();
    let ended = bounded("the cap", holder.lost()).await;
    assert_eq!(ended, LeaseState::Capped);
    assert_eq!(holder.state(), LeaseState::Capped);
    assert_eq!(holder.lease_deadline(), holder.request_deadline());

    // Not released: the gateway reclaims the slot at the cap on its own.
    gw.wait_freed("p", "capped slot reclaimed").await;
    let next = gw.lock_client("p").acquire(None).await.unwrap();
    assert!(!holder.release(None).await.unwrap(), "already reclaimed");
    assert!(next.release(None).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_guard_releases_the_slot() {
    // The default 30 s term: only a release frees the slot within the bounded wait.
    let gw = gateway(&pool("p", "limit = 1")).await;
    let client = gw.lock_client("p");
    let guard = client.acquire(None).await.unwrap();
    let lost = guard.lost();
    assert_eq!(gw.in_flight("p").await, 1);
    drop(guard);
    assert_eq!(
        bounded("lost() after drop", lost).await,
        LeaseState::Released
    );
    gw.wait_freed("p", "dropped slot released").await;
    let again = client.acquire(None).await.unwrap();
    assert!(again.release(None).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_released_behind_our_back_is_reported_lost() {
    let gw = gateway(&pool("p", FAST)).await;
    let holder = gw.lock_client("p").acquire(None).await.unwrap();
    let r = gw
        .raw_post(&format!("/pools/p/lock/{}/release", holder.slot_id()))
        .await;
    assert_eq!(r.status(), 200);
    // The next renewal is answered 404.
    assert_eq!(bounded("lost", holder.lost()).await, LeaseState::Lost);
    assert_eq!(holder.state(), LeaseState::Lost);
    assert!(!holder.release(None).await.unwrap(), "already gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_acquires_are_served_in_priority_order() {
    let gw = gateway(&pool("p", "limit = 1")).await;
    let holder = gw.lock_client("p").acquire(None).await.unwrap();
    let wait = |priority| AcquireOptions {
        wait: Some(Duration::from_secs(10)),
        priority: Some(priority),
    };
    let normal_client = gw.lock_client("p");
    let normal =
        tokio::spawn(async move { normal_client.acquire_with(wait(Priority::Normal)).await });
    gw.wait_queued("p", 1, "one waiter").await;
    let high_client = gw.lock_client("p");
    let high = tokio::spawn(async move { high_client.acquire_with(wait(Priority::High)).await });
    gw.wait_queued("p", 2, "two waiters").await;

    assert!(holder.release(Outcome::from_status(200)).await.unwrap());
    let high = bounded("high acquires", high).await.unwrap().unwrap();
    assert!(high.grant().queued_ms.is_some());
    assert!(!normal.is_finished(), "normal still waits behind high");
    assert_eq!(gw.state("p").await["queued"], 1);
    assert!(high.release(None).await.unwrap());
    let normal = bounded("normal acquires", normal).await.unwrap().unwrap();
    assert!(normal.release(None).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_sorted_into_error_kinds() {
    let gw = gateway(&pool("p", "limit = 1")).await;
    let holder = gw.lock_client("p").acquire(None).await.unwrap();

    let full = gw.lock_client("p").acquire(None).await;
    assert!(matches!(full, Err(LockError::NoSlot { .. })), "{full:?}");
    assert!(full.as_ref().err().is_some_and(LockError::is_transient));
    let timed_out = gw
        .lock_client("p")
        .acquire(Some(Duration::from_millis(50)))
        .await;
    assert!(
        matches!(timed_out, Err(LockError::QueueTimeout { .. })),
        "{timed_out:?}"
    );

    let bad_key = LockClient::new(&gw.base, "p", "not-the-key-0123456789")
        .unwrap()
        .with_host(API_HOST)
        .unwrap()
        .acquire(None)
        .await;
    assert!(
        matches!(bad_key, Err(LockError::Unauthorized { status: 401, .. })),
        "{bad_key:?}"
    );

    let no_pool = gw.lock_client("nope").acquire(None).await;
    assert!(
        matches!(no_pool, Err(LockError::PoolNotFound)),
        "{no_pool:?}"
    );
    // Without the Host override the gateway cannot tell this is the API host.
    let wrong_host = LockClient::new(&gw.base, "p", KEY)
        .unwrap()
        .acquire(None)
        .await;
    assert!(
        matches!(wrong_host, Err(LockError::PoolNotFound)),
        "{wrong_host:?}"
    );

    // A port nobody listens on.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let down = LockClient::new(&format!("http://{closed}"), "p", KEY)
        .unwrap()
        .acquire(None)
        .await;
    assert!(matches!(down, Err(LockError::Http(_))), "{down:?}");

    assert!(holder.release(None).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_under_localhost_reach_loopback_without_a_host_override() {
    let gw = gateway(&pool("p", "limit = 1")).await;
    let port = gw.running.addr.port();
    let client = LockClient::new(&format!("http://{API_HOST}:{port}"), "p", KEY).unwrap();
    let guard = client.acquire(None).await.unwrap();
    assert_eq!(gw.in_flight("p").await, 1);
    assert!(guard.release(None).await.unwrap());
}

#[test]
fn bad_settings_are_refused_up_front() {
    for url in ["not a url", "ftp://example.com", "unix:/tmp/sock"] {
        assert!(
            matches!(LockClient::new(url, "p", KEY), Err(LockError::Config(_))),
            "{url}"
        );
    }
    assert!(matches!(
        LockClient::new("http://127.0.0.1:1", "", KEY),
        Err(LockError::Config(_))
    ));
    assert!(matches!(
        LockClient::new("http://127.0.0.1:1", "p", "bad\nkey"),
        Err(LockError::Config(_))
    ));
    let client = LockClient::new("http://127.0.0.1:1", "p", KEY).unwrap();
    assert!(matches!(
        client.with_host("bad\nhost"),
        Err(LockError::Config(_))
    ));
    // The key never shows in debug output.
    let client = LockClient::new("http://127.0.0.1:1", "p", KEY).unwrap();
    assert!(!format!("{client:?}").contains(KEY));
}
