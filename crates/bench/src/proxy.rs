//! The proxy overhead benchmark: the same keep-alive `wrk` load against a fast local upstream
//! directly (the baseline) and through each proxy, in rotating order over several rounds so the
//! drift of a shared machine hits every path alike.
//!
//! Before any load, one request through each path must come back `200` with the upstream's
//! exact body, so a proxy that answers errors quickly cannot pass for a fast one; `wrk`'s error
//! counts (including non-2xx answers) are reported too.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::header::{HeaderValue, HOST};
use hyper::{Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::cpu::{per_op, Probe};
use crate::stats::{count, ms, table};
use crate::upstream::BODY;
use crate::BoxError;

/// `NAME=VALUE`, for `--target`, `--host-header` and `--missing`.
#[derive(Clone)]
pub struct Named {
    name: String,
    value: String,
}

impl FromStr for Named {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, value) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected NAME=VALUE"))?;
        Ok(Named {
            name: name.to_string(),
            value: value.to_string(),
        })
    }
}

#[derive(clap::Args)]
pub struct ProxyArgs {
    /// `NAME=URL`, repeated; the first is the baseline (the upstream itself).
    #[arg(long = "target", required = true)]
    targets: Vec<Named>,
    /// `NAME=HOST`: the `Host` header to send to that target (a pool host for nthbouncer).
    #[arg(long = "host-header")]
    hosts: Vec<Named>,
    /// `NAME=REASON`: a peer that could not be run, listed in the table with the reason.
    #[arg(long = "missing")]
    missing: Vec<Named>,
    /// The target compared against every other proxy.
    #[arg(long, default_value = "nthbouncer")]
    subject: String,
    /// A target whose ratios against every other proxy are printed as well (`bench/run`: the
    /// floor proxy, nthbouncer's parts without its features).
    #[arg(long)]
    floor: Option<String>,
    /// Pool key, sent to every target alike (the others ignore it).
    #[arg(long)]
    key: String,
    #[arg(long, default_value = "wrk")]
    wrk: PathBuf,
    /// The Lua script that makes wrk print its summary as one JSON line.
    #[arg(long)]
    wrk_script: PathBuf,
    #[arg(long, default_value_t = 64)]
    connections: u32,
    #[arg(long, default_value_t = 2)]
    wrk_threads: u32,
    /// Length of one measured round of one target.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Measured rounds per target, in rotating order.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// Unmeasured warm-up per target (opens the proxies' upstream connections).
    #[arg(long, default_value_t = 1)]
    warmup_seconds: u64,
    /// `NAME=PID`: the process serving that target (with its children), to report its CPU time
    /// per request. For the baseline, the upstream.
    #[arg(long = "pid")]
    pids: Vec<Named>,
    /// Clock ticks per second of `/proc/*/stat` (`getconf CLK_TCK`).
    #[arg(long, default_value_t = 100)]
    clk_tck: u64,
}

/// What one wrk run reported.
struct WrkRun {
    requests: u64,
    duration_us: u64,
    p50_us: u32,
    p99_us: u32,
    errors: u64,
}

#[derive(Default)]
struct Totals {
    requests: u64,
    duration_us: u64,
    p50_us: Vec<u32>,
    p99_us: Vec<u32>,
    errors: u64,
    cpu: Option<Duration>,
}

impl Totals {
    fn rate(&self) -> f64 {
        self.requests as f64 * 1e6 / (self.duration_us.max(1) as f64)
    }
    fn cpu_per_request(&self) -> Option<f64> {
        let cpu = self.cpu?;
        (self.requests > 0).then(|| cpu.as_secs_f64() / self.requests as f64)
    }
    /// Mean over rounds: wrk's histograms cannot be merged from its summary, and the rounds are
    /// equally long.
    fn mean(v: &[u32]) -> Option<u32> {
        let n = u64::try_from(v.len()).ok().filter(|n| *n > 0)?;
        let sum: u64 = v.iter().map(|x| u64::from(*x)).sum();
        u32::try_from(sum / n).ok()
    }
}

fn host_of<'a>(args: &'a ProxyArgs, name: &str) -> Option<&'a str> {
    args.hosts
        .iter()
        .find(|h| h.name == name)
        .map(|h| h.value.as_str())
}

/// One GET through `url`: it must answer 200 with the upstream's body.
async fn preflight(url: &str, host: Option<&str>, key: &str) -> Result<(), BoxError> {
    let uri: Uri = url.parse()?;
    let authority = uri
        .authority()
        .ok_or_else(|| format!("{url}: no host:port"))?
        .clone();
    let stream = TcpStream::connect(authority.as_str()).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let host = HeaderValue::from_str(host.unwrap_or(authority.as_str()))?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let req = Request::get(path)
        .header(HOST, host)
        .header("x-nthpool-key", key)
        .body(Empty::<Bytes>::new())?;
    let resp = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req)).await??;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if status != StatusCode::OK || body.as_ref() != BODY {
        return Err(format!(
            "{url}: expected 200 with the upstream's body, got {status}: {}",
            String::from_utf8_lossy(&body)
        )
        .into());
    }
    Ok(())
}

async fn wrk(
    args: &ProxyArgs,
    url: &str,
    host: Option<&str>,
    seconds: u64,
) -> Result<WrkRun, BoxError> {
    let mut cmd = tokio::process::Command::new(&args.wrk);
    cmd.arg("-t")
        .arg(args.wrk_threads.to_string())
        .arg("-c")
        .arg(args.connections.to_string())
        .arg("-d")
        .arg(format!("{seconds}s"))
        .arg("--timeout")
        .arg("5s")
        .arg("-s")
        .arg(&args.wrk_script)
        .arg("-H")
        .arg(format!("X-Nthpool-Key: {}", args.key));
    if let Some(h) = host {
        cmd.arg("-H").arg(format!("Host: {h}"));
    }
    cmd.arg(url).kill_on_drop(true);
    // wrk stops itself after `seconds`; the margin only guards against a wedged wrk.
    let out = tokio::time::timeout(Duration::from_secs(seconds + 30), cmd.output()).await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "wrk against {url} failed ({}): {}{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("WRK_JSON "))
        .ok_or_else(|| format!("wrk printed no summary (is --wrk-script right?): {stdout}"))?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let field = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| format!("wrk summary lacks {k}: {line}"))
    };
    let errors = ["connect", "read", "write", "status", "timeout"]
        .iter()
        .map(|k| field(k))
        .sum::<Result<u64, _>>()?;
    Ok(WrkRun {
        requests: field("requests")?,
        duration_us: field("duration_us")?,
        p50_us: u32::try_from(field("p50_us")?)?,
        p99_us: u32::try_from(field("p99_us")?)?,
        errors,
    })
}

pub async fn run(args: ProxyArgs) -> Result<(), BoxError> {
    for t in &args.targets {
        preflight(&t.value, host_of(&args, &t.name), &args.key)
            .await
            .map_err(|e| format!("preflight of {}: {e}", t.name))?;
    }
    let n = args.targets.len();
    let mut totals: Vec<Totals> = (0..n).map(|_| Totals::default()).collect();
    let mut probes = Vec::with_capacity(n);
    for t in &args.targets {
        let pid = args.pids.iter().find(|p| p.name == t.name);
        let probe = match pid {
            Some(p) => Some(Probe::new(
                p.value
                    .parse()
                    .map_err(|_| format!("--pid {}={}: not a pid", p.name, p.value))?,
                args.clk_tck,
            )?),
            None => None,
        };
        probes.push(probe);
    }
    eprintln!(
        "proxy: {} targets, wrk -t{} -c{}: warm-up {} s each, then {} × {} s rounds",
        n, args.wrk_threads, args.connections, args.warmup_seconds, args.rounds, args.seconds
    );
    if args.warmup_seconds > 0 {
        for t in &args.targets {
            wrk(
                &args,
                &t.value,
                host_of(&args, &t.name),
                args.warmup_seconds,
            )
            .await?;
        }
    }
    for round in 0..args.rounds {
        // Rotate the order each round, so no target always runs first (or right after the
        // heaviest one).
        for i in 0..n {
            let idx = (i + round) % n;
            let (Some(t), Some(total), Some(probe)) =
                (args.targets.get(idx), totals.get_mut(idx), probes.get(idx))
            else {
                continue;
            };
            let before = probe.map(|p| p.cpu());
            let r = wrk(&args, &t.value, host_of(&args, &t.name), args.seconds).await?;
            if let (Some(p), Some(before)) = (probe, before) {
                let used = p.cpu().saturating_sub(before);
                total.cpu = Some(total.cpu.unwrap_or_default() + used);
            }
            total.requests += r.requests;
            total.duration_us += r.duration_us;
            total.p50_us.push(r.p50_us);
            total.p99_us.push(r.p99_us);
            total.errors += r.errors;
        }
    }

    let base_p99 = totals.first().and_then(|t| Totals::mean(&t.p99_us));
    let mut rows = Vec::new();
    for (i, (t, total)) in args.targets.iter().zip(&totals).enumerate() {
        let p99 = Totals::mean(&total.p99_us);
        let added = match (i, p99, base_p99) {
            (0, _, _) => "(baseline)".to_string(),
            (_, Some(p), Some(b)) => {
                let d = i64::from(p) - i64::from(b);
                format!(
                    "{}{}",
                    if d < 0 { "-" } else { "+" },
                    ms(d.unsigned_abs() as u32)
                )
            }
            _ => "-".into(),
        };
        rows.push(vec![
            t.name.clone(),
            count(total.rate()),
            Totals::mean(&total.p50_us).map_or("-".into(), ms),
            p99.map_or("-".into(), ms),
            added,
            total.cpu.map_or("-".into(), |c| per_op(c, total.requests)),
            count(total.errors as f64),
        ]);
    }
    for m in &args.missing {
        rows.push(vec![
            m.name.clone(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            format!("not run: {}", m.value),
        ]);
    }
    println!(
        "PROXY  GET, {}-byte body, HTTP/1.1 keep-alive, wrk -t{} -c{}, {} × {} s per path, rotating",
        BODY.len(),
        args.wrk_threads,
        args.connections,
        args.rounds,
        args.seconds
    );
    println!("       peers: nginx and HAProxy as reverse proxies to the same upstream");
    println!();
    print!(
        "{}",
        table(
            &[
                "path",
                "req/s",
                "p50 ms",
                "p99 ms",
                "p99 added vs direct",
                "CPU µs/req",
                "errors"
            ],
            &rows
        )
    );
    println!();
    println!("ratios:");
    print_ratios(&args, &totals, &args.subject, None);
    // The floor (nthbouncer's parts without its features) against the same peers: the share of
    // the gap the stack itself leaves (against the subject it is the line above, inverted).
    if let Some(floor) = &args.floor {
        print_ratios(&args, &totals, floor, Some(&args.subject));
    }
    for m in &args.missing {
        println!("  {}/{} = not measured ({})", args.subject, m.name, m.value);
    }
    let errors: u64 = totals.iter().map(|t| t.errors).sum();
    if errors > 0 {
        println!("WARNING: {errors} requests failed (see the errors column); their paths' numbers are suspect");
    }
    Ok(())
}

/// `name`'s req/s (and CPU per request) against every other target but the baseline and
/// `except`.
fn print_ratios(args: &ProxyArgs, totals: &[Totals], name: &str, except: Option<&str>) {
    let Some(subject) = args
        .targets
        .iter()
        .position(|t| t.name == name)
        .and_then(|i| totals.get(i))
    else {
        return;
    };
    for (i, (t, total)) in args.targets.iter().zip(totals).enumerate() {
        if i == 0 || t.name == name || except == Some(t.name.as_str()) {
            continue;
        }
        let cpu = match (subject.cpu_per_request(), total.cpu_per_request()) {
            (Some(a), Some(b)) => format!("; CPU per request = {:.2}", a / b.max(f64::EPSILON)),
            _ => String::new(),
        };
        println!(
            "  {name}/{}: req/s = {:.2}{cpu}",
            t.name,
            subject.rate() / total.rate().max(f64::EPSILON)
        );
    }
}
