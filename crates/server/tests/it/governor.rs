//! End-to-end admission through the real router over loopback: limits, FIFO, budgets,
//! priorities, fair share, RPM on an injected clock.

use std::sync::Arc;

use nthbouncer_coord::ManualClock;
use nthbouncer_testkit::*;
use reqwest::Method;

/// limit = 3, 50 concurrent slow requests: the upstream never sees more than 3, all succeed,
/// and they reach the upstream in their order of arrival (one key, one class).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_holds_and_queue_is_fifo() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "limit = 3")).await;
    let gw = Arc::new(gw);
    let mut tasks = Vec::new();
    for i in 0..50 {
        let gw2 = gw.clone();
        tasks.push(tokio::spawn(async move {
            gw2.get("p", "/hold")
                .header("x-seq", i.to_string())
                .send()
                .await
                .unwrap()
                .status()
        }));
        // Arrival order at the gateway is the order we wait for here: the first three are
        // admitted, every later one must be parked before the next is sent.
        if i < 3 {
            up.wait_arrivals(i + 1).await;
        } else {
            let queued = (i - 2) as u64;
            gw.wait_state("p", "request parked", |s| s["queued"] == queued)
                .await;
        }
    }
    // Free one at a time: each completion admits exactly the oldest waiter.
    for n in 0..50 {
        up.release(1);
        up.wait_arrivals((n + 4).min(50)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(
        up.max_in_flight(),
        3,
        "the upstream saw more (or fewer) than the limit at once"
    );
    let expected: Vec<String> = (0..50).map(|i: i32| i.to_string()).collect();
    assert_eq!(up.arrivals(), expected);
    let s = gw.wait_state("p", "drained", |s| s["inFlight"] == 0).await;
    assert_eq!(s["queued"], 0);
}

#[tokio::test]
async fn no_queue_gets_429_and_governor_headers() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "limit = 1")).await;
    let gw2 = gw.client.clone();
    let held = tokio::spawn(gw.get("p", "/hold").header("x-seq", "a").send());
    up.wait_arrivals(1).await;
    let r = send(gw.no_queue("p", "/")).await;
    assert_eq!(r.headers()["x-nthpool-remaining-slots"], "0");
    assert_eq!(r.headers()["x-nthpool-effective-limit"], "1");
    assert!(r.headers().contains_key("x-nthpool-queued-ms"));
    let body = expect_error(r, 429, "too_many_requests").await;
    assert!(body["message"].as_str().unwrap().contains("slot"));
    up.release(1);
    let ok = held.await.unwrap().unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(ok.headers()["x-nthpool-effective-limit"], "1");
    drop(gw2);
}

#[tokio::test]
async fn wait_budget_runs_out_with_504_queue_timeout() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "limit = 1")).await;
    let held = tokio::spawn(gw.get("p", "/hold").header("x-seq", "a").send());
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
    assert_eq!(held.await.unwrap().unwrap().status(), 200);
}

#[tokio::test]
async fn queue_overflow_gets_429() {
    let up = Upstream::start().await;
    let gw = Arc::new(gateway(&pool_toml("p", &up.url(), "limit = 1\nqueue_size = 2")).await);
    let mut tasks = Vec::new();
    for i in 0..3 {
        let g = gw.clone();
        tasks.push(tokio::spawn(async move {
            g.get("p", "/hold")
                .header("x-seq", i.to_string())
                .send()
                .await
                .unwrap()
        }));
    }
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
/// and returns the order in which the upstream saw them.
async fn admitted_order(
    gw: &Arc<Gateway>,
    up: &Upstream,
    requests: Vec<(&'static str, &'static str, &'static str)>,
) -> Vec<String> {
    let held = tokio::spawn(gw.get("p", "/hold").header("x-seq", "holder").send());
    up.wait_arrivals(1).await;
    let mut tasks = Vec::new();
    for (i, (seq, key, priority)) in requests.iter().enumerate() {
        let g = gw.clone();
        let (seq, key, priority) = (*seq, *key, *priority);
        tasks.push(tokio::spawn(async move {
            g.pool("p", Method::GET, "/hold")
                .header("x-nthpool-key", key)
                .header("x-nthpool-priority", priority)
                .header("x-seq", seq)
                .send()
                .await
                .unwrap()
                .status()
        }));
        let n = (i + 1) as u64;
        gw.wait_state("p", "request parked", |s| s["queued"] == n)
            .await;
    }
    for n in 0..=requests.len() {
        up.release(1);
        up.wait_arrivals((n + 2).min(requests.len() + 1)).await;
    }
    assert_eq!(held.await.unwrap().unwrap().status(), 200);
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    up.arrivals().into_iter().skip(1).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn high_priority_overtakes_normal_and_low() {
    let up = Upstream::start().await;
    let gw = Arc::new(gateway(&pool_toml("p", &up.url(), "limit = 1")).await);
    let order = admitted_order(
        &gw,
        &up,
        vec![
            ("low", KEY, "low"),
            ("n1", KEY, "normal"),
            ("n2", KEY, "normal"),
            ("high", KEY, "high"),
        ],
    )
    .await;
    assert_eq!(order, vec!["high", "n1", "n2", "low"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_keys_flooding_unequally_alternate() {
    let up = Upstream::start().await;
    let gw = Arc::new(gateway(&pool_toml("p", &up.url(), "limit = 1")).await);
    let order = admitted_order(
        &gw,
        &up,
        vec![
            ("a1", KEY, "normal"),
            ("a2", KEY, "normal"),
            ("a3", KEY, "normal"),
            ("a4", KEY, "normal"),
            ("b1", KEY2, "normal"),
            ("b2", KEY2, "normal"),
        ],
    )
    .await;
    assert_eq!(order, vec!["a1", "b1", "a2", "b2", "a3", "a4"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_share_off_is_strict_fifo() {
    let up = Upstream::start().await;
    let gw = Arc::new(gateway(&pool_toml("p", &up.url(), "limit = 1\nfair_share = false")).await);
    let order = admitted_order(
        &gw,
        &up,
        vec![
            ("a1", KEY, "normal"),
            ("a2", KEY, "normal"),
            ("b1", KEY2, "normal"),
        ],
    )
    .await;
    assert_eq!(order, vec!["a1", "a2", "b1"]);
}

/// RPM 60 on an injected clock: 60 admitted in the minute, the 61st refused with the exact
/// Retry-After; the window rolls.
#[tokio::test]
async fn rpm_gate_admits_60_per_rolling_minute() {
    let up = Upstream::start().await;
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let gw = gateway_with(
        &pool_toml("p", &up.url(), "limit = 100\nrpm = 60"),
        Some(clock.clone()),
    )
    .await;
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
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let gw = Arc::new(
        gateway_with(
            &pool_toml(
                "p",
                &up.url(),
                "limit = 10\nrpm = 1\nqueue_timeout_ms = 3600000",
            ),
            Some(clock.clone()),
        )
        .await,
    );
    assert_eq!(gw.get("p", "/").send().await.unwrap().status(), 200);
    let g = gw.clone();
    let waiting = tokio::spawn(async move {
        g.get("p", "/")
            .header("x-seq", "w")
            .send()
            .await
            .unwrap()
            .status()
    });
    gw.wait_state("p", "waiter parked", |s| s["queued"] == 1)
        .await;
    clock.advance(60_000);
    assert_eq!(waiting.await.unwrap(), 200);
}
