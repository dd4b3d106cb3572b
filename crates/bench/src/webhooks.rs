//! The webhook benchmark: deliveries per second from nthbouncer's outbox to a local receiver.
//!
//! Unlike the other benchmarks this one runs nthbouncer in this process (the `nthbouncer-server`
//! library, exactly what `nthbouncer serve` runs), because it needs a full outbox before the
//! clock starts: it writes `--deliveries` pending deliveries through the store (terminal jobs and
//! their outbox rows, in two transactions), then starts the server on that data directory, which
//! is what a restart after an outage of the receiver looks like. The dispatcher drains the outbox
//! into a hyper receiver on loopback that answers `204` and counts distinct
//! (destination, `webhook-id`) pairs. Reported: deliveries/s from the server's start to the last
//! delivery, the steady rate between the first and the last delivery, duplicates, and a check
//! that the store recorded every delivery as delivered.
//!
//! The peer, for the ratio: `direct`, a plain hyper client POSTing the same bodies to the same
//! kind of receiver at the same concurrency (8 per destination), with nothing signed, stored or
//! retried: the ceiling of any sender on this machine.
//!
//! Each delivery is a signed POST (HMAC-SHA256 over the poll body) on a keep-alive connection,
//! plus its attempt record (group commit, fsync) — the product's real cost, nothing turned off.
//! Run it with `--threads 2` so the receiver does not share one thread with the server.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use nthbouncer_store::{JobRequest, JobStore, NewJob};

use crate::BoxError;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const POOL: &str = "p";
const INSERT_BATCH: usize = 1000;

#[derive(clap::Args)]
pub struct WebhooksArgs {
    /// Deliveries to send (jobs × destinations).
    #[arg(long, default_value_t = 20_000)]
    deliveries: usize,
    /// Destinations of the pool (paths of the one receiver); each job goes to every one.
    #[arg(long, default_value_t = 1)]
    destinations: usize,
    /// Longest the drain may take, in seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
}

/// What the receiver saw.
#[derive(Default)]
struct Seen {
    /// One body as received (the direct phase sends its like).
    sample: Option<Bytes>,
    pairs: HashSet<(String, String)>,
    requests: u64,
    first: Option<Instant>,
    last: Option<Instant>,
    unsigned: u64,
}

/// A data directory removed when the run ends, however it ends.
struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn receiver(seen: Arc<Mutex<Seen>>) -> Result<SocketAddr, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let seen = seen.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let path = req.uri().path().to_string();
                        let id = req
                            .headers()
                            .get("webhook-id")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_string();
                        let signed = req.headers().contains_key("webhook-signature");
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        let now = Instant::now();
                        if let Ok(mut s) = seen.lock() {
                            s.sample.get_or_insert(body);
                            s.requests += 1;
                            s.unsigned += u64::from(!signed);
                            s.first.get_or_insert(now);
                            if s.pairs.insert((path, id)) {
                                s.last = Some(now);
                            }
                        }
                        let mut r = Response::new(Full::new(Bytes::new()));
                        *r.status_mut() = StatusCode::NO_CONTENT;
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(addr)
}

pub async fn run(args: WebhooksArgs) -> Result<(), BoxError> {
    if args.destinations == 0 || args.deliveries < args.destinations {
        return Err("need at least one destination and one delivery per destination".into());
    }
    let jobs = args.deliveries / args.destinations;
    let total = jobs * args.destinations;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let addr = receiver(seen.clone()).await?;
    let urls: Vec<String> = (0..args.destinations)
        .map(|i| format!("http://{addr}/d{i}"))
        .collect();
    let dir = TempDir(std::env::temp_dir().join(format!(
        "nthbouncer-bench-webhooks-{}-{}",
        std::process::id(),
        now_ms()
    )));

    // The outbox, full: `jobs` expired jobs with one pending delivery per destination.
    let prefill = Instant::now();
    {
        let store = nthbouncer_store::sqlite::SqliteStore::open_in_dir(&dir.0)?;
        let now = now_ms();
        let mut batch = Vec::with_capacity(INSERT_BATCH);
        for i in 0..jobs {
            batch.push(NewJob {
                id: format!("job_{i:032x}"),
                pool: POOL.into(),
                reason: "requested".into(),
                key_id: "key_bench".into(),
                fairness: 1,
                priority: "normal".into(),
                created_at: now - 2,
                expires_at: now - 1,
                retention_ms: 86_400_000,
                destinations: args.destinations as u32,
                request: JobRequest {
                    method: "POST".into(),
                    path_and_query: "/v1/chat/completions".into(),
                    headers: Vec::new(),
                    body: Vec::new(),
                },
                request_id: None,
            });
            if batch.len() == INSERT_BATCH {
                store.insert_jobs(&batch).await?;
                batch.clear();
            }
        }
        store.insert_jobs(&batch).await?;
        let ids: Vec<String> = urls
            .iter()
            .map(|u| nthbouncer_server::pools::config_destination_id(POOL, u))
            .collect();
        let active = HashMap::from([(POOL.to_string(), ids)]);
        let expired = store.expire_jobs(now, &active).await?;
        if expired.len() != jobs {
            return Err(format!("prefill: {} of {jobs} jobs ended", expired.len()).into());
        }
    }
    let prefill = prefill.elapsed();

    let hooks: String = urls
        .iter()
        .map(|u| {
            format!("[[pools.webhooks]]\nurl = \"{u}\"\nsecret = \"{SECRET}\"\ndeactivate_after = 1000000\n")
        })
        .collect();
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\ndata_dir = {:?}\nallow_private_webhooks = true\n\
         max_destinations_per_pool = {}\n\
         [[pools]]\nname = \"{POOL}\"\nupstream = \"http://127.0.0.1:9\"\nkeys = [\"bench-key-0123456789abcdef\"]\n\
         [pools.async]\nenabled = true\n{hooks}",
        dir.0.display().to_string(),
        args.destinations.max(10)
    );
    let config = nthbouncer_config::Config::from_toml_str(&toml).map_err(|e| e.to_string())?;

    let started = Instant::now();
    let server = nthbouncer_server::start(config, nthbouncer_server::Options::default())
        .await
        .map_err(|e| e.to_string())?;
    let deadline = started + Duration::from_secs(args.timeout_s);
    loop {
        let done = seen.lock().map(|s| s.pairs.len()).unwrap_or(0);
        if done >= total {
            break;
        }
        if Instant::now() >= deadline {
            server.shutdown().await;
            return Err(format!(
                "only {done} of {total} deliveries within {} s",
                args.timeout_s
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (requests, first, last, unsigned, sample) = {
        let s = seen.lock().map_err(|_| "receiver state poisoned")?;
        (s.requests, s.first, s.last, s.unsigned, s.sample.clone())
    };

    // Every delivery recorded as delivered (the attempt log is group-committed just after the
    // receiver answered, so allow it a moment).
    let store = server.state.jobs.store.clone();
    let mut recorded = 0usize;
    for _ in 0..1000 {
        recorded = 0;
        let mut cursor: Option<String> = None;
        loop {
            let page = store.list_jobs(POOL, None, cursor.as_deref(), 1000).await?;
            recorded += page.iter().map(|j| j.delivered as usize).sum::<usize>();
            match page.last() {
                Some(j) if page.len() == 1000 => cursor = Some(j.id.clone()),
                _ => break,
            }
        }
        if recorded >= total {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.shutdown().await;

    let (Some(first), Some(last), Some(sample)) = (first, last, sample) else {
        return Err("no delivery arrived".into());
    };
    let whole = last.duration_since(started).as_secs_f64();
    let steady = last.duration_since(first).as_secs_f64();
    let concurrency = (8 * args.destinations).min(64);
    let direct = direct(total, concurrency, sample).await?;
    let rate = total as f64 / whole;
    println!("webhook deliveries to a local receiver (in-process server, SQLite outbox)");
    println!(
        "  deliveries        {total} ({jobs} jobs x {} destination{})",
        args.destinations,
        if args.destinations == 1 { "" } else { "s" }
    );
    println!(
        "  outbox prefill    {:.2} s (not measured)",
        prefill.as_secs_f64()
    );
    println!(
        "  drain             {whole:.2} s from start, {:.0} deliveries/s",
        total as f64 / whole
    );
    println!(
        "  steady rate       {:.0} deliveries/s (first to last delivery)",
        (total.saturating_sub(1)) as f64 / steady.max(1e-9)
    );
    println!(
        "  requests          {requests} ({} duplicates, {unsigned} unsigned)",
        requests.saturating_sub(total as u64)
    );
    println!("  recorded          {recorded}/{total} delivered in the store");
    println!(
        "  direct (peer)     {direct:.0} requests/s: plain POSTs of the same body, {concurrency} at once"
    );
    println!(
        "ratio nthbouncer/direct: {:.2} (deliveries per second, signed and recorded, vs bare POSTs)",
        rate / direct
    );
    if recorded < total || unsigned > 0 {
        return Err("the run is invalid: deliveries missing from the store or unsigned".into());
    }
    Ok(())
}

/// The peer: `total` POSTs of `body` to a fresh receiver, `concurrency` at a time, over
/// keep-alive; nothing signed, stored or retried. Returns requests per second.
async fn direct(total: usize, concurrency: usize, body: Bytes) -> Result<f64, BoxError> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let addr = receiver(seen.clone()).await?;
    let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_max_idle_per_host(concurrency)
            .build_http();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let (client, next, body) = (client.clone(), next.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= total {
                    return Ok::<(), String>(());
                }
                let req = Request::post(format!("http://{addr}/direct"))
                    .header("content-type", "application/json")
                    .header("webhook-id", format!("job_{i:032x}"))
                    .header("webhook-signature", "none")
                    .body(Full::new(body.clone()))
                    .map_err(|e| e.to_string())?;
                let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
                    .await
                    .map_err(|_| "a direct request timed out".to_string())?
                    .map_err(|e| e.to_string())?;
                let _ = resp.into_body().collect().await;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let got = seen.lock().map(|s| s.pairs.len()).unwrap_or(0);
    if got < total {
        return Err(format!("direct: only {got} of {total} requests arrived").into());
    }
    Ok(total as f64 / elapsed)
}
