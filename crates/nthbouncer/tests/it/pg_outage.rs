//! PostgreSQL lost mid-load (issue #17): no `202` that is not durable. The node reaches its
//! database through a TCP forwarder of the test's own, which the test cuts (every open
//! connection closed, every new one closed at once) while clients keep submitting async jobs,
//! and then restores: the machine's PostgreSQL keeps running for every other test.
//!
//! Every `202` a client got names a job that is in the database afterwards (and completes);
//! every submission made while the forwarder is cut gets `503 store_unavailable`; proxied calls
//! go on during the outage; jobs are accepted again after it without a restart.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nthbouncer_testkit::binary::Server;
use nthbouncer_testkit::{ok, pool_toml, serve_http, wait_until, webhook_toml};
use reqwest::Method;
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::BIN;
use nthbouncer_testkit::pg::{admin_client as client, TestDb};

/// A TCP forwarder from a loopback port to PostgreSQL at 127.0.0.1:5432 that can be cut.
struct Forwarder {
    port: u16,
    /// `true` while cut.
    cut: watch::Sender<bool>,
}

impl Forwarder {
    async fn start() -> Forwarder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, watching) = watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                let mut watching = watching.clone();
                if *watching.borrow_and_update() {
                    drop(inbound); // cut: closed at once
                    continue;
                }
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect("127.0.0.1:5432").await else {
                        return;
                    };
                    // Both sockets are dropped (closed) when the forwarder is cut.
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = watching.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Forwarder { port, cut }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// What the clients saw.
#[derive(Default)]
struct Seen {
    /// Job ids answered `202`.
    accepted: Mutex<Vec<String>>,
    /// `503 store_unavailable` answers to submissions sent after the cut was in place.
    refused_while_cut: AtomicU64,
    /// `202`s after the forwarder was restored.
    accepted_after: AtomicU64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lost_mid_load_loses_no_accepted_job() {
    let db = TestDb::create().await;
    let forwarder = Forwarder::start().await;
    let url = db.url.replacen(
        "127.0.0.1:5432",
        &format!("127.0.0.1:{}", forwarder.port),
        1,
    );
    let up = serve_http(|_req| async { ok(b"done") }).await;
    // Async needs an active webhook destination (without one the header is ignored).
    let hook = serve_http(|_req| async { ok(b"") }).await;
    let config = format!(
        "store = \"{url}\"\nallow_private_webhooks = true\n{}[pools.async]\nenabled = true\n{}{}",
        pool_toml("p", &format!("http://{up}"), "limit = 4"),
        webhook_toml(&format!("http://{hook}/hook")),
        // Proxied calls during the outage go to a pool of their own: on `p` they would wait
        // behind the jobs accepted before it.
        pool_toml("s", &format!("http://{up}"), "limit = 4"),
    );
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(16)
        .build()
        .unwrap();
    let node = Arc::new(Server::start(BIN, "warn", http, &config).await);

    // 0: before the cut; 1: cut in place; 2: restored. Clients note the phase before sending.
    let phase = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Seen::default());
    let mut clients = Vec::new();
    for c in 0..6 {
        let (node, phase, stop, seen) = (node.clone(), phase.clone(), stop.clone(), seen.clone());
        clients.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                let sent_in = phase.load(Ordering::SeqCst);
                let r = node
                    .pool("p", Method::POST, &format!("/work/{c}/{i}"))
                    .header("x-nthpool-async", "1")
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                let body: Value = r.json().await.unwrap_or(Value::Null);
                match status {
                    202 => {
                        // The restore begins with phase 2, then reopens the forwarder: a
                        // submission sent and answered within phase 1 saw only the cut.
                        assert!(
                            sent_in != 1 || phase.load(Ordering::SeqCst) == 2,
                            "a 202 while PostgreSQL was cut off: {body}"
                        );
                        let id = body["jobId"].as_str().unwrap().to_owned();
                        seen.accepted.lock().unwrap().push(id);
                        if sent_in == 2 {
                            seen.accepted_after.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    503 => {
                        assert_eq!(body["error"], "store_unavailable", "{body}");
                        if sent_in == 1 {
                            seen.refused_while_cut.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    _ => panic!("submission answered {status}: {body}"),
                }
                if sent_in == 1 {
                    // Not a spin while everything is refused at once.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }));
    }

    // Load first, then the cut.
    let loaded = wait_until(3000, Duration::from_millis(10), async || {
        seen.accepted.lock().unwrap().len() >= 200
    })
    .await;
    assert!(loaded, "the jobs were never accepted before the cut");
    forwarder.set_cut(true);
    phase.store(1, Ordering::SeqCst);
    let refused = wait_until(3000, Duration::from_millis(10), async || {
        seen.refused_while_cut.load(Ordering::SeqCst) >= 50
    })
    .await;
    assert!(refused, "submissions during the outage were not refused");
    // Proxying needs no store: it goes on.
    for i in 0..3 {
        let r = node
            .pool_get("s", &format!("/sync/{i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "done");
    }
    // Restored: jobs are accepted again without a restart.
    phase.store(2, Ordering::SeqCst);
    forwarder.set_cut(false);
    let back = wait_until(3000, Duration::from_millis(10), async || {
        seen.accepted_after.load(Ordering::SeqCst) >= 50
    })
    .await;
    assert!(back, "no jobs accepted after PostgreSQL came back");
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.await.unwrap();
    }

    // Every 202 is a row in the database (read directly, not through the node).
    let accepted: Vec<String> = seen.accepted.lock().unwrap().clone();
    let unique: HashSet<&String> = accepted.iter().collect();
    assert_eq!(unique.len(), accepted.len(), "a job id answered twice");
    let raw = client(&db.url).await;
    let found: i64 = raw
        .query_one("SELECT COUNT(*) FROM jobs WHERE id = ANY($1)", &[&accepted])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        found as usize,
        accepted.len(),
        "jobs answered 202 missing from the database"
    );
    eprintln!(
        "{} jobs accepted ({} after the outage), {} submissions refused during it",
        accepted.len(),
        seen.accepted_after.load(Ordering::SeqCst),
        seen.refused_while_cut.load(Ordering::SeqCst)
    );
    // And every one of them completes.
    node.wait_completed("p", &accepted, "done").await;
}
