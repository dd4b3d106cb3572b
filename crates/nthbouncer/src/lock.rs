//! `nthbouncer lock`: holds a slot of a pool for the lifetime of a command (SPEC §11). It owns
//! the mapping between the lock API and a process: acquire → run CMD with inherited stdio while
//! the client's guard renews → release with CMD's exit status as the outcome → exit with CMD's
//! status; and, when no slot could be had, a one-line message and a sysexits-style code.

use std::ffi::OsString;
use std::io::ErrorKind;
use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use nthbouncer_client::{AcquireOptions, LeaseState, LockClient, LockError, Outcome, Priority};
use tokio::process::Child;

/// Exit codes of our own, used only when CMD did not run or its status is unknown (sysexits.h
/// where one fits).
mod code {
    /// Invalid --api, --key or --host (clap's own usage errors exit 2 as well).
    pub const USAGE: u8 = 2;
    /// EX_NOHOST: no such pool on that gateway (or the wrong --host).
    pub const NO_POOL: u8 = 68;
    /// EX_SOFTWARE: waiting for CMD failed, so its status is unknown (the slot is released).
    pub const LOST_TRACK: u8 = 70;
    /// EX_UNAVAILABLE: the gateway could not be reached.
    pub const UNREACHABLE: u8 = 69;
    /// EX_TEMPFAIL: no free slot (429) or the wait ran out (504); try again later.
    pub const NO_SLOT: u8 = 75;
    /// EX_PROTOCOL: the gateway answered something we do not understand.
    pub const PROTOCOL: u8 = 76;
    /// EX_NOPERM: the gateway refused the key (401/403).
    pub const UNAUTHORIZED: u8 = 77;
    /// The shell's "found but cannot be run".
    pub const CANNOT_RUN: u8 = 126;
    /// The shell's "command not found".
    pub const NOT_FOUND: u8 = 127;
}

/// Printed after `nthbouncer lock --help`.
pub const AFTER_HELP: &str = "\
Example:
  export NTHBOUNCER_KEY='nb_live_…'
  nthbouncer lock --api http://api.localhost:8080 --pool prod-acme --wait-ms 30000 -- ./sync.sh

When --api names the gateway by IP, pass its API host: --api http://10.0.0.5:8080 --host api.localhost

Outcome reported on release (it feeds the pool's adaptive learning):
  CMD exits 0          status 200 (a success)
  CMD exits non-zero   status 500 (a failure that neither shrinks nor grows the learned limit)
  CMD killed by signal no outcome

If the lease is lost (reclaimed) or capped (reached the pool's request timeout) while CMD runs, a
warning is printed and CMD keeps running: only CMD knows whether stopping half-way is safe. Bound
long commands yourself (for example with timeout(1)) below the pool's request_timeout_ms.
SIGTERM is forwarded to CMD; SIGINT (Ctrl-C) reaches CMD from the terminal, and nthbouncer waits for
CMD to exit and then releases the slot.

Exit status:
  CMD's own exit status when CMD ran (128+N when signal N killed it). Otherwise:
    75   no free slot (the pool is full, or --wait-ms passed with no slot opening)
    77   the gateway refused the key (401/403)
    68   no such pool (check --pool, and --host when --api names the gateway by IP)
    69   the gateway could not be reached
    76   the gateway answered something unexpected
    126  CMD could not be started; 127 CMD was not found (the slot is released)
    70   waiting for CMD failed, its status is unknown (the slot is released)
    2    usage error";

/// Arguments of `nthbouncer lock`.
#[derive(clap::Args)]
pub struct LockArgs {
    /// Base URL of the gateway's API host (names under localhost resolve to 127.0.0.1).
    #[arg(long, value_name = "URL")]
    api: String,
    /// The pool to take a slot of.
    #[arg(long, value_name = "NAME")]
    pool: String,
    /// The pool key.
    #[arg(
        long,
        value_name = "KEY",
        env = "NTHBOUNCER_KEY",
        hide_env_values = true
    )]
    key: String,
    /// Wait up to N ms in the pool's queue for a slot (clamped to its queue_timeout_ms).
    /// Without it, fail at once when the pool is full.
    #[arg(long, value_name = "N")]
    wait_ms: Option<u64>,
    /// Queue class: high, normal (default) or low.
    #[arg(long, value_name = "CLASS", value_parser = parse_priority)]
    priority: Option<Priority>,
    /// Host header to send (the gateway's api_host, e.g. api.localhost) when --api names the
    /// gateway by IP or by another name.
    #[arg(long, value_name = "HOST")]
    host: Option<String>,
    /// The command to run while holding the slot, and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

fn parse_priority(s: &str) -> Result<Priority, String> {
    s.parse()
}

/// Runs `nthbouncer lock`.
pub fn main(args: LockArgs) -> ExitCode {
    init_tracing();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nthbouncer lock: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    ExitCode::from(runtime.block_on(lock(args)))
}

/// Warnings and errors only, and on stderr: stdout belongs to CMD.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .init();
}

async fn lock(args: LockArgs) -> u8 {
    let pool = args.pool.clone();
    let client = LockClient::new(&args.api, args.pool, &args.key).and_then(|c| match &args.host {
        Some(host) => c.with_host(host),
        None => Ok(c),
    });
    let client = match client {
        Ok(c) => c,
        Err(e) => {
            eprintln!("nthbouncer lock: {e}");
            return code::USAGE;
        }
    };
    let options = AcquireOptions {
        wait: args.wait_ms.map(Duration::from_millis),
        priority: args.priority,
    };
    let guard = match client.acquire_with(options).await {
        Ok(g) => g,
        Err(e) => {
            let (message, code) = refusal(&e, &pool, &args.api, args.wait_ms);
            eprintln!("nthbouncer lock: {message}");
            return code;
        }
    };

    // `last = true` and `required = true` guarantee a program name.
    let Some((program, rest)) = args.command.split_first() else {
        return code::USAGE;
    };
    let mut child = match tokio::process::Command::new(program).args(rest).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "nthbouncer lock: cannot run {}: {e}",
                program.to_string_lossy()
            );
            if let Err(e) = guard.release(None).await {
                eprintln!("nthbouncer lock: warning: could not release the slot: {e}");
            }
            return match e.kind() {
                ErrorKind::NotFound => code::NOT_FOUND,
                _ => code::CANNOT_RUN,
            };
        }
    };

    let status = supervise(&mut child, &guard, &pool).await;
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            // Waiting on our own child failed: nothing is known of its outcome.
            eprintln!("nthbouncer lock: cannot wait for the command: {e}");
            if let Err(e) = guard.release(None).await {
                eprintln!("nthbouncer lock: warning: could not release the slot: {e}");
            }
            return code::LOST_TRACK;
        }
    };
    let outcome = match status.code() {
        Some(0) => Some(Outcome::from_status(200)),
        Some(_) => Some(Outcome::from_status(500)),
        None => None,
    };
    if let Err(e) = guard.release(outcome).await {
        eprintln!(
            "nthbouncer lock: warning: could not release the slot ({e}); the gateway reclaims it within one lease term"
        );
    }
    exit_code(status)
}

/// The message and exit code for an acquire that got no slot.
fn refusal(e: &LockError, pool: &str, api: &str, wait_ms: Option<u64>) -> (String, u8) {
    match e {
        LockError::NoSlot { retry_after } => {
            let hint = retry_after
                .map(|d| format!(" (retry after {} s)", d.as_millis().div_ceil(1000)))
                .unwrap_or_default();
            (format!("no free slot in pool {pool:?}{hint}"), code::NO_SLOT)
        }
        LockError::QueueTimeout { waited } => {
            let waited = waited
                .map(|d| d.as_millis())
                .or(wait_ms.map(u128::from))
                .map(|ms| format!(" {ms} ms"))
                .unwrap_or_default();
            (
                format!("waited{waited} in pool {pool:?}, no slot opened"),
                code::NO_SLOT,
            )
        }
        LockError::Unauthorized { status, message } => (
            format!("the gateway refused the key for pool {pool:?} ({status}: {message})"),
            code::UNAUTHORIZED,
        ),
        LockError::PoolNotFound => (
            format!("no pool {pool:?} at {api} (check --pool, and --host when --api names the gateway by IP)"),
            code::NO_POOL,
        ),
        LockError::Http(err) => (
            format!("cannot reach the gateway at {api}: {}", chain(err)),
            code::UNREACHABLE,
        ),
        LockError::Unexpected { .. } => (format!("{e}"), code::PROTOCOL),
        LockError::Config(_) => (format!("{e}"), code::USAGE),
        // `LockError` may grow; anything new is a protocol surprise to this version.
        _ => (format!("{e}"), code::PROTOCOL),
    }
}

/// An error and its causes on one line (reqwest's own message names only the URL).
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Waits for CMD while the guard renews: warns once if the lease ends early, forwards SIGTERM,
/// and outlives Ctrl-C so the slot is released after CMD exits.
async fn supervise(
    child: &mut Child,
    guard: &nthbouncer_client::SlotGuard,
    pool: &str,
) -> std::io::Result<ExitStatus> {
    let mut lease = guard.watch();
    let mut warned = false;
    // A lease capped from the start (term not shorter than the request timeout) never changes.
    if guard.state() != LeaseState::Held {
        warn_lease(guard.state(), pool);
        warned = true;
    }
    let mut signals = Signals::new();
    loop {
        tokio::select! {
            status = child.wait() => return status,
            changed = lease.changed(), if !warned => {
                if changed.is_err() {
                    warned = true;
                    continue;
                }
                let state = *lease.borrow_and_update();
                if state != LeaseState::Held {
                    warn_lease(state, pool);
                    warned = true;
                }
            }
            forward = signals.next() => {
                if forward {
                    forward_term(child);
                }
            }
        }
    }
}

fn warn_lease(state: LeaseState, pool: &str) {
    match state {
        LeaseState::Lost => eprintln!(
            "nthbouncer lock: warning: the slot in pool {pool:?} was lost (the gateway reclaimed it); the command keeps running without it"
        ),
        LeaseState::Capped => eprintln!(
            "nthbouncer lock: warning: the slot in pool {pool:?} was capped at the pool's request timeout and will be reclaimed then; the command keeps running"
        ),
        LeaseState::Held | LeaseState::Released => {}
    }
}

/// CMD's exit code, or 128+N when signal N killed it (as shells report it).
fn exit_code(status: ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        return u8::try_from(code).unwrap_or(1);
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return u8::try_from(128 + sig).unwrap_or(255);
        }
    }
    1
}

/// SIGTERM and SIGINT while CMD runs. Listening replaces their default action (dying), which
/// would leave the slot to lapse instead of being released.
struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn new() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Signals {
                term: signal(SignalKind::terminate()).ok(),
                int: signal(SignalKind::interrupt()).ok(),
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    /// The next signal: `true` for one to forward to CMD (SIGTERM), `false` for one CMD got
    /// already (SIGINT goes to the terminal's whole foreground process group).
    async fn next(&mut self) -> bool {
        #[cfg(unix)]
        {
            tokio::select! {
                () = next_of(&mut self.term) => true,
                () = next_of(&mut self.int) => false,
            }
        }
        #[cfg(not(unix))]
        {
            std::future::pending::<bool>().await
        }
    }
}

/// Resolves on the next delivery; never, once the stream has ended.
#[cfg(unix)]
async fn next_of(signal: &mut Option<tokio::signal::unix::Signal>) {
    loop {
        match signal {
            Some(s) => {
                if s.recv().await.is_some() {
                    return;
                }
                *signal = None;
            }
            None => std::future::pending::<()>().await,
        }
    }
}

#[cfg(unix)]
fn forward_term(child: &Child) {
    let pid = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .and_then(rustix::process::Pid::from_raw);
    if let Some(pid) = pid {
        if let Err(e) = rustix::process::kill_process(pid, rustix::process::Signal::TERM) {
            tracing::warn!(error = %e, "cannot forward SIGTERM to the command");
        }
    }
}

#[cfg(not(unix))]
fn forward_term(_child: &Child) {}
