//! End-to-end admission through the real router over loopback: limits, FIFO, budgets,
//! priorities, fair share, RPM on an injected clock.

use nthbouncer_testkit::*;
use reqwest::Method;

/// limit = 3, 50 concurrent slow requests: the upstream never sees more than 3, all succeed,
/// and they reach the upstream in their order of arrival (one key, one class).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_holds_and_queue_is_fifo() {
    let (up, gw) = proxied_pool("limit = 3").await;
    let mut tasks = Vec::new();
    for i in 0..50 {
        tasks.push(gw.hold("p", &i.to_string()));
        // Arrival order at the gateway is the order we wait for here: the first three are
        // admitted, every later one must be parked before the next is sent.
        if i < 3 {
            up.wait_arrivals(i + 1).await;
        } else {
            let queued = (i - 2) as u64;
            gw.wait_queued("p", queued, "request parked").await;
        }
    }
    // Free one at a time: each completion admits exactly the oldest waiter.
    for n in 0..50 {
        up.release(1);
        up.wait_arrivals((n + 4).min(50)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().status(), 200);
    }
    assert_eq!(
        up.max_in_flight(),
        3,
        "the upstream saw more (or fewer) than the limit at once"
    );
    let expected: Vec<String> = (0..50).map(|i: i32| i.to_string()).collect();
    assert_eq!(up.arrivals(), expected);
    let s = gw.wait_freed("p", "drained").await;
    assert_eq!(s["queued"], 0);
}

#[tokio::test]
async fn no_queue_gets_429_and_governor_headers() {
    let (up, gw) = proxied_pool("limit = 1").await;
    let held = gw.hold("p", "a");
    up.wait_arrivals(1).await;
    let r = send(gw.no_queue("p", "/")).await;
    assert_eq!(r.headers()["x-nthpool-remaining-slots"], "0");
    assert_eq!(r.headers()["x-nthpool-effective-limit"], "1");
    assert!(r.headers().contains_key("x-nthpool-queued-ms"));
    let body = expect_error(r, 429, "too_many_requests").await;
    assert!(body["message"].as_str().unwrap().contains("slot"));
    up.release(1);
    let ok = held.await.unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(ok.headers()["x-nthpool-effective-limit"], "1");
}

#[tokio::test]
async fn wait_budget_runs_out_with_504_queue_timeout() {
    let (up, gw) = proxied_pool("limit = 1").await;
    let held = gw.hold("p", "a");
    up.wait_arrivals(1).await;
    let r = send(gw.get("p", "/").header("x-nthpool-queue-timeout-ms", "100")).await;
    assert_eq!(r.status(), 504);
    let queued: u64 = r.headers()["x-nthpool-queued-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(queued >= 100, "waited {queued} ms, budget was 100");
    expect_error(r, 504, "queue_timeout").await;
    // The timed-out waiter left the queue.
    assert_eq!(gw.state("p").await["queued"], 0);
    up.release(1);
    assert_eq!(held.await.unwrap().status(), 200);
}

#[tokio::test]
async fn queue_overflow_gets_429() {
    let (up, gw) = proxied_pool("limit = 1\nqueue_size = 2").await;
    let tasks: Vec<_> = (0..3).map(|i| gw.hold("p", &i.to_string())).collect();
    gw.wait_state("p", "one in flight and two queued", |s| {
        s["inFlight"] == 1 && s["queued"] == 2
    })
    .await;
    let body = expect_error(send(gw.get("p", "/")).await, 429, "too_many_requests").await;
    assert!(body["message"].as_str().unwrap().contains("queue is full"));
    up.release(3);
    for t in tasks {
        assert_eq!(t.await.unwrap().status(), 200);
    }
}

/// Queues requests one by one (each parked before the next), then frees slots one at a time
/// and returns the order in which the upstream saw them (`case` names the run in failures).
async fn admitted_order(
    case: &str,
    gw: &Gateway,
    up: &Upstream,
    requests: Vec<(&str, &str, &str)>,
) -> Vec<String> {
    let held = gw.hold("p", "holder");
    up.wait_arrivals(1).await;
    let mut tasks = Vec::new();
    for (i, (seq, key, priority)) in requests.iter().enumerate() {
        tasks.push(spawn_send(
            gw.pool("p", Method::GET, "/hold")
                .header("x-nthpool-key", *key)
                .header("x-nthpool-priority", *priority)
                .header("x-seq", *seq),
        ));
        let n = (i + 1) as u64;
        gw.wait_queued("p", n, &format!("{case}: request parked"))
            .await;
    }
    for n in 0..=requests.len() {
        up.release(1);
        up.wait_arrivals((n + 2).min(requests.len() + 1)).await;
    }
    assert_eq!(held.await.unwrap().status(), 200, "{case}");
    for t in tasks {
        assert_eq!(t.await.unwrap().status(), 200, "{case}");
    }
    up.arrivals().into_iter().skip(1).collect()
}

/// With one slot freed at a time, the queue admits by priority class first, then shares
/// fairly between keys (round robin), or in strict arrival order with `fair_share = false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_order_follows_priority_and_fair_share() {
    let (a, b) = (KEY, KEY2);
    for (case, concurrency, requests, want) in [
        (
            "high priority overtakes normal and low",
            "limit = 1",
            vec![
                ("low", a, "low"),
                ("n1", a, "normal"),
                ("n2", a, "normal"),
                ("high", a, "high"),
            ],
            vec!["high", "n1", "n2", "low"],
        ),
        (
            "two keys flooding unequally alternate",
            "limit = 1",
            vec![
                ("a1", a, "normal"),
                ("a2", a, "normal"),
                ("a3", a, "normal"),
                ("a4", a, "normal"),
                ("b1", b, "normal"),
                ("b2", b, "normal"),
            ],
            vec!["a1", "b1", "a2", "b2", "a3", "a4"],
        ),
        (
            "fair share off is strict FIFO",
            "limit = 1\nfair_share = false",
            vec![
                ("a1", a, "normal"),
                ("a2", a, "normal"),
                ("b1", b, "normal"),
            ],
            vec!["a1", "a2", "b1"],
        ),
    ] {
        let (up, gw) = proxied_pool(concurrency).await;
        let order = admitted_order(case, &gw, &up, requests).await;
        assert_eq!(order, want, "{case}");
    }
}

/// RPM 60 on an injected clock: 60 admitted in the minute, the 61st refused with the exact
/// Retry-After; the window rolls.
#[tokio::test]
async fn rpm_gate_admits_60_per_rolling_minute() {
    let up = Upstream::start().await;
    let (gw, clock) = clocked(&pool_toml("p", &up.url(), "limit = 100\nrpm = 60")).await;
    for i in 0..60u32 {
        if i == 30 {
            clock.advance(20_000);
        }
        let r = send(gw.no_queue("p", "/")).await;
        assert_eq!(r.status(), 200, "request {i}");
        assert_eq!(
            r.headers()["x-nthpool-rpm-remaining"],
            (59 - i).to_string().as_str()
        );
    }
    let r = send(gw.no_queue("p", "/")).await;
    assert_eq!(r.status(), 429);
    // The first 30 leave the window 60 s after they were admitted: 40 s from now.
    assert_eq!(r.headers()["retry-after"], "40");
    assert_eq!(r.headers()["x-nthpool-rpm-remaining"], "0");
    clock.advance(39_999);
    let r = send(gw.no_queue("p", "/")).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    clock.advance(1);
    for _ in 0..30 {
        assert_eq!(send(gw.no_queue("p", "/")).await.status(), 200);
    }
    let r = send(gw.no_queue("p", "/")).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "20");
    // Refused requests consumed nothing: exactly 90 reached the upstream.
    assert_eq!(up.seen().len(), 90);
}

/// A waiter parked behind the RPM gate is admitted when the window rolls (on the injected clock).
#[tokio::test]
async fn rpm_waiter_is_admitted_when_the_window_rolls() {
    let up = Upstream::start().await;
    let pool = pool_toml(
        "p",
        &up.url(),
        "limit = 10\nrpm = 1\nqueue_timeout_ms = 3600000",
    );
    let (gw, clock) = clocked(&pool).await;
    assert_eq!(send(gw.get("p", "/")).await.status(), 200);
    let waiting = spawn_send(gw.get("p", "/").header("x-seq", "w"));
    gw.wait_queued("p", 1, "waiter parked").await;
    clock.advance(60_000);
    assert_eq!(waiting.await.unwrap().status(), 200);
}
