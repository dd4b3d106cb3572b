//! The request id end to end over loopback (SPEC §12, #13): a caller's sane `x-request-id` comes
//! back and reaches the origin, an insane one is replaced, every answer (errors included, on the
//! API host and on pool hosts) carries it and error bodies name it as `requestId`, the
//! access-log row records it, and an async job keeps its intake request's id: sent upstream,
//! shown on the poll and admin views, on its delivery and in the webhook.

use nthbouncer_testkit::*;
use reqwest::Method;
use serde_json::Value;

fn header_of(r: &reqwest::Response) -> String {
    r.headers()
        .get("x-request-id")
        .expect("every answer carries x-request-id")
        .to_str()
        .unwrap()
        .to_string()
}

/// What a generated id looks like: 32 lowercase hex characters.
fn is_generated(id: &str) -> bool {
    id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// The `x-request-id` the origin saw on its latest request.
fn origin_saw(up: &Upstream) -> Option<String> {
    let seen = up.seen();
    let last = seen.last()?;
    Some(last.headers.get("x-request-id")?.to_str().ok()?.to_string())
}

#[tokio::test]
async fn a_sane_caller_id_comes_back_reaches_the_origin_and_is_logged() {
    let (up, gw) = proxied_pool("limit = 2").await;
    let id = "trace-7f3a.B:42/~!";
    let r = send(gw.get("p", "/echo").header("x-request-id", id)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header_of(&r), id);
    assert_eq!(origin_saw(&up).as_deref(), Some(id));

    // The longest sane id is kept whole.
    let longest = "x".repeat(128);
    let r = send(gw.get("p", "/echo").header("x-request-id", &longest)).await;
    assert_eq!(header_of(&r), longest);
    assert_eq!(origin_saw(&up), Some(longest.clone()));

    let rows = gw.access_log("p", "").await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0]["requestId"], longest.as_str());
    assert_eq!(rows[1]["requestId"], id);
    assert_eq!(rows[1]["outcome"], "admitted");
}

#[tokio::test]
async fn a_missing_or_insane_id_is_replaced_and_the_replacement_forwarded() {
    let (up, gw) = proxied_pool("limit = 2").await;
    let too_long = "y".repeat(129);
    let insane = [
        None,
        Some(too_long.as_str()),
        Some("has\ttab"),
        Some("has space"),
        Some(""),
    ];
    let mut given = Vec::new();
    for sent in insane {
        let mut rb = gw.get("p", "/echo");
        if let Some(v) = sent {
            rb = rb.header("x-request-id", v);
        }
        let r = send(rb).await;
        assert_eq!(r.status(), 200, "{sent:?}");
        let id = header_of(&r);
        assert!(is_generated(&id), "{sent:?} must be replaced, got {id:?}");
        assert_eq!(
            origin_saw(&up),
            Some(id.clone()),
            "the origin sees the id the caller got back"
        );
        given.push(id);
    }
    given.sort();
    given.dedup();
    assert_eq!(given.len(), insane.len(), "every request gets its own id");

    // Two ids in one request: neither is chosen.
    let r = send(
        gw.get("p", "/echo")
            .header("x-request-id", "first")
            .header("x-request-id", "second"),
    )
    .await;
    assert!(is_generated(&header_of(&r)));
    let seen = up.seen();
    let forwarded: Vec<_> = seen
        .last()
        .unwrap()
        .headers
        .get_all("x-request-id")
        .iter()
        .collect();
    assert_eq!(forwarded.len(), 1, "one id goes upstream");
}

#[tokio::test]
async fn error_answers_carry_the_id_in_header_and_body_on_every_host() {
    let (up, gw) = proxied_pool("limit = 1").await;
    let cases: Vec<(&str, reqwest::RequestBuilder, u16, &str)> = vec![
        (
            "pool host without a key",
            gw.pool("p", Method::GET, "/echo"),
            401,
            "unauthorized",
        ),
        (
            "unknown pool host",
            gw.pool("nope", Method::GET, "/echo"),
            404,
            "pool_not_found",
        ),
        (
            "API host, unknown route",
            gw.api_anon(Method::GET, "/no/such/route"),
            404,
            "not_found",
        ),
        (
            "admin API without a token",
            gw.api_anon(Method::GET, "/admin/pools"),
            401,
            "unauthorized",
        ),
        (
            "lock API, unknown pool",
            gw.api_anon(Method::POST, "/pools/nope/lock/acquire")
                .header("x-nthpool-key", KEY),
            404,
            "pool_not_found",
        ),
    ];
    for (what, rb, status, code) in cases {
        for sent in [Some("caller-err-1"), None] {
            let rb = rb.try_clone().unwrap();
            let rb = match sent {
                Some(v) => rb.header("x-request-id", v),
                None => rb,
            };
            let r = send(rb).await;
            assert_eq!(r.status(), status, "{what}");
            let id = header_of(&r);
            match sent {
                Some(v) => assert_eq!(id, v, "{what}"),
                None => assert!(is_generated(&id), "{what}: {id}"),
            }
            let body = json_of(r).await;
            assert_eq!(body["error"], code, "{what}: {body}");
            assert_eq!(body["requestId"], id.as_str(), "{what}: {body}");
            assert!(body["message"].is_string(), "{what}: {body}");
        }
    }
    assert_eq!(up.total(), 0, "no refusal reached the origin");

    // The refused request's access-log row has its id.
    let rows = gw.access_log("p", "").await;
    assert!(
        rows.iter()
            .any(|r| r["status"] == 401 && r["requestId"] == "caller-err-1"),
        "{rows:?}"
    );
}

#[tokio::test]
async fn success_answers_on_the_api_host_carry_the_id_too() {
    let gw = gateway(&lock_pool_toml("l", "limit = 1")).await;
    let r = send(
        gw.api(Method::GET, "/admin/pools")
            .header("x-request-id", "adm-1"),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header_of(&r), "adm-1");
    // A lock acquire is logged with its id.
    let r = send(
        gw.api_anon(Method::POST, "/pools/l/lock/acquire")
            .header("x-nthpool-key", KEY)
            .header("x-request-id", "lock-1"),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header_of(&r), "lock-1");
    let rows = gw.access_log("l", "").await;
    assert_eq!(rows[0]["route"], "lock acquire");
    assert_eq!(rows[0]["requestId"], "lock-1");
}

/// Governor refusals and upstream failures name the request too: `429` (no slot, no queue) and
/// `504 upstream_timeout`.
#[tokio::test]
async fn governor_refusals_and_upstream_timeouts_carry_the_id() {
    let (up, gw) = proxied_pool("limit = 1\nrequest_timeout_ms = 300").await;
    let held = tokio::spawn(
        gw.get("p", "/hold")
            .header("x-seq", "h")
            .header("x-request-id", "holder")
            .send(),
    );
    up.wait_arrivals(1).await;
    let r = send(
        gw.no_queue("p", "/echo")
            .header("x-request-id", "refused-429"),
    )
    .await;
    assert_eq!(r.status(), 429);
    assert_eq!(header_of(&r), "refused-429");
    let body = json_of(r).await;
    assert_eq!(body["error"], "too_many_requests");
    assert_eq!(body["requestId"], "refused-429");
    // The held request outlives its request_timeout_ms.
    let r = held.await.unwrap().unwrap();
    assert_eq!(r.status(), 504);
    assert_eq!(header_of(&r), "holder");
    let body = json_of(r).await;
    assert_eq!(body["error"], "upstream_timeout");
    assert_eq!(body["requestId"], "holder");
    up.release(1);
    let rows = gw.access_log("p", "").await;
    for id in ["refused-429", "holder"] {
        assert!(rows.iter().any(|r| r["requestId"] == id), "{id}: {rows:?}");
    }
}

#[tokio::test]
async fn an_async_job_keeps_its_intake_id_upstream_on_its_views_and_deliveries() {
    // The webhook receiver: it answers 200 and keeps what it got.
    let hook = nthbouncer_testkit::access::Recorder::start().await;
    let extra = "[pools.async]\nenabled = true\n".to_string()
        + &webhook_toml(&format!("{}/hook", hook.url()));
    let (up, gw) = proxied_pool_with("allow_private_webhooks = true", "limit = 2", &extra).await;
    let id = "job-trace-0001";
    let r = send(gw.get_async("p", "/echo").header("x-request-id", id)).await;
    assert_eq!(header_of(&r), id);
    let job = accepted_id(r).await;

    // The origin got the intake request's id, and the job's Idempotency-Key.
    let poll = async || {
        let r = send(gw.poll_job("p", &job)).await;
        (header_of(&r), json_of(r).await)
    };
    let done = eventually("the job to complete", async || {
        let (_, body) = poll().await;
        (body["status"] == "completed").then_some(body)
    })
    .await;
    let seen = up.seen();
    let fetch = seen.last().unwrap();
    assert_eq!(fetch.headers["idempotency-key"], job.as_str());
    assert_eq!(fetch.headers["x-request-id"], id);

    // The poll body names the job's id; the poll itself is another request with its own.
    assert_eq!(done["requestId"], id);
    let (poll_id, _) = poll().await;
    assert!(is_generated(&poll_id), "{poll_id}");

    // The admin view: the job and its delivery.
    let detail = gw.admin_json(&format!("/admin/pools/p/jobs/{job}")).await;
    assert_eq!(detail["requestId"], id, "{detail}");
    let deliveries = detail["deliveries"].as_array().unwrap();
    assert_eq!(deliveries.len(), 1, "{detail}");
    assert_eq!(deliveries[0]["requestId"], id, "{detail}");

    // The webhook: its payload (the poll body) and its header.
    until("the webhook", async || !hook.seen().is_empty()).await;
    let webhook = hook.seen().swap_remove(0);
    let payload: Value = serde_json::from_slice(&webhook.body).unwrap();
    assert_eq!(payload["jobId"], job.as_str());
    assert_eq!(payload["requestId"], id);
    assert_eq!(webhook.headers["x-request-id"], id);

    // The intake's access-log row too.
    let rows = gw.access_log("p", "").await;
    assert!(
        rows.iter()
            .any(|r| r["outcome"] == "202" && r["requestId"] == id),
        "{rows:?}"
    );
}
