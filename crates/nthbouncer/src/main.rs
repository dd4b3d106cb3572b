//! The `nthbouncer` binary: parses the command line and wires the crates together.
//! It owns no behaviour of its own beyond start-up, signals and printing.

#![forbid(unsafe_code)]

mod lock;
mod migrate;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use nthbouncer_config::{keys, Config, PoolSpec};

/// mimalloc: the proxy path allocates and frees many small buffers per request (header maps,
/// bodies, access-log rows); it costs measurably less CPU per request than glibc's malloc
/// (bench/RESULTS.md, proxy).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "nthbouncer",
    version,
    about = "A self-hosted concurrency governor for upstream APIs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        /// TOML configuration file; without one, the defaults and the embedded store.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Also start an in-process sandbox origin and a `demo` pool in front of it, and print
        /// ready-to-paste curl commands.
        #[arg(long)]
        demo: bool,
    },
    /// Run a local stand-in for a rate-limited origin (no network needed).
    Sandbox {
        #[arg(long, default_value = "127.0.0.1:9090")]
        listen: String,
        /// Hidden concurrency limit (0 = none).
        #[arg(long, default_value_t = 8)]
        limit: u32,
        /// Hidden requests-per-minute limit (0 = none).
        #[arg(long, default_value_t = 0)]
        rpm: u32,
        /// Fixed latency of every answer.
        #[arg(long, default_value_t = 50)]
        latency_ms: u64,
        /// Extra random latency, uniform in 0..=N ms.
        #[arg(long, default_value_t = 0)]
        jitter_ms: u64,
        /// Hidden tokens-per-minute limit on chat completions (0 = none), announced with
        /// `x-ratelimit-*-tokens`.
        #[arg(long, default_value_t = 0)]
        tpm: u64,
        /// The period the token limit refills over.
        #[arg(long, default_value_t = 60_000)]
        token_window_ms: u64,
    },
    /// Print a new pool key and its sha256 hash (or a webhook secret).
    Keygen {
        #[arg(long)]
        webhook_secret: bool,
    },
    /// Validate a config file and print the resolved pools.
    CheckConfig { file: PathBuf },
    /// Hold a slot of a pool while a command runs.
    ///
    /// Acquires a slot through the lock API, runs CMD while renewing the lease, releases the
    /// slot with CMD's outcome, and exits with CMD's status.
    #[command(after_help = lock::AFTER_HELP)]
    Lock(lock::LockArgs),
    /// Move a node's SQLite store into PostgreSQL (pools, keys, webhook destinations and
    /// unfinished jobs), for `server.store = "postgres://…"`.
    MigrateStore(migrate::MigrateArgs),
}

/// Prints a line of the demo's instructions. Unlike `println!`, which panics when stdout is
/// closed (whoever read it went away), a write error is ignored: it must not stop the server.
macro_rules! say {
    () => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout());
    }};
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Keygen { webhook_secret } => {
            if webhook_secret {
                println!("{}", keys::generate_webhook_secret());
            } else {
                let key = keys::generate_key();
                println!("{key}");
                println!("sha256:{}", keys::hash_hex(&key));
            }
            ExitCode::SUCCESS
        }
        Command::CheckConfig { file } => check_config(&file),
        Command::Serve { config, demo } => run(serve(config, demo)),
        Command::Sandbox {
            listen,
            limit,
            rpm,
            latency_ms,
            jitter_ms,
            tpm,
            token_window_ms,
        } => run(sandbox(
            listen,
            limit,
            rpm,
            latency_ms,
            jitter_ms,
            (tpm, token_window_ms),
        )),
        Command::Lock(args) => lock::main(args),
        Command::MigrateStore(args) => run(migrate::main(args)),
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Logs go to stderr: stdout is for what a command prints on purpose (the demo's commands,
    // `keygen`'s key), so it stays clean enough to pipe.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal, not in files and log collectors.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn run(fut: impl std::future::Future<Output = Result<(), String>>) -> ExitCode {
    init_tracing();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(fut) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn check_config(file: &std::path::Path) -> ExitCode {
    let config = match Config::load(file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}: {e}", file.display());
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = nthbouncer_server::check_config(&config) {
        eprintln!("{}: {e}", file.display());
        return ExitCode::FAILURE;
    }
    println!("{}: ok, {} pool(s)", file.display(), config.pools.len());
    for p in &config.pools {
        let shown = serde_json::to_string(&p.masked()).unwrap_or_default();
        println!("{shown}");
    }
    ExitCode::SUCCESS
}

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

/// Reloads the configuration at each SIGHUP (`systemctl reload`); the outcome is logged.
#[cfg(unix)]
async fn reload_on_sighup(state: Arc<nthbouncer_server::app::state::AppState>) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hangups = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGHUP; reload with POST /admin/reload");
            return;
        }
    };
    while hangups.recv().await.is_some() {
        // The outcome is logged and in /metrics; nobody waits for it here.
        let _ = nthbouncer_server::app::reload::reload(&state, "SIGHUP").await;
    }
}

async fn serve(config_path: Option<PathBuf>, demo: bool) -> Result<(), String> {
    let mut config = match &config_path {
        Some(path) => Config::load(path).map_err(|e| format!("{}: {e}", path.display()))?,
        None => Config::default(),
    };
    let mut demo_lines = None;
    if demo {
        demo_lines = Some(add_demo(&mut config).await?);
    }
    // The demo's pools are not in the file: a reload would remove them, so `--demo` has none.
    let options = nthbouncer_server::Options {
        config_path: config_path.filter(|_| !demo),
        // One connection thread per core, as nginx runs a worker per core.
        connection_threads: Some(std::thread::available_parallelism().map_or(1, |n| n.get())),
        ..Default::default()
    };
    let running = nthbouncer_server::start(config, options)
        .await
        .map_err(|e| e.to_string())?;
    if let Some(print) = demo_lines {
        let listeners = &running.state.pools.listeners;
        print(
            running.addr.port(),
            listeners.addr("demo"),
            listeners.addr(DEMO_DB),
        );
    }
    #[cfg(unix)]
    tokio::spawn(reload_on_sighup(running.state.clone()));
    let token = running.shutdown_token();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("signal received");
        token.cancel();
    });
    running.wait().await;
    tracing::info!("stopped");
    Ok(())
}

/// The printer of the demo's ready-to-paste commands: it needs the bound port and the demo
/// pools' own listeners (`demo`, then `demo-db`).
type DemoLines = Box<dyn FnOnce(u16, Option<SocketAddr>, Option<SocketAddr>)>;

/// The demo's database pool, added when a local PostgreSQL answers.
const DEMO_DB: &str = "demo-db";

/// Where a demo pool gets its own listener: `beside` (8081, 8082) next to the default 8080 when
/// it is free, else any free port the system picks (printed). Only the default ports are
/// predictable: next to any other port, a guess could take a port someone else is about to bind.
fn demo_listen(server_listen: &str, beside: u16) -> String {
    let Ok(addr) = server_listen.parse::<SocketAddr>() else {
        return "127.0.0.1:0".into();
    };
    let next = SocketAddr::new(addr.ip(), beside);
    if addr.port() == 8080 && std::net::TcpListener::bind(next).is_ok() {
        next.to_string()
    } else {
        SocketAddr::new(addr.ip(), 0).to_string()
    }
}

/// Where the demo looks for PostgreSQL: `NTHBOUNCER_DEMO_DATABASE_URL`, else the local server's
/// `postgres` database as the `postgres` user.
fn demo_database_url() -> String {
    std::env::var("NTHBOUNCER_DEMO_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Adds the `demo-db` database pool when PostgreSQL answers at [`demo_database_url`] within a
/// second or two; its address as logs may show it (no password), or why not.
async fn add_demo_database(config: &mut Config, key: &str) -> Result<String, String> {
    let url = demo_database_url();
    let limits = nthbouncer_sqlhttp::Limits {
        max_connections: 1,
        connect_timeout: std::time::Duration::from_secs(1),
        ..Default::default()
    };
    let db = nthbouncer_sqlhttp::Database::new(&url, limits).map_err(|e| e.to_string())?;
    let checked = tokio::time::timeout(std::time::Duration::from_secs(2), db.check()).await;
    db.close();
    match checked {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err("no answer within 2 s".into()),
    }
    if config.pools.iter().any(|p| p.name == DEMO_DB) {
        return Err(format!("the config already has a pool named {DEMO_DB:?}"));
    }
    let mut spec: PoolSpec = serde_json::from_value(serde_json::json!({
        "name": DEMO_DB,
        "kind": "database",
        "upstream": url,
        "keys": [key],
        "listen": demo_listen(&config.server.listen, 8082),
        "async": { "enabled": true },
    }))
    .map_err(|e| e.to_string())?;
    spec.concurrency.limit = 4;
    config.pools.push(spec);
    Ok(db.redacted_url())
}

/// The demo's database lines: the pool's commands, or how to get one.
fn print_demo_database(database: &Result<String, String>, pool: &str, own: Option<SocketAddr>) {
    match database {
        Ok(target) => {
            say!("  # pool `{DEMO_DB}` (limit 4): SQL over HTTP in front of {target}, Neon's wire format:");
            say!("  curl -s {pool}/sql -H \"X-Nthpool-Key: $KEY\" -d '{{\"query\":\"SELECT $1::int + 1 AS n, now()\",\"params\":[41]}}'");
            say!("  curl -s {pool}/sql -H \"X-Nthpool-Key: $KEY\" -H 'X-Nthpool-Async: 1' -d '{{\"query\":\"SELECT pg_sleep(1)\"}}'");
            if let Some(own) = own {
                say!("  # the @neondatabase/serverless driver, on the pool's own listener:");
                say!("  #   neonConfig.fetchEndpoint = 'http://{own}/sql'");
                say!("  #   const sql = neon('postgresql://any:thing@localhost/db', {{ authToken: KEY }})");
            }
        }
        Err(why) => {
            say!(
                "  # no database pool: PostgreSQL did not answer at {} ({why});",
                redact(&demo_database_url())
            );
            say!("  # set NTHBOUNCER_DEMO_DATABASE_URL=postgres://user:password@host/db, or add to the config:");
            say!("  #   [[pools]] name = \"db\", kind = \"database\", upstream = \"env:DATABASE_URL\", keys = [...]");
        }
    }
}

/// A URL as the demo may print it: the password, if any, masked.
fn redact(url: &str) -> String {
    nthbouncer_config::database::mask_database_url(url)
}

/// Starts an in-process sandbox and adds a `demo` pool in front of it, with its own listener
/// too. Returns the printer of the ready-to-paste commands.
async fn add_demo(config: &mut Config) -> Result<DemoLines, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("demo sandbox: {e}"))?;
    let sandbox_addr = listener.local_addr().map_err(|e| e.to_string())?;
    let sandbox_cfg = nthbouncer_sandbox::SandboxConfig {
        limit: 8,
        rpm: 600,
        latency_ms: 200,
        ..Default::default()
    };
    let sandbox = nthbouncer_sandbox::Sandbox::new(sandbox_cfg);
    tokio::spawn(nthbouncer_sandbox::serve(
        listener,
        sandbox,
        std::future::pending(),
    ));

    let key = keys::generate_key();
    if config.pools.iter().any(|p| p.name == "demo") {
        return Err("--demo adds a pool named \"demo\", but the config already has one".into());
    }
    let mut spec: PoolSpec = serde_json::from_value(serde_json::json!({
        "name": "demo",
        "upstream": format!("http://{sandbox_addr}"),
        "keys": [key.clone()],
        "upstream_headers": { "authorization": "Bearer sandbox-managed-credential" },
        "listen": demo_listen(&config.server.listen, 8081),
    }))
    .map_err(|e| e.to_string())?;
    spec.concurrency.limit = 4;
    spec.concurrency.queue_timeout_ms = 10_000;
    config.pools.push(spec);
    let database = add_demo_database(config, &key).await;
    let token = match config.server.admin_token().map_err(|e| e.to_string())? {
        Some(t) => t,
        None => {
            let t = keys::generate_key();
            config.server.admin_token = Some(t.clone());
            t
        }
    };
    let api_host = config.server.api_host.clone();
    let pool_domain = config.server.pool_domain.clone();
    Ok(Box::new(
        move |port: u16, own: Option<SocketAddr>, db_own: Option<SocketAddr>| {
            let pool = format!("http://demo.{pool_domain}:{port}");
            let api = format!("http://{api_host}:{port}");
            say!();
            say!(
            "nthbouncer demo: pool `demo` (limit 4) in front of a sandbox origin at {sandbox_addr}"
        );
            say!("  (hidden limits: 8 concurrent, 600 requests/minute, 200 ms latency)");
            say!();
            say!("  export KEY='{key}'");
            say!("  export ADMIN='{token}'");
            say!();
            say!("  # a proxied call (the sandbox answers like an LLM API):");
            say!("  curl -s {pool}/v1/chat/completions -H \"X-Nthpool-Key: $KEY\" -H 'content-type: application/json' \\");
            say!("       -d '{{\"model\":\"demo\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'");
            say!("  # a streamed answer holds its slot until it ends:");
            say!("  curl -sN '{pool}/stream?chunks=5&interval_ms=300' -H \"X-Nthpool-Key: $KEY\"");
            say!(
            "  # what the upstream received (no X-Nthpool-Key, the managed credential instead):"
        );
            say!("  curl -s {pool}/echo -H \"X-Nthpool-Key: $KEY\"");
            say!("  # 20 at once: at most 4 reach the origin, the rest queue in order:");
            say!("  for i in $(seq 20); do curl -s -o /dev/null -w '%{{http_code}} ' {pool}/v1/chat/completions -H \"X-Nthpool-Key: $KEY\" -d '{{}}' & done; wait; echo");
            say!("  # live governor state:");
            say!("  curl -s {api}/admin/pools/demo/state -H \"Authorization: Bearer $ADMIN\"");
            if let Some(own) = own {
                say!("  # the same pool on its own listener: no Host header needed, so any SDK works");
                say!("  # with a plain base URL (OpenAI's: base_url=\"http://{own}/v1\" and the key as");
                say!("  # default_headers={{\"X-Nthpool-Key\": KEY}}):");
                say!("  curl -s http://{own}/v1/chat/completions -H \"X-Nthpool-Key: $KEY\" -d '{{}}'");
            }
            let db_pool = format!("http://{DEMO_DB}.{pool_domain}:{port}");
            print_demo_database(&database, &db_pool, db_own);
            say!();
        },
    ))
}

async fn sandbox(
    listen: String,
    limit: u32,
    rpm: u32,
    latency_ms: u64,
    jitter_ms: u64,
    (tpm, token_window_ms): (u64, u64),
) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let cfg = nthbouncer_sandbox::SandboxConfig {
        limit,
        rpm,
        latency_ms,
        latency_jitter_ms: jitter_ms,
        tpm,
        token_window_ms,
        ..Default::default()
    };
    let sandbox: Arc<nthbouncer_sandbox::Sandbox> = nthbouncer_sandbox::Sandbox::new(cfg);
    say!("sandbox origin on http://{addr} (limit {limit}, rpm {rpm}, tpm {tpm}, latency {latency_ms}+0..{jitter_ms} ms)");
    say!("  endpoints: POST /v1/chat/completions, /echo, GET /stream?chunks=N&interval_ms=M, /status/CODE, /healthz");
    nthbouncer_sandbox::serve(listener, sandbox, shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}
