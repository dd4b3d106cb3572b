//! The convergence benchmark: does a pool learn an origin's hidden limits?
//!
//! `bench/run converge` starts two `nthbouncer sandbox` origins with the same hidden limits
//! (default: concurrency 8, 300 RPM announced OpenAI-style, answers after 1000..1400 ms) and one
//! nthbouncer with two pools configured far above them (limit 64, no RPM): `adaptive` (learning
//! on) in front of the first sandbox, `fixed` (learning off) in front of the second. This binary
//! then drives each pool in turn with eager clients (default 100) and reports, side by side:
//!
//! - **goodput**: successful answers per second after the warm-up, as a share of what the hidden
//!   limits allow (`min(limit / mean latency, rpm / 60)`);
//! - **origin 429s**: the share of requests that reached the origin and were refused by it.
//!
//! Clients behave like a well-behaved SDK with endless work: after a success they send the next
//! request at once; after a 429 they wait what `retry-after-ms` / `Retry-After` says (at most
//! 10 s). Requests wait in the pool's queue when the pool holds them back. An origin 429 is told
//! from a gateway refusal by its body (the sandbox answers `rate_limit_error`, nthbouncer
//! `too_many_requests` / `queue_timeout`).
//!
//! Each pool has its own sandbox, so the second run does not inherit the first one's RPM
//! window; the runs are sequential, so they do not share the machine's two cores.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::stats::table;
use crate::BoxError;

/// Longest wait for one answer: the pool's queue timeout (30 s by default) plus the answer.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(90);

/// Longest a client honours a retry hint.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Width of one timeline row.
const BUCKET_S: u64 = 10;

const BODY: &str = r#"{"model":"bench","messages":[{"role":"user","content":"hello"}]}"#;

#[derive(clap::Args)]
pub struct ConvergeArgs {
    /// nthbouncer's listen address.
    #[arg(long)]
    nthbouncer: SocketAddr,
    /// A pool key accepted by both pools.
    #[arg(long)]
    key: String,
    /// The pool with adaptive learning on.
    #[arg(long, default_value = "adaptive")]
    pool_on: String,
    /// The same pool with adaptive learning off, in front of its own identical sandbox.
    #[arg(long, default_value = "fixed")]
    pool_off: String,
    #[arg(long, default_value = "localhost")]
    pool_domain: String,
    #[arg(long, default_value = "api.localhost")]
    api_host: String,
    /// Admin token, to sample the pool's learned state (`/admin/pools/{pool}/state`).
    #[arg(long)]
    admin_token: Option<String>,
    /// The pools' configured concurrency limit (for the table).
    #[arg(long, default_value_t = 64)]
    pool_limit: u32,
    #[arg(long, default_value_t = 100)]
    clients: usize,
    /// Unmeasured seconds at the start of each run. At least the origin's 60 s RPM window, so
    /// the measured span starts after the first full window.
    #[arg(long, default_value_t = 60)]
    warmup_s: u64,
    /// Measured seconds of each run.
    #[arg(long, default_value_t = 120)]
    measure_s: u64,
    /// The sandboxes' hidden limits and latency (must match how they were started).
    #[arg(long, default_value_t = 8)]
    origin_limit: u32,
    #[arg(long, default_value_t = 300)]
    origin_rpm: u32,
    #[arg(long, default_value_t = 1_000)]
    latency_ms: u64,
    #[arg(long, default_value_t = 400)]
    jitter_ms: u64,
}

/// How one answer counts.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    Ok,
    /// The origin refused it (the request reached the origin).
    Origin429,
    /// nthbouncer refused or timed it out in its queue (it never reached the origin).
    Gateway,
    /// Any other answer from the origin.
    OtherOrigin,
    /// No answer (connection error or timeout).
    Failed,
}

const CLASSES: usize = 5;

impl Class {
    /// How long an eager client waits after an answer of this class before its next request:
    /// not at all after a success, what a refusal asks (capped), a moment otherwise.
    pub(crate) fn wait_before_next(self, headers: &hyper::HeaderMap) -> Duration {
        match self {
            Class::Ok => Duration::ZERO,
            Class::Origin429 | Class::Gateway => retry_hint(headers)
                .unwrap_or(Duration::from_millis(100))
                .min(MAX_BACKOFF),
            Class::OtherOrigin | Class::Failed => Duration::from_millis(100),
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            Class::Ok => 0,
            Class::Origin429 => 1,
            Class::Gateway => 2,
            Class::OtherOrigin => 3,
            Class::Failed => 4,
        }
    }
}

/// Counts per timeline bucket and class, plus sampled pool state per bucket.
struct Recorder {
    start: Instant,
    buckets: Vec<[AtomicU64; CLASSES]>,
    /// `x-nthpool-effective-limit` last seen in each bucket (0 = none seen).
    limit_seen: Vec<AtomicU32>,
}

impl Recorder {
    fn new(start: Instant, seconds: u64) -> Self {
        let n = usize::try_from(seconds / BUCKET_S + 2).unwrap_or(usize::MAX);
        Recorder {
            start,
            buckets: (0..n).map(|_| Default::default()).collect(),
            limit_seen: (0..n).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    fn bucket(&self, at: Instant) -> usize {
        usize::try_from(at.saturating_duration_since(self.start).as_secs() / BUCKET_S)
            .unwrap_or(usize::MAX)
            .min(self.buckets.len() - 1)
    }

    fn record(&self, class: Class, effective_limit: Option<u32>) {
        let b = self.bucket(Instant::now());
        self.buckets[b][class.index()].fetch_add(1, Ordering::Relaxed);
        if let Some(limit) = effective_limit {
            self.limit_seen[b].store(limit, Ordering::Relaxed);
        }
    }

    /// Totals of buckets `from..to` per class.
    fn sum(&self, from: usize, to: usize) -> [u64; CLASSES] {
        let mut out = [0; CLASSES];
        for b in &self.buckets[from.min(self.buckets.len())..to.min(self.buckets.len())] {
            for (o, c) in out.iter_mut().zip(b) {
                *o += c.load(Ordering::Relaxed);
            }
        }
        out
    }
}

/// One client's keep-alive connection to nthbouncer.
pub(crate) struct Conn {
    pub(crate) addr: SocketAddr,
    pub(crate) sender: Option<SendRequest<Full<Bytes>>>,
}

impl Conn {
    pub(crate) async fn send(
        &mut self,
        req: Request<Full<Bytes>>,
    ) -> Result<(StatusCode, hyper::HeaderMap, Bytes), BoxError> {
        if self.sender.as_ref().is_none_or(SendRequest::is_closed) {
            let stream = TcpStream::connect(self.addr).await?;
            stream.set_nodelay(true)?;
            let (sender, conn) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            // Ends when the sender is dropped; its errors surface through the next request.
            tokio::spawn(conn);
            self.sender = Some(sender);
        }
        let Some(sender) = self.sender.as_mut() else {
            return Err("not connected".into());
        };
        sender.ready().await?;
        let resp = sender.send_request(req).await?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok((parts.status, parts.headers, body))
    }
}

pub(crate) fn header_u64(headers: &hyper::HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

/// The wait a 429 or 503 asks for: `retry-after-ms`, else `Retry-After` seconds.
fn retry_hint(headers: &hyper::HeaderMap) -> Option<Duration> {
    header_u64(headers, "retry-after-ms")
        .map(Duration::from_millis)
        .or_else(|| header_u64(headers, "retry-after").map(Duration::from_secs))
}

pub(crate) fn classify(status: StatusCode, body: &[u8]) -> Class {
    let text = String::from_utf8_lossy(body);
    if status.is_success() {
        Class::Ok
    } else if status == StatusCode::TOO_MANY_REQUESTS && text.contains("rate_limit_error") {
        Class::Origin429
    } else if text.contains("\"too_many_requests\"") || text.contains("\"queue_timeout\"") {
        Class::Gateway
    } else {
        Class::OtherOrigin
    }
}

/// One eager client: always has another request to send.
async fn client(args: Arc<ConvergeArgs>, pool: String, rec: Arc<Recorder>, until: Instant) {
    let mut conn = Conn {
        addr: args.nthbouncer,
        sender: None,
    };
    let host = format!("{pool}.{}", args.pool_domain);
    while Instant::now() < until {
        let req = Request::post("/v1/chat/completions")
            .header(HOST, host.as_str())
            .header("x-nthpool-key", args.key.as_str())
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from_static(BODY.as_bytes())));
        let Ok(req) = req else {
            return;
        };
        let wait = match tokio::time::timeout(REQUEST_TIMEOUT, conn.send(req)).await {
            Ok(Ok((status, headers, body))) => {
                let class = classify(status, &body);
                let limit = header_u64(&headers, "x-nthpool-effective-limit")
                    .and_then(|l| u32::try_from(l).ok());
                rec.record(class, limit);
                class.wait_before_next(&headers)
            }
            Ok(Err(_)) | Err(_) => {
                rec.record(Class::Failed, None);
                conn.sender = None;
                Duration::from_millis(200)
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// The pool's learned state, as the admin API shows it.
#[derive(Default, Clone)]
struct Learned {
    effective_limit: Option<u64>,
    learned_rpm: Option<u64>,
    paused: bool,
    cause: Option<String>,
}

async fn sample_state(args: &ConvergeArgs, pool: &str) -> Option<Learned> {
    let token = args.admin_token.as_deref()?;
    let stream = TcpStream::connect(args.nthbouncer).await.ok()?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(conn);
    let req = Request::get(format!("/admin/pools/{pool}/state"))
        .header(HOST, args.api_host.as_str())
        .header(
            AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {token}")).ok()?,
        )
        .body(Empty::<Bytes>::new())
        .ok()?;
    let resp = tokio::time::timeout(Duration::from_secs(5), sender.send_request(req))
        .await
        .ok()?
        .ok()?;
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    Some(Learned {
        effective_limit: v["effectiveLimit"].as_u64(),
        learned_rpm: v["learnedRpm"].as_u64(),
        paused: !v["pausedUntil"].is_null(),
        cause: v["lastThrottle"]["cause"].as_str().map(str::to_owned),
    })
}

/// What one run measured.
struct RunResult {
    label: &'static str,
    adaptive: bool,
    /// Per class, after the warm-up.
    measured: [u64; CLASSES],
    /// Per class, the whole run.
    whole: [u64; CLASSES],
    timeline: Vec<String>,
    last_state: Option<Learned>,
}

impl RunResult {
    fn origin_requests(c: &[u64; CLASSES]) -> u64 {
        c[Class::Ok.index()] + c[Class::Origin429.index()] + c[Class::OtherOrigin.index()]
    }

    fn origin_429_share(c: &[u64; CLASSES]) -> f64 {
        c[Class::Origin429.index()] as f64 / Self::origin_requests(c).max(1) as f64
    }
}

async fn run_one(
    args: &Arc<ConvergeArgs>,
    label: &'static str,
    pool: &str,
    adaptive: bool,
) -> RunResult {
    let total_s = args.warmup_s + args.measure_s;
    let start = Instant::now();
    let until = start + Duration::from_secs(total_s);
    let rec = Arc::new(Recorder::new(start, total_s));
    eprintln!(
        "converge: {label} pool `{pool}` ({} clients, {} s warm-up + {} s measured)",
        args.clients, args.warmup_s, args.measure_s
    );
    let clients: Vec<_> = (0..args.clients)
        .map(|_| {
            tokio::spawn(client(
                Arc::clone(args),
                pool.to_owned(),
                Arc::clone(&rec),
                until,
            ))
        })
        .collect();

    // Sample the learned state once per bucket, at its end.
    let mut states: Vec<Option<Learned>> = Vec::new();
    let buckets = total_s.div_ceil(BUCKET_S);
    for b in 1..=buckets {
        tokio::time::sleep_until((start + Duration::from_secs(b * BUCKET_S)).into()).await;
        states.push(sample_state(args, pool).await);
    }
    // Answers still on their way belong to no bucket we report; stop waiting for them.
    for c in clients {
        c.abort();
    }

    let warm_bucket = usize::try_from(args.warmup_s / BUCKET_S).unwrap_or(usize::MAX);
    let all_buckets = usize::try_from(buckets).unwrap_or(usize::MAX);
    let mut timeline = Vec::new();
    for (b, state) in states.iter().enumerate() {
        let c = rec.sum(b, b + 1);
        let limit = match state.as_ref().and_then(|s| s.effective_limit) {
            Some(l) => l.to_string(),
            None => match rec.limit_seen[b].load(Ordering::Relaxed) {
                0 => "-".to_owned(),
                l => l.to_string(),
            },
        };
        let rpm = state
            .as_ref()
            .and_then(|s| s.learned_rpm)
            .map_or_else(|| "-".to_owned(), |r| r.to_string());
        let paused = if state.as_ref().is_some_and(|s| s.paused) {
            " (paused)"
        } else {
            ""
        };
        timeline.push(format!(
            "{:>4}s{} ok {:>4}  origin 429 {:>5}  gateway {:>4}  limit {limit}  learned rpm {rpm}{paused}",
            (b as u64 + 1) * BUCKET_S,
            if b < warm_bucket { "*" } else { " " },
            c[Class::Ok.index()],
            c[Class::Origin429.index()],
            c[Class::Gateway.index()],
        ));
    }
    RunResult {
        label,
        adaptive,
        measured: rec.sum(warm_bucket, all_buckets),
        whole: rec.sum(0, all_buckets),
        timeline,
        last_state: states.into_iter().flatten().last(),
    }
}

pub async fn run(args: ConvergeArgs) -> Result<(), BoxError> {
    // Whole timeline rows only: the warm-up/measured split falls on a row boundary.
    let args = Arc::new(ConvergeArgs {
        warmup_s: args.warmup_s.div_ceil(BUCKET_S) * BUCKET_S,
        measure_s: args.measure_s.div_ceil(BUCKET_S).max(1) * BUCKET_S,
        ..args
    });
    let mean_latency_s = (args.latency_ms as f64 + args.jitter_ms as f64 / 2.0) / 1_000.0;
    let by_limit = (args.origin_limit > 0).then(|| f64::from(args.origin_limit) / mean_latency_s);
    let by_rpm = (args.origin_rpm > 0).then(|| f64::from(args.origin_rpm) / 60.0);
    let capacity = match (by_limit, by_rpm) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a
            .or(b)
            .ok_or("the origin has no hidden limit: nothing to converge to")?,
    };

    let on = run_one(&args, "adaptive on", &args.pool_on, true).await;
    let off = run_one(&args, "adaptive off", &args.pool_off, false).await;

    println!(
        "CONVERGE  hidden limits: concurrency {} at {:.2} s mean answer = {}/s, {} RPM = {}/s; \
         capacity {:.2}/s",
        args.origin_limit,
        mean_latency_s,
        by_limit.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}")),
        args.origin_rpm,
        by_rpm.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}")),
        capacity
    );
    println!(
        "pools configured at limit {}, no RPM; {} eager clients; measured {} s after a {} s warm-up",
        args.pool_limit, args.clients, args.measure_s, args.warmup_s
    );
    let secs = args.measure_s as f64;
    let rows: Vec<Vec<String>> = [&on, &off]
        .iter()
        .map(|r| {
            let m = &r.measured;
            let ok = m[Class::Ok.index()];
            vec![
                r.label.to_owned(),
                format!("{:.2}", ok as f64 / secs),
                format!("{:.1} %", 100.0 * ok as f64 / (capacity * secs)),
                RunResult::origin_requests(m).to_string(),
                m[Class::Origin429.index()].to_string(),
                format!("{:.2} %", 100.0 * RunResult::origin_429_share(m)),
                m[Class::Gateway.index()].to_string(),
                (m[Class::OtherOrigin.index()] + m[Class::Failed.index()]).to_string(),
                format!("{:.2} %", 100.0 * RunResult::origin_429_share(&r.whole)),
            ]
        })
        .collect();
    println!(
        "{}",
        table(
            &[
                "run",
                "ok/s",
                "goodput (of capacity)",
                "origin requests",
                "origin 429s",
                "origin 429 share",
                "gateway refusals",
                "other/failed",
                "429 share incl. warm-up",
            ],
            &rows,
        )
    );
    for r in [&on, &off] {
        let m = &r.measured;
        let goodput = m[Class::Ok.index()] as f64 / (capacity * secs);
        let share = RunResult::origin_429_share(m);
        if r.adaptive {
            let pass = goodput >= 0.9 && share < 0.02;
            println!(
                "{}: goodput {:.1} % (target >= 90 %), origin 429s {:.2} % (target < 2 %): {}",
                r.label,
                100.0 * goodput,
                100.0 * share,
                if pass { "PASS" } else { "FAIL" }
            );
        }
        if let Some(s) = &r.last_state {
            println!(
                "{} final state: effective limit {}, learned rpm {}, last throttle: {}",
                r.label,
                s.effective_limit
                    .map_or_else(|| "-".to_owned(), |v| v.to_string()),
                s.learned_rpm
                    .map_or_else(|| "-".to_owned(), |v| v.to_string()),
                s.cause.as_deref().unwrap_or("-")
            );
        }
    }
    for r in [&on, &off] {
        println!();
        println!("timeline, {} (per {BUCKET_S} s; * = warm-up):", r.label);
        for line in &r.timeline {
            println!("  {line}");
        }
    }
    Ok(())
}
