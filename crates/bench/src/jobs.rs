//! The async-jobs benchmark: accepted jobs per second (each durable before its `202`) and
//! completed jobs per second, against the same requests sent synchronously through the proxy,
//! in the same run, through one in-process nthbouncer (the `nthbouncer-server` library, what
//! `nthbouncer serve` runs) in front of a local upstream.
//!
//! Phases, each with `--concurrency` client tasks on keep-alive connections:
//! 1. `sync`: `--requests` proxied POSTs; reported req/s.
//! 2. `accept`: `--requests` POSTs with `X-Nthpool-Async: 1`; reported accepted/s (every `202`
//!    means the job's row was committed with fsync, in group commits).
//! 3. `complete`: from the first accept until the upstream has answered every job; reported
//!    jobs/s.
//!
//! Ratios: accepted/sync and completed/sync.
//!
//! `--store postgres://…` puts the jobs in PostgreSQL instead of SQLite; `--nodes N` starts N
//! servers (in this process, each with its own listener, job runner and store connections) on
//! that one database, sharing each pool through `--coordination redis://…`, and the client tasks
//! spread over them (task `i` talks to node `i % N`, as a round-robin balancer would).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::cpu::{machine_cpu, per_op, Probe};
use crate::BoxError;

const KEY: &str = "bench-jobs-key-0123456789";
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

#[derive(clap::Args)]
pub struct JobsArgs {
    /// Requests per phase.
    #[arg(long, default_value_t = 5_000)]
    requests: u64,
    /// Client tasks.
    #[arg(long, default_value_t = 32)]
    concurrency: u64,
    /// The pool's concurrency limit.
    #[arg(long, default_value_t = 64)]
    limit: u32,
    /// `server.store`: where the jobs live (default: SQLite in a temporary data dir).
    #[arg(long)]
    store: Option<String>,
    /// Servers started on the store (more than one needs a shared store and `--coordination`).
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// `server.coordination` for every node (`redis://…`).
    #[arg(long)]
    coordination: Option<String>,
    /// `server.coordination_prefix` (keep runs apart in a shared Redis).
    #[arg(long, default_value = "nthbouncer-bench-jobs")]
    coordination_prefix: String,
    /// Clock ticks per second of `/proc/stat` (`getconf CLK_TCK`).
    #[arg(long, default_value_t = 100)]
    clk_tck: u64,
}

/// An upstream that answers every request (and every webhook) with a small body, counting them.
async fn upstream(count: Arc<AtomicU64>) -> Result<SocketAddr, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let count = count.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let count = count.clone();
                    async move {
                        if req.uri().path().starts_with("/work") {
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
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

/// Sends `n` requests with `c` tasks; returns the elapsed time and how many got `expect`.
async fn phase(
    addrs: &[SocketAddr],
    n: u64,
    c: u64,
    asynchronous: bool,
    expect: StatusCode,
) -> Result<(Duration, u64), BoxError> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let next = Arc::new(AtomicU64::new(0));
    let good = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..c {
        let (client, next, good) = (client.clone(), next.clone(), good.clone());
        let addr = addrs[i as usize % addrs.len()];
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < n {
                let mut req = Request::post(format!("http://{addr}/work"))
                    .header("host", "p.localhost")
                    .header("x-nthpool-key", KEY);
                if asynchronous {
                    req = req.header("x-nthpool-async", "1");
                }
                let Ok(req) = req.body(Full::new(Bytes::from_static(b"{\"job\":1}"))) else {
                    continue;
                };
                if let Ok(resp) = client.request(req).await {
                    let status = resp.status();
                    let _ = resp.into_body().collect().await;
                    if status == expect {
                        good.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    Ok((started.elapsed(), good.load(Ordering::Relaxed)))
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64().max(1e-9)
}

pub async fn run(args: JobsArgs) -> Result<(), BoxError> {
    let served = Arc::new(AtomicU64::new(0));
    let up = upstream(served.clone()).await?;
    if args.nodes == 0 {
        return Err("--nodes must be at least 1".into());
    }
    if args.nodes > 1 && (args.store.is_none() || args.coordination.is_none()) {
        return Err("--nodes above 1 needs --store postgres://… and --coordination".into());
    }
    let mut store_lines = String::new();
    if let Some(store) = &args.store {
        store_lines.push_str(&format!("store = {store:?}\n"));
    }
    if let Some(coordination) = &args.coordination {
        store_lines.push_str(&format!(
            "coordination = {coordination:?}\ncoordination_prefix = {:?}\nexpected_nodes = {}\n",
            args.coordination_prefix, args.nodes
        ));
    }
    let mut dirs = Vec::new();
    let mut nodes = Vec::new();
    for n in 0..args.nodes {
        let dir =
            std::env::temp_dir().join(format!("nthbouncer-bench-jobs-{}-{n}", std::process::id()));
        let toml = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\ndata_dir = {:?}\nallow_private_webhooks = true\n\
             {store_lines}\
             [[pools]]\nname = \"p\"\nupstream = \"http://{up}\"\nkeys = [\"{KEY}\"]\n\
             [pools.concurrency]\nlimit = {}\nqueue_size = 100000\n\
             [pools.async]\nenabled = true\n\
             [[pools.webhooks]]\nurl = \"http://{up}/hook\"\nsecret = \"{SECRET}\"\n",
            dir.display().to_string(),
            args.limit
        );
        let config = nthbouncer_config::Config::from_toml_str(&toml).map_err(|e| e.to_string())?;
        let running = nthbouncer_server::start(config, nthbouncer_server::Options::default())
            .await
            .map_err(|e| e.to_string())?;
        dirs.push(dir);
        nodes.push(running);
    }
    let addrs: Vec<SocketAddr> = nodes.iter().map(|r| r.addr).collect();
    let addr = &addrs[..];
    let (sync_time, sync_ok) =
        phase(addr, args.requests, args.concurrency, false, StatusCode::OK).await?;
    let before = served.load(Ordering::Relaxed);
    let me = Probe::new(std::process::id(), args.clk_tck)?;
    let (machine_before, me_before) = (machine_cpu(args.clk_tck), me.cpu());
    let accept_start = Instant::now();
    let (accept_time, accepted) = phase(
        addr,
        args.requests,
        args.concurrency,
        true,
        StatusCode::ACCEPTED,
    )
    .await?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while served.load(Ordering::Relaxed) < before + accepted && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let complete_time = accept_start.elapsed();
    let completed = served.load(Ordering::Relaxed).saturating_sub(before);
    let machine_spent = machine_cpu(args.clk_tck)
        .zip(machine_before)
        .map(|(after, before)| after.saturating_sub(before));
    let me_spent = me.cpu().saturating_sub(me_before);
    for running in nodes {
        running.shutdown().await;
    }
    for dir in dirs {
        let _ = std::fs::remove_dir_all(&dir);
    }

    let sync_rate = rate(sync_ok, sync_time);
    let accept_rate = rate(accepted, accept_time);
    let complete_rate = rate(completed, complete_time);
    let store = match &args.store {
        Some(url) if url.starts_with("postgres") => "PostgreSQL",
        Some(_) => "given store",
        None => "SQLite",
    };
    println!(
        "JOBS  {} requests per phase, {} client tasks, pool limit {}, {store}, {} node(s)",
        args.requests, args.concurrency, args.limit, args.nodes
    );
    println!("phase                     ok        per second");
    println!("sync through the proxy    {sync_ok:>8}  {sync_rate:>12.0}");
    println!("async accepted (durable)  {accepted:>8}  {accept_rate:>12.0}");
    println!("async completed           {completed:>8}  {complete_rate:>12.0}");
    println!(
        "ratios: accepted/sync {:.2}, completed/sync {:.2}",
        accept_rate / sync_rate.max(1e-9),
        complete_rate / sync_rate.max(1e-9)
    );
    // The async phases' CPU per job completed: the whole machine (the store's database, Redis
    // and anything else running count too) and this process (the nodes, the clients and the
    // origin); steadier than the rates on a machine whose load moves.
    let machine = machine_spent.map_or_else(|| "-".to_string(), |m| per_op(m, completed));
    let rest = machine_spent.map_or_else(
        || "-".to_string(),
        |m| per_op(m.saturating_sub(me_spent), completed),
    );
    println!(
        "CPU per job (µs, async phases): machine {machine}, this process (nodes, clients, origin) {}, the rest (database, Redis, other) {rest}",
        per_op(me_spent, completed)
    );
    if completed < accepted {
        return Err(format!("only {completed} of {accepted} accepted jobs completed").into());
    }
    Ok(())
}
