//! Webhook delivery end to end over loopback (SPEC §7): a real receiver, signatures checked by an
//! independent implementation of the Standard Webhooks spec (ring's HMAC, written from the spec)
//! and by the spec's published test vector, the retry schedule on an injected clock, Retry-After,
//! 410, deactivation and the fallback to sync, re-enable, redelivery, secret rotation, and the
//! private-address guard.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;

use base64::prelude::*;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use nthbouncer_coord::Clock;
use nthbouncer_testkit::*;
use parking_lot::Mutex;
use reqwest::Method;
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------------
// An independent verifier, written from the Standard Webhooks specification: the signed content
// is `{webhook-id}.{webhook-timestamp}.{body}`, the key is the base64-decoded part of the secret
// after `whsec_`, the header holds space-separated `v1,<base64 HMAC-SHA256>` entries, and any one
// of them matching (compared in constant time) verifies the message.

fn verify(secret: &str, id: &str, timestamp: &str, body: &[u8], header: &str) -> bool {
    let Some(b64) = secret.strip_prefix("whsec_") else {
        return false;
    };
    let Ok(key) = BASE64_STANDARD.decode(b64) else {
        return false;
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key);
    let mut signed = Vec::new();
    signed.extend_from_slice(id.as_bytes());
    signed.push(b'.');
    signed.extend_from_slice(timestamp.as_bytes());
    signed.push(b'.');
    signed.extend_from_slice(body);
    header.split(' ').any(|entry| {
        let Some(sig) = entry.strip_prefix("v1,") else {
            return false;
        };
        let Ok(sig) = BASE64_STANDARD.decode(sig) else {
            return false;
        };
        ring::hmac::verify(&key, &signed, &sig).is_ok()
    })
}

/// Verifies a received webhook as a receiver would: headers present, timestamp within 5 minutes
/// of `now_ms`, signature valid for `secret`.
fn verify_received(r: &Received, secret: &str, now_ms: u64) -> bool {
    let h = |n: &str| r.headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("");
    let ts: u64 = h("webhook-timestamp").parse().unwrap_or(0);
    ts.abs_diff(now_ms / 1000) <= 300
        && verify(
            secret,
            h("webhook-id"),
            h("webhook-timestamp"),
            &r.body,
            h("webhook-signature"),
        )
}

/// Verifies a received webhook with the official Standard Webhooks library, unchanged (it checks
/// the timestamp against the wall clock, so only for gateways whose clock is wall time).
fn official_verify(r: &Received, secret: &str) -> Result<(), String> {
    standardwebhooks::Webhook::new(secret)
        .map_err(|e| e.to_string())?
        .verify(&r.body, &r.headers)
        .map_err(|e| e.to_string())
}

/// The specification's published test vector, against the independent verifier and against
/// the signer nthbouncer uses.
#[test]
fn the_spec_test_vector() {
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let (id, ts, body) = (
        "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "1614265330",
        br#"{"test": 2432232314}"#,
    );
    let expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
    assert!(verify(secret, id, ts, body, expected));
    assert!(!verify(secret, id, "1614265331", body, expected));
    assert!(!verify(
        secret,
        id,
        ts,
        br#"{"test": 2432232315}"#,
        expected
    ));
    let key = internals::secret_key(secret).unwrap();
    assert_eq!(
        internals::sign(&key, id, 1_614_265_330, body).unwrap(),
        expected
    );
    // The official library agrees.
    let official = standardwebhooks::Webhook::new(secret)
        .unwrap()
        .sign(id, 1_614_265_330, body)
        .unwrap();
    assert_eq!(official, expected);
}

// ---------------------------------------------------------------------------------------------
// A receiver that answers from a script and records everything it got.

#[derive(Clone, Debug)]
struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
}

fn reply(status: u16) -> Reply {
    Reply {
        status,
        headers: Vec::new(),
    }
}

fn reply_with(status: u16, name: &'static str, value: impl Into<String>) -> Reply {
    Reply {
        status,
        headers: vec![(name, value.into())],
    }
}

#[derive(Clone, Debug)]
struct Received {
    path: String,
    headers: HeaderMap,
    body: Bytes,
    answered: u16,
}

impl Received {
    fn header(&self, name: &str) -> String {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

#[derive(Default)]
struct ReceiverState {
    script: Mutex<VecDeque<Reply>>,
    default: Mutex<Option<Reply>>,
    received: Mutex<Vec<Received>>,
}

struct Receiver {
    addr: SocketAddr,
    state: Arc<ReceiverState>,
}

impl Receiver {
    async fn start() -> Receiver {
        let state = Arc::new(ReceiverState::default());
        let st = state.clone();
        let addr = serve_http(move |req| answer(st.clone(), req)).await;
        Receiver { addr, state }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn script(&self, replies: impl IntoIterator<Item = Reply>) {
        self.state.script.lock().extend(replies);
    }

    fn set_default(&self, r: Reply) {
        *self.state.default.lock() = Some(r);
    }

    fn received(&self) -> Vec<Received> {
        self.state.received.lock().clone()
    }

    async fn wait_received(&self, n: usize) -> Vec<Received> {
        until(&format!("{n} webhook requests"), async || {
            self.state.received.lock().len() >= n
        })
        .await;
        self.received()
    }
}

async fn answer(st: Arc<ReceiverState>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = read_body(body).await;
    let r = st
        .script
        .lock()
        .pop_front()
        .or_else(|| st.default.lock().clone())
        .unwrap_or_else(|| reply(200));
    st.received.lock().push(Received {
        path: parts.uri.path().to_string(),
        headers: parts.headers,
        body,
        answered: r.status,
    });
    let mut resp = Response::new(Full::new(Bytes::from(format!("answered {}", r.status))));
    *resp.status_mut() = StatusCode::from_u16(r.status).unwrap();
    for (k, v) in r.headers {
        resp.headers_mut().insert(k, v.parse().unwrap());
    }
    resp
}

// ---------------------------------------------------------------------------------------------
// Gateway helpers.

fn async_pool(up: &Upstream, server_extra: &str, pool_extra: &str) -> String {
    format!(
        "[server]\n{server_extra}\n{}[pools.async]\nenabled = true\n{pool_extra}",
        pool_toml("p", &up.url(), "limit = 4")
    )
}

/// Attaches a destination through the admin API; returns its id and secret.
async fn add_destination(gw: &Gateway, url: &str, extra: Value) -> (String, String) {
    let mut body = json!({ "url": url });
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        body[k] = v;
    }
    let (status, v) = gw.post("/admin/pools/p/webhooks", body).await;
    assert_eq!(status, 201);
    (
        v["id"].as_str().unwrap().to_string(),
        v["secret"].as_str().unwrap().to_string(),
    )
}

async fn submit(gw: &Gateway) -> String {
    let r = send(gw.get_async("p", "/echo")).await;
    assert_eq!(r.status(), 202, "the pool must be async");
    json_of(r).await["jobId"].as_str().unwrap().to_string()
}

async fn get_json(gw: &Gateway, path: &str) -> Value {
    let r = send(gw.api(Method::GET, path)).await;
    assert_eq!(r.status(), 200, "{path}");
    json_of(r).await
}

async fn poll(gw: &Gateway, job: &str) -> Value {
    let r = send(gw.poll_job("p", job)).await;
    assert_eq!(r.status(), 200);
    json_of(r).await
}

/// Switches a destination on or off through the admin API; asserts 200.
async fn set_active(gw: &Gateway, dest: &str, active: bool) {
    let path = format!("/admin/pools/p/webhooks/{dest}");
    assert_eq!(gw.patch(&path, json!({ "active": active })).await.0, 200);
}

/// Rotates a destination's secret through the admin API (`body` as JSON, if any).
async fn rotate(gw: &Gateway, dest: &str, body: Option<Value>) -> (u16, Value) {
    let path = format!("/admin/pools/p/webhooks/{dest}/rotate");
    gw.admin(Method::POST, &path, body).await
}

/// Asks for a job's redelivery through the admin API.
async fn redeliver(gw: &Gateway, job: &str) -> (u16, Value) {
    let path = format!("/admin/pools/p/jobs/{job}/redeliver");
    gw.admin(Method::POST, &path, None).await
}

/// A job's attempts, oldest first.
async fn attempts(gw: &Gateway, job: &str) -> Vec<Value> {
    let v = get_json(gw, &format!("/admin/pools/p/deliveries?jobId={job}")).await;
    let mut items = v["items"].as_array().unwrap().clone();
    items.reverse();
    items
}

/// Waits (bounded) until `job` has `n` recorded attempts; returns them oldest first.
async fn wait_attempts(gw: &Gateway, job: &str, n: usize) -> Vec<Value> {
    eventually(
        &format!("job {job} to have {n} recorded attempts"),
        async || {
            let a = attempts(gw, job).await;
            (a.len() >= n).then_some(a)
        },
    )
    .await
}

/// Waits (bounded) until the job's poll body satisfies `pred`.
async fn wait_poll(gw: &Gateway, job: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    let reached = wait::poll(wait::TRIES, wait::EVERY, async || {
        last = poll(gw, job).await;
        pred(&last).then(|| last.clone())
    })
    .await;
    if let Some(v) = reached {
        return v;
    }
    let detail = get_json(gw, &format!("/admin/pools/p/jobs/{job}")).await;
    panic!("job {job} never reached: {what}; last poll body {last}; detail {detail}");
}

/// Waits (bounded) until the job counts one delivery.
async fn wait_delivered(gw: &Gateway, job: &str, what: &str) -> Value {
    wait_poll(gw, job, what, |v| v["webhook"]["delivered"] == 1).await
}

/// How long after `attempt` the job's delivery is due again (ms).
async fn retry_wait(gw: &Gateway, job: &str, attempt: &Value) -> u64 {
    let d = delivery_of(gw, job).await;
    d["nextAttemptAt"].as_u64().unwrap() - attempt["at"].as_u64().unwrap()
}

async fn destination(gw: &Gateway, id: &str) -> Value {
    let list = get_json(gw, "/admin/pools/p/webhooks").await;
    item_where(&list, "id", id)
}

/// Asserts a destination's streak of consecutive failures is `n`.
async fn assert_streak(gw: &Gateway, dest: &str, n: u64, why: &str) {
    let d = destination(gw, dest).await;
    assert_eq!(d["consecutiveFailures"], n, "{why}");
}

async fn wait_destination(
    gw: &Gateway,
    id: &str,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    eventually(&format!("destination {id}: {what}"), async || {
        let d = destination(gw, id).await;
        pred(&d).then_some(d)
    })
    .await
}

/// The single delivery of `job` (from the admin job detail).
async fn delivery_of(gw: &Gateway, job: &str) -> Value {
    let d = get_json(gw, &format!("/admin/pools/p/jobs/{job}")).await;
    d["deliveries"][0].clone()
}

/// Whether an async request is answered sync (the pool fell back) or with 202.
async fn async_answer(gw: &Gateway) -> u16 {
    send(gw.get_async("p", "/status/201"))
        .await
        .status()
        .as_u16()
}

// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn delivers_the_poll_body_signed_per_the_standard() {
    let up = Upstream::start().await;
    let rx = Receiver::start().await;
    let gw = gateway(&async_pool(&up, "allow_private_webhooks = true", "")).await;
    let (dest, secret) = add_destination(&gw, &rx.url("/hook"), json!({})).await;
    let job = submit(&gw).await;

    let got = rx.wait_received(1).await;
    let r = &got[0];
    assert_eq!(r.path, "/hook");
    assert_eq!(r.header("webhook-id"), job, "webhook-id is the job id");
    assert_eq!(r.header("content-type"), "application/json");
    assert!(
        r.header("user-agent").starts_with("nthbouncer/"),
        "{}",
        r.header("user-agent")
    );
    let now = wall_ms();
    assert!(
        verify_received(r, &secret, now),
        "the independent verifier refused the signature"
    );
    assert!(
        !verify(
            &secret,
            &job,
            &r.header("webhook-timestamp"),
            b"{\"tampered\":true}",
            &r.header("webhook-signature")
        ),
        "a tampered body must not verify"
    );
    let other = nthbouncer_config::keys::generate_webhook_secret();
    assert!(
        !verify_received(r, &other, now),
        "another secret must not verify"
    );
    official_verify(r, &secret).expect("the official Standard Webhooks library refused it");
    assert!(official_verify(r, &other).is_err());

    // The body is the poll body.
    let body = r.json();
    assert_eq!(body["jobId"], job.as_str());
    assert_eq!(body["status"], "completed");
    assert_eq!(body["reason"], "requested");
    assert_eq!(body["result"]["status"], 200);
    assert_eq!(body["webhook"]["destinations"], 1);
    for f in ["createdAt", "updatedAt", "expiresAt"] {
        assert!(body[f].as_u64().unwrap() > 0, "{f}");
    }

    // Poll counts stay true, and the attempt is logged.
    let done = wait_delivered(&gw, &job, "delivered").await;
    assert_eq!(
        done["webhook"],
        json!({"destinations": 1, "delivered": 1, "failed": 0})
    );
    let a = wait_attempts(&gw, &job, 1).await;
    assert_eq!(a.len(), 1);
    assert_eq!(a[0]["attempt"], 1);
    assert_eq!(a[0]["statusCode"], 200);
    assert_eq!(a[0]["outcome"], "delivered");
    assert_eq!(a[0]["destinationId"], dest.as_str());
    assert_eq!(a[0]["responseBody"], "answered 200");
    assert!(a[0]["latencyMs"].is_u64());
    assert!(a[0]["error"].is_null());
    let by_dest = get_json(
        &gw,
        &format!("/admin/pools/p/deliveries?destinationId={dest}"),
    )
    .await;
    assert_eq!(by_dest["items"].as_array().unwrap().len(), 1);
    let none = get_json(&gw, "/admin/pools/p/deliveries?destinationId=wh_other").await;
    assert!(none["items"].as_array().unwrap().is_empty());
    let detail = get_json(&gw, &format!("/admin/pools/p/jobs/{job}")).await;
    assert_eq!(detail["deliveries"][0]["status"], "delivered");
    // The routes are in the OpenAPI document.
    let doc = gw.admin_json("/openapi.json").await;
    for path in [
        "/admin/pools/{pool}/deliveries",
        "/admin/pools/{pool}/jobs/{jobId}/redeliver",
        "/admin/pools/{pool}/webhooks/{id}/rotate",
    ] {
        assert!(
            doc["paths"].get(path).is_some(),
            "{path} missing from /openapi.json"
        );
    }
    for schema in [
        "AttemptPage",
        "AttemptView",
        "RotatedSecret",
        "Redelivery",
        "DeliveryView",
    ] {
        assert!(
            doc["components"]["schemas"].get(schema).is_some(),
            "{schema}"
        );
    }
    assert_eq!(detail["deliveries"][0]["destinationId"], dest.as_str());
}

/// 3xx and 5xx fail; the schedule (5 s, then 5 min, with jitter) runs on the injected clock; the
/// same webhook-id goes out every time; a redirect is never followed.
#[tokio::test]
async fn retries_after_failures_then_succeeds() {
    let up = Upstream::start().await;
    let rx = Receiver::start().await;
    let (gw, clock) = clocked(&async_pool(&up, "allow_private_webhooks = true", "")).await;
    let (dest, secret) = add_destination(&gw, &rx.url("/hook"), json!({})).await;
    rx.script([
        reply_with(302, "location", rx.url("/elsewhere")),
        reply(500),
        reply(200),
    ]);
    let job = submit(&gw).await;

    let a = wait_attempts(&gw, &job, 1).await;
    assert_eq!(a[0]["statusCode"], 302);
    assert_eq!(a[0]["outcome"], "retrying");
    assert!(a[0]["error"].as_str().unwrap().contains("not followed"));
    let wait = retry_wait(&gw, &job, &a[0]).await;
    assert!(
        (4_500..=5_500).contains(&wait),
        "first retry after 5 s ± 10 %, got {wait} ms"
    );
    assert_streak(&gw, &dest, 1, "a failed attempt counts").await;

    clock.advance(6_000);
    let a = wait_attempts(&gw, &job, 2).await;
    assert_eq!(a[1]["statusCode"], 500);
    assert_eq!(a[1]["attempt"], 2);
    let wait = retry_wait(&gw, &job, &a[1]).await;
    assert!(
        (270_000..=330_000).contains(&wait),
        "second retry after 5 min ± 10 %, got {wait} ms"
    );

    clock.advance(331_000);
    let a = wait_attempts(&gw, &job, 3).await;
    assert_eq!(a[2]["statusCode"], 200);
    assert_eq!(a[2]["outcome"], "delivered");
    let done = wait_delivered(&gw, &job, "delivered").await;
    assert_eq!(done["webhook"]["failed"], 0);
    assert_streak(&gw, &dest, 0, "a success resets the streak").await;

    let got = rx.received();
    assert_eq!(got.len(), 3, "the redirect was not followed");
    assert!(got.iter().all(|r| r.path == "/hook"));
    for (r, attempt) in got.iter().zip(&a) {
        assert_eq!(
            r.header("webhook-id"),
            job,
            "the same webhook-id on every retry"
        );
        // Signed when sent, with the time it was sent.
        assert!(verify_received(r, &secret, attempt["at"].as_u64().unwrap()));
    }
    assert_eq!(
        got.iter().map(|r| r.answered).collect::<Vec<_>>(),
        vec![302, 500, 200]
    );
}

/// On 429/503 a Retry-After is honoured as max(backoff, hint).
#[tokio::test]
async fn retry_after_is_honoured() {
    let up = Upstream::start().await;
    let rx = Receiver::start().await;
    let (gw, clock) = clocked(&async_pool(&up, "allow_private_webhooks = true", "")).await;
    add_destination(&gw, &rx.url("/hook"), json!({})).await;
    rx.script([
        reply_with(503, "retry-after", "120"),
        reply_with(429, "retry-after", "1"),
        reply(204),
    ]);
    let job = submit(&gw).await;

    // The hint is longer than the 5 s backoff: it wins, exactly.
    let a = wait_attempts(&gw, &job, 1).await;
    assert_eq!(a[0]["statusCode"], 503);
    assert_eq!(retry_wait(&gw, &job, &a[0]).await, 120_000);

    // The hint is shorter than the 5 min backoff: the backoff wins.
    clock.advance(121_000);
    let a = wait_attempts(&gw, &job, 2).await;
    assert_eq!(a[1]["statusCode"], 429);
    let wait = retry_wait(&gw, &job, &a[1]).await;
    assert!((270_000..=330_000).contains(&wait), "got {wait} ms");

    clock.advance(331_000);
    let a = wait_attempts(&gw, &job, 3).await;
    assert_eq!(a[2]["statusCode"], 204);
    assert_eq!(rx.received().len(), 3);
}

/// 410 deactivates a destination at once; with two destinations the pool stays async until the
/// last one goes, then serves sync; re-enabling brings async back.
#[tokio::test]
async fn gone_deactivates_and_the_last_one_flips_the_pool_to_sync() {
    let up = Upstream::start().await;
    let a_rx = Receiver::start().await;
    let b_rx = Receiver::start().await;
    let (gw, _clock) = clocked(&async_pool(&up, "allow_private_webhooks = true", "")).await;
    let (a, _) = add_destination(&gw, &a_rx.url("/a"), json!({})).await;
    let (b, _) = add_destination(&gw, &b_rx.url("/b"), json!({})).await;
    b_rx.set_default(reply(410));

    let job = submit(&gw).await;
    let d = wait_destination(&gw, &b, "deactivated", |d| d["active"] == false).await;
    assert!(d["deactivatedAt"].as_u64().is_some());
    assert_eq!(d["consecutiveFailures"], 1, "one 410 is enough");
    let v = wait_poll(&gw, &job, "one delivered, one failed", |v| {
        v["webhook"]["delivered"] == 1 && v["webhook"]["failed"] == 1
    })
    .await;
    assert_eq!(v["webhook"]["destinations"], 2);
    // Destination a is still active: the pool stays async (and the probe job is delivered to a
    // before a starts answering 410, so that job 2 is the one that deactivates it).
    let probe = submit(&gw).await;
    wait_delivered(&gw, &probe, "delivered to a").await;

    // Now a answers 410 too: the pool's last destination goes, and the pool serves sync.
    a_rx.set_default(reply(410));
    let job2 = submit(&gw).await;
    wait_destination(&gw, &a, "deactivated", |d| d["active"] == false).await;
    assert_eq!(async_answer(&gw).await, 201, "no active destination: sync");
    let v = wait_poll(&gw, &job2, "failed", |v| v["webhook"]["failed"] == 1).await;
    assert_eq!(v["webhook"]["destinations"], 1);

    // Re-enable a: async again, and it is delivered to.
    a_rx.set_default(reply(200));
    set_active(&gw, &a, true).await;
    let job3 = submit(&gw).await;
    wait_delivered(&gw, &job3, "delivered").await;
    assert_eq!(
        b_rx.received().len(),
        1,
        "b was deactivated by job 1's 410 and never called again"
    );
}

/// `deactivate_after` consecutive failures deactivate the destination, fail its pending retries,
/// and flip the pool to sync; re-enabling clears the streak and restores async.
#[tokio::test]
async fn consecutive_failures_deactivate_and_re_enable_restores_async() {
    let up = Upstream::start().await;
    let rx = Receiver::start().await;
    let (gw, _clock) = clocked(&async_pool(&up, "allow_private_webhooks = true", "")).await;
    let (dest, _) = add_destination(&gw, &rx.url("/hook"), json!({"deactivateAfter": 3})).await;
    rx.set_default(reply(500));

    let mut jobs = Vec::new();
    for i in 1..=3 {
        jobs.push(submit(&gw).await);
        wait_destination(&gw, &dest, "the streak grows", |d| {
            d["consecutiveFailures"].as_u64().unwrap() >= i
        })
        .await;
    }
    let d = wait_destination(&gw, &dest, "deactivated", |d| d["active"] == false).await;
    assert_eq!(d["consecutiveFailures"], 3);
    assert_eq!(async_answer(&gw).await, 201, "the pool serves sync");
    for job in &jobs {
        // The pending retries failed with the destination: the counts say so.
        let v = wait_poll(&gw, job, "failed", |v| v["webhook"]["failed"] == 1).await;
        assert_eq!(v["webhook"]["delivered"], 0);
    }
    let jobs_before = get_json(&gw, "/admin/pools/p/jobs").await["items"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(
        jobs_before, 3,
        "no job is created while the pool serves sync"
    );

    rx.set_default(reply(200));
    set_active(&gw, &dest, true).await;
    let d = destination(&gw, &dest).await;
    assert_eq!(d["active"], true);
    assert_eq!(d["consecutiveFailures"], 0);
    assert!(d["deactivatedAt"].is_null());
    let job = submit(&gw).await;
    wait_delivered(&gw, &job, "delivered").await;
}

/// A job can be redelivered by hand: the same webhook-id again, a new round whose failures do
/// not count towards the destination's streak.
#[tokio::test]
async fn manual_redelivery() {
    let up = Upstream::start().await;
    let rx = Receiver::start().await;
    let (gw, clock) = clocked(&async_pool(&up, "allow_private_webhooks = true", "")).await;
    let (dest, secret) = add_destination(&gw, &rx.url("/hook"), json!({})).await;
    let job = submit(&gw).await;
    wait_delivered(&gw, &job, "delivered").await;

    rx.script([reply(500), reply(200)]);
    let (status, body) = redeliver(&gw, &job).await;
    assert_eq!(status, 202);
    assert_eq!(body, json!({"jobId": job, "deliveries": 1}));
    let a = wait_attempts(&gw, &job, 2).await;
    assert_eq!(a[1]["manual"], true);
    assert_eq!(a[1]["statusCode"], 500);
    assert_eq!(a[1]["attempt"], 2);
    assert_streak(
        &gw,
        &dest,
        0,
        "a manual redelivery's failure does not count towards the streak",
    )
    .await;
    clock.advance(6_000);
    let a = wait_attempts(&gw, &job, 3).await;
    assert_eq!(a[2]["statusCode"], 200);
    assert_eq!(a[2]["manual"], true);
    let got = rx.received();
    assert_eq!(got.len(), 3);
    assert!(got.iter().all(|r| r.header("webhook-id") == job));
    for (r, attempt) in got.iter().zip(&a) {
        assert!(verify_received(r, &secret, attempt["at"].as_u64().unwrap()));
    }
    wait_delivered(&gw, &job, "delivered again").await;

    // Unknown job: 404; a job that has not ended: 409.
    let (status, body) = redeliver(&gw, &format!("job_{}", "0".repeat(32))).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"], "job_not_found");
    let held = json_of(send(gw.get_async("p", "/hold")).await).await["jobId"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, body) = redeliver(&gw, &held).await;
    assert_eq!(status, 409);
    assert_eq!(body["error"], "job_not_terminal");
    up.release(1);
}

/// Rotating a secret shows the new one once; until the grace ends both signatures are sent
/// (space-separated), after it only the new one.
#[tokio::test]
async fn rotation_sends_both_signatures_during_the_grace() {
    let up = Upstream::start().await;
    let rx = Receiver::start().await;
    // The clock starts at wall time, so the official library's timestamp check applies too.
    let t0 = wall_ms();
    let (gw, clock) = clocked_at(&async_pool(&up, "allow_private_webhooks = true", ""), t0).await;
    let (dest, old) = add_destination(&gw, &rx.url("/hook"), json!({})).await;

    let (status, rotated) = rotate(&gw, &dest, Some(json!({"graceS": 3600}))).await;
    assert_eq!(status, 200);
    let new = rotated["secret"].as_str().unwrap().to_string();
    assert!(new.starts_with("whsec_") && new != old);
    assert_eq!(rotated["previousSecretExpiresAt"], t0 + 3_600_000);
    let listed = get_json(&gw, "/admin/pools/p/webhooks").await.to_string();
    assert!(
        !listed.contains(&new[10..]) && !listed.contains(&old[10..]),
        "secrets stay masked"
    );

    submit(&gw).await;
    let got = rx.wait_received(1).await;
    let sig = got[0].header("webhook-signature");
    let parts: Vec<&str> = sig.split(' ').collect();
    assert_eq!(parts.len(), 2, "two signatures during the grace: {sig}");
    let (id, ts) = (
        got[0].header("webhook-id"),
        got[0].header("webhook-timestamp"),
    );
    assert!(verify(&new, &id, &ts, &got[0].body, parts[0]));
    assert!(verify(&old, &id, &ts, &got[0].body, parts[1]));
    assert!(verify_received(&got[0], &new, clock.now_ms()));
    assert!(verify_received(&got[0], &old, clock.now_ms()));
    // Receivers on either secret accept it with the official library, unchanged.
    official_verify(&got[0], &new).expect("official library, new secret");
    official_verify(&got[0], &old).expect("official library, previous secret");

    // After the grace: only the new secret signs.
    clock.advance(3_600_001);
    submit(&gw).await;
    let got = rx.wait_received(2).await;
    assert_eq!(got[1].header("webhook-signature").split(' ').count(), 1);
    assert!(verify_received(&got[1], &new, clock.now_ms()));
    assert!(!verify_received(&got[1], &old, clock.now_ms()));

    // graceS 0 drops the previous secret at once; bad input is refused.
    let r = send(
        gw.api(
            Method::POST,
            &format!("/admin/pools/p/webhooks/{dest}/rotate"),
        )
        .json(&json!({"graceS": 0})),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert!(json_of(r).await["previousSecretExpiresAt"].is_null());
    let (status, _) = rotate(&gw, &dest, Some(json!({"graceS": 604_801}))).await;
    assert_eq!(status, 400);
    assert_eq!(rotate(&gw, "wh_nope", None).await.0, 404);
}

/// Private destinations are refused when saved, and at every attempt on the address actually
/// connected to, unless `server.allow_private_webhooks` is set.
#[tokio::test]
async fn private_destinations_are_refused_unless_allowed() {
    let up = Upstream::start().await;
    let rx = Receiver::start().await;
    let port = rx.addr.port();
    // A config destination is not checked when saved: every attempt still is.
    let toml = format!(
        "{}[[pools.webhooks]]\nurl = \"{}\"\nsecret = \"{}\"\n",
        async_pool(&up, "", ""),
        rx.url("/hook"),
        nthbouncer_config::keys::generate_webhook_secret()
    );
    let gw = gateway(&toml).await;
    for url in [
        format!("http://127.0.0.1:{port}/hook"),
        format!("http://127.1:{port}/hook"), // a name that resolves to loopback
        format!("http://localhost:{port}/hook"),
        format!("http://[::1]:{port}/hook"),
        "http://169.254.169.254/latest/meta-data".to_string(),
        "http://10.0.0.8/hook".to_string(),
        "http://100.64.1.1/hook".to_string(),
    ] {
        let (status, body) = gw
            .post("/admin/pools/p/webhooks", json!({ "url": url }))
            .await;
        assert_eq!(status, 400, "{url} must be refused");
        assert_eq!(body["field"], "url");
    }
    let job = submit(&gw).await;
    let a = wait_attempts(&gw, &job, 1).await;
    assert!(a[0]["statusCode"].is_null());
    assert!(
        a[0]["error"].as_str().unwrap().contains("refused"),
        "{}",
        a[0]["error"]
    );
    assert!(
        rx.received().is_empty(),
        "nothing reached the private address"
    );

    // Allowed: the same destination is delivered to.
    let gw2 =
        gateway(&toml.replace("[server]\n", "[server]\nallow_private_webhooks = true\n")).await;
    let job = submit(&gw2).await;
    let got = rx.wait_received(1).await;
    assert_eq!(got[0].header("webhook-id"), job);
}

/// `webhooks` in a pool created through the admin API are real destinations, as a config
/// pool's are: a job is delivered to them, signed with their secret. The secret is not in the
/// stored body (only in the destination), and the pool keeps its webhooks across a restart.
/// Before, they were stored (secret in plain text) and never used: async quietly stayed sync.
#[tokio::test]
async fn an_api_pools_webhooks_are_real_destinations() {
    let up = Upstream::start().await;
    let rx = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "[server]\nallow_private_webhooks = true\ndata_dir = {:?}\n",
        dir.path().display().to_string()
    );
    let gw = gateway(&toml).await;
    let body = json!({
        "name": "p", "upstream": up.url(), "keys": [KEY],
        "async": {"enabled": true},
        "webhooks": [{"url": rx.url("/hook"), "secret": WEBHOOK_SECRET}],
    });
    let (status, v) = gw.post("/admin/pools", body).await;
    assert_eq!(status, 201, "{v}");
    let job = submit(&gw).await;
    let got = rx.wait_received(1).await;
    assert_eq!(got[0].header("webhook-id"), job);
    assert!(verify_received(&got[0], WEBHOOK_SECRET, wall_ms()));

    let stored = gw.running.state.store.list_pools().await.unwrap();
    let stored = serde_json::to_string(&stored[0].spec).unwrap();
    assert!(
        !stored.contains(WEBHOOK_SECRET),
        "the secret is in the stored body: {stored}"
    );
    // The destination routes leave it to the pool's settings.
    let list = gw.admin_json("/admin/pools/p/webhooks").await;
    let id = list["items"][0]["id"].as_str().unwrap().to_string();
    let (status, v) = gw.delete(&format!("/admin/pools/p/webhooks/{id}")).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (409, Some("conflict")),
        "{v}"
    );
    gw.running.shutdown().await;

    let gw = gateway(&toml).await;
    let (_, pool) = gw.admin(Method::GET, "/admin/pools/p", None).await;
    assert_eq!(pool["webhooks"][0]["url"], rx.url("/hook"), "{pool}");
    assert_ne!(
        pool["webhooks"][0]["secret"], WEBHOOK_SECRET,
        "shown masked"
    );
    let job = submit(&gw).await;
    let got = rx.wait_received(2).await;
    assert_eq!(got[1].header("webhook-id"), job);
    assert!(verify_received(&got[1], WEBHOOK_SECRET, wall_ms()));

    // A PUT without them removes them.
    let (status, v) = gw
        .put(
            "/admin/pools/p",
            json!({"name": "p", "upstream": up.url(), "keys": [KEY], "async": {"enabled": true}}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let list = gw.admin_json("/admin/pools/p/webhooks").await;
    assert_eq!(list["items"].as_array().map(Vec::len), Some(0), "{list}");
}
