//! End-to-end tests over real loopback HTTP: limits, headers, endpoints and
//! in-flight accounting as a client (or a gateway) would see them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::header::{HeaderMap, HeaderValue};
use reqwest::{Client, Response, StatusCode};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::{serve, Sandbox, SandboxConfig};

struct Running {
    base: String,
    sandbox: Arc<Sandbox>,
    client: Client,
    _stop: oneshot::Sender<()>,
}

impl Running {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn get(&self, path: &str) -> Response {
        self.client.get(self.url(path)).send().await.unwrap()
    }
}

async fn start(sandbox: Arc<Sandbox>) -> Running {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(serve(listener, Arc::clone(&sandbox), async {
        let _ = stopped.await;
    }));
    Running {
        base: format!("http://{addr}"),
        sandbox,
        client: Client::new(),
        _stop: stop,
    }
}

fn cfg(limit: u32, rpm: u32, latency_ms: u64) -> SandboxConfig {
    SandboxConfig {
        limit,
        rpm,
        latency_ms,
        latency_jitter_ms: 0,
        announce: true,
        tpm: 0,
        token_window_ms: 60_000,
        input_tpm: 0,
        output_tpm: 0,
    }
}

fn header<'a>(resp: &'a Response, name: &str) -> Option<&'a str> {
    resp.headers().get(name).map(|v| v.to_str().unwrap())
}

fn header_u64(resp: &Response, name: &str) -> u64 {
    header(resp, name)
        .unwrap_or_else(|| panic!("missing {name}"))
        .parse()
        .unwrap()
}

async fn wait_for_idle(sandbox: &Sandbox, within: Duration) {
    let deadline = Instant::now() + within;
    while sandbox.stats().in_flight != 0 {
        assert!(
            Instant::now() < deadline,
            "in_flight stuck at {}",
            sandbox.stats().in_flight
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn assert_rate_limit_error(resp: Response) {
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(header_u64(&resp, "retry-after") >= 1);
    assert!(header_u64(&resp, "retry-after-ms") >= 1);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert!(body["error"]["message"].as_str().unwrap().len() > 10);
}

/// Parses an SSE body into its `data:` payloads.
fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|frame| frame.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn concurrency_limit_refuses_past_limit_with_retry_after() {
    let run = start(Sandbox::new(cfg(2, 0, 20))).await;
    // Two long streams hold both slots for as long as we keep them.
    let held_a = run.get("/stream?chunks=2&interval_ms=5000").await;
    let held_b = run.get("/stream?chunks=2&interval_ms=5000").await;
    assert_eq!(held_a.status(), StatusCode::OK);
    assert_eq!(held_b.status(), StatusCode::OK);
    assert_eq!(run.sandbox.stats().in_flight, 2);

    let refused = run.get("/echo").await;
    // The hint is the typical request duration (20 ms here).
    assert_eq!(header(&refused, "retry-after"), Some("1"));
    assert_eq!(header(&refused, "retry-after-ms"), Some("20"));
    // The concurrency limit is hidden: no rate headers without an RPM.
    assert!(refused
        .headers()
        .get("x-ratelimit-limit-requests")
        .is_none());
    assert_rate_limit_error(refused).await;

    // Health probes are never limited.
    let health = run.get("/healthz").await;
    assert_eq!(health.status(), StatusCode::OK);
    assert_eq!(health.text().await.unwrap(), "ok");

    let stats = run.sandbox.stats();
    assert_eq!(stats.in_flight, 2);
    assert_eq!(stats.max_in_flight, 2);
    assert_eq!(stats.throttled, 1);
    assert_eq!(stats.requests, 3);

    drop(held_a);
    drop(held_b);
    wait_for_idle(&run.sandbox, Duration::from_secs(5)).await;
    assert_eq!(run.get("/echo").await.status(), StatusCode::OK);
}

#[tokio::test]
async fn concurrent_burst_never_exceeds_limit() {
    let run = start(Sandbox::new(cfg(4, 0, 300))).await;
    let burst = (0..24).map(|_| async {
        let resp = run.client.get(run.url("/echo")).send().await.unwrap();
        if resp.status() == StatusCode::TOO_MANY_REQUESTS {
            assert!(header_u64(&resp, "retry-after") >= 1);
        } else {
            assert_eq!(resp.status(), StatusCode::OK);
        }
        resp.status()
    });
    let statuses = futures_util::future::join_all(burst).await;
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count() as u64;

    let stats = run.sandbox.stats();
    assert_eq!(stats.requests, 24);
    assert_eq!(stats.ok, ok);
    assert_eq!(stats.ok + stats.throttled, 24);
    assert_eq!(stats.max_in_flight, 4);
    assert!(stats.throttled > 0);
    assert_eq!(stats.in_flight, 0);
}

#[tokio::test]
async fn rpm_limit_refuses_with_retry_after_and_rate_headers() {
    let run = start(Sandbox::new(cfg(0, 3, 0))).await;
    for remaining in ["2", "1", "0"] {
        let resp = run.get("/echo").await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(header(&resp, "x-ratelimit-limit-requests"), Some("3"));
        assert_eq!(
            header(&resp, "x-ratelimit-remaining-requests"),
            Some(remaining)
        );
        assert!(header(&resp, "x-ratelimit-reset-requests").is_some());
    }

    let refused = run.get("/echo").await;
    assert_eq!(header(&refused, "x-ratelimit-limit-requests"), Some("3"));
    assert_eq!(
        header(&refused, "x-ratelimit-remaining-requests"),
        Some("0")
    );
    // The window frees when the first request ages out: just under a minute.
    let secs = header_u64(&refused, "retry-after");
    assert!((59..=60).contains(&secs), "Retry-After {secs}");
    let ms = header_u64(&refused, "retry-after-ms");
    assert!((55_000..=60_000).contains(&ms), "retry-after-ms {ms}");
    let reset = header(&refused, "x-ratelimit-reset-requests").unwrap();
    assert!(reset == "1m0s" || reset.starts_with("59"), "reset {reset}");
    assert_rate_limit_error(refused).await;

    let stats = run.sandbox.stats();
    assert_eq!((stats.requests, stats.ok, stats.throttled), (4, 3, 1));
}

#[tokio::test]
async fn rpm_window_frees_after_retry_after() {
    let run = start(Sandbox::with_window(
        cfg(0, 2, 0),
        Duration::from_millis(300),
    ))
    .await;
    assert_eq!(run.get("/echo").await.status(), StatusCode::OK);
    assert_eq!(run.get("/echo").await.status(), StatusCode::OK);
    let refused = run.get("/echo").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&refused, "retry-after"), Some("1"));
    let wait = header_u64(&refused, "retry-after-ms");
    assert!(wait <= 300, "retry-after-ms {wait}");

    tokio::time::sleep(Duration::from_millis(wait + 30)).await;
    let resp = run.get("/echo").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "x-ratelimit-remaining-requests"), Some("1"));
}

#[tokio::test]
async fn rate_headers_only_when_announced_with_an_rpm() {
    let no_rpm = start(Sandbox::new(cfg(8, 0, 0))).await;
    let resp = no_rpm.get("/echo").await;
    assert!(resp.headers().get("x-ratelimit-limit-requests").is_none());

    let quiet = start(Sandbox::new(SandboxConfig {
        announce: false,
        tpm: 0,
        token_window_ms: 60_000,
        ..cfg(8, 1, 0)
    }))
    .await;
    assert!(quiet
        .get("/echo")
        .await
        .headers()
        .get("x-ratelimit-limit-requests")
        .is_none());
    let refused = quiet.get("/echo").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused
        .headers()
        .get("x-ratelimit-remaining-requests")
        .is_none());
    let body: Value = refused.json().await.unwrap();
    // A hidden RPM is not revealed in the message either.
    assert!(!body["error"]["message"].as_str().unwrap().contains("Limit"));
}

#[tokio::test]
async fn echo_reflects_method_path_query_headers_and_body() {
    let run = start(Sandbox::new(cfg(8, 0, 0))).await;
    let mut headers = HeaderMap::new();
    headers.insert("x-single", HeaderValue::from_static("one"));
    headers.append("x-multi", HeaderValue::from_static("a"));
    headers.append("x-multi", HeaderValue::from_static("b"));
    let resp = run
        .client
        .post(run.url("/echo/a/b?x=1&y=two%20words"))
        .headers(headers)
        .body("hello \u{e9}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let echo: Value = resp.json().await.unwrap();
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["path"], "/echo/a/b");
    assert_eq!(echo["query"], "x=1&y=two%20words");
    assert_eq!(echo["headers"]["x-single"], json!(["one"]));
    assert_eq!(echo["headers"]["x-multi"], json!(["a", "b"]));
    assert_eq!(echo["body"], "hello \u{e9}");
    assert_eq!(echo["body_len"], 8);

    let plain: Value = run.get("/echo").await.json().await.unwrap();
    assert_eq!(plain["method"], "GET");
    assert_eq!(plain["path"], "/echo");
    assert_eq!(plain["query"], Value::Null);
    assert_eq!(plain["body_len"], 0);

    let put = run
        .client
        .put(run.url("/echo"))
        .body("x")
        .send()
        .await
        .unwrap();
    let put: Value = put.json().await.unwrap();
    assert_eq!(put["method"], "PUT");
}

#[tokio::test]
async fn sse_stream_yields_n_events_then_done_and_frees_slot() {
    let run = start(Sandbox::new(cfg(8, 0, 0))).await;
    let started = Instant::now();
    let resp = run.get("/stream?chunks=3&interval_ms=30").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "content-type"), Some("text/event-stream"));
    let text = resp.text().await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(60));

    let data = sse_data(&text);
    assert_eq!(data.len(), 4, "{text}");
    for (i, event) in data[..3].iter().enumerate() {
        let event: Value = serde_json::from_str(event).unwrap();
        assert_eq!(event["index"], i);
        assert_eq!(event["chunks"], 3);
    }
    assert_eq!(data[3], "[DONE]");
    // The slot is released before [DONE] is sent, so this is not racy.
    let stats = run.sandbox.stats();
    assert_eq!(stats.in_flight, 0);
    assert_eq!(stats.max_in_flight, 1);
    assert_eq!(stats.ok, 1);
}

#[tokio::test]
async fn dropped_streaming_client_frees_in_flight() {
    let run = start(Sandbox::new(cfg(1, 0, 0))).await;
    let mut resp = run.get("/stream?chunks=1000&interval_ms=20").await;
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    assert_eq!(run.sandbox.stats().in_flight, 1);
    assert_eq!(
        run.get("/echo").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    drop(resp);
    wait_for_idle(&run.sandbox, Duration::from_secs(5)).await;
    assert_eq!(run.get("/echo").await.status(), StatusCode::OK);
}

#[tokio::test]
async fn client_hanging_up_during_latency_frees_in_flight() {
    let run = start(Sandbox::new(cfg(1, 0, 3_000))).await;
    let err = run
        .client
        .get(run.url("/echo"))
        .timeout(Duration::from_millis(100))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout());
    // Freed well before the 3 s latency would have run out.
    wait_for_idle(&run.sandbox, Duration::from_millis(1_500)).await;
    assert_eq!(run.sandbox.stats().ok, 0);
}

#[tokio::test]
async fn chat_completions_answers_like_openai() {
    let run = start(Sandbox::new(cfg(8, 0, 0))).await;
    let resp = run
        .client
        .post(run.url("/v1/chat/completions"))
        .json(&json!({
            "model": "gpt-sandbox",
            "messages": [
                { "role": "system", "content": "be brief" },
                { "role": "user", "content": "What is the capital of France?" },
            ],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "gpt-sandbox");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        content.contains("What is the capital of France?"),
        "{content}"
    );
    assert!(body["usage"]["total_tokens"].as_u64().unwrap() > 0);

    // Any JSON is accepted, even without a model or messages.
    let odd = run
        .client
        .post(run.url("/v1/chat/completions"))
        .body("[1, 2, 3]")
        .send()
        .await
        .unwrap();
    assert_eq!(odd.status(), StatusCode::OK);
}

#[tokio::test]
async fn chat_completions_rejects_bad_json_with_json_400() {
    let run = start(Sandbox::new(cfg(8, 0, 0))).await;
    let resp = run
        .client
        .post(run.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{\"model\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not valid JSON"));
    let stats = run.sandbox.stats();
    assert_eq!((stats.requests, stats.ok, stats.in_flight), (1, 0, 0));
}

#[tokio::test]
async fn chat_completions_streams_when_asked() {
    let run = start(Sandbox::new(cfg(8, 0, 0))).await;
    let resp = run
        .client
        .post(run.url("/v1/chat/completions"))
        .json(&json!({ "model": "m", "stream": true, "messages": [{ "role": "user", "content": "hi" }] }))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&resp, "content-type"), Some("text/event-stream"));
    let data = sse_data(&resp.text().await.unwrap());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let mut content = String::new();
    for event in &data[..data.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        assert_eq!(chunk["object"], "chat.completion.chunk");
        if let Some(text) = chunk["choices"][0]["delta"]["content"].as_str() {
            content.push_str(text);
        }
    }
    assert_eq!(content, "Sandbox reply to: hi");
    assert_eq!(run.sandbox.stats().in_flight, 0);
}

#[tokio::test]
async fn status_endpoint_answers_requested_status() {
    let run = start(Sandbox::new(cfg(8, 0, 0))).await;
    let resp = run
        .get("/status/503?retry_after=7&retry_after_ms=6500")
        .await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&resp, "retry-after"), Some("7"));
    assert_eq!(header(&resp, "retry-after-ms"), Some("6500"));
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "api_error");

    let resp = run
        .client
        .post(run.url("/status/429"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(resp.headers().get("retry-after").is_none());

    let resp = run.get("/status/204").await;
    assert_eq!(resp.status(), StatusCode::NO_CONTENT);
    assert!(resp.bytes().await.unwrap().is_empty());

    let resp = run.get("/status/201").await;
    assert_eq!(resp.status(), StatusCode::CREATED);

    let stats = run.sandbox.stats();
    assert_eq!((stats.requests, stats.ok, stats.throttled), (4, 2, 1));
}

#[tokio::test]
async fn bad_input_and_unknown_paths_get_json_errors() {
    let run = start(Sandbox::new(cfg(8, 0, 0))).await;
    for (path, status) in [
        ("/status/abc", StatusCode::BAD_REQUEST),
        ("/status/42", StatusCode::BAD_REQUEST),
        ("/status/700", StatusCode::BAD_REQUEST),
        ("/status/500?retry_after=soon", StatusCode::BAD_REQUEST),
        ("/stream?chunks=lots", StatusCode::BAD_REQUEST),
        ("/stream?chunks=1000000", StatusCode::BAD_REQUEST),
        ("/stream?interval_ms=-1", StatusCode::BAD_REQUEST),
        ("/nope", StatusCode::NOT_FOUND),
        ("/v1/chat/completions", StatusCode::METHOD_NOT_ALLOWED),
    ] {
        let resp = run.get(path).await;
        assert_eq!(resp.status(), status, "{path}");
        let body: Value = resp.json().await.unwrap();
        assert!(body["error"]["type"].is_string(), "{path}: {body}");
        assert!(body["error"]["message"].is_string(), "{path}: {body}");
    }
    let resp = run.client.post(run.url("/healthz")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert!(resp.json::<Value>().await.unwrap()["error"].is_object());
}

#[tokio::test]
async fn healthz_and_unknown_paths_are_not_counted() {
    let run = start(Sandbox::new(cfg(8, 0, 0))).await;
    assert_eq!(run.get("/healthz").await.status(), StatusCode::OK);
    assert_eq!(run.get("/nope").await.status(), StatusCode::NOT_FOUND);
    assert_eq!(run.sandbox.stats().requests, 0);
}

#[tokio::test]
async fn latency_is_applied_before_answering() {
    let run = start(Sandbox::new(SandboxConfig {
        latency_ms: 120,
        latency_jitter_ms: 40,
        ..cfg(8, 0, 0)
    }))
    .await;
    let started = Instant::now();
    assert_eq!(run.get("/echo").await.status(), StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(120));
    // Health probes skip the latency.
    let started = Instant::now();
    run.get("/healthz").await;
    assert!(started.elapsed() < Duration::from_millis(120));
}

#[tokio::test]
async fn serve_stops_on_shutdown() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(
        listener,
        Sandbox::new(SandboxConfig::default()),
        async {
            let _ = stopped.await;
        },
    ));
    stop.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap();
    assert!(result.unwrap().is_ok());
}
