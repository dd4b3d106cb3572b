//! The lock benchmark: acquire+release pairs per second against nthbouncer's lock API (HTTP/1.1
//! keep-alive, one connection per client task), side by side with the usual home-grown
//! alternative, a Redis Lua semaphore, at the same concurrency.
//!
//! The Redis semaphore is the common pattern: one sorted set of leases per semaphore, scored by
//! lease deadline; `acquire` drops expired leases and adds a random id if fewer than `limit`
//! remain, `renew` pushes an existing lease's deadline, `release` removes it. All three are Lua
//! scripts run with `EVALSHA` (redis-rs loads them on the first `NOSCRIPT`). It has no queue: a
//! refused caller sleeps and retries, like the libraries that implement it.
//!
//! Each pool scenario runs both systems in alternating rounds (so drift of a shared machine hits
//! both), after an unmeasured warm-up. Every task counts itself as a holder between the grant
//! and the release request, so the count seen client-side never exceeds the real number of
//! holders: if it exceeds the limit, the system under test broke its limit.

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderValue, CONTENT_TYPE, HOST};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Script};
use tokio::net::TcpStream;

use crate::cpu::{per_op, Probe};
use crate::stats::{count, ms, percentile, table};
use crate::BoxError;

/// Drops expired leases, then takes a slot if one is free. KEYS[1] = the set; ARGV = now (ms),
/// lease term (ms), limit, lease id. Returns 1 when granted, 0 when full.
const ACQUIRE_LUA: &str = r"
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]), ARGV[4])
  return 1
end
return 0
";

/// Pushes a live lease's deadline. ARGV = now (ms), lease term (ms), lease id. Returns 1 when
/// renewed, 0 when the lease is gone or already expired (someone else may hold the slot now).
const RENEW_LUA: &str = r"
local deadline = redis.call('ZSCORE', KEYS[1], ARGV[3])
if not deadline or tonumber(deadline) <= tonumber(ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', tonumber(ARGV[1]) + tonumber(ARGV[2]), ARGV[3])
return 1
";

/// Removes a lease. ARGV = lease id. Returns 1 when it was held.
const RELEASE_LUA: &str = r"
return redis.call('ZREM', KEYS[1], ARGV[1])
";

/// No single request may take longer than this; a hung server fails the run instead of
/// hanging it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// `POOL=LIMIT`: a pool of the running nthbouncer and the limit it was configured with.
#[derive(Clone)]
pub struct PoolArg {
    name: String,
    limit: u32,
}

impl FromStr for PoolArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, limit) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected POOL=LIMIT"))?;
        let limit = limit
            .parse()
            .map_err(|_| format!("{s:?}: LIMIT must be a positive integer"))?;
        Ok(PoolArg {
            name: name.to_string(),
            limit,
        })
    }
}

#[derive(clap::Args)]
pub struct LockArgs {
    /// Address of the running nthbouncer.
    #[arg(long)]
    nthbouncer: SocketAddr,
    /// Its API host (the `Host` of lock requests).
    #[arg(long, default_value = "api.localhost")]
    api_host: String,
    /// A key of every `--pool`.
    #[arg(long)]
    key: String,
    #[arg(long, default_value = "redis://127.0.0.1:6379/")]
    redis: String,
    /// `POOL=LIMIT`, repeated: one scenario each. The Redis semaphore gets the same limit.
    #[arg(long = "pool", required = true)]
    pools: Vec<PoolArg>,
    /// Client tasks, each with its own connection.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Length of one measured round of one system.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Measured rounds per system and scenario, alternating which system goes first.
    #[arg(long, default_value_t = 4)]
    rounds: u32,
    /// Unmeasured warm-up per system, before the first round.
    #[arg(long, default_value_t = 1.0)]
    warmup_seconds: f64,
    /// How long a refused Redis caller sleeps before retrying (redis-semaphore's default).
    #[arg(long, default_value_t = 10)]
    redis_retry_ms: u64,
    /// `waitMs` of each nthbouncer acquire: the caller queues in nthbouncer instead of retrying.
    #[arg(long, default_value_t = 10_000)]
    wait_ms: u64,
    /// Lease term of the Redis semaphore (nthbouncer's default `lease_term_ms`).
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
    /// Further scenarios for each pool whose limit is below the client tasks: every grant is
    /// held this long (a sleep) before its release, as a caller working under the lock would.
    /// Comma-separated; 0 (the lock API's bare overhead) always runs. With a hold, a slot the
    /// Redis semaphore frees stays idle until some refused caller's retry comes round, where
    /// nthbouncer hands it to the next queued caller at once.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    hold_ms: Vec<u64>,
    /// Upper bound on the pairs of one run, whatever the duration.
    #[arg(long, default_value_t = 5_000_000)]
    max_pairs: u64,
    /// Pid of the nthbouncer process, to report its CPU time per pair.
    #[arg(long)]
    nthbouncer_pid: Option<u32>,
    /// Pid of redis-server, likewise.
    #[arg(long)]
    redis_pid: Option<u32>,
    /// Clock ticks per second of `/proc/*/stat` (`getconf CLK_TCK`).
    #[arg(long, default_value_t = 100)]
    clk_tck: u64,
}

/// One system under test, seen from one client task.
trait Locker: Send + 'static {
    /// `Some(lease id)` when granted; `None` when refused (full, or the wait ran out).
    fn acquire(&mut self) -> impl Future<Output = Result<Option<String>, BoxError>> + Send;
    /// `true` when the lease was still held.
    fn renew(&mut self, id: &str) -> impl Future<Output = Result<bool, BoxError>> + Send;
    /// `true` when the lease was still held.
    fn release(&mut self, id: String) -> impl Future<Output = Result<bool, BoxError>> + Send;
}

/// One keep-alive connection to nthbouncer's API host.
struct NbLocker {
    sender: SendRequest<Full<Bytes>>,
    host: HeaderValue,
    key: HeaderValue,
    pool: String,
    acquire_body: Bytes,
    /// `x-nthpool-effective-limit` of the last grant, to check the pool is the one we think.
    effective_limit: Option<u32>,
}

impl NbLocker {
    async fn connect(args: &LockArgs, pool: &str) -> Result<Self, BoxError> {
        let stream = TcpStream::connect(args.nthbouncer).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        // The connection task ends when the sender is dropped; its error, if any, surfaces
        // through the next request on the sender.
        tokio::spawn(conn);
        Ok(NbLocker {
            sender,
            host: HeaderValue::from_str(&args.api_host)?,
            key: HeaderValue::from_str(&args.key)?,
            pool: pool.to_string(),
            acquire_body: Bytes::from(format!("{{\"waitMs\":{}}}", args.wait_ms)),
            effective_limit: None,
        })
    }

    async fn post(
        &mut self,
        path: String,
        body: Bytes,
    ) -> Result<(StatusCode, hyper::HeaderMap, Bytes), BoxError> {
        self.sender.ready().await?;
        let req = Request::post(path)
            .header(HOST, self.host.clone())
            .header("x-nthpool-key", self.key.clone())
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(body))?;
        let resp = self.sender.send_request(req).await?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok((parts.status, parts.headers, body))
    }
}

fn unexpected(what: &str, status: StatusCode, body: &[u8]) -> BoxError {
    format!(
        "{what}: unexpected {status}: {}",
        String::from_utf8_lossy(body)
    )
    .into()
}

impl Locker for NbLocker {
    async fn acquire(&mut self) -> Result<Option<String>, BoxError> {
        let path = format!("/pools/{}/lock/acquire", self.pool);
        let (status, headers, body) = self.post(path, self.acquire_body.clone()).await?;
        match status {
            StatusCode::OK => {
                self.effective_limit = headers
                    .get("x-nthpool-effective-limit")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok());
                let grant: serde_json::Value = serde_json::from_slice(&body)?;
                match grant.get("slotId").and_then(|v| v.as_str()) {
                    Some(id) => Ok(Some(id.to_string())),
                    None => Err(unexpected("acquire: no slotId", status, &body)),
                }
            }
            StatusCode::TOO_MANY_REQUESTS | StatusCode::GATEWAY_TIMEOUT => Ok(None),
            _ => Err(unexpected("acquire", status, &body)),
        }
    }

    async fn renew(&mut self, id: &str) -> Result<bool, BoxError> {
        let path = format!("/pools/{}/lock/{id}/renew", self.pool);
        let (status, _, body) = self.post(path, Bytes::new()).await?;
        match status {
            StatusCode::OK => Ok(true),
            StatusCode::NOT_FOUND | StatusCode::CONFLICT => Ok(false),
            _ => Err(unexpected("renew", status, &body)),
        }
    }

    async fn release(&mut self, id: String) -> Result<bool, BoxError> {
        let path = format!("/pools/{}/lock/{id}/release", self.pool);
        let (status, _, body) = self.post(path, Bytes::new()).await?;
        if status != StatusCode::OK {
            return Err(unexpected("release", status, &body));
        }
        let answer: serde_json::Value = serde_json::from_slice(&body)?;
        Ok(answer.get("released").and_then(|v| v.as_bool()) == Some(true))
    }
}

/// The three scripts, shared by every task (each holds its SHA-1).
struct Scripts {
    acquire: Script,
    renew: Script,
    release: Script,
}

/// One connection to Redis (a task of its own, as each nthbouncer task has its own HTTP
/// connection: no pipelining across tasks on either side).
struct RedisLocker {
    conn: MultiplexedConnection,
    scripts: Arc<Scripts>,
    set: String,
    limit: u32,
    lease_ms: u64,
    ids: RandomState,
    next_id: u64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl RedisLocker {
    async fn connect(
        client: &redis::Client,
        scripts: Arc<Scripts>,
        set: &str,
        limit: u32,
        lease_ms: u64,
    ) -> Result<Self, BoxError> {
        // redis-rs gives up on an answer after 500 ms by default; a loaded 2-core machine can
        // exceed that without anything being wrong.
        let config = AsyncConnectionConfig::new().set_response_timeout(Some(REQUEST_TIMEOUT));
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        Ok(RedisLocker {
            conn,
            scripts,
            set: set.to_string(),
            limit,
            lease_ms,
            ids: RandomState::new(),
            next_id: 0,
        })
    }

    /// A fresh 128-bit lease id: SipHash under this task's random keys of a counter.
    fn fresh_id(&mut self) -> String {
        self.next_id += 1;
        let a = self.ids.hash_one(self.next_id);
        let b = self.ids.hash_one(!self.next_id);
        format!("{a:016x}{b:016x}")
    }
}

impl Locker for RedisLocker {
    async fn acquire(&mut self) -> Result<Option<String>, BoxError> {
        let id = self.fresh_id();
        let granted: i64 = self
            .scripts
            .acquire
            .key(&self.set)
            .arg(now_ms())
            .arg(self.lease_ms)
            .arg(self.limit)
            .arg(&id)
            .invoke_async(&mut self.conn)
            .await?;
        Ok((granted == 1).then_some(id))
    }

    async fn renew(&mut self, id: &str) -> Result<bool, BoxError> {
        let renewed: i64 = self
            .scripts
            .renew
            .key(&self.set)
            .arg(now_ms())
            .arg(self.lease_ms)
            .arg(id)
            .invoke_async(&mut self.conn)
            .await?;
        Ok(renewed == 1)
    }

    async fn release(&mut self, id: String) -> Result<bool, BoxError> {
        let removed: i64 = self
            .scripts
            .release
            .key(&self.set)
            .arg(id)
            .invoke_async(&mut self.conn)
            .await?;
        Ok(removed == 1)
    }
}

/// Shared by the tasks of one run.
#[derive(Default)]
struct Shared {
    holders: AtomicI64,
    max_holders: AtomicI64,
    /// Pairs still allowed in this run (the count bound).
    budget: AtomicU64,
}

#[derive(Default)]
struct TaskResult {
    pairs: u64,
    refused: u64,
    /// Releases that found the lease gone (reclaimed early): must stay 0.
    lost: u64,
    latencies_us: Vec<u32>,
    /// Time spent holding grants (the sleep as the timer actually ran it, when held).
    held: Duration,
}

/// Runs `until` the deadline (or the pair budget runs out): acquire (retrying after `retry`
/// when refused), count the holder, release. A pair's latency runs from its first acquire
/// attempt to the release answer, so retries and queueing are in it.
async fn task<L: Locker>(
    mut locker: L,
    shared: Arc<Shared>,
    until: Instant,
    retry: Duration,
    hold: Duration,
) -> Result<TaskResult, BoxError> {
    let mut out = TaskResult::default();
    'pairs: while Instant::now() < until {
        if shared
            .budget
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| b.checked_sub(1))
            .is_err()
        {
            break;
        }
        let started = Instant::now();
        let id = loop {
            match tokio::time::timeout(REQUEST_TIMEOUT, locker.acquire()).await?? {
                Some(id) => break id,
                None => {
                    out.refused += 1;
                    if Instant::now() >= until {
                        break 'pairs;
                    }
                    tokio::time::sleep(retry).await;
                }
            }
        };
        let now = shared.holders.fetch_add(1, Ordering::SeqCst) + 1;
        shared.max_holders.fetch_max(now, Ordering::SeqCst);
        // Hold across at least one scheduling point, so the other tasks' grants that arrived
        // meanwhile overlap with this one and the count sees them; without it a
        // single-threaded client would never see two holders at once and the check would
        // prove nothing.
        if hold.is_zero() {
            tokio::task::yield_now().await;
        } else {
            // The timer rounds up to its millisecond ticks: what was really held is measured.
            let held_from = Instant::now();
            tokio::time::sleep(hold).await;
            out.held += held_from.elapsed();
        }
        // Stop counting before the release is sent: the server may hand the slot on as soon as
        // the request arrives, and the count must never include a holder that already let go.
        shared.holders.fetch_sub(1, Ordering::SeqCst);
        if !tokio::time::timeout(REQUEST_TIMEOUT, locker.release(id)).await?? {
            out.lost += 1;
        }
        out.pairs += 1;
        out.latencies_us
            .push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
    }
    Ok(out)
}

/// What one system did over all rounds of one scenario.
#[derive(Default)]
struct Totals {
    pairs: u64,
    refused: u64,
    lost: u64,
    elapsed: Duration,
    /// CPU time of the server process during the runs (when its pid was given).
    cpu: Option<Duration>,
    max_holders: i64,
    latencies_us: Vec<u32>,
    /// Pairs of each task, summed over rounds (task i of every round together).
    per_task: Vec<u64>,
    held: Duration,
}

impl Totals {
    fn rate(&self) -> f64 {
        self.pairs as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }
}

/// How one run goes: its length, the Redis retry pause, how long each grant is held, the pair
/// bound, the server to measure.
#[derive(Clone, Copy)]
struct RunSpec {
    seconds: f64,
    retry: Duration,
    hold: Duration,
    max_pairs: u64,
    server: Option<Probe>,
}

/// Runs `lockers` concurrently for `spec.seconds` and adds what they did to `totals`.
async fn run_once<L: Locker>(
    lockers: Vec<L>,
    spec: RunSpec,
    totals: &mut Totals,
) -> Result<(), BoxError> {
    let RunSpec {
        seconds,
        retry,
        hold,
        max_pairs,
        server,
    } = spec;
    let shared = Arc::new(Shared {
        budget: AtomicU64::new(max_pairs),
        ..Shared::default()
    });
    let cpu_before = server.map(|p| p.cpu());
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(seconds);
    let handles: Vec<_> = lockers
        .into_iter()
        .map(|l| tokio::spawn(task(l, shared.clone(), until, retry, hold)))
        .collect();
    let mut results = Vec::with_capacity(handles.len());
    for h in handles {
        results.push(h.await??);
    }
    // Pairs that began before the deadline still count, so the clock stops when the last one
    // ended, not at the deadline.
    totals.elapsed += start.elapsed();
    if let (Some(p), Some(before)) = (server, cpu_before) {
        let used = p.cpu().saturating_sub(before);
        totals.cpu = Some(totals.cpu.unwrap_or_default() + used);
    }
    totals.max_holders = totals
        .max_holders
        .max(shared.max_holders.load(Ordering::SeqCst));
    totals
        .per_task
        .resize(results.len().max(totals.per_task.len()), 0);
    for (i, r) in results.into_iter().enumerate() {
        totals.pairs += r.pairs;
        totals.refused += r.refused;
        totals.lost += r.lost;
        if let Some(t) = totals.per_task.get_mut(i) {
            *t += r.pairs;
        }
        totals.latencies_us.extend(r.latencies_us);
        totals.held += r.held;
    }
    Ok(())
}

/// Opens the connections before the clock starts, so connection setup is not measured.
async fn nb_lockers(args: &LockArgs, pool: &str) -> Result<Vec<NbLocker>, BoxError> {
    let mut out = Vec::with_capacity(args.concurrency);
    for _ in 0..args.concurrency {
        out.push(NbLocker::connect(args, pool).await?);
    }
    Ok(out)
}

async fn redis_lockers(
    args: &LockArgs,
    client: &redis::Client,
    scripts: &Arc<Scripts>,
    set: &str,
    limit: u32,
) -> Result<Vec<RedisLocker>, BoxError> {
    let mut out = Vec::with_capacity(args.concurrency);
    for _ in 0..args.concurrency {
        out.push(RedisLocker::connect(client, scripts.clone(), set, limit, args.lease_ms).await?);
    }
    Ok(out)
}

/// acquire → renew → release → release again, on one connection: both systems must grant,
/// renew, release, and answer the second release with "not held". Hands the locker back so
/// the caller can read what the grant said (nthbouncer's effective limit).
async fn sanity<L: Locker>(what: &str, mut l: L) -> Result<L, BoxError> {
    let id = l
        .acquire()
        .await?
        .ok_or_else(|| format!("{what}: the first acquire of an idle pool was refused"))?;
    if !l.renew(&id).await? {
        return Err(format!("{what}: renew of a held lease failed").into());
    }
    if !l.release(id.clone()).await? {
        return Err(format!("{what}: release of a held lease said it was not held").into());
    }
    if l.release(id).await? {
        return Err(format!("{what}: a second release said the lease was still held").into());
    }
    Ok(l)
}

pub async fn run(args: LockArgs) -> Result<(), BoxError> {
    // Connected as a node connects (TCP_NODELAY): the semaphore's calls are one at a time per
    // connection, so it should not matter, and the two sides stay alike.
    let client = nthbouncer_coord::redis::client_for(&args.redis)?;
    let scripts = Arc::new(Scripts {
        acquire: Script::new(ACQUIRE_LUA),
        renew: Script::new(RENEW_LUA),
        release: Script::new(RELEASE_LUA),
    });
    let nb_probe = args
        .nthbouncer_pid
        .map(|pid| Probe::new(pid, args.clk_tck))
        .transpose()?;
    let redis_probe = args
        .redis_pid
        .map(|pid| Probe::new(pid, args.clk_tck))
        .transpose()?;
    let nb_spec = |seconds, hold| RunSpec {
        seconds,
        retry: Duration::ZERO,
        hold,
        max_pairs: args.max_pairs,
        server: nb_probe,
    };
    let redis_spec = |seconds, hold| RunSpec {
        seconds,
        retry: Duration::from_millis(args.redis_retry_ms),
        hold,
        max_pairs: args.max_pairs,
        server: redis_probe,
    };
    let mut rows = Vec::new();
    let mut summary = Vec::new();
    let mut all_ok = true;
    // Each pool bare (hold 0), then each pool callers queue on with every extra hold.
    let mut scenarios: Vec<(&PoolArg, u64)> = args.pools.iter().map(|p| (p, 0)).collect();
    for pool in args
        .pools
        .iter()
        .filter(|p| (p.limit as usize) < args.concurrency)
    {
        scenarios.extend(args.hold_ms.iter().filter(|&&h| h > 0).map(|&h| (pool, h)));
    }
    for (pool, hold_ms) in scenarios {
        let hold = Duration::from_millis(hold_ms);
        // A set of our own per scenario and run, so a shared redis-server's other keys are
        // never touched and a crashed run's leftovers never count against the next.
        let set = format!(
            "nthbouncer-bench:{}:{}:{}:{hold_ms}",
            std::process::id(),
            now_ms(),
            pool.name
        );

        let mut probe = NbLocker::connect(&args, &pool.name).await?;
        probe = sanity("nthbouncer", probe).await?;
        if let Some(effective) = probe.effective_limit {
            if effective != pool.limit {
                return Err(format!(
                    "pool {:?} has effective limit {effective}, not the {} given with --pool",
                    pool.name, pool.limit
                )
                .into());
            }
        }
        drop(probe);
        let probe =
            RedisLocker::connect(&client, scripts.clone(), &set, pool.limit, args.lease_ms).await?;
        let mut probe = sanity("redis", probe).await?;

        eprintln!(
            "lock: pool {} (limit {}), {} tasks, each grant held {hold_ms} ms: warm-up {:.1} s each, then {} × {:.1} s rounds",
            pool.name, pool.limit, args.concurrency, args.warmup_seconds, args.rounds, args.seconds
        );
        let mut nb = Totals::default();
        let mut rd = Totals::default();
        if args.warmup_seconds > 0.0 {
            let mut discard = Totals::default();
            let l = nb_lockers(&args, &pool.name).await?;
            run_once(l, nb_spec(args.warmup_seconds, hold), &mut discard).await?;
            let l = redis_lockers(&args, &client, &scripts, &set, pool.limit).await?;
            run_once(l, redis_spec(args.warmup_seconds, hold), &mut discard).await?;
        }
        for round in 0..args.rounds {
            for nb_turn in [round % 2 == 0, round % 2 == 1] {
                if nb_turn {
                    let l = nb_lockers(&args, &pool.name).await?;
                    run_once(l, nb_spec(args.seconds, hold), &mut nb).await?;
                } else {
                    let l = redis_lockers(&args, &client, &scripts, &set, pool.limit).await?;
                    run_once(l, redis_spec(args.seconds, hold), &mut rd).await?;
                }
            }
        }
        // Every lease was released: the set must be empty again.
        let left: u64 = redis::cmd("ZCARD")
            .arg(&set)
            .query_async(&mut probe.conn)
            .await?;
        let _: i64 = redis::cmd("DEL")
            .arg(&set)
            .query_async(&mut probe.conn)
            .await?;

        let mut scenario = if pool.limit as usize >= args.concurrency {
            format!("limit {} ≥ {} tasks", pool.limit, args.concurrency)
        } else {
            format!("limit {} < {} tasks", pool.limit, args.concurrency)
        };
        if hold_ms > 0 {
            scenario.push_str(&format!(", each held {hold_ms} ms"));
        }
        for (name, t, extra_lost) in [("nthbouncer", &mut nb, 0), ("redis lua", &mut rd, left)] {
            t.latencies_us.sort_unstable();
            let held_ok = t.max_holders <= i64::from(pool.limit) && t.lost + extra_lost == 0;
            all_ok &= held_ok;
            let min = t.per_task.iter().min().copied().unwrap_or(0);
            let max = t.per_task.iter().max().copied().unwrap_or(0);
            rows.push(vec![
                if name == "nthbouncer" {
                    scenario.clone()
                } else {
                    String::new()
                },
                name.to_string(),
                count(t.rate()),
                percentile(&t.latencies_us, 50.0).map_or("-".into(), ms),
                percentile(&t.latencies_us, 99.0).map_or("-".into(), ms),
                format!(
                    "{} / {} {}",
                    t.max_holders,
                    pool.limit,
                    if held_ok { "ok" } else { "EXCEEDED" }
                ),
                count(t.refused as f64),
                format!("{}..{}", count(min as f64), count(max as f64)),
                t.cpu.map_or("-".into(), |c| per_op(c, t.pairs)),
            ]);
        }
        let cpu_ratio = match (nb.cpu, rd.cpu) {
            (Some(a), Some(b)) if nb.pairs > 0 && rd.pairs > 0 => format!(
                "; server CPU per pair nthbouncer/redis = {:.2}",
                (a.as_secs_f64() / nb.pairs as f64)
                    / (b.as_secs_f64() / rd.pairs as f64).max(f64::EPSILON)
            ),
            _ => String::new(),
        };
        summary.push(format!(
            "  {scenario}: pairs/s nthbouncer/redis = {:.2}{cpu_ratio}",
            nb.rate() / rd.rate().max(f64::EPSILON)
        ));
        if hold_ms > 0 {
            // The most any system can do: every slot busy holding, none idle between holders,
            // at the hold the timer really gave (both systems' holds together).
            let pairs = nb.pairs + rd.pairs;
            let mean_hold = (nb.held + rd.held).as_secs_f64() / (pairs.max(1) as f64);
            if mean_hold > 0.0 {
                summary.push(format!(
                    "    held {:.2} ms on average: at most {} pairs/s; nthbouncer {:.0} %, redis {:.0} % of that",
                    mean_hold * 1000.0,
                    count(f64::from(pool.limit) / mean_hold),
                    100.0 * nb.rate() * mean_hold / f64::from(pool.limit),
                    100.0 * rd.rate() * mean_hold / f64::from(pool.limit),
                ));
            }
        }
    }
    println!(
        "LOCK  acquire+release pairs, {} client tasks (one connection each), {} × {:.0} s per system, alternating",
        args.concurrency, args.rounds, args.seconds
    );
    println!(
        "      peer: Redis Lua semaphore (sorted set of leases, EVALSHA; refused callers retry after {} ms)",
        args.redis_retry_ms
    );
    println!(
        "      nthbouncer callers queue server-side (waitMs {})",
        args.wait_ms
    );
    println!(
        "      each grant held across one yield; in the \"each held\" rows for that long (a sleep),"
    );
    println!("      as a caller working under the lock would");
    println!();
    print!(
        "{}",
        table(
            &[
                "scenario",
                "system",
                "pairs/s",
                "p50 ms",
                "p99 ms",
                "max holders / limit",
                "refused",
                "pairs per task",
                "server CPU µs/pair",
            ],
            &rows,
        )
    );
    println!();
    println!("ratios:");
    for line in summary {
        println!("{line}");
    }
    println!(
        "limit check (holders counted client-side, every lease released): {}",
        if all_ok { "PASS" } else { "FAIL" }
    );
    if all_ok {
        Ok(())
    } else {
        Err("a system exceeded its limit or lost a lease".into())
    }
}
