//! The token-budget benchmark (issue #22): does a pool keep an origin bound by tokens per minute
//! busy without being refused?
//!
//! `bench/run tokens` starts two `nthbouncer sandbox` origins with the same hidden token budget
//! (default: 60,000 tokens refilling over 10 s, i.e. 6,000 tokens/s; no concurrency or request
//! limit; answers after 200..300 ms) and one nthbouncer with two pools configured far above
//! them: `tokens-on` (learning on, so it admits by the token budget the origin announces) in
//! front of the first sandbox, `tokens-off` (learning off: no token admission) in front of the
//! second. This binary then drives each pool in turn with eager clients sending chat completions
//! of mixed length (prompts of 20..=600 words, `max_tokens` 50..=300, half for an OpenAI model
//! counted with its tokenizer, half for another counted by bytes) and reports, side by side:
//!
//! - **goodput**: tokens the origin served (the `usage` of the successful answers) per second
//!   after the warm-up, as a share of the hidden budget's refill rate;
//! - **origin 429s**: the share of requests that reached the origin and were refused by it.
//!
//! Clients behave as in `converge` (which this shares its client plumbing with): the next
//! request at once after a success, the wait a 429 asks for (at most 10 s) after one. The
//! sandbox charges a request's words plus its `max_tokens` on arrival and gives back what the
//! reply did not use, so the served tokens can reach the refill rate but not pass it for long.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::Request;

use crate::converge::{classify, Class, Conn, REQUEST_TIMEOUT};
use crate::stats::table;
use crate::BoxError;

/// Words the prompts are made of (the sandbox counts words; our estimate counts tokens).
const WORDS: &[&str] = &[
    "the",
    "budget",
    "of",
    "tokens",
    "is",
    "what",
    "an",
    "origin",
    "allows",
    "per",
    "minute",
    "requests",
    "arrive",
    "with",
    "prompts",
    "long",
    "and",
    "short",
    "answers",
    "stream",
    "back",
    "quickly",
    "governor",
    "admits",
    "waits",
    "when",
    "nothing",
    "fits",
    "concurrency",
    "window",
];

#[derive(clap::Args)]
pub struct TokensArgs {
    /// nthbouncer's listen address.
    #[arg(long)]
    nthbouncer: SocketAddr,
    /// A pool key accepted by both pools.
    #[arg(long)]
    key: String,
    /// The pool with token admission on.
    #[arg(long, default_value = "tokens-on")]
    pool_on: String,
    /// The same pool with token admission off, in front of its own identical sandbox.
    #[arg(long, default_value = "tokens-off")]
    pool_off: String,
    #[arg(long, default_value = "localhost")]
    pool_domain: String,
    #[arg(long, default_value_t = 50)]
    clients: usize,
    /// Unmeasured seconds at the start of each run (the full bucket's first burst).
    #[arg(long, default_value_t = 20)]
    warmup_s: u64,
    /// Measured seconds of each run.
    #[arg(long, default_value_t = 60)]
    measure_s: u64,
    /// The sandboxes' hidden token budget and its refill period (must match how they were
    /// started).
    #[arg(long, default_value_t = 60_000)]
    tpm: u64,
    #[arg(long, default_value_t = 10_000)]
    token_window_ms: u64,
}

/// Answers per class, and the tokens the successful ones used.
#[derive(Default)]
struct Counts {
    by_class: [AtomicU64; 5],
    used_tokens: AtomicU64,
}

impl Counts {
    fn get(&self, class: Class) -> u64 {
        self.by_class[class.index()].load(Ordering::Relaxed)
    }

    fn origin_requests(&self) -> u64 {
        self.get(Class::Ok) + self.get(Class::Origin429) + self.get(Class::OtherOrigin)
    }

    fn origin_429_share(&self) -> f64 {
        self.get(Class::Origin429) as f64 / self.origin_requests().max(1) as f64
    }
}

/// What one run counted: the whole run and the measured part.
struct Recorder {
    measured_from: Instant,
    whole: Counts,
    measured: Counts,
}

impl Recorder {
    fn record(&self, class: Class, used: u64) {
        let sets: &[&Counts] = if Instant::now() >= self.measured_from {
            &[&self.whole, &self.measured]
        } else {
            &[&self.whole]
        };
        for c in sets {
            c.by_class[class.index()].fetch_add(1, Ordering::Relaxed);
            c.used_tokens.fetch_add(used, Ordering::Relaxed);
        }
    }
}

/// A small deterministic generator (xorshift64), one per client.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// A chat completion of mixed length.
fn request_body(rng: &mut Rng) -> String {
    let words = 20 + rng.below(581);
    let prompt: Vec<&str> = (0..words)
        .map(|_| WORDS[rng.below(WORDS.len() as u64) as usize])
        .collect();
    let model = if rng.below(2) == 0 {
        "gpt-4o"
    } else {
        "claude-sonnet-4"
    };
    serde_json::json!({
        "model": model,
        "max_tokens": 50 + rng.below(251),
        "messages": [{"role": "user", "content": prompt.join(" ")}],
    })
    .to_string()
}

/// The tokens an answer's body says it used.
fn used_tokens(body: &[u8]) -> u64 {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["usage"]["total_tokens"].as_u64())
        .unwrap_or(0)
}

/// One eager client: always has another request to send.
async fn client(
    args: Arc<TokensArgs>,
    pool: String,
    rec: Arc<Recorder>,
    seed: u64,
    until: Instant,
) {
    let mut conn = Conn {
        addr: args.nthbouncer,
        sender: None,
    };
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let host = format!("{pool}.{}", args.pool_domain);
    while Instant::now() < until {
        let req = Request::post("/v1/chat/completions")
            .header(HOST, host.as_str())
            .header("x-nthpool-key", args.key.as_str())
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(request_body(&mut rng))));
        let Ok(req) = req else {
            return;
        };
        let wait = match tokio::time::timeout(REQUEST_TIMEOUT, conn.send(req)).await {
            Ok(Ok((status, headers, body))) => {
                let class = classify(status, &body);
                let used = if class == Class::Ok {
                    used_tokens(&body)
                } else {
                    0
                };
                rec.record(class, used);
                class.wait_before_next(&headers)
            }
            Ok(Err(_)) | Err(_) => {
                rec.record(Class::Failed, 0);
                conn.sender = None;
                Duration::from_millis(200)
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

async fn run_one(
    args: &Arc<TokensArgs>,
    label: &'static str,
    pool: &str,
) -> (&'static str, Arc<Recorder>) {
    let start = Instant::now();
    let until = start + Duration::from_secs(args.warmup_s + args.measure_s);
    let rec = Arc::new(Recorder {
        measured_from: start + Duration::from_secs(args.warmup_s),
        whole: Counts::default(),
        measured: Counts::default(),
    });
    eprintln!(
        "tokens: {label} pool `{pool}` ({} clients, {} s warm-up + {} s measured)",
        args.clients, args.warmup_s, args.measure_s
    );
    let clients: Vec<_> = (0..args.clients)
        .map(|i| {
            tokio::spawn(client(
                Arc::clone(args),
                pool.to_owned(),
                Arc::clone(&rec),
                i as u64 + 1,
                until,
            ))
        })
        .collect();
    tokio::time::sleep_until(until.into()).await;
    // Answers still on their way are past the measured span; stop waiting for them.
    for c in clients {
        c.abort();
    }
    (label, rec)
}

pub async fn run(args: TokensArgs) -> Result<(), BoxError> {
    if args.tpm == 0 || args.token_window_ms == 0 {
        return Err("the origin has no hidden token budget: nothing to measure".into());
    }
    let args = Arc::new(args);
    let per_s = args.tpm as f64 * 1_000.0 / args.token_window_ms as f64;
    let on = run_one(&args, "token admission on", &args.pool_on).await;
    let off = run_one(&args, "token admission off", &args.pool_off).await;

    println!(
        "TOKENS  hidden budget: {} tokens refilling over {} ms = {:.0} tokens/s; no request or \
         concurrency limit",
        args.tpm, args.token_window_ms, per_s
    );
    println!(
        "{} eager clients, prompts of 20..=600 words and max_tokens 50..=300; measured {} s after \
         a {} s warm-up",
        args.clients, args.measure_s, args.warmup_s
    );
    let secs = args.measure_s as f64;
    let rows: Vec<Vec<String>> = [&on, &off]
        .iter()
        .map(|(label, r)| {
            let m = &r.measured;
            let used = m.used_tokens.load(Ordering::Relaxed) as f64;
            vec![
                (*label).to_owned(),
                format!("{:.2}", m.get(Class::Ok) as f64 / secs),
                format!("{:.0}", used / secs),
                format!("{:.1} %", 100.0 * used / (per_s * secs)),
                m.origin_requests().to_string(),
                m.get(Class::Origin429).to_string(),
                format!("{:.2} %", 100.0 * m.origin_429_share()),
                m.get(Class::Gateway).to_string(),
                (m.get(Class::OtherOrigin) + m.get(Class::Failed)).to_string(),
                format!("{:.2} %", 100.0 * r.whole.origin_429_share()),
            ]
        })
        .collect();
    println!(
        "{}",
        table(
            &[
                "run",
                "ok/s",
                "tokens/s served",
                "goodput (of budget)",
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
    let m = &on.1.measured;
    let goodput = m.used_tokens.load(Ordering::Relaxed) as f64 / (per_s * secs);
    let share = m.origin_429_share();
    println!(
        "{}: goodput {:.1} % (target >= 90 %), origin 429s {:.2} % (target < 1 %): {}",
        on.0,
        100.0 * goodput,
        100.0 * share,
        if goodput >= 0.9 && share < 0.01 {
            "PASS"
        } else {
            "FAIL"
        }
    );
    Ok(())
}
