//! The scale benchmark (issue #8): resident memory of the real `nthbouncer serve` process idle,
//! with 10,000 waiters parked in one pool's queue, after they are all released, and with 1,000
//! pools configured. Goals: under 40 MiB idle, under 2 KiB per parked waiter.
//!
//! This subcommand starts the servers itself (the release binary given by `--nthbouncer`, on
//! loopback, each with a fresh config and data directory under `--dir`), because every waiter
//! scenario gets a **fresh server**: each one is measured against its own idle figure, and none
//! inherits memory the allocator kept from the scenario before. Every server is killed when its
//! scenario ends (and on drop); its pid is appended to `--pid-file`, so `bench/run` can stop it
//! even if this process dies.
//!
//! A scenario: start, one warm-up of each route used (proxy, lock, admin state), read VmRSS
//! (`/proc/PID/status`) = *idle*; take the pool's one slot (limit 1) with a lock acquire; park
//! the waiters; wait until the admin state says `queued` = waiters; read VmRSS = *parked*;
//! release the slot (the waiters then go through one at a time, each proxied to the local
//! upstream or, for lock waiters, released at once); check `inFlight` and `queued` are back to
//! 0 and every waiter got its 200; read VmRSS = *released*. Per waiter = (parked − idle) /
//! waiters. The transports:
//! - HTTP/1.1: one TCP connection per waiter (what a fleet of workers on HTTP/1.1 costs);
//! - h2c (prior knowledge): 100 connections × 100 multiplexed streams by default;
//! - and, to tell the connection from the request: the same number of idle HTTP/1.1 keep-alive
//!   connections (one finished request each, nothing parked), and the gate alone in this
//!   process (`nthbouncer-coord`'s in-process gate, one task per waiter, no HTTP), measured
//!   first, while this process is fresh.
//!
//! The pools scenario starts a server with `--pools` pools, reads VmRSS after a warm-up request,
//! then after one request through every pool; per pool = (that − median idle of the one-pool
//! servers) / (pools − 1).
//!
//! Kernel socket buffers are not in VmRSS (they are kernel memory); the figures are the
//! process's own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use nthbouncer_coord::in_process::InProcessGate;
use nthbouncer_coord::{
    AcquireRequest, Clock, PoolGate, PoolSettings, Priority, SlotKind, SystemClock,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::stats::{count, table};
use crate::BoxError;

const GOAL_IDLE_MIB: f64 = 40.0;
const GOAL_WAITER_BYTES: f64 = 2048.0;
/// The queued pool's name, and the API host (the server's default).
const POOL: &str = "q";
const API_HOST: &str = "api.localhost";
/// Long enough that nothing times out while the waiters are parked and drained.
const LONG_MS: u64 = 600_000;
/// Bound on one HTTP exchange of the harness (state, warm-up, hold, release).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct ScaleArgs {
    /// The nthbouncer binary to start (`serve --config`).
    #[arg(long)]
    nthbouncer: PathBuf,
    /// An existing directory for the generated configs, data directories and server logs.
    #[arg(long)]
    dir: PathBuf,
    /// Waiters parked in the queue, per scenario.
    #[arg(long, default_value_t = 10_000)]
    waiters: usize,
    /// Connections the h2c waiters are multiplexed over (the streams are spread evenly; the
    /// server allows 200 concurrent streams per connection).
    #[arg(long, default_value_t = 100)]
    h2_connections: usize,
    /// Pools of the pools scenario.
    #[arg(long, default_value_t = 1000)]
    pools: usize,
    /// Connections being opened at once while parking HTTP/1.1 waiters (the listen backlog is
    /// finite).
    #[arg(long, default_value_t = 200)]
    connect_concurrency: usize,
    /// Pause before every reading, so buffered work (access log, metrics) has settled.
    #[arg(long, default_value_t = 1000)]
    settle_ms: u64,
    /// Appends the pid of every server started, one a line.
    #[arg(long)]
    pid_file: Option<PathBuf>,
    /// nginx's binary: adds its row for the same idle keep-alive connections as `h1-idle`, the
    /// peer of nthbouncer's per-connection memory (skip it as `nginx-idle`).
    #[arg(long)]
    nginx: Option<PathBuf>,
    /// Skip the scenarios whose names are given (gate, h1-idle, nginx-idle, proxy-h1, proxy-h2,
    /// lock-h1, lock-h2, pools), comma-separated.
    #[arg(long, value_delimiter = ',')]
    skip: Vec<String>,
}

/// What `/proc/PID/status` says about memory, in KiB.
#[derive(Clone, Copy, Debug, Default)]
struct Mem {
    rss: u64,
    hwm: u64,
    anon: u64,
    threads: u64,
}

fn mem(pid: u32) -> Result<Mem, BoxError> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        line.get(name.len()..)?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    Ok(Mem {
        rss: field("VmRSS:").ok_or("no VmRSS in /proc/PID/status")?,
        hwm: field("VmHWM:").unwrap_or(0),
        anon: field("RssAnon:").unwrap_or(0),
        threads: field("Threads:").unwrap_or(0),
    })
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// Soft limit on open files of this process (the servers it starts inherit it).
fn open_files_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.get("Max open files".len()..)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

mod nginx;

// --- HTTP ---------------------------------------------------------------------------------------

type H1 = hyper::client::conn::http1::SendRequest<Full<Bytes>>;
type H2 = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

async fn h1_connect(addr: SocketAddr) -> Result<H1, BoxError> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    // Ends when the sender is dropped; an error surfaces through the next request.
    tokio::spawn(conn);
    Ok(sender)
}

async fn h2_connect(addr: SocketAddr) -> Result<H2, BoxError> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

/// One connection of either transport.
#[derive(Clone)]
enum Conn {
    H1(Arc<tokio::sync::Mutex<H1>>),
    H2(H2),
}

/// A request as the harness sends it: `host` becomes the `Host` header (HTTP/1.1) or the
/// authority of an absolute URI (h2, where `:authority` stands for `Host`).
struct Req<'a> {
    method: Method,
    host: &'a str,
    path: &'a str,
    key: Option<&'a str>,
    bearer: Option<&'a str>,
    body: Bytes,
}

impl Req<'_> {
    fn build(&self, h2: bool) -> Result<Request<Full<Bytes>>, BoxError> {
        let mut b = if h2 {
            Request::builder().uri(format!("http://{}{}", self.host, self.path))
        } else {
            Request::builder().uri(self.path).header(HOST, self.host)
        };
        b = b.method(self.method.clone());
        if let Some(key) = self.key {
            b = b.header("x-nthpool-key", key);
        }
        if let Some(token) = self.bearer {
            b = b.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        if !self.body.is_empty() {
            b = b.header(CONTENT_TYPE, "application/json");
        }
        Ok(b.body(Full::new(self.body.clone()))?)
    }
}

impl Conn {
    async fn send(&self, req: &Req<'_>) -> Result<(StatusCode, Bytes), BoxError> {
        let resp = match self {
            Conn::H1(sender) => {
                let mut sender = sender.lock().await;
                sender.ready().await?;
                sender.send_request(req.build(false)?).await?
            }
            Conn::H2(sender) => {
                let mut sender = sender.clone();
                sender.ready().await?;
                sender.send_request(req.build(true)?).await?
            }
        };
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }
}

/// The server under test, as the harness talks to it.
struct Server {
    child: tokio::process::Child,
    pid: u32,
    addr: SocketAddr,
    key: String,
    admin: String,
    ready_after: Duration,
}

impl Server {
    async fn start(args: &ScaleArgs, name: &str, pools_toml: &str) -> Result<Server, BoxError> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let admin = nthbouncer_config::keys::generate_key();
        let data = args.dir.join(format!("{name}-data"));
        std::fs::create_dir_all(&data)?;
        let config = args.dir.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"{addr}\"\ndata_dir = {:?}\nadmin_token = \"{admin}\"\n\
                 shutdown_grace_ms = 1000\nmax_connections = {}\n\n{pools_toml}",
                data.display().to_string(),
                // Every waiter's connection, and room for the harness's own requests beside
                // them (the default, 10,000, would refuse those with 503 at 10,000 waiters).
                args.waiters + 1000
            ),
        )?;
        let log = std::fs::File::create(args.dir.join(format!("{name}.log")))?;
        let started = Instant::now();
        let child = tokio::process::Command::new(&args.nthbouncer)
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().ok_or("the server exited at once")?;
        if let Some(file) = &args.pid_file {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(file)?;
            writeln!(f, "{pid}")?;
        }
        let mut server = Server {
            child,
            pid,
            addr,
            key: String::new(),
            admin,
            ready_after: Duration::ZERO,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!(
                    "nthbouncer ({name}) exited with {status} at start; see {}",
                    args.dir.join(format!("{name}.log")).display()
                )
                .into());
            }
            let ready = server
                .api(Method::GET, "/readyz", None, Bytes::new())
                .await
                .is_ok_and(|(s, _)| s == StatusCode::OK);
            if ready {
                server.ready_after = started.elapsed();
                return Ok(server);
            }
            if Instant::now() > deadline {
                return Err(format!("nthbouncer ({name}) not ready after 60 s").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn mem(&self) -> Result<Mem, BoxError> {
        mem(self.pid)
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }

    /// One request to the API host on a fresh HTTP/1.1 connection.
    async fn api(
        &self,
        method: Method,
        path: &str,
        bearer: Option<&str>,
        body: Bytes,
    ) -> Result<(StatusCode, Bytes), BoxError> {
        let req = Req {
            method,
            host: API_HOST,
            path,
            key: (!self.key.is_empty()).then_some(self.key.as_str()),
            bearer,
            body,
        };
        let exchange = async {
            let conn = Conn::H1(Arc::new(tokio::sync::Mutex::new(
                h1_connect(self.addr).await?,
            )));
            conn.send(&req).await
        };
        tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| format!("{path}: no answer within {REQUEST_TIMEOUT:?}"))?
    }

    /// `(inFlight, queued)` of a pool, from the admin API.
    async fn state(&self, pool: &str) -> Result<(u64, u64), BoxError> {
        let path = format!("/admin/pools/{pool}/state");
        let (status, body) = self
            .api(Method::GET, &path, Some(&self.admin), Bytes::new())
            .await?;
        if status != StatusCode::OK {
            return Err(format!("{path}: {status}").into());
        }
        let v: serde_json::Value = serde_json::from_slice(&body)?;
        let in_flight = v["inFlight"].as_u64().ok_or("no inFlight in the state")?;
        let queued = v["queued"].as_u64().ok_or("no queued in the state")?;
        Ok((in_flight, queued))
    }

    /// Waits (bounded) for the pool's state to be `(in_flight, queued)`; gives up early when a
    /// waiter has failed (it will never be counted).
    async fn wait_state(
        &self,
        pool: &str,
        want: (u64, u64),
        within: Duration,
        failures: Option<&Failures>,
    ) -> Result<(), BoxError> {
        let deadline = Instant::now() + within;
        loop {
            let now = self.state(pool).await?;
            if now == want {
                return Ok(());
            }
            if let Some(f) = failures.and_then(Failures::first) {
                return Err(
                    format!("a waiter failed before the pool reached {want:?}: {f}").into(),
                );
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "pool {pool}: (inFlight, queued) = {now:?}, not {want:?} after {within:?}"
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Takes a slot of `pool` through the lock API; returns its id.
    async fn hold(&self, pool: &str) -> Result<String, BoxError> {
        let path = format!("/pools/{pool}/lock/acquire");
        // Waits: the slot of a proxied request is freed just after its answer was sent.
        let wait = Bytes::from_static(b"{\"waitMs\":10000}");
        let (status, body) = self.api(Method::POST, &path, None, wait).await?;
        if status != StatusCode::OK {
            return Err(format!("{path}: {status} {}", String::from_utf8_lossy(&body)).into());
        }
        slot_id(&body)
    }

    async fn release(&self, pool: &str, slot: &str) -> Result<(), BoxError> {
        let path = format!("/pools/{pool}/lock/{slot}/release");
        let (status, body) = self.api(Method::POST, &path, None, Bytes::new()).await?;
        if status != StatusCode::OK {
            return Err(format!("{path}: {status} {}", String::from_utf8_lossy(&body)).into());
        }
        Ok(())
    }

    /// One proxied GET through `pool` on a fresh connection; must reach the upstream.
    async fn proxy_once(&self, pool: &str) -> Result<(), BoxError> {
        let conn = Conn::H1(Arc::new(tokio::sync::Mutex::new(
            h1_connect(self.addr).await?,
        )));
        proxy_get(&conn, &format!("{pool}.localhost"), &self.key).await
    }

    /// Touches every route a scenario uses once, so lazily built state (the upstream client's
    /// connection, the access log's first batch, metric handles) is in the idle figure.
    async fn warm_up(&self, pool: &str) -> Result<(), BoxError> {
        self.proxy_once(pool).await?;
        let slot = self.hold(pool).await?;
        self.release(pool, &slot).await?;
        self.wait_state(pool, (0, 0), Duration::from_secs(10), None)
            .await?;
        Ok(())
    }
}

fn slot_id(body: &[u8]) -> Result<String, BoxError> {
    let v: serde_json::Value = serde_json::from_slice(body)?;
    Ok(v["slotId"]
        .as_str()
        .ok_or("no slotId in the grant")?
        .to_string())
}

async fn proxy_get(conn: &Conn, host: &str, key: &str) -> Result<(), BoxError> {
    let req = Req {
        method: Method::GET,
        host,
        path: "/scale",
        key: Some(key),
        bearer: None,
        body: Bytes::new(),
    };
    let (status, body) = conn.send(&req).await?;
    if status != StatusCode::OK || body.as_ref() != crate::upstream::BODY {
        return Err(format!(
            "proxied GET via {host}: {status} {}",
            String::from_utf8_lossy(&body)
        )
        .into());
    }
    Ok(())
}

/// Lock acquire that waits in the queue, then releases the grant on the same connection.
async fn lock_waiter(conn: &Conn, key: &str) -> Result<(), BoxError> {
    let path = format!("/pools/{POOL}/lock/acquire");
    let acquire = Req {
        method: Method::POST,
        host: API_HOST,
        path: &path,
        key: Some(key),
        bearer: None,
        body: Bytes::from(format!("{{\"waitMs\":{LONG_MS}}}")),
    };
    let (status, body) = conn.send(&acquire).await?;
    if status != StatusCode::OK {
        return Err(format!("lock acquire: {status} {}", String::from_utf8_lossy(&body)).into());
    }
    let slot = slot_id(&body)?;
    let path = format!("/pools/{POOL}/lock/{slot}/release");
    let release = Req {
        method: Method::POST,
        host: API_HOST,
        path: &path,
        key: Some(key),
        bearer: None,
        body: Bytes::new(),
    };
    let (status, body) = conn.send(&release).await?;
    if status != StatusCode::OK {
        return Err(format!("lock release: {status} {}", String::from_utf8_lossy(&body)).into());
    }
    Ok(())
}

/// Failed waiters: how many, and the first error.
#[derive(Default)]
struct Failures {
    count: AtomicUsize,
    first: Mutex<Option<String>>,
}

impl Failures {
    fn record(&self, e: &BoxError) {
        self.count.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut first) = self.first.lock() {
            first.get_or_insert_with(|| e.to_string());
        }
    }
    fn first(&self) -> Option<String> {
        self.first.lock().ok().and_then(|f| f.clone())
    }
}

/// Opens `n` HTTP/1.1 connections to `addr` (at most `concurrency` being opened at once), sends
/// `req` once on each (it must answer 200) and returns them, idle and kept alive.
async fn open_idle_connections(
    addr: SocketAddr,
    n: usize,
    concurrency: usize,
    req: Req<'static>,
) -> Result<Vec<Conn>, BoxError> {
    let req = Arc::new(req);
    let sem = Arc::new(Semaphore::new(concurrency.max(1)));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..n {
        let permit = sem.clone().acquire_owned().await?;
        let (tx, req) = (tx.clone(), req.clone());
        tokio::spawn(async move {
            let r = async {
                let conn = Conn::H1(Arc::new(tokio::sync::Mutex::new(h1_connect(addr).await?)));
                let (status, _) = conn.send(&req).await?;
                if status != StatusCode::OK {
                    return Err::<Conn, BoxError>(format!("{}: {status}", req.path).into());
                }
                Ok(conn)
            }
            .await;
            drop(permit);
            let _ = tx.send(r);
        });
    }
    drop(tx);
    let mut kept = Vec::with_capacity(n);
    while let Some(r) = rx.recv().await {
        kept.push(r?);
    }
    Ok(kept)
}

// --- scenarios ------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Waiter {
    /// An idle keep-alive connection (one finished request), nothing parked.
    IdleConnection,
    /// A proxied GET waiting for the pool's slot.
    Proxy,
    /// A lock-API acquire with `waitMs`.
    Lock,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Transport {
    H1,
    H2,
}

/// One row of the waiters table.
struct Row {
    what: String,
    transport: String,
    waiters: usize,
    idle: Mem,
    parked: Mem,
    released: Option<Mem>,
    ready_after: Option<Duration>,
    /// A goal applies (not to idle connections, which wait for nothing).
    goal: bool,
    note: Option<String>,
}

impl Row {
    fn per_waiter(&self) -> f64 {
        (self.parked.rss as f64 - self.idle.rss as f64) * 1024.0 / self.waiters.max(1) as f64
    }
}

fn queued_pool_toml(upstream: SocketAddr, key: &str, waiters: usize) -> String {
    format!(
        "[[pools]]\nname = \"{POOL}\"\nupstream = \"http://{upstream}\"\nkeys = [\"{key}\"]\n\
         [pools.concurrency]\nlimit = 1\nqueue_size = {}\nqueue_timeout_ms = {LONG_MS}\n\
         request_timeout_ms = {LONG_MS}\nlease_term_ms = {LONG_MS}\nrenew_interval_ms = 60000\n\
         adaptive = false\n",
        (waiters * 2).max(1000)
    )
}

async fn waiter_scenario(
    args: &ScaleArgs,
    upstream: SocketAddr,
    name: &str,
    waiter: Waiter,
    transport: Transport,
) -> Result<Row, BoxError> {
    let key = nthbouncer_config::keys::generate_key();
    let mut server =
        Server::start(args, name, &queued_pool_toml(upstream, &key, args.waiters)).await?;
    server.key = key;
    let result = run_waiters(args, &server, waiter, transport).await;
    server.stop().await;
    result.map_err(|e| format!("scenario {name}: {e}").into())
}

async fn run_waiters(
    args: &ScaleArgs,
    server: &Server,
    waiter: Waiter,
    transport: Transport,
) -> Result<Row, BoxError> {
    let n = args.waiters;
    let settle = Duration::from_millis(args.settle_ms);
    server.warm_up(POOL).await?;
    tokio::time::sleep(settle).await;
    let idle = server.mem()?;

    let hold = match waiter {
        Waiter::IdleConnection => None,
        Waiter::Proxy | Waiter::Lock => Some(server.hold(POOL).await?),
    };
    let failures = Arc::new(Failures::default());
    let done = Arc::new(AtomicUsize::new(0));
    let mut tasks: Vec<JoinHandle<()>> = Vec::with_capacity(n);
    // Idle connections are kept here until they have been measured.
    let mut kept: Vec<Conn> = Vec::new();
    let host = format!("{POOL}.localhost");

    let spawn_waiter = |conn: Conn| {
        let failures = failures.clone();
        let done = done.clone();
        let key = server.key.clone();
        let host = host.clone();
        tokio::spawn(async move {
            let r = match waiter {
                Waiter::Proxy => proxy_get(&conn, &host, &key).await,
                Waiter::Lock => lock_waiter(&conn, &key).await,
                Waiter::IdleConnection => Ok(()),
            };
            match r {
                Ok(()) => {
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => failures.record(&e),
            }
        })
    };

    let parking = Instant::now();
    match (waiter, transport) {
        (Waiter::IdleConnection, _) => {
            let healthz = Req {
                method: Method::GET,
                host: API_HOST,
                path: "/healthz",
                key: None,
                bearer: None,
                body: Bytes::new(),
            };
            kept = open_idle_connections(server.addr, n, args.connect_concurrency, healthz).await?;
        }
        (_, Transport::H1) => {
            let sem = Arc::new(Semaphore::new(args.connect_concurrency.max(1)));
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            for _ in 0..n {
                let permit = sem.clone().acquire_owned().await?;
                let addr = server.addr;
                let tx = tx.clone();
                tokio::spawn(async move {
                    let r = h1_connect(addr).await;
                    drop(permit);
                    let _ = tx.send(r);
                });
                // Start the waiters of the connections opened so far.
                while let Ok(r) = rx.try_recv() {
                    tasks.push(spawn_waiter(Conn::H1(Arc::new(tokio::sync::Mutex::new(
                        r?,
                    )))));
                }
            }
            drop(tx);
            while let Some(r) = rx.recv().await {
                tasks.push(spawn_waiter(Conn::H1(Arc::new(tokio::sync::Mutex::new(
                    r?,
                )))));
            }
        }
        (_, Transport::H2) => {
            let conns = args.h2_connections.clamp(1, n.max(1));
            for c in 0..conns {
                let sender = h2_connect(server.addr).await?;
                let streams = n / conns + usize::from(c < n % conns);
                for _ in 0..streams {
                    tasks.push(spawn_waiter(Conn::H2(sender.clone())));
                }
            }
        }
    }
    if waiter != Waiter::IdleConnection {
        server
            .wait_state(
                POOL,
                (1, n as u64),
                Duration::from_secs(180),
                Some(&failures),
            )
            .await?;
    }
    let parked_in = parking.elapsed();
    tokio::time::sleep(settle).await;
    let parked = server.mem()?;

    let released = match hold {
        None => {
            drop(kept);
            // Give the server a moment to see the connections close.
            tokio::time::sleep(settle).await;
            None
        }
        Some(slot) => {
            server.release(POOL, &slot).await?;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
            for t in tasks {
                if tokio::time::timeout_at(deadline, t).await.is_err() {
                    return Err("waiters not all answered within 300 s of the release".into());
                }
            }
            if let Some(first) = failures.first() {
                return Err(format!(
                    "{} of {n} waiters failed; the first: {first}",
                    failures.count.load(Ordering::Relaxed)
                )
                .into());
            }
            let ok = done.load(Ordering::Relaxed);
            if ok != n {
                return Err(format!("{ok} of {n} waiters answered 200").into());
            }
            server
                .wait_state(POOL, (0, 0), Duration::from_secs(30), None)
                .await?;
            tokio::time::sleep(settle).await;
            Some(server.mem()?)
        }
    };
    let released = match released {
        Some(m) => Some(m),
        None => Some(server.mem()?),
    };
    let (what, transport_label) = match (waiter, transport) {
        (Waiter::IdleConnection, _) => (
            "none: idle keep-alive connections".to_string(),
            format!("HTTP/1.1, {} conns", count(n as f64)),
        ),
        (w, t) => (
            match w {
                Waiter::Proxy => "proxy GET".to_string(),
                _ => "lock acquire (waitMs)".to_string(),
            },
            match t {
                Transport::H1 => format!("HTTP/1.1, {} conns", count(n as f64)),
                Transport::H2 => {
                    let conns = args.h2_connections.clamp(1, n.max(1));
                    format!("h2c, {conns} conns x {} streams", n.div_ceil(conns))
                }
            },
        ),
    };
    Ok(Row {
        what,
        transport: transport_label,
        waiters: n,
        idle,
        parked,
        released,
        ready_after: Some(server.ready_after),
        goal: waiter != Waiter::IdleConnection,
        note: Some(format!("parked in {:.1} s", parked_in.as_secs_f64())),
    })
}

/// The gate alone, in this process: one task per waiter awaiting `acquire` on an in-process
/// gate whose one slot is held. What the governor's queue entry, the waiter's channel and timer,
/// the boxed acquire future and its task cost, with no HTTP at all.
async fn gate_scenario(args: &ScaleArgs) -> Result<Row, BoxError> {
    let n = args.waiters;
    let settle = Duration::from_millis(args.settle_ms);
    let me = std::process::id();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
    let settings = PoolSettings {
        limit: 1,
        queue_size: u32::try_from(n * 2).unwrap_or(u32::MAX),
        request_timeout_ms: LONG_MS,
        lease_term_ms: LONG_MS,
        renew_interval_ms: 60_000,
        adaptive: false,
        ..PoolSettings::default()
    };
    let gate: Arc<dyn PoolGate> = Arc::new(InProcessGate::new("scale", settings, clock));
    let request = |wait_ms| AcquireRequest {
        fairness_key: 1,
        priority: Priority::Normal,
        wait_ms,
        kind: SlotKind::Exchange,
    };
    let future_bytes = {
        let fut = gate.acquire(request(LONG_MS));
        std::mem::size_of_val(&*fut)
    };
    let held = gate
        .acquire(request(0))
        .await
        .map_err(|r| format!("gate: first acquire refused: {r:?}"))?;
    tokio::time::sleep(settle).await;
    let idle = mem(me)?;
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let gate = gate.clone();
        tasks.push(tokio::spawn(async move {
            match gate.acquire(request(LONG_MS)).await {
                Ok(g) => gate.release(g.slot_id, None).await,
                Err(_) => false,
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while gate.snapshot().await.queued != n as u32 {
        if Instant::now() > deadline {
            return Err("gate: the waiters did not all queue within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(settle).await;
    let parked = mem(me)?;
    gate.release(held.slot_id, None).await;
    let mut ok = 0;
    for t in tasks {
        if t.await.unwrap_or(false) {
            ok += 1;
        }
    }
    if ok != n {
        return Err(format!("gate: {ok} of {n} waiters were granted and released").into());
    }
    tokio::time::sleep(settle).await;
    let released = mem(me)?;
    gate.close().await;
    Ok(Row {
        what: "gate only (in-process, no HTTP)".into(),
        transport: "one task per waiter".into(),
        waiters: n,
        idle,
        parked,
        released: Some(released),
        ready_after: None,
        goal: true,
        note: Some(format!(
            "boxed acquire future {future_bytes} bytes; measured in the load generator's own process"
        )),
    })
}

/// Size of the future an async fn returns, without calling it (the type is the fn item's).
fn future_size<A, B, C, D, E, F, G>(_: &G) -> usize
where
    G: Fn(A, B, C, D, E) -> F,
{
    std::mem::size_of::<F>()
}

/// [`future_size`] of a function of six arguments.
fn future_size6<A, B, C, D, E, H, F, G>(_: &G) -> usize
where
    G: Fn(A, B, C, D, E, H) -> F,
{
    std::mem::size_of::<F>()
}

/// What a parked request keeps in its state machine besides the gate's own future: the proxy's
/// and the lock acquire's handler futures (the server boxes each request's future, HTTP/1.1 in
/// the connection, h2 in a task per stream).
fn handler_future_sizes() -> Vec<(&'static str, usize)> {
    vec![
        (
            "proxy::handle",
            future_size6(&nthbouncer_server::proxy::handle),
        ),
        (
            "lock::acquire",
            future_size(&nthbouncer_server::lock::acquire),
        ),
    ]
}

/// Size of one accepted connection's future as the server builds it (hyper-util's auto
/// builder, HTTP/1.1 header timeout, graceful-shutdown watcher), with a trivial service: the
/// tokio task of every connection holds this much inline. The HTTP/1.1 dispatcher's buffers and
/// its slot for the service future are separate heap allocations.
async fn connection_future_size() -> Result<usize, BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
    let _client = client?;
    let (stream, peer) = accepted?;
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10));
    builder.http2().timer(TokioTimer::new());
    let shared = Arc::new(());
    let service = hyper::service::service_fn(move |_req: Request<hyper::body::Incoming>| {
        let _shared = shared.clone();
        async move {
            let _ = peer;
            Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::new())))
        }
    });
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let conn = graceful.watch(
        builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned(),
    );
    Ok(std::mem::size_of_val(&conn))
}

struct PoolsResult {
    pools: usize,
    ready_after: Duration,
    idle: Mem,
    touched: Mem,
}

async fn pools_scenario(args: &ScaleArgs, upstream: SocketAddr) -> Result<PoolsResult, BoxError> {
    let key = nthbouncer_config::keys::generate_key();
    let mut toml = String::new();
    for i in 0..args.pools {
        toml.push_str(&format!(
            "[[pools]]\nname = \"p{i:04}\"\nupstream = \"http://{upstream}\"\nkeys = [\"{key}\"]\n\n"
        ));
    }
    let mut server = Server::start(args, "pools", &toml).await?;
    server.key = key;
    let result = async {
        server.warm_up("p0000").await?;
        tokio::time::sleep(Duration::from_millis(args.settle_ms)).await;
        let idle = server.mem()?;
        let conn = Conn::H1(Arc::new(tokio::sync::Mutex::new(
            h1_connect(server.addr).await?,
        )));
        for i in 0..args.pools {
            proxy_get(&conn, &format!("p{i:04}.localhost"), &server.key).await?;
        }
        drop(conn);
        tokio::time::sleep(Duration::from_millis(args.settle_ms)).await;
        let touched = server.mem()?;
        Ok::<_, BoxError>(PoolsResult {
            pools: args.pools,
            ready_after: server.ready_after,
            idle,
            touched,
        })
    }
    .await;
    server.stop().await;
    result.map_err(|e| format!("scenario pools: {e}").into())
}

fn median(mut v: Vec<u64>) -> Option<u64> {
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

fn mark(pass: bool) -> &'static str {
    if pass {
        "PASS"
    } else {
        "MISS"
    }
}

pub async fn run(args: ScaleArgs) -> Result<(), BoxError> {
    let skip = |name: &str| args.skip.iter().any(|s| s == name);
    let n = args.waiters;
    if !args.dir.is_dir() {
        return Err(format!("--dir {}: not a directory", args.dir.display()).into());
    }
    // Both ends of every HTTP/1.1 waiter's connection are open at once, one in each process.
    let need = n as u64 + 256;
    match open_files_limit() {
        Some(limit) if limit < need => {
            return Err(format!(
            "the open-files limit is {limit}; {n} waiters need about {need} in this process and \
                 in the server (raise it: `ulimit -n {need}`; bench/run does)"
        )
            .into())
        }
        _ => {}
    }

    let mut rows = Vec::new();
    // First, while this process is fresh (its own memory is what is measured).
    if !skip("gate") {
        eprintln!(
            "== scale: gate only, {} waiters in this process",
            count(n as f64)
        );
        rows.push(gate_scenario(&args).await?);
    }

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let upstream = listener.local_addr()?;
    let upstream_task = tokio::spawn(crate::upstream::serve(listener));

    let scenarios = [
        ("h1-idle", Waiter::IdleConnection, Transport::H1),
        ("proxy-h1", Waiter::Proxy, Transport::H1),
        ("proxy-h2", Waiter::Proxy, Transport::H2),
        ("lock-h1", Waiter::Lock, Transport::H1),
        ("lock-h2", Waiter::Lock, Transport::H2),
    ];
    for (name, waiter, transport) in scenarios {
        if skip(name) {
            continue;
        }
        eprintln!("== scale: {name}, {} waiters", count(n as f64));
        rows.push(waiter_scenario(&args, upstream, name, waiter, transport).await?);
        if let (Some(nginx), "h1-idle", false) = (&args.nginx, name, skip("nginx-idle")) {
            eprintln!("== scale: nginx-idle, {} connections", count(n as f64));
            let settle = Duration::from_millis(args.settle_ms);
            let row = nginx::idle_row(nginx, &args.dir, n, args.connect_concurrency, settle);
            rows.push(row.await?);
        }
    }
    let pools = if skip("pools") {
        None
    } else {
        eprintln!("== scale: {} pools", count(args.pools as f64));
        Some(pools_scenario(&args, upstream).await?)
    };
    upstream_task.abort();

    print!("{}", report(&args, &rows, pools.as_ref()));
    let mut sizes: Vec<String> = handler_future_sizes()
        .into_iter()
        .map(|(name, bytes)| format!("{name} {} bytes", count(bytes as f64)))
        .collect();
    if let Ok(bytes) = connection_future_size().await {
        sizes.push(format!(
            "one connection's task {} bytes",
            count(bytes as f64)
        ));
    }
    println!(
        "state machines (size_of, before any heap they point to): {}",
        sizes.join(", ")
    );
    Ok(())
}

fn report(args: &ScaleArgs, rows: &[Row], pools: Option<&PoolsResult>) -> String {
    let n = args.waiters;
    let mut out = String::new();
    out.push_str(&format!(
        "SCALE  resident memory (VmRSS, /proc/PID/status) of `nthbouncer serve`, a fresh server per row;\n       \
         {} waiters parked in one pool's queue (limit 1, its slot held by a lock)\n       \
         goals: idle < {GOAL_IDLE_MIB:.0} MiB; < {:.0} KiB per parked waiter\n\n",
        count(n as f64),
        GOAL_WAITER_BYTES / 1024.0
    ));
    let mut table_rows = Vec::new();
    for r in rows {
        let per = r.per_waiter();
        table_rows.push(vec![
            r.what.clone(),
            r.transport.clone(),
            mib(r.idle.rss),
            mib(r.parked.rss),
            count(per),
            r.released.map_or("-".into(), |m| mib(m.rss)),
            mib(r.parked.hwm.max(r.released.map_or(0, |m| m.hwm))),
            if r.goal {
                mark(per < GOAL_WAITER_BYTES).into()
            } else {
                "(per conn)".into()
            },
        ]);
    }
    out.push_str(&table(
        &[
            "waiters",
            "transport",
            "idle MiB",
            "parked MiB",
            "bytes/waiter",
            "released MiB",
            "VmHWM MiB",
            "< 2 KiB",
        ],
        &table_rows,
    ));
    out.push('\n');
    for r in rows {
        let mut line = format!(
            "  {} / {}: RssAnon idle {} → parked {} MiB, threads {} → {}",
            r.what,
            r.transport,
            mib(r.idle.anon),
            mib(r.parked.anon),
            r.idle.threads,
            r.parked.threads
        );
        if let Some(ready) = r.ready_after {
            line.push_str(&format!("; ready {} ms after start", ready.as_millis()));
        }
        if let Some(note) = &r.note {
            line.push_str(&format!("; {note}"));
        }
        out.push_str(&line);
        out.push('\n');
    }

    let servers: Vec<&Row> = rows.iter().filter(|r| r.ready_after.is_some()).collect();
    let idle_max = servers.iter().map(|r| r.idle.rss).max();
    let idle_median = median(servers.iter().map(|r| r.idle.rss).collect());
    out.push('\n');
    if let (Some(max), Some(med)) = (idle_max, idle_median) {
        out.push_str(&format!(
            "idle (one pool, after start and a warm-up of proxy, lock and admin routes): median {} MiB, \
             max {} MiB over {} starts (goal < {GOAL_IDLE_MIB:.0} MiB): {}\n",
            mib(med),
            mib(max),
            servers.len(),
            mark((max as f64) / 1024.0 < GOAL_IDLE_MIB)
        ));
    }
    let measured: Vec<&Row> = servers.iter().copied().filter(|r| r.goal).collect();
    if let Some(worst) = measured
        .iter()
        .max_by(|a, b| a.per_waiter().total_cmp(&b.per_waiter()))
    {
        let best = measured
            .iter()
            .min_by(|a, b| a.per_waiter().total_cmp(&b.per_waiter()))
            .unwrap_or(worst);
        out.push_str(&format!(
            "per parked waiter (goal < {:.0} bytes): {} bytes at most ({} / {}), {} at least ({} / {}): {}\n",
            GOAL_WAITER_BYTES,
            count(worst.per_waiter()),
            worst.what,
            worst.transport,
            count(best.per_waiter()),
            best.what,
            best.transport,
            mark(worst.per_waiter() < GOAL_WAITER_BYTES)
        ));
    }
    let idle_conn = |prefix: &str| rows.iter().find(|r| r.what.starts_with(prefix));
    if let (Some(ours), Some(peer)) = (
        idle_conn("none: idle keep-alive"),
        idle_conn("nginx (1 worker)"),
    ) {
        out.push_str(&format!(
            "per idle HTTP/1.1 keep-alive connection: nthbouncer {} bytes, nginx {} bytes \
             (nthbouncer/nginx {:.2})\n",
            count(ours.per_waiter()),
            count(peer.per_waiter()),
            ours.per_waiter() / peer.per_waiter().max(1.0)
        ));
    }
    if let Some(p) = pools {
        out.push('\n');
        let base = idle_median;
        let per_pool = base.map(|b| {
            (p.idle.rss as f64 - b as f64) * 1024.0 / (p.pools.saturating_sub(1)).max(1) as f64
        });
        let per_pool_touched = base.map(|b| {
            (p.touched.rss as f64 - b as f64) * 1024.0 / (p.pools.saturating_sub(1)).max(1) as f64
        });
        let rows = vec![
            vec![
                "idle (start + warm-up)".to_string(),
                mib(p.idle.rss),
                mib(p.idle.hwm),
                per_pool.map_or("-".into(), |b| format!("{:.1}", b / 1024.0)),
            ],
            vec![
                "after one request per pool".to_string(),
                mib(p.touched.rss),
                mib(p.touched.hwm),
                per_pool_touched.map_or("-".into(), |b| format!("{:.1}", b / 1024.0)),
            ],
        ];
        out.push_str(&format!(
            "{} pools configured (ready {} ms after start; per pool = (VmRSS − one-pool idle median) / {})\n",
            count(p.pools as f64),
            p.ready_after.as_millis(),
            p.pools.saturating_sub(1).max(1)
        ));
        out.push_str(&table(
            &["server state", "VmRSS MiB", "VmHWM MiB", "KiB per pool"],
            &rows,
        ));
        out.push_str(&format!(
            "{} pools idle: {} MiB (goal < {GOAL_IDLE_MIB:.0} MiB idle): {}\n",
            count(p.pools as f64),
            mib(p.idle.rss),
            mark((p.idle.rss as f64) / 1024.0 < GOAL_IDLE_MIB)
        ));
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn our_own_status_has_memory_figures() {
        let m = mem(std::process::id()).unwrap();
        assert!(m.rss > 0 && m.hwm >= m.rss && m.threads >= 1);
        assert!(open_files_limit().is_some_and(|l| l > 0));
    }

    #[test]
    fn medians_and_marks() {
        assert_eq!(median(vec![3, 1, 2]), Some(2));
        assert_eq!(median(vec![]), None);
        assert_eq!(mark(true), "PASS");
    }

    #[test]
    fn config_of_the_queued_pool_is_valid() {
        let key = nthbouncer_config::keys::generate_key();
        let toml = queued_pool_toml(SocketAddr::from(([127, 0, 0, 1], 9)), &key, 10_000);
        let config = nthbouncer_config::Config::from_toml_str(&toml).unwrap();
        config.validate().unwrap();
        assert_eq!(config.pools[0].concurrency.queue_size, 20_000);
    }
}
