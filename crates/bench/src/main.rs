//! `nthbouncer-bench`: the load side of the benchmarks in `bench/` (run them with `bench/run`).
//!
//! Every benchmark measures nthbouncer side by side with the peer a user would otherwise deploy,
//! in the same run on the same machine, and reports the ratio: absolute numbers on a shared
//! 2-core machine are noise, ratios are the result.
//!
//! Layout:
//! - [`lock`]: acquire+release pairs over HTTP keep-alive against the lock API, and the same
//!   pairs against a Redis Lua semaphore (sorted set of leases, `EVALSHA`).
//! - [`proxy`]: drives `wrk` against an upstream directly and through nthbouncer, nginx and
//!   HAProxy, and compares throughput and latency.
//! - [`converge`] / [`tokens`]: eager clients against sandboxes with hidden limits (requests
//!   and concurrency / tokens per minute), learning or token admission on vs off.
//! - [`ledger`]: Redis's time per call of the shared token ledger's script, this version
//!   against an earlier one.
//! - [`upstream`]: the fast local origin the proxy benchmark puts behind every proxy.
//! - [`floor`]: a reverse proxy of nthbouncer's parts (hyper, rustls, its threading) with none
//!   of its features, the proxy benchmarks' peer that tells the stack's cost from the features'.
//! - [`hmac`]: admitted proxy requests per second with HMAC request signing on vs off.
//! - [`cpu`]: CPU time of the server processes, from `/proc`.
//! - [`webhooks`]: webhook deliveries per second from a full outbox (runs the server in-process).
//! - [`scale`]: resident memory of `nthbouncer serve` idle, with 10,000 parked waiters and with
//!   1,000 pools (starts the release binary itself, one fresh server per scenario).
//! - [`stats`]: percentiles and table formatting.
//!
//! Processes (nthbouncer, nginx, HAProxy, redis-server) are started and stopped by `bench/run`;
//! this binary only generates load and reports, so a crash here never leaves a server behind.
//! The exception is `scale`, which needs a fresh server per scenario: it kills each one when the
//! scenario ends and lists their pids in a file that `bench/run` cleans up after.

#![forbid(unsafe_code)]

mod converge;
mod cpu;
mod floor;
mod hmac;
mod jobs;
mod ledger;
mod lock;
mod proxy;
mod scale;
mod stats;
mod tokens;
mod upstream;
mod webhooks;

use std::error::Error;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Errors cross spawned tasks, so they must be `Send + Sync`. A bench binary reports and exits;
/// a boxed error is all it needs.
pub type BoxError = Box<dyn Error + Send + Sync>;

#[derive(Parser)]
#[command(
    name = "nthbouncer-bench",
    about = "Side-by-side benchmarks of nthbouncer (run them with bench/run)"
)]
struct Cli {
    /// Tokio worker threads of this load generator (the servers under test share the machine).
    #[arg(long, global = true, default_value_t = 1)]
    threads: usize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Lock API acquire+release pairs vs a Redis Lua semaphore.
    Lock(lock::LockArgs),
    /// Proxy throughput and latency with wrk: direct, nthbouncer, nginx, HAProxy.
    Proxy(proxy::ProxyArgs),
    /// Admitted proxy requests per second with HMAC request signing on vs off.
    Hmac(hmac::HmacArgs),
    /// Adaptive learning against a sandbox with hidden limits: goodput and origin 429s, on vs off.
    Converge(converge::ConvergeArgs),
    /// Token-budget admission against a sandbox with a hidden tokens-per-minute limit: goodput
    /// and origin 429s, on vs off.
    Tokens(tokens::TokensArgs),
    /// Redis time per call of the shared token ledger's script, two versions side by side.
    TokenLedger(ledger::LedgerArgs),
    /// Serve a small fixed body on HTTP/1.1 keep-alive (the proxy benchmark's origin).
    Upstream(upstream::UpstreamArgs),
    /// Reverse-proxy to a plain-HTTP origin with nthbouncer's parts and none of its features.
    Floor(floor::FloorArgs),
    /// Async jobs accepted and completed per second vs the same requests sent synchronously.
    Jobs(jobs::JobsArgs),
    /// Webhook deliveries per second from a full outbox to a local receiver (in-process server).
    Webhooks(webhooks::WebhooksArgs),
    /// Resident memory of `nthbouncer serve`: idle, with 10,000 parked waiters, with 1,000 pools.
    Scale(scale::ScaleArgs),
    /// Print free loopback TCP ports, one a line.
    FreePorts {
        #[arg(long, default_value_t = 1)]
        count: usize,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = if cli.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cli.threads)
            .enable_all()
            .build()
    };
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Lock(args) => lock::run(args).await,
            Command::Proxy(args) => proxy::run(args).await,
            Command::Hmac(args) => hmac::run(args).await,
            Command::Converge(args) => converge::run(args).await,
            Command::Tokens(args) => tokens::run(args).await,
            Command::TokenLedger(args) => ledger::run(args).await,
            Command::Upstream(args) => upstream::run(args).await,
            Command::Floor(args) => floor::run(args).await,
            Command::Webhooks(args) => webhooks::run(args).await,
            Command::Jobs(args) => jobs::run(args).await,
            Command::Scale(args) => scale::run(args).await,
            Command::FreePorts { count } => free_ports(count),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Binds `count` ephemeral ports at once (so they are distinct), prints them and lets them go.
/// The port may be taken again before the caller binds it; on a quiet loopback that race is
/// rare, and `bench/run` fails loudly if it happens.
fn free_ports(count: usize) -> Result<(), BoxError> {
    let listeners = (0..count)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    for l in &listeners {
        println!("{}", l.local_addr()?.port());
    }
    Ok(())
}
