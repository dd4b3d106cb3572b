//! A token budget shared on Redis (issue #22): three real nodes in front of the sandbox with a
//! hidden tokens-per-minute limit admit one budget between them, not one each. Same Redis and
//! serial rules as `scale_out`. Counts only.

use std::sync::Arc;

use nthbouncer_sandbox::{Sandbox, SandboxConfig};
use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{pool_toml, wait_until};
use reqwest::Method;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use crate::scale_out::{nodes, redis_calls, redis_url, state, Space, SERIAL};

/// A sandbox whose only limit is a hidden token budget of `tpm` refilling over `window_ms`.
async fn sandbox(tpm: u64, window_ms: u64) -> (Arc<Sandbox>, String) {
    nthbouncer_sandbox::start_on_loopback(SandboxConfig {
        limit: 0,
        latency_ms: 5,
        tpm,
        token_window_ms: window_ms,
        ..SandboxConfig::default()
    })
    .await
    .unwrap()
}

/// The `i`-th request of a burst: prompts of mixed length, mixed output caps.
fn chat(i: u64) -> Value {
    let words = ["alpha "; 200].concat();
    let prompt = &words[..(6 * (5 + (i * 37) % 190)) as usize];
    json!({
        "model": "gpt-4o",
        "max_tokens": 20 + (i * 13) % 120,
        "messages": [{"role": "user", "content": prompt}],
    })
}

fn post(node: &Server, pool: &str, body: &Value) -> reqwest::RequestBuilder {
    node.pool(pool, Method::POST, "/v1/chat/completions")
        .json(body)
}

/// Waits until `node` reports the budget `pool` learned on another node.
async fn wait_budget(node: &Server, pool: &str, budget: u64) {
    let mut last = Value::Null;
    let ok = wait_until(500, std::time::Duration::from_millis(20), async || {
        last = state(node, pool).await;
        last["tokens"]["budget"] == budget
    })
    .await;
    assert!(ok, "{pool} never showed a budget of {budget}: {last}");
}

/// Eager clients spread over three nodes: once one node learned the hidden budget, the origin
/// refuses nothing (waiting clients, a budget that refills within a second); and callers that
/// may not wait, against a budget that does not refill during the test, are admitted up to one
/// budget between the three nodes, not three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_admit_one_token_budget() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let (eager, eager_url) = sandbox(3_000, 1_000).await;
    let (bound, bound_url) = sandbox(3_000, 86_400_000).await;
    let pools = pool_toml("w", &eager_url, "limit = 50\nqueue_timeout_ms = 60000")
        + &pool_toml("b", &bound_url, "limit = 50");
    let nodes = Arc::new(nodes(3, &space.server_toml(&redis_url(), ""), &pools).await);

    // One node learns each budget; the others see it in Redis.
    for pool in ["w", "b"] {
        let r = post(&nodes[0], pool, &chat(0)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers().contains_key("x-nthpool-tpm-remaining"));
        r.bytes().await.unwrap();
        for node in nodes.iter() {
            wait_budget(node, pool, 3_000).await;
        }
    }

    let mut tasks = JoinSet::new();
    for i in 1..=60u64 {
        let req = post(&nodes[(i % 3) as usize], "w", &chat(i));
        tasks.spawn(async move {
            let r = req.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        });
    }
    while let Some(done) = tasks.join_next().await {
        let (status, body) = done.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    let stats = eager.stats();
    assert_eq!(stats.throttled, 0, "the origin refused some: {stats:?}");
    assert_eq!(stats.ok, 61);

    // Fail fast against a budget that does not refill: what the three nodes admit together
    // fits the one budget (the origin refuses nothing), and the rest is refused here.
    let mut tasks = JoinSet::new();
    for i in 1..=60u64 {
        let req = post(&nodes[(i % 3) as usize], "b", &chat(i)).header("x-nthpool-no-queue", "1");
        tasks.spawn(async move {
            let r = req.send().await.unwrap();
            (i, r.status().as_u16(), r.text().await.unwrap())
        });
    }
    let (mut served, mut refused_here) = (0, 0);
    while let Some(done) = tasks.join_next().await {
        let (i, status, body) = done.unwrap();
        match status {
            200 => served += 1,
            429 => {
                assert!(body.contains("too_many_requests"), "{i}: {body}");
                refused_here += 1;
            }
            other => panic!("{i}: {other} {body}"),
        }
    }
    let stats = bound.stats();
    assert_eq!(stats.throttled, 0, "the origin refused some: {stats:?}");
    assert_eq!(stats.ok, served + 1);
    assert!(refused_here > 0, "the burst is larger than the budget");
    // Every node sees one ledger: what was admitted in all (reconciled with the usage the
    // answers reported) is within the one budget.
    for node in nodes.iter() {
        let s = state(node, "b").await;
        let admitted = s["tokens"]["admittedTokens"].as_u64().unwrap();
        assert!(admitted <= 3_000, "admitted {admitted} tokens of 3000: {s}");
        // Its calls to the shared ledger are timed with the gate's.
        let text = node.metrics_text().await;
        assert!(redis_calls(&text, "tokens") >= 1.0, "{text}");
    }
}

/// A message whose estimate is `cost` tokens (7 of framing and prompt, the rest output). Its
/// model has no public tokenizer: estimated by bytes (a node's first OpenAI estimate builds
/// its encoding, which takes a while in a debug build).
fn costing(cost: u64) -> Value {
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": cost - 7,
        "messages": [{"role": "user", "content": "hi"}],
    })
}

/// A waiter that does not fit, on one node, lets small requests of other nodes pass until its
/// hold has run out; from then on the budget is held for it on every node, and it is served
/// before anything that came later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_waiter_holds_the_shared_budget_on_every_node() {
    let _serial = SERIAL.lock().await;
    let space = Space::new();
    let up = nthbouncer_testkit::Upstream::start().await;
    let pools = format!(
        "{}[pools.tokens]\nhold_ms = 1000\nwindow_ms = 3000\n",
        pool_toml("h", &up.url(), "tpm = 1000")
    );
    let nodes = nodes(3, &space.server_toml(&redis_url(), ""), &pools).await;
    let seq = |node: &Server, n: &str, cost| {
        node.pool("h", Method::POST, "/respond")
            .json(&costing(cost))
            .header("x-seq", n)
    };
    let a = seq(&nodes[0], "a", 800).send().await.unwrap();
    assert_eq!(a.status(), 200);
    assert_eq!(a.headers()["x-nthpool-tpm-remaining"], "200");
    let large = tokio::spawn(seq(&nodes[1], "large", 900).send());
    let mut last = Value::Null;
    let waits = wait_until(500, std::time::Duration::from_millis(10), async || {
        last = state(&nodes[1], "h").await;
        last["tokens"]["waiting"] == 1
    })
    .await;
    assert!(waits, "the large one never waited: {last}");
    // A small one on another node passes it while its hold has not run out...
    let small = seq(&nodes[2], "small", 100).send().await.unwrap();
    assert_eq!(small.status(), 200);
    assert_eq!(
        up.arrivals(),
        ["a", "small"],
        "{:?}",
        state(&nodes[1], "h").await
    );
    // ...and once it has, the budget is held on every node.
    let held = wait_until(500, std::time::Duration::from_millis(10), async || {
        last = state(&nodes[2], "h").await;
        last["tokens"]["held"] == true
    })
    .await;
    assert!(held, "the budget was never held: {last}");
    let probe = seq(&nodes[2], "probe", 50).header("x-nthpool-no-queue", "1");
    let probe = probe.send().await.unwrap();
    assert_eq!(probe.status(), 429, "{:?}", probe.text().await);
    let late = tokio::spawn(seq(&nodes[0], "late", 30).send());
    assert_eq!(large.await.unwrap().unwrap().status(), 200);
    assert_eq!(late.await.unwrap().unwrap().status(), 200);
    let arrivals = up.arrivals();
    assert!(!arrivals.iter().any(|a| a == "probe"), "{arrivals:?}");
    assert_eq!(arrivals, ["a", "small", "large", "late"]);
}
