//! Token budgets end to end (SPEC §12): the real router in front of the real sandbox with a
//! hidden tokens-per-minute limit on a short window, or the counting upstream when a test
//! needs to choose the usage an answer reports. Counting, not timing.

use std::sync::Arc;

use nthbouncer_sandbox::{Sandbox, SandboxConfig};
use nthbouncer_testkit::*;
use reqwest::Method;
use serde_json::{json, Value};

/// Framing our estimate adds to a one-message chat completion whose content is one token
/// (`hi`): 3 for the message, 1 for its text, 3 to prime the answer.
const FRAMING: u64 = 7;

/// A sandbox with a hidden token limit of `tpm` refilling over `window_ms`, and no other limit.
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

/// A chat completion whose estimate is `cost` tokens (`cost - FRAMING` of output).
fn chat(cost: u64) -> Value {
    json!({
        "model": "gpt-4o",
        "max_tokens": cost - FRAMING,
        "messages": [{"role": "user", "content": "hi"}],
    })
}

fn post(gw: &Gateway, path: &str, body: &Value) -> reqwest::RequestBuilder {
    gw.pool("p", Method::POST, path)
        .header("x-nthpool-key", KEY)
        .json(body)
}

fn tokens_of(state: &Value) -> &Value {
    &state["tokens"]
}

#[tokio::test]
async fn a_request_larger_than_the_budget_gets_400_at_once() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "tpm = 1000")).await;
    let r = send(post(&gw, "/respond", &chat(5_000))).await;
    assert_eq!(r.headers()["x-nthpool-tpm-remaining"], "1000");
    let body = expect_error(r, 400, "exceeds_token_budget").await;
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("5000") && message.contains("1000"),
        "{message}"
    );
    assert_eq!(up.total(), 0, "nothing reached the origin");
    // One that fits goes through, and says what is left.
    let r = send(post(&gw, "/respond", &chat(400))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-nthpool-tpm-remaining"], "600");
    let s = gw.state("p").await;
    assert_eq!(tokens_of(&s)["budget"], 1000);
    assert_eq!(tokens_of(&s)["source"], "configured");
}

#[tokio::test]
async fn usage_reconciliation_moves_the_budget_both_ways() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "tpm = 10000")).await;
    // Estimated 300, used 40: the budget gets 260 back.
    let r = send(post(&gw, "/respond", &chat(300)).header(
        "x-respond-body",
        r#"{"usage":{"prompt_tokens":10,"completion_tokens":30}}"#,
    ))
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-nthpool-tpm-remaining"], "9700");
    r.bytes().await.unwrap();
    gw.wait_state("p", "usage of 40 reconciled", |s| {
        tokens_of(s)["remaining"] == 9960
    })
    .await;
    // Estimated 100, used 900: the budget loses 800 more.
    let r = send(post(&gw, "/respond", &chat(100)).header(
        "x-respond-body",
        r#"{"usage":{"input_tokens":400,"output_tokens":500}}"#,
    ))
    .await;
    assert_eq!(r.headers()["x-nthpool-tpm-remaining"], "9860");
    r.bytes().await.unwrap();
    let s = gw
        .wait_state("p", "usage of 900 reconciled", |s| {
            tokens_of(s)["remaining"] == 10_000 - 40 - 900
        })
        .await;
    assert_eq!(tokens_of(&s)["admittedTokens"], 940);
    // Without a usage report the estimate stands.
    let r = send(post(&gw, "/respond", &chat(60))).await;
    r.bytes().await.unwrap();
    gw.wait_state("p", "estimate kept", |s| {
        tokens_of(s)["remaining"] == 10_000 - 40 - 900 - 60
    })
    .await;
    let metrics = send(gw.api(Method::GET, "/metrics"))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("nthbouncer_admitted_tokens_total{pool=\"p\"}"),
        "admitted estimates counted: {metrics}"
    );
}

/// Eager clients with prompts of mixed length against a sandbox whose token limit is hidden:
/// once the first answer announced it, the origin refuses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_clients_get_no_origin_429_once_the_budget_is_known() {
    let (sb, url) = sandbox(3_000, 1_000).await;
    let gw = gateway(&pool_toml("p", &url, "limit = 50")).await;
    let first = send(post(&gw, "/v1/chat/completions", &chat(100))).await;
    assert_eq!(first.status(), 200);
    assert!(first.headers().contains_key("x-nthpool-tpm-remaining"));
    let s = gw.state("p").await;
    assert_eq!(tokens_of(&s)["source"], "announced");
    assert_eq!(tokens_of(&s)["budget"], 3000);
    let mut tasks = Vec::new();
    for i in 0..40u64 {
        let words = ["alpha "; 200].concat();
        let prompt = &words[..(6 * (5 + (i * 37) % 190)) as usize];
        let body = json!({
            "model": "gpt-4o",
            "max_tokens": 20 + (i * 13) % 120,
            "messages": [{"role": "user", "content": prompt}],
        });
        tasks.push(spawn_send(post(&gw, "/v1/chat/completions", &body)));
    }
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    }
    // Without the budget most of this burst would be refused.
    let stats = sb.stats();
    assert_eq!(stats.throttled, 0, "the origin refused some: {stats:?}");
    assert_eq!(stats.ok, 41);
}

/// A request that does not fit lets small ones pass until its hold has run out; from then on
/// the budget is kept for it, and it is served before the small ones that came after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_waiter_is_served_within_its_bound_while_small_ones_pass() {
    let up = Upstream::start().await;
    let toml = format!(
        "{}[pools.tokens]\nhold_ms = 300\nwindow_ms = 1500\n",
        pool_toml("p", &up.url(), "tpm = 1000")
    );
    let gw = gateway(&toml).await;
    let seq = |n: &str, cost| post(&gw, "/respond", &chat(cost)).header("x-seq", n);
    assert_eq!(send(seq("a", 800)).await.status(), 200);
    let large = spawn_send(seq("large", 900));
    gw.wait_state("p", "the large one waits", |s| tokens_of(s)["waiting"] == 1)
        .await;
    // Small ones that fit pass it while its hold has not run out...
    assert_eq!(send(seq("small", 100)).await.status(), 200);
    assert_eq!(up.arrivals(), ["a", "small"]);
    // ...and once it has, they wait behind it, though they would fit.
    gw.wait_state("p", "the budget is held", |s| tokens_of(s)["held"] == true)
        .await;
    let probe = post(&gw, "/respond", &chat(50))
        .header("x-nthpool-no-queue", "1")
        .header("x-seq", "probe");
    expect_error(send(probe).await, 429, "too_many_requests").await;
    let late: Vec<_> = (0..3)
        .map(|i| spawn_send(seq(&format!("late{i}"), 30)))
        .collect();
    assert_eq!(large.await.unwrap().status(), 200);
    for t in late {
        assert_eq!(t.await.unwrap().status(), 200);
    }
    let arrivals = up.arrivals();
    assert!(
        !arrivals.iter().any(|a| a == "probe"),
        "a small one passed the held budget: {arrivals:?}"
    );
    assert_eq!(arrivals[..3], ["a", "small", "large"]);
    assert_eq!(arrivals.len(), 6, "{arrivals:?}");
}

/// A lock acquire carries its estimate and a release its usage: the pool's token budget counts
/// lock holders' calls like proxied ones.
#[tokio::test]
async fn lock_acquire_charges_tokens_and_release_reports_usage() {
    let gw = gateway(&lock_pool_toml("p", "tpm = 1000")).await;
    let acquire = |body: Value| {
        gw.api(Method::POST, "/pools/p/lock/acquire")
            .header("x-nthpool-key", KEY)
            .json(&body)
    };
    let too_big = send(acquire(json!({"tokens": 1500}))).await;
    expect_error(too_big, 400, "exceeds_token_budget").await;
    let r = send(acquire(json!({"tokens": 600}))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-nthpool-tpm-remaining"], "400");
    let slot = r.json::<Value>().await.unwrap()["slotId"]
        .as_str()
        .unwrap()
        .to_string();
    // No room for 500 more now, and this one may not wait.
    let full = send(acquire(json!({"tokens": 500}))).await;
    expect_error(full, 429, "too_many_requests").await;
    let released = send(
        gw.api(Method::POST, &format!("/pools/p/lock/{slot}/release"))
            .header("x-nthpool-key", KEY)
            .json(&json!({"status": 200, "usage": {"promptTokens": 50, "completionTokens": 50}})),
    )
    .await;
    assert_eq!(released.status(), 200);
    let s = gw.state("p").await;
    assert_eq!(tokens_of(&s)["remaining"], 900);
    assert_eq!(send(acquire(json!({"tokens": 500}))).await.status(), 200);
}

/// Async jobs in a pool with a token budget are estimated and admitted against it like proxied
/// requests: charged when they run, corrected by the usage their answer reports; one larger
/// than the whole budget fails without reaching the origin, and one that does not fit yet
/// waits for the budget, not for a slot.
#[tokio::test]
async fn async_jobs_are_charged_against_the_token_budget() {
    let up = Upstream::start().await;
    // Async needs an active destination: one that is never contacted.
    let toml = format!(
        "[server]\nallow_private_webhooks = true\n{}[pools.async]\nenabled = true\n{}",
        pool_toml("p", &up.url(), "tpm = 1000"),
        webhook_toml("http://127.0.0.1:9/hook"),
    );
    let gw = gateway(&toml).await;
    let job = async |cost: u64, usage: Option<&str>| {
        let mut r = post(&gw, "/respond", &chat(cost)).header("x-nthpool-async", "1");
        if let Some(u) = usage {
            r = r.header("x-respond-body", u);
        }
        let (status, accepted) = call(r).await;
        assert_eq!(status, 202, "{accepted}");
        accepted["jobId"].as_str().unwrap().to_string()
    };
    let settled = async |id: &str| {
        eventually(&format!("job {id} to end"), async || {
            let (_, body) = call(gw.poll_job("p", id)).await;
            (body["status"] == "completed" || body["status"] == "failed").then_some(body)
        })
        .await
    };
    // Estimated 400, used 100: the budget keeps 900.
    let a = job(400, Some(r#"{"usage":{"total_tokens":100}}"#)).await;
    assert_eq!(settled(&a).await["status"], "completed");
    let s = gw
        .wait_state("p", "the job's usage reconciled", |s| {
            tokens_of(s)["remaining"] == 900
        })
        .await;
    assert_eq!(tokens_of(&s)["admittedTokens"], 100);
    // Larger than the whole budget: it fails at once, and the origin never sees it.
    let b = job(1_500, None).await;
    let failed = settled(&b).await;
    assert_eq!(failed["status"], "failed", "{failed}");
    let why = failed["error"].to_string();
    assert!(why.contains("1500") && why.contains("1000"), "{failed}");
    assert_eq!(up.total(), 1);
    // 950 does not fit in the 900 left: the job waits for the budget.
    let c = job(950, None).await;
    gw.wait_state("p", "the job waits for tokens", |s| {
        tokens_of(s)["waiting"] == 1
    })
    .await;
    let (_, polled) = call(gw.poll_job("p", &c)).await;
    assert_eq!(polled["status"], "queued", "{polled}");
    assert_eq!(up.total(), 1, "the waiting job did not reach the origin");
}

/// The machine's Redis (`NB_TEST_REDIS`, else 127.0.0.1:6379) as `host:port`.
fn redis_addr() -> String {
    let url = std::env::var("NB_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let rest = url.trim_start_matches("redis://");
    rest.split('/').next().unwrap_or(rest).to_string()
}

/// A way to the machine's Redis that the test can cut: a forwarder on a port of its own.
struct RedisVia {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl RedisVia {
    async fn start() -> RedisVia {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                conns.spawn(async move {
                    if let Ok(mut out) = tokio::net::TcpStream::connect(redis_addr()).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                });
            }
        });
        RedisVia { port, task }
    }

    /// Redis is away from now on: the port is closed and every connection through it cut.
    fn cut(&self) {
        self.task.abort();
    }
}

/// Deletes every key under `prefix` in the machine's Redis when dropped.
struct Keys(String);

impl Drop for Keys {
    fn drop(&mut self) {
        let url = format!("redis://{}/", redis_addr());
        let Ok(mut c) = redis::Client::open(url).and_then(|c| c.get_connection()) else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", self.0))
            .query(&mut c)
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: Result<(), _> = redis::cmd("DEL").arg(&keys).query(&mut c);
        }
    }
}

/// A shared budget opened on a runtime that then ends (a pool added through the admin API
/// opens on a connection thread, and a stopping server ends those first) still reports its
/// calls' usage to Redis: its reporter runs on the node's runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_opened_from_another_runtime_keeps_reporting_to_redis() {
    use nthbouncer_coord::redis::{RedisCoordination, RedisOptions};
    use nthbouncer_coord::{Clock, Priority, SystemClock};
    use nthbouncer_governor::{TokenCost, TokenSettings, Usage};
    use nthbouncer_server::tokens::TokenGate;

    let prefix = format!("nbtokrt-{:x}", rand::random::<u64>());
    let _keys = Keys(prefix.clone());
    let mut options = RedisOptions::new(format!("redis://{}/", redis_addr()));
    options.key_prefix = prefix;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
    let redis = RedisCoordination::new(options, clock.clone()).unwrap();
    redis.ping().await.unwrap();
    let ledger = redis.token_ledger("p");
    let settings = TokenSettings {
        tpm: 1_000,
        window_ms: 60_000,
        ..TokenSettings::default()
    };
    let gate = std::thread::spawn(move || {
        let elsewhere = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        elsewhere.block_on(async { TokenGate::open(settings, clock, Some(ledger)) })
    })
    .join()
    .unwrap();

    let remaining = gate
        .acquire(1, TokenCost::from(600), Priority::Normal, 0)
        .await
        .unwrap();
    assert_eq!(remaining, Some(400));
    // The call used 100 tokens: the reporter corrects its charge in Redis.
    gate.finish(1, Some(Usage::Total(100)));
    let mut seen = None;
    for _ in 0..100 {
        seen = gate.snapshot().await.remaining;
        if seen == Some(900) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(seen, Some(900), "the finish never reached Redis");
}

/// With coordination on a Redis that stops answering, the token budget behaves as the slot
/// gate: refused with `503 coordination_unavailable` (fail closed), or admitted against this
/// node's share of the configured budget (fail open), and nothing past it reaches the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_budget_whose_redis_is_away_fails_closed_or_open_on_the_nodes_share() {
    let prefix = format!("nbtok-{:x}", rand::random::<u64>());
    let _keys = Keys(prefix.clone());
    let server = |port: u16, fail: &str| {
        format!(
            "[server]\ncoordination = \"redis://127.0.0.1:{port}/\"\n\
             coordination_prefix = \"{prefix}\"\ncoordination_timeout_ms = 300\n{fail}"
        )
    };
    let up = Upstream::start().await;
    let via = RedisVia::start().await;
    let closed = gateway(&(server(via.port, "") + &pool_toml("p", &up.url(), "tpm = 1000"))).await;
    assert_eq!(
        send(post(&closed, "/respond", &chat(100))).await.status(),
        200
    );
    via.cut();
    let r = send(post(&closed, "/respond", &chat(100))).await;
    assert!(r.headers().contains_key("retry-after"));
    expect_error(r, 503, "coordination_unavailable").await;
    assert_eq!(up.total(), 1);

    // A port nobody listens on: the node starts on its own (fail open).
    let (_reserved, refused) = refused_port();
    let port = refused.port();
    let open = server(port, "coordination_fail = \"open\"\nexpected_nodes = 2\n");
    let open = gateway(&(open + &pool_toml("p", &up.url(), "tpm = 1000"))).await;
    let r = send(post(&open, "/respond", &chat(400))).await;
    assert_eq!(r.status(), 200, "within this node's share of 500");
    r.bytes().await.unwrap();
    let over = post(&open, "/respond", &chat(200)).header("x-nthpool-no-queue", "1");
    expect_error(send(over).await, 429, "too_many_requests").await;
    assert_eq!(up.total(), 2);
}

/// A sandbox whose `/v1/messages` has hidden input- and output-token limits apart (Anthropic's
/// split budget, announced with `anthropic-ratelimit-{input,output}-tokens-*`), each refilling
/// over a second.
async fn split_sandbox(input_tpm: u64, output_tpm: u64) -> (Arc<Sandbox>, String) {
    nthbouncer_sandbox::start_on_loopback(SandboxConfig {
        limit: 0,
        latency_ms: 5,
        token_window_ms: 1_000,
        input_tpm,
        output_tpm,
        ..SandboxConfig::default()
    })
    .await
    .unwrap()
}

/// An origin that announces its input and output tokens apart: a request's output cap must fit
/// the output budget (larger than all of it: 400 at once, though the input has plenty), and
/// eager clients whose caps together are many times the output budget get no origin 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_and_output_budgets_apart_each_bind() {
    let (sb, url) = split_sandbox(100_000, 500).await;
    let gw = gateway(&pool_toml("p", &url, "limit = 50")).await;
    let message = |max_tokens: u64| {
        json!({
            "model": "claude-sonnet-4-5",
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "say hi to the sandbox"}],
        })
    };
    let first = send(post(&gw, "/v1/messages", &message(100))).await;
    assert_eq!(first.status(), 200);
    first.bytes().await.unwrap();
    let s = gw
        .wait_state("p", "the split budget learned", |s| {
            tokens_of(s)["outputRemaining"].is_u64()
        })
        .await;
    assert_eq!(tokens_of(&s)["source"], "announced");
    assert!(
        tokens_of(&s)["inputRemaining"].as_u64().unwrap() > 99_000,
        "{s}"
    );

    let r = send(post(&gw, "/v1/messages", &message(600))).await;
    let body = expect_error(r, 400, "exceeds_token_budget").await;
    let text = body["message"].as_str().unwrap();
    assert!(text.contains("600") && text.contains("500"), "{text}");

    let mut tasks = Vec::new();
    for _ in 0..30 {
        tasks.push(spawn_send(post(&gw, "/v1/messages", &message(150))));
    }
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    }
    let stats = sb.stats();
    assert_eq!(stats.throttled, 0, "the origin refused some: {stats:?}");
    assert_eq!(stats.ok, 31);
}

/// A streamed answer whose last chunk reports the usage (OpenAI's
/// `stream_options.include_usage`): once the stream has been relayed, the charge is corrected
/// from the estimate to that usage.
#[tokio::test]
async fn a_streamed_answers_final_usage_chunk_reconciles_the_charge() {
    let (_sb, url) = sandbox(0, 60_000).await;
    let gw = gateway(&pool_toml("p", &url, "tpm = 10000")).await;
    let body = json!({
        "model": "gpt-4o",
        "max_tokens": 500,
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "hi"}],
    });
    let r = send(post(&gw, "/v1/chat/completions", &body)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    // Charged its estimate: 7 of framing and prompt, and the 500 it may write.
    assert_eq!(r.headers()["x-nthpool-tpm-remaining"], "9493");
    let text = r.text().await.unwrap();
    let usage = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v["usage"]["total_tokens"].as_u64())
        .unwrap_or_else(|| panic!("no usage chunk in {text}"));
    assert!(
        usage < 507,
        "the reported usage is not the estimate: {usage}"
    );
    let s = gw
        .wait_state("p", "the streamed usage reconciled", |s| {
            tokens_of(s)["remaining"] == 10_000 - usage
        })
        .await;
    assert_eq!(tokens_of(&s)["admittedTokens"], usage);
    // The next answer says so too.
    let r = send(post(&gw, "/v1/chat/completions", &chat(100))).await;
    assert_eq!(
        r.headers()["x-nthpool-tpm-remaining"],
        (10_000 - usage - 100).to_string().as_str()
    );
}
