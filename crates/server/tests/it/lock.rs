//! The lock API end to end (SPEC §5; the seed on concurrency locks is normative): the real router
//! on loopback, HTTP on the API host, a real counting upstream for the proxy side of the shared
//! limit, and `ManualClock` wherever a deadline or a `Retry-After` is asserted exactly.
//!
//! Not covered here: `403` for an IP-allowlist miss (the allowlist policy is not built yet).

use std::collections::BTreeSet;

use nthbouncer_testkit::*;
use reqwest::{Method, RequestBuilder, Response};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// A POST to `/pools/{pool}/lock/{rest}` on the API host, with no key.
fn lock_post(gw: &Gateway, pool: &str, rest: &str) -> RequestBuilder {
    gw.api_anon(Method::POST, &format!("/pools/{pool}/lock/{rest}"))
}

/// The same with the test key.
fn keyed(gw: &Gateway, pool: &str, rest: &str) -> RequestBuilder {
    lock_post(gw, pool, rest).header("x-nthpool-key", KEY)
}

async fn send(rb: RequestBuilder) -> Response {
    bounded("a response", rb.send()).await.unwrap()
}

/// A fail-fast acquire on `pool` with the test key.
async fn acquire(gw: &Gateway, pool: &str) -> Response {
    send(keyed(gw, pool, "acquire")).await
}

/// Spawns an acquire with the test key that waits up to `wait_ms` for a slot.
fn spawn_waiter(gw: &Gateway, pool: &str, wait_ms: u64) -> JoinHandle<Response> {
    spawn_send(keyed(gw, pool, "acquire").json(&json!({ "waitMs": wait_ms })))
}

/// Awaits a spawned request.
async fn finish(what: &str, task: JoinHandle<Response>) -> Response {
    bounded(what, task).await.unwrap()
}

/// Awaits a spawned request that must succeed (200).
async fn finished_ok(what: &str, task: JoinHandle<Response>) -> Response {
    let r = finish(what, task).await;
    assert_eq!(r.status(), 200, "{what}");
    r
}

fn header(r: &Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

/// Asserts header `name` of `r` is `want` (`None`: absent).
fn assert_header(r: &Response, name: &str, want: Option<&str>) {
    assert_eq!(header(r, name).as_deref(), want, "{name}");
}

/// Asserts the governor headers of `r`: remaining slots, effective limit and queued ms.
fn assert_gate(r: &Response, remaining: &str, limit: &str, queued_ms: &str) {
    assert_header(r, "x-nthpool-remaining-slots", Some(remaining));
    assert_header(r, "x-nthpool-effective-limit", Some(limit));
    assert_header(r, "x-nthpool-queued-ms", Some(queued_ms));
}

/// Asserts a fail-fast acquire on `pool` is refused `429` with `Retry-After: retry_after`.
async fn assert_refused_for(gw: &Gateway, pool: &str, retry_after: &str) {
    let r = acquire(gw, pool).await;
    assert_header(&r, "retry-after", Some(retry_after));
    expect_error(r, 429, "too_many_requests").await;
}

/// An acquire with the test key whose body is `body`, sent as JSON.
fn json_acquire(gw: &Gateway, pool: &str, body: &'static str) -> RequestBuilder {
    keyed(gw, pool, "acquire")
        .header("content-type", "application/json")
        .body(body)
}

/// Asserts a JSON error answer with `status` and `code`; returns its body.
async fn expect_error(r: Response, status: u16, code: &str) -> Value {
    assert_eq!(r.status(), status, "status of an expected {code}");
    assert_header(&r, "content-type", Some("application/json"));
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], code, "{body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    body
}

/// Acquires a slot fail-fast with the test key; asserts the grant.
async fn grant(gw: &Gateway, pool: &str) -> Value {
    let r = send(keyed(gw, pool, "acquire")).await;
    assert_eq!(r.status(), 200, "acquire on {pool}");
    r.json().await.unwrap()
}

fn slot(g: &Value) -> String {
    g["slotId"].as_str().unwrap().to_string()
}

async fn renew(gw: &Gateway, pool: &str, slot: &str) -> Response {
    send(keyed(gw, pool, &format!("{slot}/renew"))).await
}

async fn renewed(gw: &Gateway, pool: &str, slot: &str) -> u64 {
    let r = renew(gw, pool, slot).await;
    assert_eq!(r.status(), 200, "renew");
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body.as_object().unwrap().len(),
        1,
        "renew answers only leaseDeadline: {body}"
    );
    body["leaseDeadline"].as_u64().unwrap()
}

async fn release(gw: &Gateway, pool: &str, slot: &str, report: Option<Value>) -> Response {
    let rb = keyed(gw, pool, &format!("{slot}/release"));
    let rb = match report {
        Some(v) => rb.json(&v),
        None => rb,
    };
    send(rb).await
}

/// Releases and returns the `released` flag (asserting the exact body shape).
async fn released(gw: &Gateway, pool: &str, slot: &str, report: Option<Value>) -> bool {
    let r = release(gw, pool, slot, report).await;
    assert_eq!(r.status(), 200, "release");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body.as_object().unwrap().len(), 1, "{body}");
    body["released"].as_bool().unwrap()
}

fn is_slot_id(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

// ---- acquire: the grant ----

/// The grant has exactly the seed's fields, its deadlines follow the pool's settings to the
/// millisecond, and the governor headers come with it. Empty body, `{}` and no Content-Type all
/// work.
#[tokio::test]
async fn grant_has_the_seed_fields_exact_deadlines_and_governor_headers() {
    let (gw, clock) = clocked(&lock_pool_toml(
        "p",
        "limit = 3\nlease_term_ms = 20000\nrenew_interval_ms = 5000\nrequest_timeout_ms = 90000",
    ))
    .await;

    // No body, no Content-Type.
    let r = acquire(&gw, "p").await;
    assert_eq!(r.status(), 200);
    assert!(header(&r, "content-type")
        .unwrap()
        .starts_with("application/json"));
    assert_gate(&r, "2", "3", "0");
    assert_eq!(
        header(&r, "x-nthpool-rpm-remaining"),
        None,
        "no RPM gate, no RPM header"
    );
    let g1: Value = r.json().await.unwrap();
    let fields: BTreeSet<&str> = g1.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        fields,
        BTreeSet::from([
            "slotId",
            "leaseDeadline",
            "requestDeadline",
            "termMs",
            "renewIntervalMs"
        ])
    );
    assert!(is_slot_id(g1["slotId"].as_str().unwrap()), "{g1}");
    assert_eq!(g1["leaseDeadline"], T0 + 20_000);
    assert_eq!(g1["requestDeadline"], T0 + 90_000);
    assert_eq!(g1["termMs"], 20_000);
    assert_eq!(g1["renewIntervalMs"], 5_000);

    // `{}` with a JSON Content-Type, a little later: deadlines move with the clock.
    clock.advance(1_234);
    let r = send(json_acquire(&gw, "p", "{}")).await;
    assert_eq!(r.status(), 200);
    assert_header(&r, "x-nthpool-remaining-slots", Some("1"));
    let g2: Value = r.json().await.unwrap();
    assert_eq!(g2["leaseDeadline"], T0 + 1_234 + 20_000);
    assert_eq!(g2["requestDeadline"], T0 + 1_234 + 90_000);

    // An empty body that claims to be JSON.
    let r = send(json_acquire(&gw, "p", "")).await;
    assert_eq!(r.status(), 200);
    assert_header(&r, "x-nthpool-remaining-slots", Some("0"));
    let g3: Value = r.json().await.unwrap();

    // Unguessable: every grant has its own id.
    let ids: BTreeSet<String> = [&g1, &g2, &g3].into_iter().map(slot).collect();
    assert_eq!(ids.len(), 3, "slot ids repeat: {ids:?}");
    assert!(ids.iter().all(|s| is_slot_id(s)));
    assert_eq!(gw.state("p").await["inFlight"], 3);
}

/// On an RPM-limited pool the grant carries `x-nthpool-rpm-remaining`, and the refusal once the
/// minute is spent carries the exact `Retry-After`.
#[tokio::test]
async fn rpm_pool_grants_carry_rpm_remaining_and_refusals_an_exact_retry_after() {
    let (gw, clock) = clocked(&lock_pool_toml("p", "limit = 5\nrpm = 2")).await;
    for left in ["1", "0"] {
        let r = acquire(&gw, "p").await;
        assert_eq!(r.status(), 200);
        assert_header(&r, "x-nthpool-rpm-remaining", Some(left));
    }
    let r = acquire(&gw, "p").await;
    assert_header(&r, "retry-after", Some("60"));
    assert_header(&r, "x-nthpool-rpm-remaining", Some("0"));
    assert_gate(&r, "3", "5", "0");
    expect_error(r, 429, "too_many_requests").await;
    clock.advance(15_000);
    assert_refused_for(&gw, "p", "45").await;
    clock.advance(45_000);
    let r = acquire(&gw, "p").await;
    assert_eq!(r.status(), 200);
    assert_header(&r, "x-nthpool-rpm-remaining", Some("1"));
}

// ---- acquire: refusals and the wait budget ----

/// Locks fail fast by default (on a manual clock a wait would never end by itself): 429 with the
/// governor headers, `Retry-After` only once an estimate exists (here: one measured hold of 4 s).
#[tokio::test]
async fn acquire_fails_fast_by_default_with_429_and_governor_headers() {
    let (gw, clock) = clocked(&lock_pool_toml("p", "limit = 1")).await;
    let held = grant(&gw, "p").await;
    let r = acquire(&gw, "p").await;
    assert_gate(&r, "0", "1", "0");
    assert_eq!(header(&r, "retry-after"), None, "no estimate yet");
    expect_error(r, 429, "too_many_requests").await;
    assert_eq!(gw.state("p").await["queued"], 0, "nobody was parked");

    // One hold of exactly 4 s teaches the gate how long a slot is kept.
    clock.advance(4_000);
    assert!(released(&gw, "p", &slot(&held), None).await);
    let _held = grant(&gw, "p").await;
    let r = send(keyed(&gw, "p", "acquire").json(&json!({}))).await;
    assert_header(&r, "retry-after", Some("4"));
    expect_error(r, 429, "too_many_requests").await;
}

/// `waitMs` opts into the queue; when no slot opens in time the answer is 504 queue_timeout with
/// the governor headers, and the waiter has left the queue.
#[tokio::test]
async fn wait_ms_on_a_busy_pool_ends_in_504_queue_timeout() {
    let gw = gateway(&lock_pool_toml("p", "limit = 1")).await;
    let held = grant(&gw, "p").await;
    let r = send(keyed(&gw, "p", "acquire").json(&json!({"waitMs": 50}))).await;
    assert_header(&r, "x-nthpool-remaining-slots", Some("0"));
    assert_header(&r, "x-nthpool-effective-limit", Some("1"));
    assert!(header(&r, "x-nthpool-queued-ms").is_some());
    expect_error(r, 504, "queue_timeout").await;
    let s = gw.state("p").await;
    assert_eq!(s["queued"], 0);
    assert_eq!(s["inFlight"], 1);
    // The holder is untouched.
    assert!(released(&gw, "p", &slot(&held), None).await);
}

/// The body's `waitMs` beats `X-Nthpool-Queue-Timeout-Ms` both ways (exact on a manual clock).
#[tokio::test]
async fn body_wait_ms_beats_the_queue_timeout_header() {
    let (gw, clock) = clocked(&lock_pool_toml("p", "limit = 1")).await;
    let held = grant(&gw, "p").await;

    // Header 5000, body 50: times out after 50 ms.
    let w = spawn_send(
        keyed(&gw, "p", "acquire")
            .header("x-nthpool-queue-timeout-ms", "5000")
            .json(&json!({"waitMs": 50})),
    );
    gw.wait_queued("p", 1, "waiter parked").await;
    clock.advance(50);
    let r = finish("the 50 ms waiter", w).await;
    assert_header(&r, "x-nthpool-queued-ms", Some("50"));
    expect_error(r, 504, "queue_timeout").await;
    gw.wait_queued("p", 0, "waiter gone").await;

    // Header 50, body 5000: still waiting after 4999 ms, and gets the slot when it frees.
    let w = spawn_send(
        keyed(&gw, "p", "acquire")
            .header("x-nthpool-queue-timeout-ms", "50")
            .json(&json!({"waitMs": 5000})),
    );
    gw.wait_queued("p", 1, "waiter parked").await;
    clock.advance(4_999);
    assert_eq!(gw.state("p").await["queued"], 1);
    assert!(released(&gw, "p", &slot(&held), None).await);
    let r = finished_ok("the 5000 ms waiter", w).await;
    assert_header(&r, "x-nthpool-queued-ms", Some("4999"));
    let g: Value = r.json().await.unwrap();
    assert_eq!(g["leaseDeadline"], T0 + 50 + 4_999 + 30_000);
}

/// `X-Nthpool-No-Queue` forces fail-fast even with `waitMs` (on a manual clock a wait would
/// hang, so an answer at all proves there was none).
#[tokio::test]
async fn no_queue_header_beats_wait_ms() {
    let (gw, _clock) = clocked(&lock_pool_toml("p", "limit = 1")).await;
    let _held = grant(&gw, "p").await;
    let r = send(
        keyed(&gw, "p", "acquire")
            .header("x-nthpool-no-queue", "1")
            .json(&json!({"waitMs": 5000})),
    )
    .await;
    assert_header(&r, "x-nthpool-queued-ms", Some("0"));
    expect_error(r, 429, "too_many_requests").await;
    assert_eq!(gw.state("p").await["queued"], 0);
}

/// A wait longer than the pool's `queue_timeout_ms` is clamped to it, from the body and from the
/// header alike.
#[tokio::test]
async fn wait_ms_is_clamped_to_the_pool_queue_timeout() {
    let (gw, clock) = clocked(&lock_pool_toml("p", "limit = 1\nqueue_timeout_ms = 100")).await;
    let _held = grant(&gw, "p").await;
    let w = spawn_waiter(&gw, "p", 3_600_000);
    gw.wait_queued("p", 1, "waiter parked").await;
    clock.advance(100);
    let r = finish("the clamped waiter", w).await;
    assert_header(&r, "x-nthpool-queued-ms", Some("100"));
    expect_error(r, 504, "queue_timeout").await;

    let w = spawn_send(keyed(&gw, "p", "acquire").header("x-nthpool-queue-timeout-ms", "3600000"));
    gw.wait_queued("p", 1, "waiter parked").await;
    clock.advance(100);
    let r = finish("the clamped header waiter", w).await;
    assert_header(&r, "x-nthpool-queued-ms", Some("100"));
    expect_error(r, 504, "queue_timeout").await;
}

/// A waiter that finds the queue full is refused at once with 429 too_many_requests.
#[tokio::test]
async fn a_full_queue_refuses_lock_waiters_with_429() {
    let (gw, clock) = clocked(&lock_pool_toml("p", "limit = 1\nqueue_size = 1")).await;
    let _held = grant(&gw, "p").await;
    let first = spawn_waiter(&gw, "p", 1000);
    gw.wait_queued("p", 1, "first waiter parked").await;
    let r = send(keyed(&gw, "p", "acquire").json(&json!({"waitMs": 1000}))).await;
    assert_header(&r, "x-nthpool-remaining-slots", Some("0"));
    let e = expect_error(r, 429, "too_many_requests").await;
    assert!(
        e["message"].as_str().unwrap().contains("queue is full"),
        "{e}"
    );
    assert_eq!(gw.state("p").await["queued"], 1);
    clock.advance(1000);
    expect_error(
        finish("the first waiter", first).await,
        504,
        "queue_timeout",
    )
    .await;
}

/// The body's `priority` (which beats `X-Nthpool-Priority`) lets a lock waiter overtake.
#[tokio::test]
async fn body_priority_overtakes_queued_normal_waiters() {
    let gw = gateway(&lock_pool_toml("p", "limit = 1")).await;
    let held = grant(&gw, "p").await;
    let normal = spawn_waiter(&gw, "p", 10_000);
    gw.wait_queued("p", 1, "normal waiter parked").await;
    let high = spawn_send(
        keyed(&gw, "p", "acquire")
            .header("x-nthpool-priority", "low")
            .json(&json!({"waitMs": 10_000, "priority": "high"})),
    );
    let s = gw
        .wait_state("p", "high waiter parked", |s| s["queued"] == 2)
        .await;
    assert_eq!(s["queuedByClass"]["high"], 1);
    assert_eq!(s["queuedByClass"]["normal"], 1);
    assert!(released(&gw, "p", &slot(&held), None).await);
    let r = finished_ok("the high waiter", high).await;
    let g: Value = r.json().await.unwrap();
    let s = gw.state("p").await;
    assert_eq!(
        s["queuedByClass"]["normal"], 1,
        "the normal one still waits"
    );
    assert!(released(&gw, "p", &slot(&g), None).await);
    finished_ok("the normal waiter", normal).await;
}

/// A release that frees a slot lets the waiter it went to answer first: the slot's next holder
/// hears of its grant before the releasing caller hears it let go, which holds nothing any more
/// (a slot idles from its release until its next holder knows). Server and clients share this
/// test's one thread, so the order the answers are written in is the order they arrive in.
#[tokio::test]
async fn a_freed_slot_s_next_holder_is_answered_before_its_releaser() {
    let gw = gateway(&lock_pool_toml("p", "limit = 1")).await;
    for round in 0..3 {
        let held = grant(&gw, "p").await;
        let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let waiter = {
            let order = order.clone();
            let rb = keyed(&gw, "p", "acquire").json(&json!({ "waitMs": 10_000 }));
            tokio::spawn(async move {
                let r = bounded("the waiter", rb.send()).await.unwrap();
                order.lock().unwrap().push("grant");
                r
            })
        };
        gw.wait_queued("p", 1, "waiter parked").await;
        let releaser = {
            let order = order.clone();
            let rb = keyed(&gw, "p", &format!("{}/release", slot(&held)));
            tokio::spawn(async move {
                let r = bounded("the release", rb.send()).await.unwrap();
                order.lock().unwrap().push("released");
                r
            })
        };
        let r = finish("the release", releaser).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.json::<Value>().await.unwrap()["released"], true);
        let g: Value = finished_ok("the waiter", waiter)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(
            *order.lock().unwrap(),
            ["grant", "released"],
            "round {round}: the next holder is answered first"
        );
        assert!(released(&gw, "p", &slot(&g), None).await);
    }
}

/// A waiter whose client goes away leaves the queue and holds nothing.
#[tokio::test]
async fn a_waiter_that_goes_away_leaves_the_queue() {
    let gw = gateway(&lock_pool_toml("p", "limit = 1")).await;
    let held = grant(&gw, "p").await;
    let w = spawn_waiter(&gw, "p", 10_000);
    gw.wait_queued("p", 1, "waiter parked").await;
    w.abort();
    gw.wait_queued("p", 0, "waiter gone").await;
    assert!(released(&gw, "p", &slot(&held), None).await);
    let s = gw.state("p").await;
    assert_eq!(s["inFlight"], 0, "no slot went to the vanished waiter");
    grant(&gw, "p").await;
}

// ---- auth, unknown pools, bad input ----

/// 401 without a key, with an unknown key, a malformed key or a key in a form the pool does not
/// accept — on acquire, renew and release alike; a refused release frees nothing. (One gateway
/// per route keeps each address under the failure throttle's bound.)
#[tokio::test]
async fn bad_or_missing_keys_get_401_on_every_lock_route() {
    for route in ["acquire", "renew", "release"] {
        let gw = gateway(&lock_pool_toml("p", "limit = 2")).await;
        let id = slot(&grant(&gw, "p").await);
        let rest = match route {
            "acquire" => "acquire".to_string(),
            op => format!("{id}/{op}"),
        };
        expect_error(send(lock_post(&gw, "p", &rest)).await, 401, "unauthorized").await;
        for bad in [
            "test-key-unknown-0123456789",
            "nope",
            "nb_live_00000000000000000000000000000000AAAAAA",
        ] {
            let r = send(lock_post(&gw, "p", &rest).header("x-nthpool-key", bad)).await;
            expect_error(r, 401, "unauthorized").await;
        }
        // `auth.accept` defaults to the header only.
        let r = send(lock_post(&gw, "p", &rest).bearer_auth(KEY)).await;
        expect_error(r, 401, "unauthorized").await;
        let s = gw.state("p").await;
        assert_eq!(
            s["inFlight"], 1,
            "{route}: no refused acquire took a slot, no refused release freed one"
        );
        assert!(renewed(&gw, "p", &id).await > 0);
        assert!(released(&gw, "p", &id, None).await);
    }
}

/// A pool that accepts `Authorization: Bearer` / `Nthbouncer` takes them on the lock routes too,
/// and then refuses the header form it does not accept.
#[tokio::test]
async fn authorization_forms_follow_the_pool_auth_accept() {
    let toml = format!(
        "{}[pools.auth]\naccept = [\"bearer\", \"nthbouncer\"]\n",
        lock_pool_toml("p", "limit = 2")
    );
    let gw = gateway(&toml).await;
    let r = send(lock_post(&gw, "p", "acquire").bearer_auth(KEY)).await;
    assert_eq!(r.status(), 200);
    let id = slot(&r.json().await.unwrap());
    let r = send(
        lock_post(&gw, "p", &format!("{id}/renew"))
            .header("authorization", format!("Nthbouncer {KEY}")),
    )
    .await;
    assert_eq!(r.status(), 200);
    expect_error(acquire(&gw, "p").await, 401, "unauthorized").await;
    let r = send(lock_post(&gw, "p", &format!("{id}/release")).bearer_auth(KEY)).await;
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"released": true}));
}

/// An unknown pool is 404 pool_not_found on every lock route.
#[tokio::test]
async fn unknown_pool_is_404_pool_not_found() {
    let gw = gateway(&lock_pool_toml("p", "")).await;
    let id = slot(&grant(&gw, "p").await);
    // A pool segment that does not even decode (`%FF`) names no pool either (JSON, not a bare
    // 400).
    for pool in ["nope", "%FF"] {
        for rest in [
            "acquire".to_string(),
            format!("{id}/renew"),
            format!("{id}/release"),
        ] {
            let r = send(keyed(&gw, pool, &rest)).await;
            expect_error(r, 404, "pool_not_found").await;
        }
    }
    // Other unknown routes under /pools answer the API host's JSON 404.
    expect_error(
        send(keyed(&gw, "p", "nothing/here/at/all")).await,
        404,
        "not_found",
    )
    .await;
}

/// A body over 64 KiB is 413 payload_too_large, declared or streamed; exactly 64 KiB is fine.
#[tokio::test]
async fn bodies_over_64_kib_get_413() {
    let gw = gateway(&lock_pool_toml("p", "limit = 5")).await;
    let padded = |total: usize| {
        let mut b = vec![b' '; total - 2];
        b.extend_from_slice(b"{}");
        b
    };
    let r = send(keyed(&gw, "p", "acquire").body(padded(64 * 1024))).await;
    assert_eq!(r.status(), 200, "exactly 64 KiB is allowed");
    let id = slot(&r.json().await.unwrap());

    let r = send(keyed(&gw, "p", "acquire").body(padded(64 * 1024 + 1))).await;
    expect_error(r, 413, "payload_too_large").await;
    // Chunked, no length: cut off once it passes the bound.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..5).map(|_| Ok(vec![b' '; 16 * 1024])).collect();
    let body = reqwest::Body::wrap_stream(futures_util::stream::iter(chunks));
    expect_error(
        send(keyed(&gw, "p", "acquire").body(body)).await,
        413,
        "payload_too_large",
    )
    .await;
    assert_eq!(
        gw.state("p").await["inFlight"],
        1,
        "no refused acquire took a slot"
    );

    // Release bodies have the same bound; a refused release frees nothing.
    let r = send(keyed(&gw, "p", &format!("{id}/release")).body(padded(64 * 1024 + 1))).await;
    expect_error(r, 413, "payload_too_large").await;
    assert_eq!(gw.state("p").await["inFlight"], 1);
    assert!(released(&gw, "p", &id, None).await);
}

/// Malformed JSON, wrong types, a bad priority and a release status outside 100-599 are
/// `400 invalid` naming the field; none of them takes or frees a slot.
#[tokio::test]
async fn malformed_bodies_get_400_invalid() {
    let gw = gateway(&lock_pool_toml("p", "limit = 5")).await;
    let id = slot(&grant(&gw, "p").await);

    for (body, field) in [
        ("{", None),
        ("not json", None),
        (r#"{"waitMs":"soon"}"#, Some("waitMs")),
        (r#"{"waitMs":-1}"#, Some("waitMs")),
        (r#"{"waitMs":1.5}"#, Some("waitMs")),
        (r#"{"priority":"urgent"}"#, Some("priority")),
        (r#"{"priority":5}"#, Some("priority")),
    ] {
        let e = expect_error(send(json_acquire(&gw, "p", body)).await, 400, "invalid").await;
        if let Some(field) = field {
            assert_eq!(e["field"], field, "acquire {body}: {e}");
        }
    }
    // Bad headers too.
    let r = send(keyed(&gw, "p", "acquire").header("x-nthpool-priority", "urgent")).await;
    expect_error(r, 400, "invalid").await;
    let r = send(keyed(&gw, "p", "acquire").header("x-nthpool-queue-timeout-ms", "soon")).await;
    expect_error(r, 400, "invalid").await;

    for (body, field) in [
        ("{", None),
        (r#"{"status":99}"#, Some("status")),
        (r#"{"status":600}"#, Some("status")),
        (r#"{"status":0}"#, Some("status")),
        (r#"{"status":70000}"#, Some("status")),
        (r#"{"status":"ok"}"#, Some("status")),
        (r#"{"throttled":"x"}"#, Some("throttled")),
        (r#"{"retryAfterMs":-5}"#, Some("retryAfterMs")),
        (r#"{"rate":{"limit":"many"}}"#, Some("rate.limit")),
        (r#"{"headers":{"retry-after":5}}"#, None),
    ] {
        let r = send(
            keyed(&gw, "p", &format!("{id}/release"))
                .header("content-type", "application/json")
                .body(body),
        )
        .await;
        let e = expect_error(r, 400, "invalid").await;
        if let Some(field) = field {
            assert_eq!(e["field"], field, "release {body}: {e}");
        }
    }
    assert_eq!(
        gw.state("p").await["inFlight"],
        1,
        "nothing taken, nothing freed"
    );
    // Boundaries of the status range are fine.
    assert!(released(&gw, "p", &id, Some(json!({"status": 599}))).await);
    let id = slot(&grant(&gw, "p").await);
    assert!(released(&gw, "p", &id, Some(json!({"status": 100}))).await);
}

// ---- renew ----

/// Renew extends by exactly one term from now; once the next renew would pass `requestDeadline`
/// the lease is capped there, the next renew is 409 capped, and at `requestDeadline` the slot is
/// gone. A lease never exceeds `requestDeadline`.
#[tokio::test]
async fn renew_extends_by_one_term_and_is_capped_at_the_request_deadline() {
    let (gw, clock) = clocked(&lock_pool_toml(
        "p",
        "limit = 1\nlease_term_ms = 30000\nrenew_interval_ms = 10000\nrequest_timeout_ms = 70000",
    ))
    .await;
    let g = grant(&gw, "p").await;
    let id = slot(&g);
    let request_deadline = T0 + 70_000;
    assert_eq!(g["leaseDeadline"], T0 + 30_000);
    assert_eq!(g["requestDeadline"], request_deadline);

    clock.advance(10_000);
    assert_eq!(renewed(&gw, "p", &id).await, T0 + 40_000);
    clock.advance(25_000);
    assert_eq!(renewed(&gw, "p", &id).await, T0 + 65_000);
    clock.advance(20_000); // now + term = T0 + 85 000 > requestDeadline
    assert_eq!(renewed(&gw, "p", &id).await, request_deadline);
    expect_error(renew(&gw, "p", &id).await, 409, "capped").await;
    clock.advance(14_999);
    expect_error(renew(&gw, "p", &id).await, 409, "capped").await;
    assert_eq!(gw.state("p").await["inFlight"], 1, "capped is still held");
    clock.advance(1);
    expect_error(renew(&gw, "p", &id).await, 404, "not_found").await;
    assert_eq!(gw.state("p").await["inFlight"], 0);
    assert!(!released(&gw, "p", &id, None).await);
}

/// Renew is 404 not_found after release, for an unknown id, a malformed id, and a slot of
/// another pool (slot ids are bound to their pool); a foreign release frees nothing.
#[tokio::test]
async fn renew_is_404_for_released_unknown_malformed_and_foreign_slots() {
    let toml = lock_pool_toml("a", "limit = 2") + &lock_pool_toml("b", "limit = 2");
    let gw = gateway(&toml).await;
    let id = slot(&grant(&gw, "a").await);

    // Another pool cannot name it.
    expect_error(renew(&gw, "b", &id).await, 404, "not_found").await;
    assert!(!released(&gw, "b", &id, None).await);
    assert_eq!(gw.state("a").await["inFlight"], 1);
    assert!(renewed(&gw, "a", &id).await > 0);

    let unknown = format!("{:032x}", 0xdead_beef_u128);
    let upper = id.to_ascii_uppercase();
    let too_long = format!("{id}0");
    for bad in [
        unknown.as_str(),
        "not-a-slot",
        "xyz",
        &id[..31],
        too_long.as_str(),
        upper.as_str(),
        "%FF%FE",
    ] {
        expect_error(renew(&gw, "a", bad).await, 404, "not_found").await;
        assert!(!released(&gw, "a", bad, None).await, "release {bad}");
    }

    assert!(released(&gw, "a", &id, None).await);
    expect_error(renew(&gw, "a", &id).await, 404, "not_found").await;
}

// ---- release ----

/// Release answers `{"released":true}` once, then `{"released":false}`; the full outcome report
/// is accepted, and so are an empty body and `{}`.
#[tokio::test]
async fn release_is_idempotent_and_takes_the_outcome_report() {
    let gw = gateway(&lock_pool_toml("p", "limit = 3")).await;
    let report = json!({
        "status": 200,
        "throttled": 0,
        "retryAfterMs": 0,
        "rate": {
            "limit": 100, "remaining": 50, "resetMs": 1000,
            "tokenLimit": 10000, "tokenRemaining": 9000, "tokenResetMs": 2000
        },
        "headers": {
            "x-ratelimit-limit-requests": "100",
            "x-ratelimit-remaining-requests": ["50"],
            "content-type": "application/json"
        }
    });
    let full = slot(&grant(&gw, "p").await);
    let empty = slot(&grant(&gw, "p").await);
    let braces = slot(&grant(&gw, "p").await);
    let r = release(&gw, "p", &full, Some(report.clone())).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"released": true}));
    let r = release(&gw, "p", &full, Some(report)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"released": false}));

    assert!(released(&gw, "p", &empty, None).await);
    assert!(!released(&gw, "p", &empty, None).await);
    assert!(released(&gw, "p", &braces, Some(json!({}))).await);
    assert!(!released(&gw, "p", &braces, Some(json!({}))).await);
    let s = gw.state("p").await;
    assert_eq!(s["inFlight"], 0);
    assert!(
        s["pausedUntil"].is_null(),
        "a healthy report pauses nothing"
    );
}

/// Before: releasing any id with `{"status":429,"retryAfterMs":900000}` answered
/// `released:false` and still paused the whole pool for 15 minutes (and halved its limit), so
/// any key holder could stop every caller. Now only a release that freed a slot reports, once,
/// and no report pauses longer than `max_pause_ms`.
#[tokio::test]
async fn a_release_that_freed_nothing_teaches_nothing_and_pauses_are_capped() {
    let gw = gateway(&lock_pool_toml("p", "limit = 4\nmax_pause_ms = 5000")).await;
    let throttle = json!({"status": 429, "throttled": 1, "retryAfterMs": 900_000});
    let bogus = "0123456789abcdef0123456789abcdef";
    assert!(!released(&gw, "p", bogus, Some(throttle.clone())).await);
    let s = gw.state("p").await;
    assert!(s["pausedUntil"].is_null(), "a bogus release paused: {s}");
    assert_eq!(
        s["effectiveLimit"], 4,
        "a bogus release taught the limit: {s}"
    );
    assert_eq!(acquire(&gw, "p").await.status(), 200);

    // A real release reports once, and its pause is capped.
    let gw2 = gateway(&lock_pool_toml("q", "limit = 4\nmax_pause_ms = 5000")).await;
    let id = slot(&grant(&gw2, "q").await);
    let before = wall_ms();
    assert!(released(&gw2, "q", &id, Some(throttle.clone())).await);
    let paused = gw2.state("q").await["pausedUntil"].as_u64().unwrap();
    assert!(
        paused <= wall_ms() + 5_000 && paused >= before,
        "the pause is capped at max_pause_ms: {paused}"
    );
    let limit_after_one = gw2.state("q").await["effectiveLimit"].clone();
    // Repeating the release re-feeds nothing.
    assert!(!released(&gw2, "q", &id, Some(throttle)).await);
    assert_eq!(gw2.state("q").await["effectiveLimit"], limit_after_one);
}

/// A reported throttle pauses admission for the hinted time: the next acquire is 429 with
/// `Retry-After: 2`, the state shows the pause and the throttle, and 2000 ms later admission
/// resumes.
#[tokio::test]
async fn a_reported_throttle_pauses_admission() {
    let (gw, clock) = clocked(&lock_pool_toml("p", "limit = 4")).await;
    let id = slot(&grant(&gw, "p").await);
    let report = json!({"status": 429, "throttled": 1, "retryAfterMs": 2000});
    assert!(released(&gw, "p", &id, Some(report)).await);
    let r = acquire(&gw, "p").await;
    assert_header(&r, "retry-after", Some("2"));
    assert!(header(&r, "x-nthpool-effective-limit").is_some());
    expect_error(r, 429, "too_many_requests").await;
    let s = gw.state("p").await;
    assert_eq!(s["pausedUntil"], T0 + 2_000, "{s}");
    assert_eq!(s["lastThrottle"]["at"], T0, "{s}");
    assert!(
        s["lastThrottle"]["cause"]
            .as_str()
            .is_some_and(|c| c.contains("429")),
        "{s}"
    );
    assert!(
        s["effectiveLimit"].as_u64().unwrap() < 4,
        "a throttle shrinks the limit: {s}"
    );
    // Even a waiter cannot get in during the pause, but is admitted when it ends.
    let w = spawn_waiter(&gw, "p", 10_000);
    gw.wait_queued("p", 1, "waiter parked behind the pause")
        .await;
    clock.advance(1_999);
    assert_refused_for(&gw, "p", "1").await;
    clock.advance(1);
    let r = finished_ok("the waiter behind the pause", w).await;
    assert_header(&r, "x-nthpool-queued-ms", Some("2000"));
    let r = acquire(&gw, "p").await;
    assert_eq!(r.status(), 200);
    assert!(gw.state("p").await["pausedUntil"].is_null());
}

/// Raw `headers` are parsed (an exhausted budget pauses until its reset), and when `rate` is sent
/// too, `rate` wins — for the budget and for the retry delay derived from it.
#[tokio::test]
async fn release_headers_are_parsed_and_rate_wins_over_them() {
    let (gw, clock) = clocked(&lock_pool_toml("p", "limit = 10")).await;
    let spent_headers = json!({
        "x-ratelimit-limit-requests": "100",
        "x-ratelimit-remaining-requests": ["0"],
        "x-ratelimit-reset-requests": "30s"
    });

    // Headers alone: the spent budget pauses for its 30 s reset.
    let id = slot(&grant(&gw, "p").await);
    let report = json!({"status": 200, "headers": spent_headers});
    assert!(released(&gw, "p", &id, Some(report)).await);
    let s = gw.state("p").await;
    assert_eq!(s["pausedUntil"], T0 + 30_000, "{s}");
    assert_refused_for(&gw, "p", "30").await;
    clock.advance(30_000);
    let now = T0 + 30_000;

    // `rate` says there is budget left: no pause, whatever the headers say.
    let id = slot(&grant(&gw, "p").await);
    let report = json!({
        "status": 200,
        "headers": spent_headers,
        "rate": {"limit": 100, "remaining": 50, "resetMs": 30000}
    });
    assert!(released(&gw, "p", &id, Some(report)).await);
    assert!(gw.state("p").await["pausedUntil"].is_null());

    // `rate` says the budget is spent for 5 s while the headers say 50 are left.
    let id = slot(&grant(&gw, "p").await);
    let report = json!({
        "status": 200,
        "headers": {"x-ratelimit-remaining-requests": "50", "x-ratelimit-reset-requests": "1s"},
        "rate": {"remaining": 0, "resetMs": 5000}
    });
    assert!(released(&gw, "p", &id, Some(report)).await);
    assert_eq!(gw.state("p").await["pausedUntil"], now + 5_000);
    clock.advance(5_000);
    let now = now + 5_000;

    // A throttled answer: the delay comes from `rate` (5 s), not from the headers' 30 s reset.
    let id = slot(&grant(&gw, "p").await);
    let report = json!({
        "status": 429,
        "throttled": 1,
        "headers": spent_headers,
        "rate": {"remaining": 0, "resetMs": 5000}
    });
    assert!(released(&gw, "p", &id, Some(report)).await);
    let s = gw.state("p").await;
    assert_eq!(s["pausedUntil"], now + 5_000, "{s}");
    clock.advance(5_000);
    let now = now + 5_000;

    // An explicit Retry-After among the headers still counts when `rate` is sent.
    let id = slot(&grant(&gw, "p").await);
    let report = json!({
        "status": 429,
        "headers": {"retry-after": "7"},
        "rate": {"limit": 100, "remaining": 10, "resetMs": 1000}
    });
    assert!(released(&gw, "p", &id, Some(report)).await);
    assert_eq!(gw.state("p").await["pausedUntil"], now + 7_000);
}

// ---- reclaim ----

/// A holder that never renews loses its slot at `leaseDeadline` (manual clock): not a
/// millisecond earlier, and the waiter behind it is admitted.
#[tokio::test]
async fn an_unrenewed_lease_is_reclaimed_at_its_deadline() {
    let (gw, clock) = clocked(&lock_pool_toml("p", "limit = 1\nqueue_timeout_ms = 600000")).await;
    let g = grant(&gw, "p").await;
    assert_eq!(g["leaseDeadline"], T0 + 30_000);
    let w = spawn_waiter(&gw, "p", 600_000);
    gw.wait_queued("p", 1, "waiter parked").await;
    clock.advance(29_999);
    let s = gw.state("p").await;
    assert_eq!(
        (s["inFlight"].clone(), s["queued"].clone()),
        (json!(1), json!(1))
    );
    clock.advance(1);
    let r = finished_ok("the waiter behind the vanished holder", w).await;
    assert_header(&r, "x-nthpool-queued-ms", Some("30000"));
    let next: Value = r.json().await.unwrap();
    assert_eq!(next["leaseDeadline"], T0 + 60_000);
    // The vanished holder's slot is gone for good.
    expect_error(renew(&gw, "p", &slot(&g)).await, 404, "not_found").await;
    assert!(!released(&gw, "p", &slot(&g), None).await);
    assert_eq!(gw.state("p").await["inFlight"], 1);
}

/// The same on the system clock with a short term: a holder that does not renew is reclaimed
/// (bounded polling, no timing asserted).
#[tokio::test]
async fn an_unrenewed_lease_is_reclaimed_for_real() {
    let gw = gateway(&lock_pool_toml(
        "p",
        "limit = 1\nlease_term_ms = 200\nrenew_interval_ms = 100",
    ))
    .await;
    let g = grant(&gw, "p").await;
    assert_eq!(g["termMs"], 200);
    assert_eq!(g["renewIntervalMs"], 100);
    gw.wait_freed("p", "the unrenewed slot reclaimed").await;
    expect_error(renew(&gw, "p", &slot(&g)).await, 404, "not_found").await;
    assert!(!released(&gw, "p", &slot(&g), None).await);
    grant(&gw, "p").await;
}

// ---- locks and the proxy ----

/// On a pool host, lock and admin paths are just paths: proxied upstream, never served as the
/// lock or admin API.
#[tokio::test]
async fn lock_paths_on_a_pool_host_go_upstream() {
    let (up, gw) = proxied_pool("limit = 1").await;
    let renew = "/pools/p/lock/0123456789abcdef0123456789abcdef/renew";
    for (method, path) in [
        (Method::POST, "/pools/p/lock/acquire"),
        (Method::POST, renew),
        (Method::GET, "/admin/pools"),
    ] {
        let r = send(gw.pool("p", method, path).header("x-nthpool-key", KEY)).await;
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(
            r.text().await.unwrap(),
            "ok",
            "the upstream answered {path}"
        );
    }
    let seen = up.seen();
    let sent: Vec<(&str, &str)> = seen
        .iter()
        .map(|s| (s.method.as_str(), s.path.as_str()))
        .collect();
    assert_eq!(
        sent,
        [
            ("POST", "/pools/p/lock/acquire"),
            ("POST", renew),
            ("GET", "/admin/pools")
        ]
    );
    gw.wait_freed("p", "no slot left held").await;
}

/// Locks and proxied requests count against one limit.
#[tokio::test]
async fn locks_and_proxied_requests_share_one_limit() {
    let (up, gw) = proxied_pool("limit = 2").await;
    let lock = grant(&gw, "p").await;
    let proxied = gw.hold("p", "held");
    up.wait_arrivals(1).await;

    let r = acquire(&gw, "p").await;
    assert_header(&r, "x-nthpool-remaining-slots", Some("0"));
    assert_header(&r, "x-nthpool-effective-limit", Some("2"));
    expect_error(r, 429, "too_many_requests").await;
    let r = send(gw.get("p", "/").header("x-nthpool-no-queue", "1")).await;
    assert_eq!(r.status(), 429);
    assert_header(&r, "x-nthpool-remaining-slots", Some("0"));
    assert_eq!(
        up.seen().len(),
        1,
        "the refused request never reached the upstream"
    );

    assert!(released(&gw, "p", &slot(&lock), None).await);
    let r = send(gw.get("p", "/").header("x-nthpool-no-queue", "1")).await;
    assert_eq!(r.status(), 200);
    // One slot left again (the proxied /hold still has the other): a lock gets it.
    let again = grant(&gw, "p").await;
    up.release(1);
    finished_ok("the held proxy request", proxied).await;
    assert!(released(&gw, "p", &slot(&again), None).await);
    gw.wait_freed("p", "idle").await;
}

/// One FIFO queue for both: a queued lock and a queued proxied request are admitted in their
/// order of arrival, whichever came first.
#[tokio::test]
async fn queued_locks_and_proxied_requests_are_admitted_in_arrival_order() {
    let (up, gw) = proxied_pool("limit = 1").await;

    // Lock first, then the proxied request.
    let holder = grant(&gw, "p").await;
    let lock = spawn_waiter(&gw, "p", 10_000);
    gw.wait_queued("p", 1, "lock parked").await;
    let proxied = gw.hold("p", "proxy-1");
    gw.wait_queued("p", 2, "proxy parked").await;
    assert!(released(&gw, "p", &slot(&holder), None).await);
    let r = finished_ok("the queued lock: the lock came first", lock).await;
    let second = r.json::<Value>().await.unwrap();
    let s = gw.state("p").await;
    assert_eq!(
        (s["inFlight"].clone(), s["queued"].clone()),
        (json!(1), json!(1))
    );
    assert!(
        up.arrivals().is_empty(),
        "the proxied request waits its turn"
    );
    assert!(released(&gw, "p", &slot(&second), None).await);
    up.wait_arrivals(1).await;
    up.release(1);
    finished_ok("the queued proxy request", proxied).await;
    gw.wait_freed("p", "idle").await;

    // Proxied request first, then the lock.
    let holder = grant(&gw, "p").await;
    let proxied = gw.hold("p", "proxy-2");
    gw.wait_queued("p", 1, "proxy parked").await;
    let lock = spawn_waiter(&gw, "p", 10_000);
    gw.wait_queued("p", 2, "lock parked").await;
    assert!(released(&gw, "p", &slot(&holder), None).await);
    up.wait_arrivals(2).await;
    assert_eq!(up.arrivals(), vec!["proxy-1", "proxy-2"]);
    let s = gw.state("p").await;
    assert_eq!(s["queued"], 1, "the lock waits behind the proxied request");
    up.release(1);
    finished_ok("the queued proxy request", proxied).await;
    let r = finished_ok("the queued lock", lock).await;
    assert!(released(&gw, "p", &slot(&r.json::<Value>().await.unwrap()), None).await);
    assert_eq!(up.max_in_flight(), 1);
}

// ---- access log ----

/// Every acquire attempt is logged as route "lock acquire" (admitted, 429, 504, 401); renew and
/// release are not.
#[tokio::test]
async fn acquire_attempts_are_access_logged_renew_and_release_are_not() {
    let gw = gateway(&lock_pool_toml("p", "limit = 1")).await;
    let id = slot(&grant(&gw, "p").await);
    assert!(renewed(&gw, "p", &id).await > 0);
    expect_error(acquire(&gw, "p").await, 429, "too_many_requests").await;
    let r = send(keyed(&gw, "p", "acquire").json(&json!({"waitMs": 20}))).await;
    expect_error(r, 504, "queue_timeout").await;
    expect_error(
        send(lock_post(&gw, "p", "acquire")).await,
        401,
        "unauthorized",
    )
    .await;
    expect_error(renew(&gw, "p", "not-a-slot").await, 404, "not_found").await;
    // Refused renews and releases are not logged either.
    for rest in [format!("{id}/renew"), format!("{id}/release")] {
        expect_error(send(lock_post(&gw, "p", &rest)).await, 401, "unauthorized").await;
    }
    assert!(released(&gw, "p", &id, None).await);
    assert!(!released(&gw, "p", &id, None).await);

    gw.flush_access_log().await;
    let log = gw.admin_json("/admin/pools/p/access-log").await;
    let items = log["items"].as_array().unwrap();
    assert_eq!(items.len(), 4, "four acquire attempts, nothing else: {log}");
    assert!(items.iter().all(|e| e["route"] == "lock acquire"), "{log}");
    // Newest first.
    let outcomes: Vec<(&str, u64)> = items
        .iter()
        .map(|e| {
            (
                e["outcome"].as_str().unwrap(),
                e["status"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        outcomes,
        vec![("401", 401), ("504", 504), ("429", 429), ("admitted", 200)]
    );
    assert!(items[0]["keyId"].is_null());
    for e in &items[1..] {
        assert!(e["keyId"].as_str().is_some_and(|k| !k.is_empty()), "{e}");
    }
    assert!(
        !log.to_string().contains(KEY),
        "the key itself is never logged"
    );
}

/// An announced budget is spent, not spread (SPEC §3): every admission goes through while it
/// has room (less a margin of one), then the next one waits for its reset, and the state shows
/// until when.
#[tokio::test]
async fn an_announced_budget_is_spent_then_holds_admission_until_its_reset() {
    let (gw, clock) = clocked(&lock_pool_toml("p", "limit = 10")).await;
    let id = slot(&grant(&gw, "p").await);
    let report = json!({"status": 200, "rate": {"limit": 100, "remaining": 10, "resetMs": 10000}});
    assert!(released(&gw, "p", &id, Some(report)).await);
    let s = gw.state("p").await;
    assert!(
        s["learnedRpm"].is_null(),
        "no pace while the budget has room: {s}"
    );
    // 10 left, 1 kept back: 9 go out at once, with a slot to spare; the 10th waits.
    let mut granted = 0;
    let refused = loop {
        let r = acquire(&gw, "p").await;
        if r.status() != 200 {
            break r;
        }
        granted += 1;
        assert!(granted <= 9, "the spent budget never held anything back");
    };
    assert_eq!(granted, 9);
    assert_eq!(refused.status(), 429);
    let s = gw.state("p").await;
    assert_eq!(s["pacedUntil"], T0 + 10_000, "{s}");
    assert!(
        s["pausedUntil"].is_null(),
        "holding back for a budget is not a pause: {s}"
    );
    clock.advance(10_000);
    assert_eq!(acquire(&gw, "p").await.status(), 200);
}
