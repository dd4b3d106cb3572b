//! The pool access log's write path: the hot path hands entries to a bounded channel and never
//! waits; one writer task commits them in batches and trims each pool to its bound.
//!
//! When the channel is full (storage far slower than traffic), entries are dropped and counted
//! (`nthbouncer_access_log_dropped_total`) rather than slowing admission.
//!
//! Under load the writer commits at most once per `MIN_COMMIT_INTERVAL` (unless a batch is
//! full or a flush is asked for): a commit costs about as much as a few hundred rows, so many
//! tiny batches would cost more than the rows themselves. A lone entry after a quiet spell is
//! committed at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use nthbouncer_store::{AccessLogEntry, Store};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{Duration, Instant};

const CHANNEL_CAPACITY: usize = 65_536;
const MAX_BATCH: usize = 4096;
/// The shortest time between two commits while entries keep coming.
const MIN_COMMIT_INTERVAL: Duration = Duration::from_millis(20);

enum Msg {
    Entry(AccessLogEntry),
    /// Answered once everything queued before it is committed.
    Flush(oneshot::Sender<()>),
}

#[derive(Clone)]
pub struct AccessLog {
    tx: mpsc::Sender<Msg>,
}

impl AccessLog {
    /// Starts the writer. It ends once every `AccessLog` clone is dropped and the queue is drained.
    pub fn start(store: Arc<dyn Store>, keep_per_pool: u64) -> (AccessLog, JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
        let task = tokio::spawn(writer(store, rx, keep_per_pool));
        (AccessLog { tx }, task)
    }

    /// Queues an entry without waiting.
    pub fn record(&self, entry: AccessLogEntry) {
        if self.tx.try_send(Msg::Entry(entry)).is_err() {
            metrics::counter!("nthbouncer_access_log_dropped_total").increment(1);
        }
    }

    /// Waits until every entry recorded so far is committed (tests, shutdown).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// What became of a request, as the access log's `outcome` column spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogOutcome {
    /// Admitted by the gate (whatever the upstream then answered): `admitted`.
    Admitted,
    /// Taken as an async job: `202`.
    Accepted,
    /// Answered by us with this status, never reaching the upstream or failing on the way:
    /// `401`, `429`, `502`, `504`, ….
    Refused(http::StatusCode),
}

impl LogOutcome {
    pub fn as_str(&self) -> &str {
        match self {
            LogOutcome::Admitted => "admitted",
            LogOutcome::Accepted => "202",
            LogOutcome::Refused(status) => status.as_str(),
        }
    }
}

/// What the upstream answered, when it was reached.
#[derive(Clone, Copy, Debug, Default)]
pub struct UpstreamSeen {
    pub status: Option<u16>,
    pub latency_ms: Option<u64>,
}

/// One request's line, filled in as the request goes; [`LogLine::write`] queues it.
pub struct LogLine<'a> {
    pub log: &'a AccessLog,
    pub pool: &'a str,
    /// Epoch ms when the request arrived.
    pub at: u64,
    pub peer: SocketAddr,
    pub route: String,
}

impl LogLine<'_> {
    /// Logs a request refused before it was admitted, with the answer's status as its
    /// outcome, and returns that answer.
    pub fn refuse(
        self,
        key_id: Option<&str>,
        e: crate::core::error::ApiError,
    ) -> axum::response::Response {
        let status = e.status;
        let queued_ms = e.gate.map_or(0, |g| g.queued_ms);
        self.write(
            key_id,
            LogOutcome::Refused(status),
            None,
            status,
            queued_ms,
            UpstreamSeen::default(),
        );
        axum::response::IntoResponse::into_response(e)
    }

    pub fn write(
        self,
        key_id: Option<&str>,
        outcome: LogOutcome,
        reason: Option<&str>,
        status: http::StatusCode,
        queued_ms: u64,
        upstream: UpstreamSeen,
    ) {
        self.log.record(AccessLogEntry {
            id: 0,
            pool: self.pool.to_string(),
            at: self.at,
            key_id: key_id.map(str::to_string),
            client_addr: self.peer.ip().to_string(),
            route: self.route,
            outcome: outcome.as_str().to_string(),
            reason: reason.map(str::to_string),
            status: status.as_u16(),
            queued_ms,
            upstream_status: upstream.status,
            upstream_latency_ms: upstream.latency_ms,
        });
    }
}

async fn writer(store: Arc<dyn Store>, mut rx: mpsc::Receiver<Msg>, keep: u64) {
    let mut msgs = Vec::with_capacity(MAX_BATCH);
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut flushes = Vec::new();
    // Appends since the last trim, per pool: trimming every batch would double the write load.
    let mut since_trim: HashMap<String, u64> = HashMap::new();
    let trim_every = (keep / 10).max(100);
    let mut last_commit: Option<Instant> = None;
    while rx.recv_many(&mut msgs, MAX_BATCH).await > 0 {
        // Let the batch fill until the commit interval has passed since the last commit, unless
        // it is full, someone waits for a flush, or the log is closing.
        if let Some(last) = last_commit {
            let until = last + MIN_COMMIT_INTERVAL;
            while msgs.len() < MAX_BATCH && !msgs.iter().any(|m| matches!(m, Msg::Flush(_))) {
                let room = MAX_BATCH - msgs.len();
                tokio::select! {
                    biased;
                    n = rx.recv_many(&mut msgs, room) => if n == 0 { break },
                    () = tokio::time::sleep_until(until) => break,
                }
            }
        }
        for msg in msgs.drain(..) {
            match msg {
                Msg::Entry(e) => batch.push(e),
                Msg::Flush(done) => flushes.push(done),
            }
        }
        if batch.is_empty() {
            flushes.drain(..).for_each(|f| {
                let _ = f.send(());
            });
            continue;
        }
        last_commit = Some(Instant::now());
        if let Err(e) = store.append_access_log(&batch).await {
            tracing::warn!(error = %e, entries = batch.len(), "access log batch lost");
        }
        for entry in &batch {
            match since_trim.get_mut(entry.pool.as_str()) {
                Some(n) => *n += 1,
                None => {
                    since_trim.insert(entry.pool.clone(), 1);
                }
            }
        }
        for (pool, n) in since_trim.iter_mut() {
            if *n >= trim_every {
                *n = 0;
                if let Err(e) = store.trim_access_log(pool, keep).await {
                    tracing::warn!(error = %e, pool = %pool, "access log trim failed");
                }
            }
        }
        batch.clear();
        flushes.drain(..).for_each(|f| {
            let _ = f.send(());
        });
    }
}
