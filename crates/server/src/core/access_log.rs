//! The pool access log's write path: the hot path hands entries to a bounded channel and never
//! waits; one writer task commits them in batches and trims each pool to its bound.
//!
//! Bounds, so that a flood of refusals cannot fill memory nor hold up the store's one writer
//! (lease grants and job intake commit on it too):
//! - a route is cut to [`MAX_ROUTE_BYTES`] (a visible [`CUT_MARKER`] at the end);
//! - authentication refusals (`access::refuse`) of one client address, alike in pool, status,
//!   reason and key, are folded within [`FOLD_WINDOW_MS`] into one row whose `count` says how
//!   many requests it stands for (the first one's route and time);
//! - refusal rows wait at most [`REFUSAL_QUEUE_ROWS`] rows or [`REFUSAL_QUEUE_BYTES`] bytes in
//!   the queue, whichever comes first; past that they are dropped and counted
//!   (`nthbouncer_access_log_refusals_shed_total`). Other rows (admitted requests among them)
//!   are never folded, and have [`QUEUE_ROWS`] rows of room in all: only storage far slower than
//!   traffic drops them (`nthbouncer_access_log_dropped_total`).
//!
//! The writer is the one group-commit writer (`core::batch`), paced: under load it commits at
//! most every 20 ms (unless a batch is full or a flush is asked for); a lone entry after a
//! quiet spell is committed at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use nthbouncer_store::{AccessLogEntry, Store, StoreError};
use tokio::task::JoinHandle;
use tokio::time::Duration;

use crate::core::batch::{BatchConfig, Batcher, Commit};
use crate::core::live::LiveServer;

/// Longest route (method and path) a row keeps, in bytes, marker included.
pub const MAX_ROUTE_BYTES: usize = 512;
/// The end of a route that was cut.
pub const CUT_MARKER: &str = "…[cut]";
/// Refusals alike from one address within this long of the row's first are one row.
pub const FOLD_WINDOW_MS: u64 = 10_000;
/// Refusal rows waiting to be written, at most.
pub const REFUSAL_QUEUE_ROWS: usize = 65_536;
/// Bytes of refusal and other rows waiting to be written past which refusal rows are shed.
pub const REFUSAL_QUEUE_BYTES: usize = 16 << 20;
/// Rows waiting to be written, at most (refusals stop at [`REFUSAL_QUEUE_ROWS`]).
pub const QUEUE_ROWS: usize = REFUSAL_QUEUE_ROWS + 16_384;
/// Fold windows tracked at once; past it, new refusals are written unfolded until windows end.
const MAX_FOLDS: usize = 100_000;

const CONFIG: BatchConfig = BatchConfig {
    capacity: QUEUE_ROWS,
    max_batch: 4096,
    // The shortest time between two commits while entries keep coming.
    min_interval: Some(Duration::from_millis(20)),
};

/// A row on its way, and whether it may be folded with others alike.
pub struct Row {
    entry: AccessLogEntry,
    foldable: bool,
}

/// What queued rows weigh, shared by the hot path (adds) and the writer (subtracts).
#[derive(Default)]
struct Queued {
    rows: AtomicUsize,
    bytes: AtomicUsize,
}

/// About what a row costs in memory while it waits.
fn weight(e: &AccessLogEntry) -> usize {
    128 + e.pool.len()
        + e.key_id.as_ref().map_or(0, String::len)
        + e.client_addr.len()
        + e.route.len()
        + e.outcome.len()
        + e.reason.as_ref().map_or(0, String::len)
        + e.request_id.as_ref().map_or(0, String::len)
}

/// `text` cut to `max` bytes at most, marker included, on a character boundary.
pub fn cut(text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max.saturating_sub(CUT_MARKER.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{CUT_MARKER}", &text[..end])
}

/// Refusals that fold together.
#[derive(Clone, PartialEq, Eq, Hash)]
struct FoldKey {
    pool: String,
    client_addr: String,
    status: u16,
    reason: Option<String>,
    key_id: Option<String>,
}

impl FoldKey {
    fn of(e: &AccessLogEntry) -> FoldKey {
        FoldKey {
            pool: e.pool.clone(),
            client_addr: e.client_addr.clone(),
            status: e.status,
            reason: e.reason.clone(),
            key_id: e.key_id.clone(),
        }
    }
}

/// Where a fold's row is: in the batch being built, or written already.
#[derive(Clone, Copy)]
enum Target {
    Pending(usize),
    Written(u64),
}

#[derive(Clone, Copy)]
struct Fold {
    target: Target,
    /// Epoch ms: refusals at or past it start a new row.
    until: u64,
}

/// Appends rows (folding refusals) and trims each pool to its bound every so often (trimming
/// every batch would double the write load).
struct Append {
    store: Arc<dyn Store>,
    /// `server.access_log_keep` is read from here at each trim (a reload changes it).
    live: Arc<LiveServer>,
    queued: Arc<Queued>,
    /// Appends since the last trim, per pool.
    since_trim: HashMap<String, u64>,
    folds: HashMap<FoldKey, Fold>,
}

impl Append {
    /// Folds the batch's refusals into rows of this batch or into counts of written rows.
    fn fold(&mut self, batch: Vec<Row>) -> (Vec<AccessLogEntry>, HashMap<u64, u64>) {
        let mut rows: Vec<AccessLogEntry> = Vec::with_capacity(batch.len());
        let mut bumps: HashMap<u64, u64> = HashMap::new();
        for Row { entry, foldable } in batch {
            if !foldable {
                rows.push(entry);
                continue;
            }
            let key = FoldKey::of(&entry);
            match self.folds.get(&key) {
                Some(f) if entry.at < f.until => {
                    match f.target {
                        Target::Pending(i) => {
                            if let Some(row) = rows.get_mut(i) {
                                row.count += 1;
                            }
                        }
                        Target::Written(id) => *bumps.entry(id).or_default() += 1,
                    }
                    continue;
                }
                Some(_) => {}
                None if self.folds.len() >= MAX_FOLDS => {
                    rows.push(entry);
                    continue;
                }
                None => {}
            }
            let until = entry.at.saturating_add(FOLD_WINDOW_MS);
            let target = Target::Pending(rows.len());
            self.folds.insert(key, Fold { target, until });
            rows.push(entry);
        }
        (rows, bumps)
    }

    /// After the commit: the batch's new rows are written, at these ids.
    fn settle(&mut self, ids: Option<&[u64]>, newest: u64) {
        self.folds.retain(|_, f| {
            if let Target::Pending(i) = f.target {
                match ids.and_then(|ids| ids.get(i)) {
                    Some(id) => f.target = Target::Written(*id),
                    None => return false,
                }
            }
            f.until > newest
        });
    }

    /// Counts `rows` towards their pools' next trims.
    fn count_for_trim(&mut self, rows: &[AccessLogEntry]) {
        for entry in rows {
            match self.since_trim.get_mut(entry.pool.as_str()) {
                Some(n) => *n += 1,
                None => {
                    self.since_trim.insert(entry.pool.clone(), 1);
                }
            }
        }
    }

    /// Trims the pools whose new rows reached a tenth of what the log keeps.
    async fn trim(&mut self) {
        let keep = self.live.load().access_log_keep;
        let trim_every = (keep / 10).max(100);
        for (pool, n) in self.since_trim.iter_mut() {
            if *n >= trim_every {
                *n = 0;
                if let Err(e) = self.store.trim_access_log(pool, keep).await {
                    tracing::warn!(error = %e, pool = %pool, "access log trim failed");
                }
            }
        }
    }
}

impl Commit for Append {
    type Item = Row;
    type Done = ();
    async fn commit(&mut self, batch: Vec<Row>) -> Result<Vec<()>, StoreError> {
        let n = batch.len();
        let bytes: usize = batch.iter().map(|r| weight(&r.entry)).sum();
        self.queued.rows.fetch_sub(n, Ordering::Relaxed);
        self.queued.bytes.fetch_sub(bytes, Ordering::Relaxed);
        let newest = batch.iter().map(|r| r.entry.at).max().unwrap_or(0);
        let (rows, bumps) = self.fold(batch);
        let bumps: Vec<(u64, u64)> = bumps.into_iter().collect();
        // Counted before the store takes the rows: a batch that then fails to be written
        // counts too, which only brings its pool's next trim forward.
        self.count_for_trim(&rows);
        match self.store.append_access_log_folded(rows, bumps).await {
            Ok(ids) => self.settle(Some(&ids), newest),
            Err(e) => {
                self.settle(None, newest);
                return Err(e);
            }
        }
        self.trim().await;
        Ok(vec![(); n])
    }
}

#[derive(Clone)]
pub struct AccessLog {
    writer: Batcher<Row, ()>,
    queued: Arc<Queued>,
}

impl AccessLog {
    /// Starts the writer. It ends once every `AccessLog` clone is dropped and the queue is drained.
    pub fn start(store: Arc<dyn Store>, live: Arc<LiveServer>) -> (AccessLog, JoinHandle<()>) {
        let queued = Arc::new(Queued::default());
        let append = Append {
            store,
            live,
            queued: queued.clone(),
            since_trim: HashMap::new(),
            folds: HashMap::new(),
        };
        let (writer, task) = Batcher::start(append, CONFIG);
        (AccessLog { writer, queued }, task)
    }

    /// Queues an entry without waiting. `foldable`: an authentication refusal, which may be
    /// folded with others alike, or shed past the refusal bounds.
    pub fn record(&self, entry: AccessLogEntry, foldable: bool) {
        let weight = weight(&entry);
        let rows = self.queued.rows.fetch_add(1, Ordering::Relaxed);
        let bytes = self.queued.bytes.fetch_add(weight, Ordering::Relaxed);
        let shed = foldable
            && (rows >= REFUSAL_QUEUE_ROWS || bytes.saturating_add(weight) > REFUSAL_QUEUE_BYTES);
        if shed || !self.writer.enqueue(Row { entry, foldable }) {
            self.queued.rows.fetch_sub(1, Ordering::Relaxed);
            self.queued.bytes.fetch_sub(weight, Ordering::Relaxed);
            let name = if shed {
                "nthbouncer_access_log_refusals_shed_total"
            } else {
                "nthbouncer_access_log_dropped_total"
            };
            metrics::counter!(name).increment(1);
        }
    }

    /// Waits until every entry recorded so far is committed (tests, shutdown).
    pub async fn flush(&self) {
        self.writer.flush().await;
    }
}

/// What became of a request, as the access log's `outcome` column spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogOutcome {
    /// Admitted by the gate (whatever the upstream then answered): `admitted`.
    Admitted,
    /// Taken as an async job: `202`.
    Accepted,
    /// Answered from the proxy's shared response cache, without a slot: `cache_hit`.
    CacheHit,
    /// Answered by us with this status, never reaching the upstream or failing on the way:
    /// `401`, `429`, `502`, `504`, ….
    Refused(http::StatusCode),
}

impl LogOutcome {
    pub fn as_str(&self) -> &str {
        match self {
            LogOutcome::Admitted => "admitted",
            LogOutcome::Accepted => "202",
            LogOutcome::CacheHit => "cache_hit",
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
    /// `peer`'s address as text when the connection formatted it already (`core::peer`).
    pub peer_text: Option<http::HeaderValue>,
    pub route: String,
    /// The request's id (`core::request_id`).
    pub request_id: Option<String>,
    /// The client certificate of the request's TLS connection (`subject="…" sans=…`), if it
    /// presented one: joins the reason column.
    pub client_cert: Option<String>,
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
        self.record(key_id, outcome, reason, status, queued_ms, upstream, false);
    }

    /// Logs an authentication refusal: foldable with others alike from the same address.
    pub fn write_auth_refusal(self, key_id: Option<&str>, reason: &str, status: http::StatusCode) {
        let outcome = LogOutcome::Refused(status);
        let upstream = UpstreamSeen::default();
        self.record(key_id, outcome, Some(reason), status, 0, upstream, true);
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        self,
        key_id: Option<&str>,
        outcome: LogOutcome,
        reason: Option<&str>,
        status: http::StatusCode,
        queued_ms: u64,
        upstream: UpstreamSeen,
        foldable: bool,
    ) {
        let entry = AccessLogEntry {
            id: 0,
            pool: self.pool.to_string(),
            at: self.at,
            key_id: key_id.map(str::to_string),
            client_addr: match self.peer_text.as_ref().and_then(|t| t.to_str().ok()) {
                Some(text) => text.to_string(),
                None => self.peer.ip().to_string(),
            },
            route: cut(self.route, MAX_ROUTE_BYTES),
            outcome: outcome.as_str().to_string(),
            reason: with_client_cert(reason, self.client_cert.as_deref())
                .map(|r| cut(r, MAX_ROUTE_BYTES)),
            status: status.as_u16(),
            queued_ms,
            upstream_status: upstream.status,
            upstream_latency_ms: upstream.latency_ms,
            count: 1,
            request_id: self.request_id,
        };
        self.log.record(entry, foldable);
    }
}

/// The reason column: the reason, and the client certificate when there was one.
fn with_client_cert(reason: Option<&str>, cert: Option<&str>) -> Option<String> {
    match (reason, cert) {
        (Some(r), Some(c)) => Some(format!("{r}; client certificate {c}")),
        (Some(r), None) => Some(r.to_string()),
        (None, Some(c)) => Some(format!("client certificate {c}")),
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_on_a_character_boundary_with_a_marker() {
        assert_eq!(cut("GET /short".into(), 512), "GET /short");
        let exact = "x".repeat(512);
        assert_eq!(cut(exact.clone(), 512), exact);
        let cut_long = cut("y".repeat(70_000), 512);
        assert_eq!(cut_long.len(), 512);
        assert!(cut_long.ends_with(CUT_MARKER));
        // A two-byte character straddling the cut is left out whole.
        let text = format!("{}é{}", "z".repeat(503), "z".repeat(100));
        let cut_text = cut(text, 512);
        assert_eq!(cut_text, format!("{}{CUT_MARKER}", "z".repeat(503)));
    }
}
