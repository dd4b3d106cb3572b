//! The HMAC benchmark: admitted proxy requests per second through one nthbouncer, to a pool with
//! the pool key only (`plain`) and to a pool that also requires HMAC request signing (`signed`,
//! SPEC §9), at the same concurrency, in alternating rounds. The ratio signed/plain is the cost
//! of signing as the gateway pays it: parse and check the signature headers, hash the body as it
//! streams, compute and compare the HMAC, record the nonce.
//!
//! Every request is a `POST` with the same body (`--body-bytes`), one keep-alive connection per
//! client task. A signed request gets a fresh nonce and timestamp and its own signature, computed
//! as it is sent (the body's SHA-256 is computed once: the body never changes). Before the runs,
//! the signed pool must refuse an unsigned request and a replayed one, and admit a signed one —
//! so a misconfigured pool cannot pass for a fast signed one.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hmac::{Hmac, Mac};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderValue, CONTENT_TYPE, HOST};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;

use crate::stats::{count, ms, percentile, table};
use crate::upstream::BODY;
use crate::BoxError;

const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const TARGET: &str = "/v1/bench";

#[derive(clap::Args)]
pub struct HmacArgs {
    /// Address of the running nthbouncer.
    #[arg(long)]
    nthbouncer: SocketAddr,
    /// A key of both pools.
    #[arg(long)]
    key: String,
    /// The signed pool's `access.hmac` secret.
    #[arg(long)]
    secret: String,
    /// The pool with the key only.
    #[arg(long, default_value = "plain")]
    plain_pool: String,
    /// The pool that also requires signatures.
    #[arg(long, default_value = "signed")]
    signed_pool: String,
    /// `server.pool_domain` of the nthbouncer.
    #[arg(long, default_value = "localhost")]
    pool_domain: String,
    /// Client tasks, each with its own connection.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Size of every request body.
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    /// Length of one measured round of one pool.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Measured rounds per pool, alternating which goes first.
    #[arg(long, default_value_t = 2)]
    rounds: u32,
    /// Unmeasured warm-up per pool.
    #[arg(long, default_value_t = 1.0)]
    warmup_seconds: f64,
    /// Upper bound on the requests of one run, whatever the duration.
    #[arg(long, default_value_t = 5_000_000)]
    max_requests: u64,
}

/// How one task signs: `None` for the plain pool.
struct Signing {
    secret: Vec<u8>,
    body_sha256_hex: String,
    /// Random per run, so nonces never repeat across runs against the same server.
    nonce_prefix: String,
    /// Shared by every client of every round: a nonce is never used twice.
    next_nonce: AtomicU64,
}

struct Client {
    sender: SendRequest<Full<Bytes>>,
    host: HeaderValue,
    host_str: String,
    key: HeaderValue,
    body: Bytes,
    signing: Option<Arc<Signing>>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn signature(secret: &[u8], canonical: &str) -> Result<String, BoxError> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret)?;
    mac.update(canonical.as_bytes());
    Ok(hex::encode(mac.finalize().into_bytes()))
}

impl Client {
    async fn connect(
        args: &HmacArgs,
        pool: &str,
        body: &Bytes,
        signing: Option<Arc<Signing>>,
    ) -> Result<Client, BoxError> {
        let stream = TcpStream::connect(args.nthbouncer).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let host_str = format!("{pool}.{}", args.pool_domain);
        Ok(Client {
            sender,
            host: HeaderValue::from_str(&host_str)?,
            host_str,
            key: HeaderValue::from_str(&args.key)?,
            body: body.clone(),
            signing,
        })
    }

    /// Builds one request, signed with `(nonce, timestamp)` when given (and this client signs).
    fn build(&self, sig: Option<(&str, &str)>) -> Result<Request<Full<Bytes>>, BoxError> {
        let mut req = Request::post(TARGET)
            .header(HOST, self.host.clone())
            .header("x-nthpool-key", self.key.clone())
            .header(CONTENT_TYPE, "application/json");
        if let (Some((nonce, ts)), Some(s)) = (sig, &self.signing) {
            let canonical = format!(
                "v1\nPOST\n{}\n{TARGET}\n{ts}\n{nonce}\n{}",
                self.host_str, s.body_sha256_hex
            );
            req = req
                .header("x-nthpool-timestamp", ts)
                .header("x-nthpool-nonce", nonce)
                .header(
                    "x-nthpool-signature",
                    format!("v1={}", signature(&s.secret, &canonical)?),
                );
        }
        Ok(req.body(Full::new(self.body.clone()))?)
    }

    /// A fresh nonce, unique across clients and rounds.
    fn nonce(&self) -> String {
        match &self.signing {
            Some(s) => {
                let n = s.next_nonce.fetch_add(1, Ordering::Relaxed);
                format!("{}-{n:016x}", s.nonce_prefix)
            }
            None => String::new(),
        }
    }

    /// The next request: signed with a fresh nonce when this client signs.
    fn request(&mut self) -> Result<Request<Full<Bytes>>, BoxError> {
        if self.signing.is_none() {
            return self.build(None);
        }
        let nonce = self.nonce();
        let ts = unix_now().to_string();
        self.build(Some((&nonce, &ts)))
    }

    async fn send(&mut self, req: Request<Full<Bytes>>) -> Result<(StatusCode, Bytes), BoxError> {
        let exchange = async {
            self.sender.ready().await?;
            let resp = self.sender.send_request(req).await?;
            let status = resp.status();
            let body = resp.into_body().collect().await?.to_bytes();
            Ok::<_, BoxError>((status, body))
        };
        tokio::time::timeout(REQUEST_TIMEOUT, exchange).await?
    }

    /// One request; `true` when admitted with the upstream's answer.
    async fn one(&mut self) -> Result<bool, BoxError> {
        let req = self.request()?;
        let (status, body) = self.send(req).await?;
        Ok(status == StatusCode::OK && body.as_ref() == BODY)
    }
}

#[derive(Default)]
struct TaskResult {
    admitted: u64,
    failed: u64,
    latencies_us: Vec<u32>,
}

async fn task(
    mut client: Client,
    budget: Arc<AtomicU64>,
    until: Instant,
) -> Result<TaskResult, BoxError> {
    let mut out = TaskResult::default();
    while Instant::now() < until {
        if budget
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| b.checked_sub(1))
            .is_err()
        {
            break;
        }
        let started = Instant::now();
        if client.one().await? {
            out.admitted += 1;
        } else {
            out.failed += 1;
        }
        out.latencies_us
            .push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
    }
    Ok(out)
}

#[derive(Default)]
struct Totals {
    admitted: u64,
    failed: u64,
    elapsed: Duration,
    latencies_us: Vec<u32>,
}

impl Totals {
    fn rate(&self) -> f64 {
        self.admitted as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }
}

async fn run_once(
    args: &HmacArgs,
    pool: &str,
    body: &Bytes,
    signing: Option<Arc<Signing>>,
    seconds: f64,
    totals: Option<&mut Totals>,
) -> Result<(), BoxError> {
    // Connections first, so the clock measures requests only.
    let mut clients = Vec::with_capacity(args.concurrency);
    for _ in 0..args.concurrency {
        clients.push(Client::connect(args, pool, body, signing.clone()).await?);
    }
    let budget = Arc::new(AtomicU64::new(args.max_requests));
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(seconds);
    let handles: Vec<_> = clients
        .into_iter()
        .map(|c| tokio::spawn(task(c, budget.clone(), until)))
        .collect();
    let mut results = Vec::with_capacity(handles.len());
    for h in handles {
        results.push(h.await??);
    }
    let elapsed = start.elapsed();
    if let Some(t) = totals {
        t.elapsed += elapsed;
        for r in results {
            t.admitted += r.admitted;
            t.failed += r.failed;
            t.latencies_us.extend(r.latencies_us);
        }
    }
    Ok(())
}

/// The signed pool must refuse unsigned and replayed requests and admit a signed one; the plain
/// pool must admit an unsigned one.
async fn check(args: &HmacArgs, body: &Bytes, signing: &Arc<Signing>) -> Result<(), BoxError> {
    let mut plain = Client::connect(args, &args.plain_pool, body, None).await?;
    if !plain.one().await? {
        return Err(format!("pool {} did not admit an unsigned request", args.plain_pool).into());
    }
    let mut signed = Client::connect(args, &args.signed_pool, body, Some(signing.clone())).await?;
    let unsigned = signed.build(None)?;
    let (status, _) = signed.send(unsigned).await?;
    if status != StatusCode::UNAUTHORIZED {
        return Err(format!(
            "pool {} answered an unsigned request with {status}, not 401: is access.hmac set?",
            args.signed_pool
        )
        .into());
    }
    let (nonce, ts) = (signed.nonce(), unix_now().to_string());
    let first = signed.build(Some((&nonce, &ts)))?;
    let replay = signed.build(Some((&nonce, &ts)))?;
    let (status, got) = signed.send(first).await?;
    if status != StatusCode::OK || got.as_ref() != BODY {
        return Err(format!("pool {}: a signed request got {status}", args.signed_pool).into());
    }
    let (status, _) = signed.send(replay).await?;
    if status != StatusCode::UNAUTHORIZED {
        return Err(format!(
            "pool {}: a replayed request got {status}, not 401",
            args.signed_pool
        )
        .into());
    }
    Ok(())
}

pub async fn run(args: HmacArgs) -> Result<(), BoxError> {
    let body = Bytes::from(
        format!(
            "{{\"pad\":\"{}\"}}",
            "x".repeat(args.body_bytes.saturating_sub(10))
        )
        .into_bytes(),
    );
    let ids = RandomState::new();
    let signing = Arc::new(Signing {
        secret: args.secret.as_bytes().to_vec(),
        body_sha256_hex: hex::encode(Sha256::digest(&body)),
        nonce_prefix: format!("{:016x}", ids.hash_one(unix_now())),
        next_nonce: AtomicU64::new(0),
    });
    check(&args, &body, &signing).await?;
    eprintln!(
        "hmac: {} tasks, {}-byte POST bodies: warm-up {} s each, then {} × {} s rounds",
        args.concurrency,
        body.len(),
        args.warmup_seconds,
        args.rounds,
        args.seconds
    );
    let systems = [
        (args.plain_pool.clone(), None),
        (args.signed_pool.clone(), Some(signing.clone())),
    ];
    if args.warmup_seconds > 0.0 {
        for (pool, s) in &systems {
            run_once(&args, pool, &body, s.clone(), args.warmup_seconds, None).await?;
        }
    }
    let mut totals = [Totals::default(), Totals::default()];
    for round in 0..args.rounds {
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let (Some((pool, s)), Some(t)) = (systems.get(i), totals.get_mut(i)) else {
                continue;
            };
            run_once(&args, pool, &body, s.clone(), args.seconds, Some(t)).await?;
        }
    }
    let mut rows = Vec::new();
    for ((pool, s), t) in systems.iter().zip(totals.iter_mut()) {
        t.latencies_us.sort_unstable();
        let pct = |p| percentile(&t.latencies_us, p).map_or("-".to_string(), ms);
        rows.push(vec![
            format!(
                "{} ({pool})",
                if s.is_some() { "HMAC on" } else { "HMAC off" }
            ),
            count(t.rate()),
            pct(50.0),
            pct(99.0),
            t.failed.to_string(),
        ]);
    }
    println!(
        "HMAC  admitted proxy requests/s, {}-byte POST, {} connections, {} × {} s rounds",
        body.len(),
        args.concurrency,
        args.rounds,
        args.seconds
    );
    print!(
        "{}",
        table(
            &["pool", "admitted/s", "p50 ms", "p99 ms", "not admitted"],
            &rows
        )
    );
    let [off, on] = &totals;
    println!(
        "ratio HMAC on/off: {:.2} (admitted requests per second)",
        on.rate() / off.rate().max(f64::EPSILON)
    );
    println!("hmac check (unsigned and replayed requests refused, signed admitted): PASS");
    Ok(())
}
