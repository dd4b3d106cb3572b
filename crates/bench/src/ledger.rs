//! `token-ledger`: Redis's own time per call of the shared token ledger's script
//! (`crates/coord/src/redis/lua/tokens.lua`), for two versions of it side by side (this
//! checkout's and a baseline's, `bench/token-ledger` extracts it from a git revision), against
//! a `redis-server` that nobody else uses (its `INFO commandstats` are server-wide).
//!
//! Scenarios, each run on a fresh database for each script:
//! - `admit` with N settled charges in the window (N = 10 … 3,000), the ledger written in the
//!   charges hash alone, as every version reads it (a first `peek`, not counted, lets a version
//!   with indexes build them);
//! - `finish` and `observe` with 1,000: an announcement without its request, and one answered
//!   by the ledger's oldest charge (all the others admitted after it);
//! - a stream: one client admitting and finishing as fast as it goes on a 2 s window, the first
//!   half of the run a warm-up; Redis time per call and requests a second over the second half,
//!   charges leaving the window on every call.
//!
//! - reports (this version only): a finish and an announcement per request, one per call and
//!   64 per call (`batch`, as a node's reporter sends what it has at hand).
//!
//! Redis time is what the ledger costs every pool coordinated through that Redis; it does not
//! move with the client's speed as a wall-clock rate does.

use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

use crate::BoxError;

#[derive(clap::Args)]
pub struct LedgerArgs {
    /// The Redis to use (its own, database 0 is flushed between runs).
    #[arg(long)]
    redis: String,
    /// `name=file`: a version of the script; give the baseline first.
    #[arg(long = "script", required = true)]
    scripts: Vec<String>,
    /// Calls per scenario (after the first).
    #[arg(long, default_value_t = 30)]
    calls: u32,
    /// Length of the stream scenario (half of it warm-up).
    #[arg(long, default_value_t = 6)]
    stream_seconds: u64,
}

const KEYS: [&str; 5] = [
    "tok:charges",
    "tok:meta",
    "tok:order",
    "tok:ends",
    "tok:blocks",
];
const WINDOW_MS: u64 = 60_000;

async fn call(
    conn: &mut MultiplexedConnection,
    sha: &str,
    args: &[String],
) -> Result<(), BoxError> {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(KEYS.len());
    for k in KEYS {
        cmd.arg(k);
    }
    for a in args {
        cmd.arg(a);
    }
    let _: redis::Value = cmd.query_async(conn).await?;
    Ok(())
}

fn args(op: &str, window_ms: u64, id: &str, rest: &[&str]) -> Vec<String> {
    let mut v = vec![
        op.to_owned(),
        "1000000000".to_owned(),
        window_ms.to_string(),
        "2000".to_owned(),
        id.to_owned(),
    ];
    v.extend(rest.iter().map(|s| (*s).to_owned()));
    v
}

/// `EVALSHA` time in µs per call since the last reset, from `INFO commandstats`.
async fn usec_per_call(conn: &mut MultiplexedConnection) -> Result<f64, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let line = info
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .ok_or("no EVALSHA in INFO commandstats")?;
    let field = |name: &str| -> Result<f64, BoxError> {
        let v = line
            .split([':', ','])
            .find_map(|kv| kv.strip_prefix(name))
            .ok_or("a field is missing from cmdstat_evalsha")?;
        Ok(v.parse()?)
    };
    Ok(field("usec=")? / field("calls=")?)
}

async fn reset(conn: &mut MultiplexedConnection) -> Result<(), BoxError> {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(conn)
        .await?;
    Ok(())
}

/// A fresh ledger of `n` settled charges of 400 tokens spread over the window's last 58 s.
async fn fill(conn: &mut MultiplexedConnection, n: u64) -> Result<(), BoxError> {
    let _: () = redis::cmd("FLUSHDB").query_async(conn).await?;
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    let now = secs * 1000 + micros / 1000;
    let mut pipe = redis::pipe();
    for i in 1..=n {
        let at = now - 59_000 + i * 58_000 / n.max(1);
        pipe.hset(KEYS[0], format!("c{i}"), format!("{i}:{at}:300:100:{i}"))
            .ignore();
    }
    pipe.hset_multiple(KEYS[1], &[("seq", n), ("admitted", 400 * n)])
        .ignore();
    let _: () = pipe.query_async(conn).await?;
    Ok(())
}

async fn scenario(
    conn: &mut MultiplexedConnection,
    sha: &str,
    n: u64,
    calls: u32,
    op: &str,
) -> Result<f64, BoxError> {
    fill(conn, n).await?;
    call(conn, sha, &args("peek", WINDOW_MS, "", &[])).await?;
    reset(conn).await?;
    for k in 0..calls {
        let a = match op {
            "admit" => args("admit", WINDOW_MS, &format!("n{k}"), &["500", "100", "0"]),
            "finish" => args(
                "finish",
                WINDOW_MS,
                &format!("c{}", n.saturating_sub(u64::from(k))),
                &["350", "-1", "-1"],
            ),
            "observe" => args("observe", WINDOW_MS, "", &["t", "100000", "50000", "10000"]),
            // Answered by the ledger's first charge: every other was admitted after it.
            _ => args(
                "observe",
                WINDOW_MS,
                "c1",
                &["t", "100000", "50000", "10000"],
            ),
        };
        call(conn, sha, &a).await?;
    }
    usec_per_call(conn).await
}

/// Redis µs per report (a finish and an announcement per request, 640 requests), sent one per
/// call or `at_once` per call (`batch`, which only this version has).
async fn reports(
    conn: &mut MultiplexedConnection,
    sha: &str,
    at_once: usize,
) -> Result<f64, BoxError> {
    let _: () = redis::cmd("FLUSHDB").query_async(conn).await?;
    let n = 640;
    for k in 0..n {
        call(
            conn,
            sha,
            &args("admit", WINDOW_MS, &format!("r{k}"), &["300", "100", "0"]),
        )
        .await?;
    }
    let mut all = Vec::new();
    for k in 0..n {
        let id = format!("r{k}");
        all.push([
            "finish".to_owned(),
            id.clone(),
            "380".into(),
            "-1".into(),
            "-1".into(),
            "-1".into(),
        ]);
        all.push([
            "observe".to_owned(),
            id,
            "t".into(),
            "1000000".into(),
            "900000".into(),
            "60000".into(),
        ]);
    }
    reset(conn).await?;
    for chunk in all.chunks(at_once) {
        if let [one] = chunk {
            let mut a = args(&one[0], WINDOW_MS, &one[1], &[]);
            a.extend(one[2..].iter().cloned());
            call(conn, sha, &a).await?;
        } else {
            let mut a = args("batch", WINDOW_MS, "", &[]);
            a.extend(chunk.iter().flatten().cloned());
            call(conn, sha, &a).await?;
        }
    }
    let per_call = usec_per_call(conn).await?;
    Ok(per_call * all.chunks(at_once).len() as f64 / all.len() as f64)
}

/// Redis µs per call and requests a second of one client admitting and finishing.
async fn stream(
    conn: &mut MultiplexedConnection,
    sha: &str,
    seconds: u64,
) -> Result<(f64, f64), BoxError> {
    let _: () = redis::cmd("FLUSHDB").query_async(conn).await?;
    let window = 2_000;
    let start = Instant::now();
    let half = Duration::from_millis(seconds * 500);
    let (mut k, mut measured_from) = (0u64, None);
    while start.elapsed() < half * 2 {
        if measured_from.is_none() && start.elapsed() >= half {
            reset(conn).await?;
            measured_from = Some((k, Instant::now()));
        }
        let id = format!("n{k}");
        call(conn, sha, &args("admit", window, &id, &["500", "100", "0"])).await?;
        call(
            conn,
            sha,
            &args("finish", window, &id, &["550", "-1", "-1"]),
        )
        .await?;
        k += 1;
    }
    let (k0, t0) = measured_from.ok_or("the stream ran too short to measure")?;
    let rate = (k - k0) as f64 / t0.elapsed().as_secs_f64();
    Ok((usec_per_call(conn).await?, rate))
}

pub async fn run(a: LedgerArgs) -> Result<(), BoxError> {
    let client = redis::Client::open(a.redis.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut versions = Vec::new();
    for s in &a.scripts {
        let (name, file) = s.split_once('=').ok_or("--script takes name=file")?;
        let body = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(body)
            .query_async(&mut conn)
            .await?;
        versions.push((name.to_owned(), sha));
    }
    let mut head = format!("{:<28}", "scenario (Redis µs/call)");
    for (name, _) in &versions {
        head.push_str(&format!("{name:>14}"));
    }
    if versions.len() == 2 {
        head.push_str(&format!("{:>10}", "old/new"));
    }
    println!(
        "TOKEN LEDGER  Redis's own time per EVALSHA (INFO commandstats), {} calls per row",
        a.calls
    );
    println!("{head}");
    let mut rows: Vec<(String, u64, &str)> = [10, 100, 300, 1_000, 3_000]
        .iter()
        .map(|&n| (format!("admit, {n} in window"), n, "admit"))
        .collect();
    rows.push(("finish, 1000 in window".to_owned(), 1_000, "finish"));
    rows.push(("observe, 1000 in window".to_owned(), 1_000, "observe"));
    rows.push((
        "observe, answered 1000 ago".to_owned(),
        1_000,
        "observe-old",
    ));
    for (label, n, op) in &rows {
        let mut line = format!("{label:<28}");
        let mut got = Vec::new();
        for (_, sha) in &versions {
            let us = scenario(&mut conn, sha, *n, a.calls, op).await?;
            line.push_str(&format!("{us:>14.0}"));
            got.push(us);
        }
        if let [old, new] = got[..] {
            line.push_str(&format!("{:>9.1}×", old / new));
        }
        println!("{line}");
    }
    let mut line = format!("{:<28}", "stream, 2 s window");
    let mut rates = format!("{:<28}", "  requests/s, one client");
    for (_, sha) in &versions {
        let (us, rate) = stream(&mut conn, sha, a.stream_seconds).await?;
        line.push_str(&format!("{us:>14.0}"));
        rates.push_str(&format!("{rate:>14.0}"));
    }
    println!("{line}");
    println!("{rates}");
    if let Some((name, sha)) = versions.last() {
        let one = reports(&mut conn, sha, 1).await?;
        let many = reports(&mut conn, sha, 64).await?;
        println!(
            "reports ({name}): finish + announcement per request, Redis µs per report: \
             {one:.0} one per call, {many:.0} 64 per call ({:.1}× less)",
            one / many
        );
    }
    let _: () = redis::cmd("FLUSHDB").query_async(&mut conn).await?;
    Ok(())
}
