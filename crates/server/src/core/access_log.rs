//! The pool access log's write path: the hot path hands entries to a bounded channel and never
//! waits; one writer task commits them in batches and trims each pool to its bound.
//!
//! When the channel is full (storage far slower than traffic), entries are dropped and counted
//! (`nthbouncer_access_log_dropped_total`) rather than slowing admission.
//!
//! The writer is the one group-commit writer (`core::batch`), paced: under load it commits at
//! most every 20 ms (unless a batch is full or a flush is asked for); a lone entry after a
//! quiet spell is committed at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use nthbouncer_store::{AccessLogEntry, Store, StoreError};
use tokio::task::JoinHandle;
use tokio::time::Duration;

use crate::core::batch::{BatchConfig, Batcher, Commit};

const CONFIG: BatchConfig = BatchConfig {
    capacity: 65_536,
    max_batch: 4096,
    // The shortest time between two commits while entries keep coming.
    min_interval: Some(Duration::from_millis(20)),
};

/// Appends rows and trims each pool to its bound every so often (trimming every batch would
/// double the write load).
struct Append {
    store: Arc<dyn Store>,
    keep: u64,
    /// Appends since the last trim, per pool.
    since_trim: HashMap<String, u64>,
}

impl Commit for Append {
    type Item = AccessLogEntry;
    type Done = ();
    async fn commit(&mut self, batch: Vec<AccessLogEntry>) -> Result<Vec<()>, StoreError> {
        self.store.append_access_log(&batch).await?;
        for entry in &batch {
            match self.since_trim.get_mut(entry.pool.as_str()) {
                Some(n) => *n += 1,
                None => {
                    self.since_trim.insert(entry.pool.clone(), 1);
                }
            }
        }
        let trim_every = (self.keep / 10).max(100);
        for (pool, n) in self.since_trim.iter_mut() {
            if *n >= trim_every {
                *n = 0;
                if let Err(e) = self.store.trim_access_log(pool, self.keep).await {
                    tracing::warn!(error = %e, pool = %pool, "access log trim failed");
                }
            }
        }
        Ok(vec![(); batch.len()])
    }
}

#[derive(Clone)]
pub struct AccessLog(Batcher<AccessLogEntry, ()>);

impl AccessLog {
    /// Starts the writer. It ends once every `AccessLog` clone is dropped and the queue is drained.
    pub fn start(store: Arc<dyn Store>, keep_per_pool: u64) -> (AccessLog, JoinHandle<()>) {
        let append = Append {
            store,
            keep: keep_per_pool,
            since_trim: HashMap::new(),
        };
        let (batcher, task) = Batcher::start(append, CONFIG);
        (AccessLog(batcher), task)
    }

    /// Queues an entry without waiting.
    pub fn record(&self, entry: AccessLogEntry) {
        if !self.0.enqueue(entry) {
            metrics::counter!("nthbouncer_access_log_dropped_total").increment(1);
        }
    }

    /// Waits until every entry recorded so far is committed (tests, shutdown).
    pub async fn flush(&self) {
        self.0.flush().await;
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
