//! The hardening soak (issue #12): everything an attacker or an unlucky operator tries, at once,
//! against one real server — stalled readers, silent sockets, forged signatures, bogus lock
//! releases, ordinary callers and async jobs — with a SIGTERM and a restart in the middle.
//!
//! Afterwards: the origins' own counts never exceeded their pools' limits, every accepted job
//! has one terminal state, each origin saw each job's `Idempotency-Key` once per attempt the job
//! records, nothing forged reached an origin, no answer was a 500, the silent sockets were
//! closed by the server, and in flight and queued are back to 0. Bounded in work (fixed counts),
//! asserting counts and order only.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use nthbouncer_testkit::access::{nonce, sign};
use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{poll, send, wait_until, wall_ms, webhook_toml, Upstream, API_HOST, KEY};
use serde_json::{json, Value};
use std::sync::Mutex;
use tokio::io::AsyncReadExt;
use tokio::task::JoinSet;

use crate::BIN;

/// Pool `p`: proxied callers, stalled readers, jobs and the lock API share this limit.
const LIMIT_P: i64 = 2;
/// Pool `s`: HMAC-signed requests only.
const LIMIT_S: i64 = 1;
const SECRET: &str = "soak-signing-secret-0123456789";
const WRONG_SECRET: &str = "not-the-signing-secret-000000";
const JOBS: usize = 16;
const CALLERS: usize = 6;
const CALLS_EACH: usize = 15;
const STALLED_READERS: usize = 2;
/// Tries a load task makes for its answers while the server restarts.
const MAX_TRIES: usize = 1000;
const SILENT_SOCKETS: usize = 24;
const FORGERIES: usize = 40;
const BOGUS_RELEASES: usize = 40;

/// Every status the load saw, by status code (transport errors while the server restarts are
/// counted under 0).
type Statuses = Arc<Mutex<HashMap<u16, u64>>>;

fn config(p_upstream: &str, s_upstream: &str, receiver: &str) -> String {
    format!(
        "allow_private_webhooks = true\nheader_read_timeout_ms = 1000\nidle_timeout_ms = 5000\nshutdown_grace_ms = 30000\n\
         [[pools]]\nname = \"p\"\nupstream = \"{p_upstream}\"\nkeys = [\"{KEY}\"]\n\
         [pools.concurrency]\nlimit = {LIMIT_P}\nqueue_size = 1000\nqueue_timeout_ms = 120000\n\
         request_timeout_ms = 2000\n\
         [pools.async]\nenabled = true\n{}\
         [[pools]]\nname = \"s\"\nupstream = \"{s_upstream}\"\nkeys = [\"{KEY}\"]\n\
         [pools.concurrency]\nlimit = {LIMIT_S}\nqueue_size = 1000\nqueue_timeout_ms = 120000\n\
         [pools.access.hmac]\nsecrets = [\"{SECRET}\"]\nwindow_s = 300\n",
        webhook_toml(receiver)
    )
}

fn count(statuses: &Statuses, r: &reqwest::Result<reqwest::Response>) {
    let code = r.as_ref().map_or(0, |r| r.status().as_u16());
    *statuses.lock().unwrap().entry(code).or_default() += 1;
}

/// How the load reaches the server: its client and port, apart from the [`Server`] handle that
/// the test keeps to stop and restart the process.
#[derive(Clone)]
struct Front {
    client: reqwest::Client,
    port: u16,
}

impl Front {
    fn of(server: &Server) -> Front {
        Front {
            client: server.client.clone(),
            port: server.port,
        }
    }

    fn pool(&self, pool: &str, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("http://127.0.0.1:{}{path}", self.port))
            .header("host", format!("{pool}.localhost"))
            .header("x-nthpool-key", KEY)
    }

    fn api(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("http://127.0.0.1:{}{path}", self.port))
            .header("host", API_HOST)
            .header("x-nthpool-key", KEY)
    }
}

/// A signed request to pool `s` (`secret` decides whether it is genuine).
fn signed(server: &Front, secret: &str, target: &str, body: &[u8]) -> reqwest::RequestBuilder {
    let ts = (wall_ms() / 1000).to_string();
    let n = nonce();
    let sig = sign(secret, "POST", "s.localhost", target, &ts, &n, body);
    server
        .pool("s", reqwest::Method::POST, target)
        .header("x-nthpool-timestamp", ts)
        .header("x-nthpool-nonce", n)
        .header("x-nthpool-signature", format!("v1={sig}"))
        .body(body.to_vec())
}

/// Accepts `JOBS` async jobs on `p` whose fetch takes 500 ms; their ids.
async fn submit_jobs(server: &Front) -> Vec<String> {
    let mut ids = Vec::with_capacity(JOBS);
    for i in 0..JOBS {
        let r = server
            .pool(
                "p",
                reqwest::Method::POST,
                &format!("/sleep?ms=500&job={i}"),
            )
            .header("x-nthpool-async", "1")
            .body(format!("job {i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202, "job {i} was not accepted");
        let v: Value = r.json().await.unwrap();
        ids.push(v["jobId"].as_str().unwrap().to_string());
    }
    ids
}

/// Opens sockets that never send a byte; they are for the server to close.
async fn silent_sockets(port: u16) -> Vec<tokio::net::TcpStream> {
    let mut sockets = Vec::with_capacity(SILENT_SOCKETS);
    for _ in 0..SILENT_SOCKETS {
        sockets.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        );
    }
    sockets
}

/// The load that runs across the SIGTERM and the restart: each task does a fixed amount of work
/// and tolerates the server being away (a transport error) for the restart's moment.
fn spawn_load(front: &Front, statuses: &Statuses, tasks: &mut JoinSet<()>) {
    for c in 0..CALLERS {
        let (server, statuses) = (front.clone(), statuses.clone());
        tasks.spawn(async move {
            // `CALLS_EACH` answers, however many tries the restart's gap costs (bounded).
            let mut answered = 0;
            for i in 0..MAX_TRIES {
                if answered == CALLS_EACH {
                    break;
                }
                let r = server
                    .pool(
                        "p",
                        reqwest::Method::GET,
                        &format!("/sleep?ms=20&caller={c}&i={i}"),
                    )
                    .send()
                    .await;
                count(&statuses, &r);
                match r {
                    Ok(_) => answered += 1,
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        });
    }
    for reader in 0..STALLED_READERS {
        let (server, statuses) = (front.clone(), statuses.clone());
        tasks.spawn(async move {
            let mut stalled = 0;
            for round in 0..MAX_TRIES {
                if stalled == 2 {
                    break;
                }
                // Read the head of a 64 MiB answer, then stop reading past the request deadline.
                let r = server
                    .pool(
                        "p",
                        reqwest::Method::GET,
                        &format!("/flood?mb=64&reader={reader}&round={round}"),
                    )
                    .send()
                    .await;
                count(&statuses, &r);
                if r.is_ok() {
                    stalled += 1;
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                } else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                drop(r);
            }
        });
    }
    // Forgeries come from their own loopback address (127.0.0.2): the failure throttle soon
    // answers that address 429, and must not touch the other callers.
    let forger = Front {
        client: reqwest::Client::builder()
            .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
            .build()
            .unwrap(),
        port: front.port,
    };
    let st = statuses.clone();
    tasks.spawn(async move {
        for i in 0..FORGERIES {
            let r = signed(&forger, WRONG_SECRET, &format!("/forged/{i}"), b"{}")
                .send()
                .await;
            if let Ok(r) = &r {
                let status = r.status().as_u16();
                assert!(
                    status == 401 || (status == 429 && i >= 10),
                    "forgery {i} was answered {status}"
                );
            }
            count(&st, &r);
        }
    });
    let (srv, st) = (front.clone(), statuses.clone());
    tasks.spawn(async move {
        let report = json!({"status": 429, "throttled": 1, "retryAfterMs": 900_000});
        for i in 0..BOGUS_RELEASES {
            let id = format!("{i:032x}");
            let r = srv
                .api(
                    reqwest::Method::POST,
                    &format!("/pools/p/lock/{id}/release"),
                )
                .json(&report)
                .send()
                .await;
            count(&st, &r);
            if let Ok(r) = r {
                assert_eq!(r.status(), 200);
                let v: Value = r.json().await.unwrap();
                assert_eq!(v, json!({"released": false}), "bogus release {id}");
            }
        }
    });
}

/// Waits for job `id` to end and returns its admin view.
async fn terminal(server: &Server, id: &str) -> Value {
    poll(3000, Duration::from_millis(20), async || {
        let v = server
            .admin_json(&format!("/admin/pools/p/jobs/{id}"))
            .await;
        ["completed", "failed", "expired", "cancelled"]
            .contains(&v["status"].as_str().unwrap_or(""))
            .then_some(v)
    })
    .await
    .unwrap_or_else(|| panic!("job {id} never reached a terminal state"))
}

/// Counts the requests `up` saw per `Idempotency-Key`.
fn keys_seen(up: &Upstream) -> HashMap<String, u64> {
    let mut counts = HashMap::new();
    for seen in up.seen() {
        if let Some(k) = seen.headers.get("idempotency-key") {
            *counts
                .entry(k.to_str().unwrap_or("").to_string())
                .or_default() += 1;
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_at_once_with_a_restart_keeps_every_promise() {
    let (up_p, up_s) = (Upstream::start().await, Upstream::start().await);
    let receiver = Upstream::start().await;
    let client = nthbouncer_testkit::unpooled_client();
    let mut server = Server::start(
        BIN,
        "warn",
        client,
        &config(
            &up_p.url(),
            &up_s.url(),
            &format!("{}/hook", receiver.url()),
        ),
    )
    .await;
    let statuses: Statuses = Arc::default();

    let front = Front::of(&server);

    // A genuine signed request, captured to replay after the restart.
    let captured = signed(&front, SECRET, "/genuine/0", b"{\"n\":0}");
    let replay = captured.try_clone().unwrap();
    assert_eq!(captured.send().await.unwrap().status(), 200);

    let mut silent = silent_sockets(server.port).await;
    let ids = submit_jobs(&front).await;
    let mut tasks = JoinSet::new();
    spawn_load(&front, &statuses, &mut tasks);

    // The silent sockets cost the server nothing it needs: its health check answers, and it
    // closes them itself (they never sent a byte within the header timeout).
    let health = send(front.api(reqwest::Method::GET, "/healthz")).await;
    assert_eq!(health.status(), 200);
    for (i, socket) in silent.iter_mut().enumerate() {
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(30), socket.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "silent socket {i} was left open: {read:?}"
        );
    }

    // SIGTERM once some jobs' fetches have reached the origin and others still wait; the load
    // keeps going while the server drains, exits and restarts.
    let some_ran = wait_until(3000, Duration::from_millis(5), async || {
        keys_seen(&up_p).len() >= 3
    })
    .await;
    assert!(some_ran, "no job reached the origin");
    assert!(
        keys_seen(&up_p).len() < JOBS,
        "every job ran before the SIGTERM; the restart proves nothing"
    );
    server.sigterm();
    assert!(server.exited().await.success(), "unclean exit on SIGTERM");
    server.restart().await;
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }

    // The replay of a genuine request captured before the restart is refused.
    assert_eq!(replay.send().await.unwrap().status(), 401, "replayed nonce");

    // Every accepted job has one terminal state, and the origin saw its key once per attempt.
    let seen = keys_seen(&up_p);
    for id in &ids {
        let v = terminal(&server, id).await;
        assert_eq!(v["status"], "completed", "{v}");
        let attempts = v["attempt"].as_u64().unwrap();
        assert_eq!(
            seen.get(id).copied().unwrap_or(0),
            attempts,
            "job {id}: the origin's count of its Idempotency-Key vs its attempts: {v}"
        );
    }

    server.wait_idle("p").await;
    server.wait_idle("s").await;
    let state = server.admin_json("/admin/pools/p/state").await;
    assert!(
        state["pausedUntil"].is_null(),
        "bogus releases paused p: {state}"
    );
    assert_eq!(state["effectiveLimit"], LIMIT_P, "{state}");

    assert!(
        up_p.max_in_flight() <= LIMIT_P,
        "origin p served {} at once",
        up_p.max_in_flight()
    );
    assert!(
        up_s.max_in_flight() <= LIMIT_S,
        "origin s served {} at once",
        up_s.max_in_flight()
    );
    let forged = up_s
        .seen()
        .iter()
        .filter(|s| s.path.starts_with("/forged"))
        .count();
    assert_eq!(forged, 0, "forged requests reached the origin");

    let statuses = statuses.lock().unwrap().clone();
    assert!(
        statuses.keys().all(|&s| s < 500 || s == 503 || s == 504),
        "an answer was a server error: {statuses:?}"
    );
    assert!(statuses.get(&200).copied().unwrap_or(0) > 0, "{statuses:?}");
    eprintln!("soak: answers by status (0: server away) {statuses:?}; origin p saw {} requests, at most {} at once", up_p.total(), up_p.max_in_flight());
}
