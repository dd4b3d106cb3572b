//! Webhook delivery (SPEC §7): the dispatcher that empties the delivery outbox, the Standard
//! Webhooks signature, and the HTTP client that will not reach private addresses.
//!
//! - The outbox rows are written by the job layer in the same transaction as a job's terminal
//!   state. [`run_dispatcher`] sends them: woken by `AppState::deliveries_pending`, by a finished
//!   attempt, or by the injected clock reaching the next retry (`Clock::sleep_until`), so the
//!   retry schedule is tested by advancing a `ManualClock`, not by waiting hours.
//! - At most [`PER_DESTINATION`] requests are on the wire per destination and [`TOTAL`] overall;
//!   a delivery stays marked in flight (skipped by scans) until its attempt's record commits.
//!   That mark lives only in memory: a crash leaves such deliveries `pending` in the store, and
//!   the next start sends them again (at-least-once; receivers dedupe on `webhook-id`, which is
//!   the job id on every attempt).
//! - Every attempt is recorded (group commit) atomically with its delivery's new state and its
//!   destination's failure streak and deactivation, by [`nthbouncer_store::JobStore::record_attempts`].
//!   A deactivation refreshes the pool's destinations at once, so a pool whose last destination
//!   went falls back to sync.
//! - [`GuardedConnector`] resolves names itself and connects only to addresses that pass
//!   [`crate::core::netcheck::is_private`] (unless `server.allow_private_webhooks`), so the check
//!   applies to the address actually connected to, at every attempt (DNS rebinding). Redirects
//!   are never followed (the client does not follow them; a 3xx is a failed attempt).

pub mod routes;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use base64::prelude::*;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use http::{header, HeaderValue, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use nthbouncer_store::{AttemptApplied, AttemptRecord, DeliveryNext, DueDelivery, JobStore};
use sha2::Sha256;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::{Id as TaskId, JoinSet};

use crate::core::batch::{BatchConfig, Batcher, Commit};
use crate::core::live::LiveServer;
use crate::core::request_id;
use crate::jobs::drain::Entered;
use crate::jobs::JobView;
use crate::jobs::Jobs;
use crate::pools::Pools;

/// Retry delays after the first, second, … failed attempt of a round (SPEC §7): 5 s, 5 min,
/// 30 min, 2 h, 5 h, 10 h, 10 h. After the last one the delivery has failed.
pub const SCHEDULE_MS: [u64; 7] = [
    5_000, 300_000, 1_800_000, 7_200_000, 18_000_000, 36_000_000, 36_000_000,
];
/// Each retry delay is moved by up to ±10 %, so a receiver that came back is not hit by every
/// delivery at the same instant.
pub const JITTER: f64 = 0.1;
/// Attempts in flight per destination.
pub const PER_DESTINATION: usize = 8;
/// Attempts in flight overall.
pub const TOTAL: usize = 64;
/// Deliveries held in memory at once (sending, or sent and waiting for their record's commit).
const HELD_MAX: usize = 4 * TOTAL;
/// A 2xx must arrive within this (connect, send, response head).
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(15);
/// How much of a response body the attempt log keeps.
pub const RESPONSE_KEEP_BYTES: usize = 1024;
/// `User-Agent` of every delivery.
pub const USER_AGENT: &str = concat!("nthbouncer/", env!("CARGO_PKG_VERSION"), " (webhooks)");
/// Attempts recorded in one transaction at most.
const RECORD_BATCH: usize = 256;
/// How often (on the injected clock) deliveries stranded on an inactive destination are failed
/// even if the set of active destinations did not change.
const STRANDED_SWEEP_MS: u64 = 60_000;

type HmacSha256 = Hmac<Sha256>;

/// What the webhooks feature needs: the jobs whose terminal states it delivers (their store,
/// clock and signals), the pools (their destinations) and the server's webhook settings.
pub struct Webhooks {
    pub jobs: Arc<Jobs>,
    pub pools: Arc<Pools>,
    /// The live `[server]` settings (`allow_private_webhooks`, `max_destinations_per_pool`,
    /// `upstream_connect_timeout_ms`).
    pub live: Arc<LiveServer>,
}

/// The HMAC key of a `whsec_` secret (the base64-decoded part after the prefix).
pub fn secret_key(secret: &str) -> Option<Vec<u8>> {
    BASE64_STANDARD
        .decode(secret.strip_prefix("whsec_")?)
        .ok()
        .filter(|k| !k.is_empty())
}

/// One Standard Webhooks signature: `v1,` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")).
pub fn sign(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> Option<String> {
    let mut mac = HmacSha256::new_from_slice(key).ok()?;
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    Some(format!(
        "v1,{}",
        BASE64_STANDARD.encode(mac.finalize().into_bytes())
    ))
}

/// The `webhook-signature` value: one signature per secret, space-separated (during a rotation
/// the new secret's first, then the previous one's).
pub fn signature_header(secrets: &[&str], id: &str, timestamp: u64, body: &[u8]) -> Option<String> {
    let sigs: Vec<String> = secrets
        .iter()
        .filter_map(|s| secret_key(s))
        .filter_map(|k| sign(&k, id, timestamp, body))
        .collect();
    (!sigs.is_empty()).then(|| sigs.join(" "))
}

/// When the delivery is tried next after a failed attempt, if at all: the schedule step of the
/// round's `round_attempts`-th attempt, moved by `jitter` (−1..1 × [`JITTER`]), no earlier than a
/// `Retry-After` hint, and never past the job's `expires_at`.
pub fn next_after_failure(
    round_attempts: u32,
    now: u64,
    hint_ms: Option<u64>,
    expires_at: u64,
    jitter: f64,
) -> DeliveryNext {
    let Some(step) = (round_attempts as usize)
        .checked_sub(1)
        .and_then(|i| SCHEDULE_MS.get(i))
    else {
        return DeliveryNext::Failed;
    };
    let factor = 1.0 + JITTER * jitter.clamp(-1.0, 1.0);
    let delay = ((*step as f64) * factor) as u64;
    let at = now.saturating_add(delay.max(hint_ms.unwrap_or(0)));
    if at > expires_at {
        DeliveryNext::Failed
    } else {
        DeliveryNext::Retry { at }
    }
}

// ---------------------------------------------------------------------------------------------
// The client.

/// A connector that resolves the destination itself and connects only to addresses that are
/// not private (unless allowed): the check covers the address actually connected to.
#[derive(Clone)]
pub struct GuardedConnector {
    /// `server.allow_private_webhooks` and `server.upstream_connect_timeout_ms`, read at each
    /// connection (a reload changes them).
    pub live: Arc<LiveServer>,
}

/// A destination that resolves only to refused addresses.
#[derive(Debug, thiserror::Error)]
#[error(
    "refused: {host} resolves only to loopback, private, link-local, CGNAT or metadata addresses \
     (server.allow_private_webhooks is off)"
)]
pub struct PrivateAddress {
    pub host: String,
}

impl GuardedConnector {
    fn allowed(&self, ip: &IpAddr) -> bool {
        self.live.load().allow_private_webhooks || !crate::core::netcheck::is_private(ip)
    }

    async fn connect(self, uri: Uri) -> io::Result<TokioIo<TcpStream>> {
        let host = uri
            .host()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the URL has no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
            Some("https") => 443,
            _ => 80,
        });
        let resolved: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect(),
        };
        let allowed: Vec<SocketAddr> = resolved
            .into_iter()
            .filter(|a| self.allowed(&a.ip()))
            .collect();
        if allowed.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                PrivateAddress { host },
            ));
        }
        let mut last = None;
        let connect_timeout = self.live.load().upstream_connect_timeout;
        for addr in allowed {
            match tokio::time::timeout(connect_timeout, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => {
                    // Belt and braces: the peer we are connected to is the address we checked.
                    let peer = stream.peer_addr()?;
                    if !self.allowed(&peer.ip()) {
                        return Err(io::Error::new(
                            io::ErrorKind::PermissionDenied,
                            PrivateAddress { host },
                        ));
                    }
                    let _ = stream.set_nodelay(true);
                    return Ok(TokioIo::new(stream));
                }
                Ok(Err(e)) => last = Some(e),
                Err(_) => {
                    last = Some(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("connecting to {addr} timed out"),
                    ))
                }
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no address to connect to")))
    }
}

impl tower::Service<Uri> for GuardedConnector {
    type Response = TokioIo<TcpStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<TcpStream>>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(self.clone().connect(uri))
    }
}

pub type WebhookClient = Client<hyper_rustls::HttpsConnector<GuardedConnector>, Full<Bytes>>;

/// The delivery client: HTTP/1.1 keep-alive, rustls, never follows redirects (hyper does not),
/// through [`GuardedConnector`].
pub fn build_client(live: Arc<LiveServer>) -> Result<WebhookClient, rustls::Error> {
    let connector = GuardedConnector { live };
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())?
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_timer(TokioTimer::new())
        .pool_max_idle_per_host(PER_DESTINATION)
        .build(https))
}

/// `text` cut to at most `max` bytes, on a character boundary.
fn cap(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// An error and its causes, one line (`client error (Connect): refused: …`).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

// ---------------------------------------------------------------------------------------------
// One attempt.

/// What the destination answered.
struct Answer {
    status: StatusCode,
    retry_after: Option<String>,
    location: Option<String>,
    body: Vec<u8>,
}

/// Why an attempt got no answer: its text is the attempt's recorded `error`.
#[derive(Debug, thiserror::Error)]
enum SendError {
    #[error("the poll body could not be encoded: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("the destination's secret is not a valid whsec_ secret")]
    Secret,
    #[error("the destination URL cannot be parsed")]
    Url,
    #[error("the signature is not a valid header value")]
    SignatureHeader,
    #[error("the request could not be built: {0}")]
    Request(#[source] http::Error),
    /// A refused address, a connect or send failure: the whole chain of causes in one line.
    #[error("{}", error_chain(.0))]
    Transport(#[source] hyper_util::client::legacy::Error),
    #[error("no response within {} s", ATTEMPT_TIMEOUT.as_secs())]
    Timeout,
}

/// Sends one delivery. `Err` is a transport failure (refused address, connect error, timeout)
/// or a delivery that cannot be sent at all.
async fn send(client: &WebhookClient, due: &DueDelivery, now: u64) -> Result<Answer, SendError> {
    let body = serde_json::to_vec(&JobView::of(&due.job, now)).map_err(SendError::Encode)?;
    let timestamp = now / 1000;
    let dest = &due.destination;
    let mut secrets = vec![dest.secret.as_str()];
    if let (Some(previous), Some(until)) = (&dest.previous_secret, dest.previous_secret_expires_at)
    {
        if now < until {
            secrets.push(previous.as_str());
        }
    }
    let signature =
        signature_header(&secrets, &due.job.id, timestamp, &body).ok_or(SendError::Secret)?;
    let uri: Uri = dest.url.parse().map_err(|_| SendError::Url)?;
    let mut signature =
        HeaderValue::from_str(&signature).map_err(|_| SendError::SignatureHeader)?;
    signature.set_sensitive(true);
    let mut req = Request::post(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::USER_AGENT, USER_AGENT)
        .header("webhook-id", due.job.id.as_str())
        .header("webhook-timestamp", timestamp)
        .header("webhook-signature", signature)
        .body(Full::new(Bytes::from(body)))
        .map_err(SendError::Request)?;
    // The job's request id (#13), so a receiver can tie the delivery to the request.
    let request_id = due.job.request_id.as_deref();
    if let Some(id) = request_id.and_then(|id| HeaderValue::from_str(id).ok()) {
        req.headers_mut().insert(request_id::HEADER, id);
    }
    let deadline = crate::core::time::now() + ATTEMPT_TIMEOUT;
    let resp = match tokio::time::timeout_at(deadline, client.request(req)).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => return Err(SendError::Transport(e)),
        Err(_) => return Err(SendError::Timeout),
    };
    let (parts, mut incoming) = resp.into_parts();
    let text = |name: header::HeaderName| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let mut answer = Answer {
        status: parts.status,
        retry_after: text(header::RETRY_AFTER),
        location: text(header::LOCATION),
        body: Vec::new(),
    };
    // The head decided the outcome; the start of the body is only for the log, read within what
    // is left of the time budget.
    let keep = async {
        while answer.body.len() < RESPONSE_KEEP_BYTES {
            match incoming.frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        let room = RESPONSE_KEEP_BYTES - answer.body.len();
                        answer.body.extend_from_slice(&data[..data.len().min(room)]);
                    }
                }
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout_at(deadline, keep).await;
    Ok(answer)
}

/// Turns an attempt's answer into its record and the delivery's next state: `sent_at` is when
/// the request was signed and sent (the attempt's time), `now` when it ended (retries count
/// from it).
fn decide(
    due: &DueDelivery,
    answer: Result<Answer, SendError>,
    sent_at: u64,
    now: u64,
    latency_ms: u64,
    jitter: f64,
) -> AttemptRecord {
    let round_attempts = due.round_attempts + 1;
    let expires_at = due.job.expires_at;
    let (status_code, response_body, error, next, gone) = match answer {
        Ok(a) => {
            let code = a.status.as_u16();
            let body = (!a.body.is_empty()).then(|| String::from_utf8_lossy(&a.body).into_owned());
            if a.status.is_success() {
                (Some(code), body, None, DeliveryNext::Delivered, false)
            } else if a.status == StatusCode::GONE {
                (
                    Some(code),
                    body,
                    Some("410 Gone: the destination was deactivated".to_string()),
                    DeliveryNext::Failed,
                    true,
                )
            } else {
                let hint = match a.status {
                    StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => a
                        .retry_after
                        .as_deref()
                        .and_then(|v| nthbouncer_ratelimit::parse_retry_after(v, now)),
                    _ => None,
                };
                let error = if a.status.is_redirection() {
                    Some(match a.location {
                        Some(l) => format!("redirect to {l} not followed"),
                        None => "redirect not followed".to_string(),
                    })
                } else {
                    None
                };
                let next = next_after_failure(round_attempts, now, hint, expires_at, jitter);
                (Some(code), body, error, next, false)
            }
        }
        Err(e) => {
            let next = next_after_failure(round_attempts, now, None, expires_at, jitter);
            (None, None, Some(e.to_string()), next, false)
        }
    };
    AttemptRecord {
        delivery_id: due.id,
        round: due.round,
        job_id: due.job.id.clone(),
        destination_id: due.destination.id.clone(),
        pool: due.job.pool.clone(),
        attempt: due.attempts + 1,
        at: sent_at,
        status_code,
        latency_ms,
        response_body,
        error: error.map(|e| cap(e, RESPONSE_KEEP_BYTES)),
        manual: due.manual,
        next,
        gone,
    }
}

/// One attempt, start to finish: send, decide, record, and refresh the pool's destinations if
/// the destination's streak or state moved.
async fn attempt(
    state: Arc<Webhooks>,
    client: Arc<WebhookClient>,
    recorder: Recorder,
    sent: mpsc::UnboundedSender<u64>,
    due: DueDelivery,
    entered: Entered,
) {
    let started = crate::core::time::now();
    let sent_at = state.jobs.now();
    let answer = send(&client, &due, sent_at).await;
    let latency_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    // The request is over: the destination's slot is free while the result is recorded.
    let _ = sent.send(due.id);
    let jitter = rand::random::<f64>() * 2.0 - 1.0;
    let record = decide(&due, answer, sent_at, state.jobs.now(), latency_ms, jitter);
    let (pool, destination) = (record.pool.clone(), record.destination_id.clone());
    tracing::debug!(%pool, %destination, job = %record.job_id, attempt = record.attempt,
        status = ?record.status_code, next = ?record.next, "webhook attempt");
    let recorded = recorder.submit(record).await;
    // Recorded (or not): a stopping server need not wait for the rest.
    drop(entered);
    match recorded {
        Ok(applied) => {
            if applied.deactivated {
                tracing::warn!(%pool, %destination, "webhook destination deactivated");
            }
            if applied.deactivated || applied.streak_changed {
                if let Some(p) = state.pools.get(&pool) {
                    if let Err(e) = state.pools.refresh_destinations(&p).await {
                        tracing::warn!(%pool, error = %e.message, "refreshing destinations failed");
                    }
                }
            }
        }
        Err(e) => {
            // The delivery stays pending and due: back off before the dispatcher picks it again.
            tracing::warn!(%pool, %destination, error = %e, "recording a webhook attempt failed");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The recorder: group commit of attempt records.

struct RecordAttempts(Arc<dyn JobStore>);

impl Commit for RecordAttempts {
    type Item = AttemptRecord;
    type Done = AttemptApplied;
    async fn commit(
        &mut self,
        records: Vec<AttemptRecord>,
    ) -> Result<Vec<AttemptApplied>, nthbouncer_store::StoreError> {
        self.0.record_attempts(&records).await
    }
}

type Recorder = Batcher<AttemptRecord, AttemptApplied>;

const RECORDER: BatchConfig = BatchConfig {
    capacity: 1024,
    max_batch: RECORD_BATCH,
    min_interval: None,
};

// ---------------------------------------------------------------------------------------------
// The dispatcher.

struct Dispatcher {
    state: Arc<Webhooks>,
    client: Arc<WebhookClient>,
    recorder: Recorder,
    tasks: JoinSet<()>,
    /// Task → (delivery id, destination id), to free both when the task ends however it ends.
    running: HashMap<TaskId, (u64, String)>,
    /// Deliveries whose attempt has not been recorded yet: still `pending` and due in the store,
    /// so a scan must skip them.
    in_flight: HashSet<u64>,
    /// Per destination: deliveries held (as `in_flight`).
    held: HashMap<String, usize>,
    /// Per destination: requests on the wire (the concurrency bound).
    sending: HashMap<String, usize>,
    /// Which held deliveries are still on the wire, and to which destination.
    on_wire: HashMap<u64, String>,
    sent_tx: mpsc::UnboundedSender<u64>,
    /// The active destinations at the last scan (`None` before the first).
    last_active: Option<Vec<String>>,
    last_stranded_sweep: u64,
    /// Which destination the next scan starts with, so none is always served last.
    cursor: usize,
}

impl Dispatcher {
    /// Starts every due attempt there is room for; returns when the next pending delivery is due.
    async fn scan(&mut self) -> nthbouncer_store::Result<Option<u64>> {
        if self.state.jobs.drain.is_draining() {
            return Ok(None); // pending deliveries go out at the next start
        }
        let now = self.state.jobs.now();
        let mut active: Vec<String> = {
            let registry = self.state.pools.snapshot();
            registry
                .pools
                .values()
                .flat_map(|p| {
                    p.destinations
                        .load()
                        .iter()
                        .filter(|d| d.active && d.pool == p.name)
                        .map(|d| d.id.clone())
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        active.sort();
        if self.last_active.as_ref() != Some(&active)
            || now >= self.last_stranded_sweep.saturating_add(STRANDED_SWEEP_MS)
        {
            let failed = self
                .state
                .jobs
                .store
                .fail_undeliverable(&active, now)
                .await?;
            if failed > 0 {
                tracing::info!(
                    deliveries = failed,
                    "deliveries to inactive or deleted destinations failed"
                );
            }
            self.last_active = Some(active.clone());
            self.last_stranded_sweep = now;
        }
        let n = active.len();
        if n > 0 {
            let start = self.cursor % n;
            self.cursor = self.cursor.wrapping_add(1);
            for i in 0..n {
                let id = &active[(start + i) % n];
                let sending = self.sending.get(id).copied().unwrap_or(0);
                let sending_total: usize = self.sending.values().sum();
                let free = PER_DESTINATION
                    .saturating_sub(sending)
                    .min(TOTAL.saturating_sub(sending_total))
                    .min(HELD_MAX.saturating_sub(self.in_flight.len()));
                if free == 0 {
                    continue;
                }
                // Held deliveries are still pending and due in the store: the query skips them.
                let exclude: Vec<u64> = if self.held.contains_key(id) {
                    self.running
                        .values()
                        .filter(|(_, dest)| dest == id)
                        .map(|(delivery, _)| *delivery)
                        .collect()
                } else {
                    Vec::new()
                };
                let limit = u32::try_from(free).unwrap_or(u32::MAX);
                let due = self
                    .state
                    .jobs
                    .store
                    .due_deliveries(id, now, limit, &exclude)
                    .await?;
                for d in due {
                    // Belt and braces: never two attempts of one delivery at once.
                    if self.in_flight.contains(&d.id) {
                        continue;
                    }
                    // A stopping server starts no new attempt (see `jobs::drain`).
                    let Some(entered) = self.state.jobs.drain.enter() else {
                        break;
                    };
                    self.spawn(d, entered);
                }
            }
        }
        let mut next: Option<u64> = None;
        for id in &active {
            if let Some(at) = self.state.jobs.store.next_delivery_at(id, now).await? {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        }
        Ok(next)
    }

    fn spawn(&mut self, due: DueDelivery, entered: Entered) {
        let dest = due.destination.id.clone();
        self.in_flight.insert(due.id);
        *self.held.entry(dest.clone()).or_default() += 1;
        *self.sending.entry(dest.clone()).or_default() += 1;
        self.on_wire.insert(due.id, dest.clone());
        let delivery = due.id;
        let handle = self.tasks.spawn(attempt(
            self.state.clone(),
            self.client.clone(),
            self.recorder.clone(),
            self.sent_tx.clone(),
            due,
            entered,
        ));
        self.running.insert(handle.id(), (delivery, dest));
    }

    /// The request of `delivery` is over (its record may still be committing).
    fn sent(&mut self, delivery: u64) {
        if let Some(dest) = self.on_wire.remove(&delivery) {
            decrement(&mut self.sending, &dest);
        }
    }

    /// The attempt task ended (recorded, failed to record, or panicked).
    fn finished(&mut self, task: TaskId) {
        if let Some((delivery, destination)) = self.running.remove(&task) {
            self.sent(delivery);
            self.in_flight.remove(&delivery);
            decrement(&mut self.held, &destination);
        }
    }
}

fn decrement(counts: &mut HashMap<String, usize>, key: &str) {
    if let Some(n) = counts.get_mut(key) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            counts.remove(key);
        }
    }
}

/// Sends the delivery outbox until the server stops (`Jobs::stopping`). Once the server drains
/// (`Jobs::drain`) no attempt starts; those in flight finish and are recorded within
/// `shutdown_grace_ms`, and any still running after it are abandoned: their deliveries stay
/// pending and go out at the next start.
pub async fn run_dispatcher(state: Arc<Webhooks>) {
    let client = match build_client(state.live.clone()) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            tracing::error!(error = %e, "cannot build the webhook client; webhooks are not sent");
            return;
        }
    };
    let (sent_tx, mut sent_rx) = mpsc::unbounded_channel();
    let mut d = Dispatcher {
        recorder: Batcher::start(RecordAttempts(state.jobs.store.clone()), RECORDER).0,
        state: state.clone(),
        client,
        tasks: JoinSet::new(),
        running: HashMap::new(),
        in_flight: HashSet::new(),
        held: HashMap::new(),
        sending: HashMap::new(),
        on_wire: HashMap::new(),
        sent_tx,
        last_active: None,
        last_stranded_sweep: 0,
        cursor: 0,
    };
    let stopping = state.jobs.stopping.clone();
    loop {
        let wake: Pin<Box<dyn Future<Output = ()> + Send>> = match d.scan().await {
            Ok(Some(at)) => state.jobs.clock.sleep_until(at),
            Ok(None) => Box::pin(std::future::pending()),
            Err(e) => {
                tracing::warn!(error = %e, "webhook dispatcher cannot read the outbox; retrying");
                Box::pin(tokio::time::sleep(Duration::from_secs(1)))
            }
        };
        tokio::select! {
            _ = stopping.cancelled() => break,
            _ = state.jobs.deliveries_pending.notified() => {}
            Some(delivery) = sent_rx.recv() => {
                d.sent(delivery);
                while let Ok(delivery) = sent_rx.try_recv() {
                    d.sent(delivery);
                }
            }
            Some(done) = d.tasks.join_next_with_id(), if !d.tasks.is_empty() => {
                let id = match done {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                };
                d.finished(id);
                while let Some(done) = d.tasks.try_join_next_with_id() {
                    let id = match done {
                        Ok((id, ())) => id,
                        Err(e) => e.id(),
                    };
                    d.finished(id);
                }
            }
            _ = wake => {}
        }
    }
    d.tasks.abort_all();
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// The Standard Webhooks specification's published test vector.
    #[test]
    fn signs_the_standard_webhooks_test_vector() {
        let key = secret_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(
            sign(
                &key,
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#
            )
            .unwrap(),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn two_secrets_give_two_space_separated_signatures() {
        let a = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let b = nthbouncer_config::keys::generate_webhook_secret();
        let both = signature_header(&[&b, a], "msg_1", 7, b"{}").unwrap();
        let parts: Vec<&str> = both.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(
            parts[0],
            sign(&secret_key(&b).unwrap(), "msg_1", 7, b"{}").unwrap()
        );
        assert_eq!(
            parts[1],
            sign(&secret_key(a).unwrap(), "msg_1", 7, b"{}").unwrap()
        );
        assert!(signature_header(&["whsec_", "nope"], "m", 1, b"").is_none());
    }

    #[test]
    fn the_schedule_with_jitter_hints_and_the_deadline() {
        let far = u64::MAX;
        let steps: Vec<DeliveryNext> = (1..=8)
            .map(|k| next_after_failure(k, 1_000, None, far, 0.0))
            .collect();
        let at: Vec<u64> = steps
            .iter()
            .filter_map(|s| match s {
                DeliveryNext::Retry { at } => Some(at - 1_000),
                _ => None,
            })
            .collect();
        assert_eq!(at, SCHEDULE_MS.to_vec());
        assert_eq!(
            steps[7],
            DeliveryNext::Failed,
            "eight attempts, then failed"
        );
        assert_eq!(
            next_after_failure(0, 0, None, far, 0.0),
            DeliveryNext::Failed
        );
        // Jitter stays within ±10 %.
        assert_eq!(
            next_after_failure(1, 0, None, far, 1.0),
            DeliveryNext::Retry { at: 5_500 }
        );
        assert_eq!(
            next_after_failure(1, 0, None, far, -1.0),
            DeliveryNext::Retry { at: 4_500 }
        );
        // A Retry-After hint wins when it is longer, never when shorter.
        assert_eq!(
            next_after_failure(1, 0, Some(60_000), far, 0.0),
            DeliveryNext::Retry { at: 60_000 }
        );
        assert_eq!(
            next_after_failure(2, 0, Some(60_000), far, 0.0),
            DeliveryNext::Retry { at: 300_000 }
        );
        // Never past the job's expiresAt.
        assert_eq!(
            next_after_failure(1, 0, None, 4_999, 0.0),
            DeliveryNext::Failed
        );
        assert_eq!(
            next_after_failure(1, 0, None, 5_000, 0.0),
            DeliveryNext::Retry { at: 5_000 }
        );
    }

    #[tokio::test]
    async fn the_connector_refuses_private_addresses_unless_allowed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let uri: Uri = format!("http://127.0.0.1:{port}/").parse().unwrap();
        let live = |allow_private_webhooks: bool| {
            let server = nthbouncer_config::ServerSpec {
                allow_private_webhooks,
                ..Default::default()
            };
            let settings = crate::core::live::ServerSettings::of(&server, port).unwrap();
            Arc::new(LiveServer::new(settings, port))
        };
        let guarded = GuardedConnector { live: live(false) };
        let e = guarded.clone().connect(uri.clone()).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("refused"), "{e}");
        // A name that resolves to loopback is refused the same way.
        let by_name: Uri = format!("http://localhost:{port}/").parse().unwrap();
        let e = guarded.connect(by_name).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        let allowed = GuardedConnector { live: live(true) };
        allowed.connect(uri).await.unwrap();
    }
}
