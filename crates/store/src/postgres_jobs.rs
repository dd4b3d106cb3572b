//! [`JobStore`] on PostgreSQL: the `jobs`, `job_events`, `webhook_destinations`, `deliveries` and
//! `delivery_attempts` tables (schema v1 in `postgres.rs`). Request and result heads are JSON
//! text, as on SQLite; bodies are `BYTEA`.
//!
//! The invariants are SQLite's: a batch of jobs is committed (synchronously) before
//! `insert_jobs` returns; a job's terminal state, its history step and its outbox rows commit
//! together; an attempt's result applies only while its attempt number holds the job (fencing);
//! a delivery attempt's result applies only to the round it started in. What several nodes add:
//! deliveries and jobs are claimed under `FOR UPDATE SKIP LOCKED` with a claim lease
//! ([`crate::postgres::CLAIM_LEASE_MS`] unless told otherwise), so two nodes never work on one row at once while its claimant lives.

use tokio_postgres::Row;

use crate::jobs::{delivery_status, status};
use crate::postgres::{
    big, exec, get, get_opt_u, get_u, query, query_one, query_opt, rows, Ctx, PgStore,
};
use crate::sqlite_jobs::{encode, RequestHead, ResultHead};
use crate::{
    AttemptApplied, AttemptEnd, AttemptQuery, AttemptRecord, DeliveryAttempt, DeliveryNext,
    DeliveryState, DueDelivery, Finish, JobCursor, JobEvent, JobRequest, JobResult, JobStore,
    NewJob, Redeliver, Released, Result, StoreError, StoredDestination, StoredJob, UnfinishedJob,
};

/// A terminal job's `destinations` is the number of its deliveries (see `sqlite_jobs`).
const JOB_COLUMNS: &str =
    "id, pool, status, reason, key_id, fairness, priority, created_at, updated_at, expires_at, \
     retention_ms, attempt, \
     CASE WHEN status IN ('completed', 'failed', 'expired') \
          THEN (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id) ELSE destinations END, \
     error, request, request_body, result, result_body, \
     (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id AND d.status = 'delivered'), \
     (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id AND d.status = 'failed'), \
     request_id";

/// [`JOB_COLUMNS`] with an empty request body (column 15) and the body's length appended
/// (column 21). Keep the two in step.
const JOB_HEAD_COLUMNS: &str =
    "id, pool, status, reason, key_id, fairness, priority, created_at, updated_at, expires_at, \
     retention_ms, attempt, \
     CASE WHEN status IN ('completed', 'failed', 'expired') \
          THEN (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id) ELSE destinations END, \
     error, request, ''::BYTEA, result, result_body, \
     (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id AND d.status = 'delivered'), \
     (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id AND d.status = 'failed'), \
     request_id, octet_length(request_body)::BIGINT";

/// Retained jobs deleted per statement by [`JobStore::delete_retained`], and statements per
/// call at most.
const RETENTION_BATCH: i64 = 500;
const RETENTION_BATCHES: usize = 20;

/// The statuses of a job not yet terminal, in the exact text of the partial indexes.
const UNFINISHED: &str = "status IN ('accepted', 'queued', 'running')";

/// [`UNFINISHED`] in words that no partial index's predicate is implied by, for a statement
/// that finds a batch of jobs by key: the planner then cannot pick an unfinished jobs' partial
/// index for it. It knows their size only as of the last `ANALYZE`, and with a backlog the
/// statistics had not caught up with, a start batch of 8 jobs was planned as a read of
/// `jobs_unfinished_pool` whole (estimated 20 entries, actually 559) joined to the batch,
/// instead of 8 probes of the primary key (auto_explain, three nodes).
const NOT_TERMINAL: &str = "status NOT IN ('completed', 'failed', 'expired')";

/// `status = 'running'` in words no partial index's predicate is implied by (see
/// [`NOT_TERMINAL`]): every other status a job can have ([`status::ALL`]) excluded. Without it
/// a batch of finishes was planned as a read of the unfinished jobs' partial index whole,
/// growing with the backlog (bench/RESULTS.md, "Finishes in batches").
const STILL_RUNNING: &str =
    "status NOT IN ('accepted', 'queued', 'completed', 'failed', 'expired')";

const DEST_COLUMNS: &str =
    "id, pool, url, secret, active, deactivate_after, consecutive_failures, deactivated_at, \
     managed_by, created_at, previous_secret, previous_secret_expires_at";

const DELIVERY_COLUMNS: &str = "id, job_id, destination_id, status, attempts, next_attempt_at, \
     manual, last_status, last_error, delivered_at, updated_at, request_id";

const ATTEMPT_COLUMNS: &str = "id, delivery_id, job_id, destination_id, attempt, at, status_code, \
     latency_ms, response_body, error, manual, outcome";

fn decode<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| StoreError::Backend(format!("reading {what}: {e}")))
}

fn job_from_row(row: &Row) -> Result<StoredJob> {
    let request: RequestHead = decode("a job's request", &get::<String>(row, 14)?)?;
    let result = match get::<Option<String>>(row, 16)? {
        Some(text) => {
            let head: ResultHead = decode("a job's result", &text)?;
            let body: Option<Vec<u8>> = get(row, 17)?;
            Some(JobResult {
                status: head.status,
                headers: head.headers,
                body: body.unwrap_or_default(),
                truncated: head.truncated,
            })
        }
        None => None,
    };
    Ok(StoredJob {
        id: get(row, 0)?,
        pool: get(row, 1)?,
        status: get(row, 2)?,
        reason: get(row, 3)?,
        key_id: get(row, 4)?,
        // Stored bit for bit (a hash), as on SQLite.
        fairness: get::<i64>(row, 5)? as u64,
        priority: get(row, 6)?,
        created_at: get_u(row, 7)?,
        updated_at: get_u(row, 8)?,
        expires_at: get_u(row, 9)?,
        retention_ms: get_u(row, 10)?,
        attempt: get_u(row, 11)?,
        destinations: get_u(row, 12)?,
        error: get(row, 13)?,
        request: JobRequest {
            method: request.method,
            path_and_query: request.path_and_query,
            headers: request.headers,
            body: get(row, 15)?,
        },
        result,
        delivered: get_u(row, 18)?,
        failed: get_u(row, 19)?,
        request_id: get(row, 20)?,
    })
}

fn dest_from_row(row: &Row) -> Result<StoredDestination> {
    Ok(StoredDestination {
        id: get(row, 0)?,
        pool: get(row, 1)?,
        url: get(row, 2)?,
        secret: get(row, 3)?,
        active: get(row, 4)?,
        deactivate_after: get_u(row, 5)?,
        consecutive_failures: get_u(row, 6)?,
        deactivated_at: get_opt_u(row, 7)?,
        managed_by: get(row, 8)?,
        created_at: get_u(row, 9)?,
        previous_secret: get(row, 10)?,
        previous_secret_expires_at: get_opt_u(row, 11)?,
    })
}

fn delivery_from_row(row: &Row) -> Result<DeliveryState> {
    let status: String = get(row, 3)?;
    let next: u64 = get_u(row, 5)?;
    Ok(DeliveryState {
        id: get_u(row, 0)?,
        job_id: get(row, 1)?,
        destination_id: get(row, 2)?,
        next_attempt_at: (status == delivery_status::PENDING).then_some(next),
        status,
        attempts: get_u(row, 4)?,
        manual: get(row, 6)?,
        last_status: get_opt_u(row, 7)?,
        last_error: get(row, 8)?,
        delivered_at: get_opt_u(row, 9)?,
        updated_at: get_u(row, 10)?,
        request_id: get(row, 11)?,
    })
}

/// A finish's columns: the terminal status, the error, the result's head (JSON) and body.
struct FinishColumns<'a> {
    status: &'static str,
    error: Option<&'a str>,
    head: Option<String>,
    body: Option<&'a [u8]>,
}

fn finish_columns(finish: &Finish) -> Result<FinishColumns<'_>> {
    Ok(match finish {
        Finish::Completed(r) => {
            let head = ResultHead {
                status: r.status,
                headers: r.headers.clone(),
                truncated: r.truncated,
            };
            FinishColumns {
                status: status::COMPLETED,
                error: None,
                head: Some(encode("finish_attempt", &head)?),
                body: Some(r.body.as_slice()),
            }
        }
        Finish::Failed(e) => FinishColumns {
            status: status::FAILED,
            error: Some(e.as_str()),
            head: None,
            body: None,
        },
    })
}

fn attempt_from_row(row: &Row) -> Result<DeliveryAttempt> {
    Ok(DeliveryAttempt {
        id: get_u(row, 0)?,
        delivery_id: get_u(row, 1)?,
        job_id: get(row, 2)?,
        destination_id: get(row, 3)?,
        attempt: get_u(row, 4)?,
        at: get_u(row, 5)?,
        status_code: get_opt_u(row, 6)?,
        latency_ms: get_u(row, 7)?,
        response_body: get(row, 8)?,
        error: get(row, 9)?,
        manual: get(row, 10)?,
        outcome: get(row, 11)?,
    })
}

/// [`JobStore::record_attempts`] as one statement, with SQLite's semantics: the records apply
/// one after another, in order. A statement sees one snapshot, so "in order" is a fold over the
/// records, in recursive CTEs:
/// - `s`: each destination's streak record by record (reset on a delivery; +1 on a failure
///   that was not manual while active; deactivated on `gone`, or at `deactivate_after`), from
///   the row as it stands (locked); `fd`/`da` are its end state and the record that
///   deactivated it (at most one: nothing reactivates within a batch).
/// - `f`: each delivery recorded, event by event: its own records (the attempt count, the
///   claim, and the new state when the round and status still allow it), and, after the record
///   that deactivated its destination, the failure of what is still pending.
///
/// Pending deliveries of a deactivated destination that no record names are failed by `sw`,
/// which reads nothing when the batch deactivated nothing (its `EXISTS` is decided once, before
/// any scan: without it, a plan that put `deliveries` first read every pending delivery of
/// every destination per batch).
/// Rows are locked (in id order) before they are read, so the fold starts from their latest
/// committed state, as the one-statement-per-step version did.
const RECORD_ATTEMPTS: &str = "WITH RECURSIVE \
    r AS (SELECT * FROM UNNEST($1::BIGINT[], $2::BIGINT[], $3::TEXT[], $4::TEXT[], $5::TEXT[], \
      $6::BIGINT[], $7::BIGINT[], $8::BIGINT[], $9::BIGINT[], $10::TEXT[], $11::TEXT[], \
      $12::BOOLEAN[], $13::TEXT[], $14::BIGINT[], $15::BOOLEAN[]) WITH ORDINALITY AS t(delivery_id, \
      round, job_id, destination_id, pool, attempt, at, status_code, latency_ms, response_body, \
      error, manual, next, retry_at, gone, n)), \
    dl AS (SELECT id, active, consecutive_failures AS cf, deactivate_after \
      FROM webhook_destinations WHERE id IN (SELECT destination_id FROM r) ORDER BY id FOR UPDATE), \
    rk AS (SELECT r.*, row_number() OVER (PARTITION BY destination_id ORDER BY n) AS k FROM r), \
    s (destination_id, k, active, cf, changed, deactivated) AS ( \
      SELECT id, 0::BIGINT, active, cf, FALSE, FALSE FROM dl \
      UNION ALL \
      SELECT s.destination_id, rk.k, s.active AND NOT c.deact, \
        CASE WHEN rk.next = 'delivered' THEN 0 WHEN c.inc THEN s.cf + 1 ELSE s.cf END, \
        CASE WHEN rk.next = 'delivered' THEN s.cf <> 0 ELSE c.inc END, c.deact \
      FROM s JOIN rk ON rk.destination_id = s.destination_id AND rk.k = s.k + 1 \
        JOIN dl ON dl.id = s.destination_id \
        CROSS JOIN LATERAL (SELECT \
          rk.next <> 'delivered' AND NOT rk.manual AND s.active AS inc, \
          rk.next <> 'delivered' AND s.active AND (rk.gone OR \
            (NOT rk.manual AND s.cf + 1 >= dl.deactivate_after)) AS deact) c), \
    rs AS (SELECT rk.*, COALESCE(s.changed, FALSE) AS changed, \
        COALESCE(s.deactivated, FALSE) AS deact, \
        CASE WHEN rk.next = 'retry' AND COALESCE(s.deactivated, FALSE) THEN 'failed' \
          ELSE rk.next END AS outcome \
      FROM rk LEFT JOIN s ON s.destination_id = rk.destination_id AND s.k = rk.k), \
    da AS (SELECT destination_id, n, at FROM rs WHERE deact), \
    fd AS (SELECT DISTINCT ON (destination_id) destination_id, active, cf FROM s \
      WHERE k > 0 ORDER BY destination_id, k DESC), \
    ud AS (UPDATE webhook_destinations w SET consecutive_failures = fd.cf, active = fd.active, \
        deactivated_at = COALESCE(da.at, w.deactivated_at) \
      FROM fd LEFT JOIN da ON da.destination_id = fd.destination_id \
      WHERE w.id = fd.destination_id \
        AND (w.consecutive_failures <> fd.cf OR w.active <> fd.active)), \
    dv AS (SELECT id, destination_id, status, round, attempts, round_attempts, next_attempt_at, \
        last_status, last_error, delivered_at, updated_at \
      FROM deliveries WHERE id IN (SELECT delivery_id FROM r) ORDER BY id FOR UPDATE), \
    ev AS (SELECT dv.id AS did, rs.n AS pos, 0 AS kind, rs.outcome AS next, rs.round, rs.at, \
        rs.status_code, rs.error, rs.retry_at \
      FROM rs JOIN dv ON dv.id = rs.delivery_id \
      UNION ALL \
      SELECT dv.id, da.n, 1, NULL::TEXT, NULL::BIGINT, da.at, NULL::BIGINT, NULL::TEXT, \
        NULL::BIGINT \
      FROM dv JOIN da ON da.destination_id = dv.destination_id), \
    evk AS (SELECT ev.*, row_number() OVER (PARTITION BY did ORDER BY pos, kind) AS k FROM ev), \
    f (id, k, status, round, attempts, round_attempts, next_attempt_at, last_status, last_error, \
        delivered_at, updated_at) AS ( \
      SELECT id, 0::BIGINT, status, round, attempts, round_attempts, next_attempt_at, \
        last_status, last_error, delivered_at, updated_at FROM dv \
      UNION ALL \
      SELECT f.id, e.k, \
        CASE WHEN c.ap AND e.next = 'delivered' THEN 'delivered' \
          WHEN c.ap AND e.next = 'failed' THEN 'failed' WHEN c.sw THEN 'failed' \
          ELSE f.status END, \
        f.round, \
        f.attempts + CASE WHEN e.kind = 0 THEN 1 ELSE 0 END, \
        f.round_attempts + CASE WHEN c.ap THEN 1 ELSE 0 END, \
        CASE WHEN c.ap AND e.next = 'retry' THEN e.retry_at ELSE f.next_attempt_at END, \
        CASE WHEN c.ap THEN e.status_code ELSE f.last_status END, \
        CASE WHEN c.ap AND e.next = 'delivered' THEN NULL WHEN c.ap THEN e.error \
          WHEN c.sw THEN 'destination deactivated' ELSE f.last_error END, \
        CASE WHEN c.ap AND e.next = 'delivered' THEN e.at ELSE f.delivered_at END, \
        CASE WHEN c.ap OR c.sw THEN e.at ELSE f.updated_at END \
      FROM f JOIN evk e ON e.did = f.id AND e.k = f.k + 1 \
        CROSS JOIN LATERAL (SELECT \
          e.kind = 0 AND e.round = f.round AND CASE WHEN e.next = 'delivered' \
            THEN f.status <> 'delivered' ELSE f.status = 'pending' END AS ap, \
          e.kind = 1 AND f.status = 'pending' AS sw) c), \
    fdv AS (SELECT DISTINCT ON (id) * FROM f WHERE k > 0 ORDER BY id, k DESC), \
    uv AS (UPDATE deliveries d SET status = x.status, attempts = x.attempts, \
        round_attempts = x.round_attempts, next_attempt_at = x.next_attempt_at, \
        last_status = x.last_status, last_error = x.last_error, delivered_at = x.delivered_at, \
        updated_at = x.updated_at, claimed_by = NULL, claim_until = NULL \
      FROM fdv x WHERE d.id = x.id), \
    sw AS (UPDATE deliveries d SET status = 'failed', last_error = 'destination deactivated', \
        updated_at = da.at FROM da \
      WHERE EXISTS (SELECT 1 FROM da) AND d.destination_id = da.destination_id \
        AND d.status = 'pending' AND d.id NOT IN (SELECT id FROM dv)), \
    ins AS (INSERT INTO delivery_attempts (delivery_id, job_id, destination_id, pool, attempt, \
        at, status_code, latency_ms, response_body, error, manual, outcome) \
      SELECT delivery_id, job_id, destination_id, pool, attempt, at, status_code, latency_ms, \
        response_body, error, manual, \
        CASE outcome WHEN 'delivered' THEN 'delivered' WHEN 'retry' THEN 'retrying' \
          ELSE 'failed' END \
      FROM rs WHERE delivery_id IN (SELECT id FROM dv) ORDER BY n) \
    SELECT delivery_id IN (SELECT id FROM dv), changed, deact FROM rs ORDER BY n";

/// One delivered attempt of a batch in which every attempt was delivered (see
/// [`PgStore::record_deliveries`]), as SQLite applies it: the attempt counted, the delivery
/// delivered unless a redelivery started another round meanwhile or it already was, its claim
/// let go, and the attempt logged — nothing if the delivery is gone. Every `SET` reads the row as
/// it was, so `applies` is the round-and-status check of that row.
const RECORD_DELIVERED: &str = "WITH d AS (UPDATE deliveries SET attempts = attempts + 1, \
      status = CASE WHEN round = $2 AND status <> 'delivered' THEN 'delivered' ELSE status END, \
      round_attempts = round_attempts + CASE WHEN round = $2 AND status <> 'delivered' \
        THEN 1 ELSE 0 END, \
      last_status = CASE WHEN round = $2 AND status <> 'delivered' THEN $3 ELSE last_status END, \
      last_error = CASE WHEN round = $2 AND status <> 'delivered' THEN NULL ELSE last_error END, \
      delivered_at = CASE WHEN round = $2 AND status <> 'delivered' THEN $4 \
        ELSE delivered_at END, \
      updated_at = CASE WHEN round = $2 AND status <> 'delivered' THEN $4 ELSE updated_at END, \
      claimed_by = NULL, claim_until = NULL \
    WHERE id = $1 RETURNING id) \
    INSERT INTO delivery_attempts (delivery_id, job_id, destination_id, pool, attempt, at, \
      status_code, latency_ms, response_body, error, manual, outcome) \
    SELECT id, $5, $6, $7, $8, $4, $3, $9, $10, $11, $12, 'delivered' FROM d";

/// The start of a batch of jobs' attempts ([`JobStore::start_attempts_with_body`]): parameters
/// the ids, their start times, the node and the claim lease. Jobs are found by key and tested
/// [`NOT_TERMINAL`], so no plan reads an unfinished jobs' index instead.
fn start_batch_sql() -> String {
    format!(
        "WITH t AS (SELECT * FROM UNNEST($1::TEXT[], $2::BIGINT[]) AS t(id, at)), \
         u AS (UPDATE jobs SET status = 'running', attempt = attempt + 1, \
         updated_at = t.at, claimed_by = $3, claim_until = t.at + $4::BIGINT FROM t \
         WHERE jobs.id = t.id AND {NOT_TERMINAL} AND (claimed_by IS NULL OR \
         claimed_by = $3 OR claim_until <= t.at) \
         RETURNING jobs.id, t.at, jobs.attempt, jobs.request_body), \
         e AS (INSERT INTO job_events (job_id, at, status, attempt, detail) \
         SELECT id, at, 'running', attempt, NULL FROM u) \
         SELECT id, attempt, request_body FROM u"
    )
}

/// The end of a batch of attempts ([`JobStore::finish_attempts`]), each fenced and recorded as
/// `finish_attempt` does it alone: its terminal state, its history row and its outbox rows (in
/// order, duplicates once) commit together, and none of it unless the attempt still holds its
/// job ([`STILL_RUNNING`], spelled so that no plan reads an unfinished jobs' index instead of
/// the key). The history and outbox rows go in the batch's order.
fn finish_batch_sql() -> String {
    format!(
        "WITH t AS (SELECT * FROM UNNEST($1::TEXT[], $2::BIGINT[], $3::BIGINT[], $4::TEXT[], \
         $5::TEXT[], $6::TEXT[], $7::BYTEA[]) WITH ORDINALITY \
         AS t(id, attempt, at, status, error, result, result_body, i)), \
         u AS (UPDATE jobs SET status = t.status, updated_at = t.at, error = t.error, \
         result = t.result, result_body = t.result_body, claimed_by = NULL, \
         claim_until = NULL FROM t WHERE jobs.id = t.id AND jobs.attempt = t.attempt \
         AND jobs.{STILL_RUNNING} \
         RETURNING jobs.id, jobs.request_id, t.attempt, t.at, t.status, t.error, t.i), \
         e AS (INSERT INTO job_events (job_id, at, status, attempt, detail) \
         SELECT id, at, status, attempt, error FROM u ORDER BY i), \
         o AS (SELECT j, d, MIN(n) AS n FROM UNNEST($8::BIGINT[], $9::TEXT[]) \
         WITH ORDINALITY AS x(j, d, n) GROUP BY j, d), \
         d AS (INSERT INTO deliveries (job_id, destination_id, status, attempts, \
         next_attempt_at, created_at, updated_at, request_id) \
         SELECT u.id, o.d, 'pending', 0, u.at, u.at, u.at, u.request_id \
         FROM u JOIN o ON o.j = u.i ORDER BY u.i, o.n \
         ON CONFLICT (job_id, destination_id) DO NOTHING) \
         SELECT id FROM u"
    )
}

impl PgStore {
    /// [`JobStore::record_attempts`] for a batch in which every attempt was delivered, the common
    /// batch: a streak can only reset, so nothing is deactivated and no record depends on
    /// another's outcome but through its own delivery's row. Short statements, each a probe by
    /// key, sent together (pipelined) in one transaction, rather than [`RECORD_ATTEMPTS`]: that
    /// one statement, planned afresh on most calls, cost about 2 ms to plan and 1 ms to run
    /// for a batch of three on three nodes (pg_stat_statements), the largest share of the
    /// database's time per webhook delivered.
    ///
    /// Destinations are reset first, each once, in id order (the order [`RECORD_ATTEMPTS`]
    /// locks them in), and only a destination whose streak moves is locked, so concurrent
    /// batches of other nodes do not queue on a healthy destination's row.
    async fn record_deliveries(&self, records: &[AttemptRecord]) -> Result<Vec<AttemptApplied>> {
        const WHAT: &str = "record_attempts";
        let mut destinations: Vec<&str> =
            records.iter().map(|r| r.destination_id.as_str()).collect();
        destinations.sort_unstable();
        destinations.dedup();
        let mut conn = self.conn().await?;
        let tx = conn.transaction().await.ctx(WHAT)?;
        let reset = tx
            .prepare_cached(
                "UPDATE webhook_destinations SET consecutive_failures = 0 \
                 WHERE id = $1 AND consecutive_failures <> 0",
            )
            .await
            .ctx(WHAT)?;
        let delivered = tx.prepare_cached(RECORD_DELIVERED).await.ctx(WHAT)?;
        let (client, reset, delivered) = (&tx, &reset, &delivered);
        let resets = futures_util::future::try_join_all(
            destinations
                .iter()
                .map(|d| async move { client.execute(reset, &[d]).await }),
        );
        let codes: Vec<Option<i64>> = records
            .iter()
            .map(|r| r.status_code.map(i64::from))
            .collect();
        let rows: Vec<[i64; 5]> = records
            .iter()
            .map(|r| {
                [
                    big(r.delivery_id),
                    i64::from(r.round),
                    big(r.at),
                    i64::from(r.attempt),
                    big(r.latency_ms),
                ]
            })
            .collect();
        let logged = futures_util::future::try_join_all(records.iter().zip(&rows).zip(&codes).map(
            |((r, [id, round, at, attempt, latency]), code)| async move {
                client
                    .execute(
                        delivered,
                        &[
                            id,
                            round,
                            code,
                            at,
                            &r.job_id,
                            &r.destination_id,
                            &r.pool,
                            attempt,
                            latency,
                            &r.response_body,
                            &r.error,
                            &r.manual,
                        ],
                    )
                    .await
            },
        ));
        // Sent in this order, on one connection: the resets, then every record in order.
        let (resets, logged) = futures_util::future::try_join(resets, logged)
            .await
            .ctx(WHAT)?;
        tx.commit().await.ctx(WHAT)?;
        // A destination's reset is its first record's, as when recorded one by one.
        let mut moved: Vec<(&str, bool)> = destinations
            .iter()
            .zip(&resets)
            .map(|(d, n)| (*d, *n > 0))
            .collect();
        Ok(records
            .iter()
            .zip(logged)
            .map(|(r, n)| {
                let streak_changed = match moved.iter_mut().find(|(d, _)| *d == r.destination_id) {
                    Some((_, moved)) => std::mem::take(moved),
                    None => false,
                };
                AttemptApplied {
                    recorded: n > 0,
                    streak_changed,
                    deactivated: false,
                }
            })
            .collect())
    }

    /// Runs `sql` ([`start_batch_sql`], or it under `EXPLAIN` in a test) for `jobs`, each
    /// `(id, now)`: one statement for the batch, each row's start decided as `start` decides it
    /// alone.
    async fn run_start_batch(&self, sql: &str, jobs: &[(String, u64)]) -> Result<Vec<Row>> {
        let ids: Vec<&str> = jobs.iter().map(|(id, _)| id.as_str()).collect();
        let nows: Vec<i64> = jobs.iter().map(|(_, now)| big(*now)).collect();
        let conn = self.conn().await?;
        query(
            &conn,
            "start_attempts",
            sql,
            &[
                &ids,
                &nows,
                &self.inner.node,
                &big(self.inner.claim_lease_ms),
            ],
        )
        .await
    }

    /// Runs `sql` ([`finish_batch_sql`], or it under `EXPLAIN` in a test) for `ends`.
    async fn run_finish_batch(&self, sql: &str, ends: &[AttemptEnd<'_>]) -> Result<Vec<Row>> {
        // The batch as parallel arrays, one element per attempt; its deliveries as two more,
        // each destination with its attempt's index (1-based, as `WITH ORDINALITY` counts).
        let n = ends.len();
        let (mut ids, mut attempts, mut nows) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut statuses, mut errors, mut heads, mut bodies) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut owners, mut dests) = (Vec::new(), Vec::new());
        for (i, end) in ends.iter().enumerate() {
            let columns = finish_columns(end.finish)?;
            ids.push(end.id);
            attempts.push(i64::from(end.attempt));
            nows.push(big(end.now));
            statuses.push(columns.status);
            errors.push(columns.error);
            heads.push(columns.head);
            bodies.push(columns.body);
            for d in end.destination_ids {
                owners.push(i as i64 + 1);
                dests.push(d.as_str());
            }
        }
        let conn = self.conn().await?;
        query(
            &conn,
            "finish_attempts",
            sql,
            &[
                &ids, &attempts, &nows, &statuses, &errors, &heads, &bodies, &owners, &dests,
            ],
        )
        .await
    }

    /// Runs `sql` ([`RECORD_ATTEMPTS`], or it under `EXPLAIN` in a test) with `records` as its
    /// parameters.
    async fn run_record_attempts(&self, sql: &str, records: &[AttemptRecord]) -> Result<Vec<Row>> {
        let col = |f: fn(&AttemptRecord) -> i64| records.iter().map(f).collect::<Vec<i64>>();
        let text = |f: fn(&AttemptRecord) -> &str| records.iter().map(f).collect::<Vec<&str>>();
        let opt = |f: fn(&AttemptRecord) -> Option<&str>| {
            records.iter().map(f).collect::<Vec<Option<&str>>>()
        };
        let flag = |f: fn(&AttemptRecord) -> bool| records.iter().map(f).collect::<Vec<bool>>();
        let codes: Vec<Option<i64>> = records
            .iter()
            .map(|r| r.status_code.map(i64::from))
            .collect();
        let next = text(|r| match r.next {
            DeliveryNext::Delivered => "delivered",
            DeliveryNext::Retry { .. } => "retry",
            DeliveryNext::Failed => "failed",
        });
        let conn = self.conn().await?;
        query(
            &conn,
            "record_attempts",
            sql,
            &[
                &col(|r| big(r.delivery_id)),
                &col(|r| i64::from(r.round)),
                &text(|r| &r.job_id),
                &text(|r| &r.destination_id),
                &text(|r| &r.pool),
                &col(|r| i64::from(r.attempt)),
                &col(|r| big(r.at)),
                &codes,
                &col(|r| big(r.latency_ms)),
                &opt(|r| r.response_body.as_deref()),
                &opt(|r| r.error.as_deref()),
                &flag(|r| r.manual),
                &next,
                &col(|r| match r.next {
                    DeliveryNext::Retry { at } => big(at),
                    _ => 0,
                }),
                &flag(|r| r.gone),
            ],
        )
        .await
    }

    /// Starts a run attempt ([`JobStore::start_attempt`]), returning `columns` of the started
    /// job (none if it is terminal, gone or held by another live node). The attempt claims the
    /// job for this node until the lease ends, unless another live node holds it (that node runs
    /// it: the origin must not be called twice). One statement: the attempt and its history row
    /// commit together.
    async fn start(&self, id: &str, now: u64, columns: &str) -> Result<Vec<Row>> {
        let conn = self.conn().await?;
        query(
            &conn,
            "start_attempt",
            &format!(
                "WITH u AS (UPDATE jobs SET status = 'running', attempt = attempt + 1, \
                 updated_at = $2, claimed_by = $3, claim_until = $4 WHERE id = $1 AND \
                 {UNFINISHED} AND (claimed_by IS NULL OR claimed_by = $3 OR claim_until <= $2) \
                 RETURNING id, {columns}), \
                 e AS (INSERT INTO job_events (job_id, at, status, attempt, detail) \
                 SELECT id, $2, 'running', attempt, NULL FROM u) \
                 SELECT {columns} FROM u"
            ),
            &[&id, &big(now), &self.inner.node, &self.claim_until(now)],
        )
        .await
    }

    async fn insert_batch(&self, jobs: &[NewJob]) -> Result<()> {
        let mut heads = Vec::with_capacity(jobs.len());
        for j in jobs {
            heads.push(encode(
                "insert_jobs",
                &RequestHead {
                    method: j.request.method.clone(),
                    path_and_query: j.request.path_and_query.clone(),
                    headers: j.request.headers.clone(),
                },
            )?);
        }
        let text = |f: fn(&NewJob) -> &str| jobs.iter().map(f).collect::<Vec<&str>>();
        let num = |f: fn(&NewJob) -> i64| jobs.iter().map(f).collect::<Vec<i64>>();
        let bodies: Vec<&[u8]> = jobs.iter().map(|j| j.request.body.as_slice()).collect();
        let request_ids: Vec<Option<&str>> = jobs.iter().map(|j| j.request_id.as_deref()).collect();
        let conn = self.intake_conn().await?;
        // One statement, so one round trip and one transaction: the jobs and their `accepted`
        // and `queued` steps commit together, on a connection that commits synchronously (a `202` promises
        // the job survives a crash of the database's host too).
        exec(
            &conn,
            "insert_jobs",
            "WITH t AS (SELECT * FROM UNNEST($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::TEXT[], \
             $5::BIGINT[], $6::TEXT[], $7::BIGINT[], $8::BIGINT[], $9::BIGINT[], $10::BIGINT[], \
             $11::TEXT[], $12::BYTEA[], $13::TEXT[]) WITH ORDINALITY AS t(id, pool, reason, \
             key_id, fairness, priority, created_at, expires_at, retention_ms, destinations, \
             request, body, request_id, n)), \
             j AS (INSERT INTO jobs (id, pool, status, reason, key_id, fairness, priority, \
             created_at, updated_at, expires_at, retention_ms, attempt, destinations, request, \
             request_body, request_id, claimed_by, claim_until) \
             SELECT id, pool, 'queued', reason, key_id, fairness, priority, created_at, \
             created_at, expires_at, retention_ms, 0, destinations, request, body, request_id, \
             $14::TEXT, CASE WHEN $14::TEXT IS NULL THEN NULL ELSE created_at + $15::BIGINT END \
             FROM t) \
             INSERT INTO job_events (job_id, at, status, attempt, detail) \
             SELECT id, created_at, s.status, 0, CASE s.k WHEN 1 THEN reason END \
             FROM t CROSS JOIN (VALUES (1, 'accepted'), (2, 'queued')) AS s(k, status) \
             ORDER BY n, s.k",
            &[
                &text(|j| &j.id),
                &text(|j| &j.pool),
                &text(|j| &j.reason),
                &text(|j| &j.key_id),
                &num(|j| j.fairness as i64),
                &text(|j| &j.priority),
                &num(|j| big(j.created_at)),
                &num(|j| big(j.expires_at)),
                &num(|j| big(j.retention_ms)),
                &num(|j| i64::from(j.destinations)),
                &heads,
                &bodies,
                &request_ids,
                &self
                    .inner
                    .claims_inserts
                    .then_some(self.inner.node.as_str()),
                &big(self.inner.claim_lease_ms),
            ],
        )
        .await
        .map(drop)
    }

    async fn query_jobs(
        &self,
        what: &str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<StoredJob>> {
        let conn = self.conn().await?;
        let found = conn.query(sql, params).await.ctx(what)?;
        rows(found, job_from_row)
    }
}

#[async_trait::async_trait]
impl JobStore for PgStore {
    async fn insert_jobs(&self, jobs: &[NewJob]) -> Result<()> {
        if jobs.is_empty() {
            return Ok(());
        }
        self.insert_batch(jobs).await
    }

    async fn get_job(&self, pool: &str, id: &str) -> Result<Option<StoredJob>> {
        let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1 AND pool = $2");
        Ok(self
            .query_jobs("get_job", &sql, &[&id, &pool])
            .await?
            .into_iter()
            .next())
    }

    async fn list_jobs(
        &self,
        pool: &str,
        status: Option<&str>,
        before: Option<&str>,
        limit: u32,
    ) -> Result<Vec<StoredJob>> {
        // Newest first by (created_at, id); the cursor is the last id of the previous page.
        let sql = format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE pool = $1 AND ($2::TEXT IS NULL OR status = $2) \
             AND ($3::TEXT IS NULL OR (created_at, id) < \
                  (SELECT created_at, id FROM jobs WHERE id = $3)) \
             ORDER BY created_at DESC, id DESC LIMIT $4"
        );
        let limit = i64::from(limit.clamp(1, 1000));
        self.query_jobs("list_jobs", &sql, &[&pool, &status, &before, &limit])
            .await
    }

    async fn job_events(&self, id: &str) -> Result<Vec<JobEvent>> {
        let conn = self.conn().await?;
        let found = conn
            .query(
                "SELECT at, status, attempt, detail FROM job_events WHERE job_id = $1 ORDER BY seq",
                &[&id],
            )
            .await
            .ctx("job_events")?;
        rows(found, |r| {
            Ok(JobEvent {
                at: get_u(r, 0)?,
                status: get(r, 1)?,
                attempt: get_u(r, 2)?,
                detail: get(r, 3)?,
            })
        })
    }

    async fn unfinished_jobs(&self) -> Result<Vec<StoredJob>> {
        let sql =
            format!("SELECT {JOB_COLUMNS} FROM jobs WHERE {UNFINISHED} ORDER BY created_at, id");
        self.query_jobs("unfinished_jobs", &sql, &[]).await
    }

    async fn unfinished_jobs_page(
        &self,
        after: Option<&JobCursor>,
        limit: u32,
    ) -> Result<Vec<UnfinishedJob>> {
        let after_at = after.map(|c| big(c.created_at));
        let after_id = after.map(|c| c.id.as_str());
        let limit = i64::from(limit.clamp(1, 1000));
        let conn = self.conn().await?;
        let found = conn
            .query(
                &format!(
                    "SELECT {JOB_HEAD_COLUMNS} FROM jobs WHERE {UNFINISHED} \
                     AND ($1::BIGINT IS NULL OR (created_at, id) > ($1, $2::TEXT)) \
                     ORDER BY created_at, id LIMIT $3"
                ),
                &[&after_at, &after_id, &limit],
            )
            .await
            .ctx("unfinished_jobs_page")?;
        rows(found, |r| {
            Ok(UnfinishedJob {
                job: job_from_row(r)?,
                body_len: get_u(r, 21)?,
            })
        })
    }

    async fn claim_jobs(
        &self,
        now: u64,
        held: &[String],
        limit: u32,
    ) -> Result<Option<Vec<UnfinishedJob>>> {
        let conn = self.conn().await?;
        let until = self.claim_until(now);
        if !held.is_empty() {
            exec(
                &conn,
                "claim_jobs",
                &format!(
                    "UPDATE jobs SET claim_until = $3 \
                     WHERE id = ANY($1) AND claimed_by = $2 AND {UNFINISHED}"
                ),
                &[&held, &self.inner.node, &until],
            )
            .await?;
        }
        if limit == 0 {
            return Ok(Some(Vec::new()));
        }
        // Rows another node is claiming at this moment are skipped, not waited for.
        let found = conn
            .query(
                &format!(
                    "WITH c AS (SELECT id AS claimed FROM jobs WHERE {UNFINISHED} \
                     AND (claim_until IS NULL OR claim_until <= $1) \
                     ORDER BY created_at, id LIMIT $2 FOR UPDATE SKIP LOCKED) \
                     UPDATE jobs SET claimed_by = $3, claim_until = $4 FROM c \
                     WHERE jobs.id = c.claimed RETURNING {JOB_HEAD_COLUMNS}"
                ),
                &[
                    &big(now),
                    &i64::from(limit.min(1000)),
                    &self.inner.node,
                    &until,
                ],
            )
            .await
            .ctx("claim_jobs")?;
        let mut claimed = rows(found, |r| {
            Ok(UnfinishedJob {
                job: job_from_row(r)?,
                body_len: get_u(r, 21)?,
            })
        })?;
        claimed.sort_by(|a, b| (a.job.created_at, &a.job.id).cmp(&(b.job.created_at, &b.job.id)));
        Ok(Some(claimed))
    }

    async fn release_claims(&self, deliveries: bool) -> Result<Released> {
        let conn = self.conn().await?;
        // One statement: both releases commit together. Only rows this node still holds: one
        // another node took over meanwhile (this node stalled past its lease) is not touched.
        // A `running` job keeps its claim (see the trait): its attempt may still be live at
        // the origin, and `start_attempt` refuses it to every other node until the lease lapses.
        let row = query_one(
            &conn,
            "release_claims",
            "WITH j AS (UPDATE jobs SET claimed_by = NULL, claim_until = NULL \
               WHERE claimed_by = $1 AND status IN ('accepted', 'queued') RETURNING 1), \
             d AS (UPDATE deliveries SET claimed_by = NULL, claim_until = NULL \
               WHERE $2 AND claimed_by = $1 AND status = 'pending' RETURNING 1) \
             SELECT (SELECT COUNT(*) FROM j), (SELECT COUNT(*) FROM d)",
            &[&self.inner.node, &deliveries],
        )
        .await?;
        Ok(Released {
            jobs: get_u(&row, 0)?,
            deliveries: get_u(&row, 1)?,
        })
    }

    async fn job_request_body(&self, id: &str) -> Result<Option<Vec<u8>>> {
        let conn = self.conn().await?;
        let found = query(
            &conn,
            "job_request_body",
            "SELECT request_body FROM jobs WHERE id = $1",
            &[&id],
        )
        .await?;
        found.first().map(|r| get(r, 0)).transpose()
    }

    async fn count_unfinished_jobs(&self, pool: &str) -> Result<u64> {
        let conn = self.conn().await?;
        let row = conn
            .query_one(
                &format!("SELECT COUNT(*) FROM jobs WHERE pool = $1 AND {UNFINISHED}"),
                &[&pool],
            )
            .await
            .ctx("count_unfinished_jobs")?;
        get_u(&row, 0)
    }

    async fn unfinished_job_counts(&self) -> Result<Vec<(String, u64)>> {
        let conn = self.conn().await?;
        let found = conn
            .query(
                &format!(
                    "SELECT pool, COUNT(*) FROM jobs WHERE {UNFINISHED} GROUP BY pool ORDER BY pool"
                ),
                &[],
            )
            .await
            .ctx("unfinished_job_counts")?;
        rows(found, |r| Ok((get(r, 0)?, get_u(r, 1)?)))
    }

    async fn mark_queued(&self, id: &str, now: u64) -> Result<()> {
        let conn = self.conn().await?;
        // One statement (one round trip): the step and its history row commit together.
        exec(
            &conn,
            "mark_queued",
            "WITH u AS (UPDATE jobs SET status = 'queued', updated_at = $2 \
             WHERE id = $1 AND status = 'accepted' RETURNING id) \
             INSERT INTO job_events (job_id, at, status, attempt, detail) \
             SELECT id, $2, 'queued', 0, NULL FROM u",
            &[&id, &big(now)],
        )
        .await
        .map(drop)
    }

    async fn start_attempt(&self, id: &str, now: u64) -> Result<Option<u32>> {
        let found = self.start(id, now, "attempt").await?;
        found.first().map(|r| get_u::<u32>(r, 0)).transpose()
    }

    async fn start_attempt_with_body(&self, id: &str, now: u64) -> Result<Option<(u32, Vec<u8>)>> {
        // The same statement, returning the body too: one round trip for the attempt's start.
        let found = self.start(id, now, "attempt, request_body").await?;
        found
            .first()
            .map(|r| Ok((get_u::<u32>(r, 0)?, get::<Vec<u8>>(r, 1)?)))
            .transpose()
    }

    fn attempts_in_batches(&self) -> bool {
        true
    }

    async fn start_attempts_with_body(
        &self,
        jobs: &[(String, u64)],
    ) -> Result<Vec<Option<(u32, Vec<u8>)>>> {
        if let [(id, now)] = jobs {
            return Ok(vec![self.start_attempt_with_body(id, *now).await?]);
        }
        let found = self.run_start_batch(&start_batch_sql(), jobs).await?;
        let mut started = std::collections::HashMap::with_capacity(found.len());
        for r in &found {
            let id: String = get(r, 0)?;
            started.insert(id, (get_u::<u32>(r, 1)?, get::<Vec<u8>>(r, 2)?));
        }
        Ok(jobs.iter().map(|(id, _)| started.remove(id)).collect())
    }

    async fn retry_attempt(&self, id: &str, attempt: u32, now: u64, detail: &str) -> Result<bool> {
        let conn = self.conn().await?;
        // One statement: the step back to `queued` and its history row commit together, and
        // neither unless the attempt still holds the job.
        let found = query(
            &conn,
            "retry_attempt",
            "WITH u AS (UPDATE jobs SET status = 'queued', updated_at = $3, error = $4 \
             WHERE id = $1 AND attempt = $2 AND status = 'running' RETURNING id), \
             e AS (INSERT INTO job_events (job_id, at, status, attempt, detail) \
             SELECT id, $3, 'queued', $2, $4 FROM u) \
             SELECT COUNT(*) FROM u",
            &[&id, &i64::from(attempt), &big(now), &detail],
        )
        .await?;
        let n = found.first().map(|r| get_u::<u64>(r, 0)).transpose()?;
        Ok(n.unwrap_or(0) > 0)
    }

    async fn finish_attempt(
        &self,
        id: &str,
        attempt: u32,
        finish: &Finish,
        now: u64,
        destination_ids: &[String],
    ) -> Result<bool> {
        let FinishColumns {
            status: new_status,
            error,
            head,
            body,
        } = finish_columns(finish)?;
        let conn = self.conn().await?;
        // One statement (one round trip, one transaction): the terminal state, its history row
        // and the outbox rows (one per destination, in order, duplicates once) commit together,
        // and none of it unless the attempt still holds the job (fencing).
        let found = query(
            &conn,
            "finish_attempt",
            "WITH u AS (UPDATE jobs SET status = $3, updated_at = $4, error = $5, result = $6, \
             result_body = $7, claimed_by = NULL, claim_until = NULL \
             WHERE id = $1 AND attempt = $2 AND status = 'running' RETURNING id, request_id), \
             e AS (INSERT INTO job_events (job_id, at, status, attempt, detail) \
             SELECT id, $4, $3, $2, $5 FROM u), \
             d AS (INSERT INTO deliveries (job_id, destination_id, status, attempts, \
             next_attempt_at, created_at, updated_at, request_id) \
             SELECT u.id, o.d, 'pending', 0, $4, $4, $4, u.request_id FROM u, \
             (SELECT d, MIN(n) AS n FROM UNNEST($8::TEXT[]) WITH ORDINALITY AS t(d, n) \
              GROUP BY d) AS o ORDER BY o.n \
             ON CONFLICT (job_id, destination_id) DO NOTHING) \
             SELECT COUNT(*) FROM u",
            &[
                &id,
                &i64::from(attempt),
                &new_status,
                &big(now),
                &error,
                &head,
                &body,
                &destination_ids,
            ],
        )
        .await?;
        let finished = found.first().map(|r| get_u::<u64>(r, 0)).transpose()?;
        Ok(finished.unwrap_or(0) > 0)
    }

    async fn finish_attempts(&self, ends: &[AttemptEnd<'_>]) -> Result<Vec<bool>> {
        if let [end] = ends {
            let finished = self
                .finish_attempt(
                    end.id,
                    end.attempt,
                    end.finish,
                    end.now,
                    end.destination_ids,
                )
                .await?;
            return Ok(vec![finished]);
        }
        if ends.is_empty() {
            return Ok(Vec::new());
        }
        let found = self.run_finish_batch(&finish_batch_sql(), ends).await?;
        let mut finished = std::collections::HashSet::with_capacity(found.len());
        for r in &found {
            finished.insert(get::<String>(r, 0)?);
        }
        Ok(ends.iter().map(|end| finished.contains(end.id)).collect())
    }

    async fn expire_jobs(
        &self,
        now: u64,
        active_destinations: &std::collections::HashMap<String, Vec<String>>,
    ) -> Result<Vec<String>> {
        // The map as two parallel arrays (pool, destination), in the map's per-pool order.
        let (mut pools, mut dests) = (Vec::new(), Vec::new());
        for (pool, ids) in active_destinations {
            for id in ids {
                pools.push(pool.as_str());
                dests.push(id.as_str());
            }
        }
        let conn = self.conn().await?;
        // One statement (one round trip, one transaction): the jobs expired, their history
        // steps and their outbox rows (one per active destination of their pool, in order,
        // duplicates once) commit together, in the jobs' order (oldest first). Rows another
        // node is expiring (or finishing) right now are left to it.
        let found = query(
            &conn,
            "expire_jobs",
            &format!(
                "WITH u AS (UPDATE jobs SET status = 'expired', updated_at = $1, \
                 claimed_by = NULL, claim_until = NULL WHERE id IN (SELECT id FROM jobs \
                 WHERE {UNFINISHED} AND expires_at <= $1 ORDER BY created_at, id \
                 FOR UPDATE SKIP LOCKED) RETURNING id, pool, created_at, request_id), \
                 e AS (INSERT INTO job_events (job_id, at, status, attempt, detail) \
                 SELECT id, $1, 'expired', 0, NULL FROM u ORDER BY created_at, id), \
                 o AS (SELECT p, d, MIN(n) AS n FROM UNNEST($2::TEXT[], $3::TEXT[]) \
                 WITH ORDINALITY AS t(p, d, n) GROUP BY p, d), \
                 d AS (INSERT INTO deliveries (job_id, destination_id, status, attempts, \
                 next_attempt_at, created_at, updated_at, request_id) \
                 SELECT u.id, o.d, 'pending', 0, $1, $1, $1, u.request_id \
                 FROM u JOIN o ON o.p = u.pool COLLATE \"C\" ORDER BY u.created_at, u.id, o.n \
                 ON CONFLICT (job_id, destination_id) DO NOTHING) \
                 SELECT id FROM u ORDER BY created_at, id"
            ),
            &[&big(now), &pools, &dests],
        )
        .await?;
        rows(found, |r| get::<String>(r, 0))
    }

    async fn delete_retained(&self, now: u64) -> Result<u64> {
        // In batches of RETENTION_BATCH, each its own short transaction, so a large backlog of
        // retained jobs never holds locks or a connection for long; at most RETENTION_BATCHES
        // per call (the next sweep goes on). Rows another node is deleting are skipped.
        let mut deleted = 0;
        for _ in 0..RETENTION_BATCHES {
            let conn = self.conn().await?;
            // One statement: the jobs and everything of theirs go together, or none of it.
            let row = query_one(
                &conn,
                "delete_retained",
                "WITH gone AS (DELETE FROM jobs WHERE id IN (SELECT id FROM jobs \
                   WHERE status IN ('completed', 'failed', 'expired') \
                   AND updated_at + retention_ms <= $1 \
                   ORDER BY updated_at + retention_ms LIMIT $2 FOR UPDATE SKIP LOCKED) \
                   RETURNING id), \
                 e AS (DELETE FROM job_events WHERE job_id IN (SELECT id FROM gone)), \
                 a AS (DELETE FROM delivery_attempts WHERE job_id IN (SELECT id FROM gone)), \
                 d AS (DELETE FROM deliveries WHERE job_id IN (SELECT id FROM gone)) \
                 SELECT COUNT(*) FROM gone",
                &[&big(now), &RETENTION_BATCH],
            )
            .await?;
            let n: u64 = get_u(&row, 0)?;
            deleted += n;
            if n < RETENTION_BATCH as u64 {
                break;
            }
        }
        Ok(deleted)
    }

    async fn list_destinations(&self, pool: Option<&str>) -> Result<Vec<StoredDestination>> {
        let conn = self.conn().await?;
        let found = conn
            .query(
                &format!(
                    "SELECT {DEST_COLUMNS} FROM webhook_destinations \
                     WHERE $1::TEXT IS NULL OR pool = $1 ORDER BY created_at, id"
                ),
                &[&pool],
            )
            .await
            .ctx("list_destinations")?;
        rows(found, dest_from_row)
    }

    async fn create_destination(&self, d: &StoredDestination) -> Result<()> {
        let conn = self.conn().await?;
        conn.execute(
            &format!(
                "INSERT INTO webhook_destinations ({DEST_COLUMNS}) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
            ),
            &[
                &d.id,
                &d.pool,
                &d.url,
                &d.secret,
                &d.active,
                &i64::from(d.deactivate_after),
                &i64::from(d.consecutive_failures),
                &d.deactivated_at.map(big),
                &d.managed_by,
                &big(d.created_at),
                &d.previous_secret,
                &d.previous_secret_expires_at.map(big),
            ],
        )
        .await
        .ctx("create_destination")
        .map(drop)
    }

    async fn update_destination(&self, d: &StoredDestination) -> Result<bool> {
        let conn = self.conn().await?;
        let n = conn
            .execute(
                "UPDATE webhook_destinations SET url = $3, secret = $4, active = $5, \
                 deactivate_after = $6, consecutive_failures = $7, deactivated_at = $8 \
                 WHERE id = $1 AND pool = $2",
                &[
                    &d.id,
                    &d.pool,
                    &d.url,
                    &d.secret,
                    &d.active,
                    &i64::from(d.deactivate_after),
                    &i64::from(d.consecutive_failures),
                    &d.deactivated_at.map(big),
                ],
            )
            .await
            .ctx("update_destination")?;
        Ok(n > 0)
    }

    async fn delete_destination(&self, pool: &str, id: &str) -> Result<bool> {
        let conn = self.conn().await?;
        let n = conn
            .execute(
                "DELETE FROM webhook_destinations WHERE id = $1 AND pool = $2",
                &[&id, &pool],
            )
            .await
            .ctx("delete_destination")?;
        Ok(n > 0)
    }

    async fn rotate_destination_secret(
        &self,
        pool: &str,
        id: &str,
        secret: &str,
        previous_expires_at: Option<u64>,
    ) -> Result<bool> {
        let conn = self.conn().await?;
        let n = conn
            .execute(
                "UPDATE webhook_destinations SET \
                 previous_secret = CASE WHEN $4::BIGINT IS NULL THEN NULL ELSE secret END, \
                 previous_secret_expires_at = $4, secret = $3 WHERE id = $1 AND pool = $2",
                &[&id, &pool, &secret, &previous_expires_at.map(big)],
            )
            .await
            .ctx("rotate_destination_secret")?;
        Ok(n > 0)
    }

    async fn due_deliveries(
        &self,
        destination_id: &str,
        now: u64,
        limit: u32,
        exclude: &[u64],
    ) -> Result<Vec<DueDelivery>> {
        let conn = self.conn().await?;
        let destination = query_opt(
            &conn,
            "due_deliveries",
            &format!("SELECT {DEST_COLUMNS} FROM webhook_destinations WHERE id = $1 AND active"),
            &[&destination_id],
        )
        .await?;
        let Some(destination) = destination.as_ref().map(dest_from_row).transpose()? else {
            return Ok(Vec::new());
        };
        let exclude: Vec<i64> = exclude.iter().map(|id| big(*id)).collect();
        // Claimed for this node until the lease ends: other nodes skip them meanwhile (and
        // rows another node is claiming right now), this node is handed its own claims again.
        let found = query(
            &conn,
            "due_deliveries",
            "WITH due AS (SELECT id FROM deliveries WHERE destination_id = $1 \
                   AND status = 'pending' AND next_attempt_at <= $2 AND id <> ALL($4::BIGINT[]) \
                   AND (claim_until IS NULL OR claim_until <= $2 OR claimed_by = $5) \
                   ORDER BY next_attempt_at, id LIMIT $3 FOR UPDATE SKIP LOCKED) \
                 UPDATE deliveries d SET claimed_by = $5, claim_until = $6 FROM due \
                 WHERE d.id = due.id \
                 RETURNING d.next_attempt_at, d.id, d.job_id, d.attempts, d.round_attempts, \
                   d.round, d.manual",
            &[
                &destination_id,
                &big(now),
                &i64::from(limit),
                &exclude,
                &self.inner.node,
                &self.claim_until(now),
            ],
        )
        .await?;
        let mut claimed = rows(found, |r| {
            Ok((
                get_u::<u64>(r, 0)?,
                get_u::<u64>(r, 1)?,
                get::<String>(r, 2)?,
                get_u::<u32>(r, 3)?,
                get_u::<u32>(r, 4)?,
                get_u::<u32>(r, 5)?,
                get::<bool>(r, 6)?,
            ))
        })?;
        claimed.sort_by_key(|c| (c.0, c.1));
        let job_ids: Vec<&str> = claimed.iter().map(|c| c.2.as_str()).collect();
        let jobs = query(
            &conn,
            "due_deliveries",
            &format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ANY($1)"),
            &[&job_ids],
        )
        .await?;
        let mut jobs: std::collections::HashMap<String, StoredJob> = rows(jobs, job_from_row)?
            .into_iter()
            .map(|j| (j.id.clone(), j))
            .collect();
        let mut due = Vec::with_capacity(claimed.len());
        for (_, id, job_id, attempts, round_attempts, round, manual) in claimed {
            // Deliveries go with their job at retention; a missing job has nothing to send.
            let Some(job) = jobs.remove(&job_id) else {
                continue;
            };
            due.push(DueDelivery {
                id,
                job,
                destination: destination.clone(),
                attempts,
                round_attempts,
                round,
                manual,
            });
        }
        Ok(due)
    }

    async fn next_delivery_at(&self, destination_id: &str, after: u64) -> Result<Option<u64>> {
        let conn = self.conn().await?;
        let row = query_one(
            &conn,
            "next_delivery_at",
            "SELECT MIN(next_attempt_at) FROM deliveries \
                 WHERE destination_id = $1 AND status = 'pending' AND next_attempt_at > $2",
            &[&destination_id, &big(after)],
        )
        .await?;
        get_opt_u(&row, 0)
    }

    async fn record_attempts(&self, records: &[AttemptRecord]) -> Result<Vec<AttemptApplied>> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        if records.iter().all(|r| r.next == DeliveryNext::Delivered) {
            return self.record_deliveries(records).await;
        }
        // One statement (one round trip, one transaction): see `RECORD_ATTEMPTS`.
        let found = self.run_record_attempts(RECORD_ATTEMPTS, records).await?;
        rows(found, |row| {
            Ok(AttemptApplied {
                recorded: get(row, 0)?,
                streak_changed: get(row, 1)?,
                deactivated: get(row, 2)?,
            })
        })
    }

    async fn fail_undeliverable(&self, active_destination_ids: &[String], now: u64) -> Result<u64> {
        let conn = self.conn().await?;
        conn.execute(
            "UPDATE deliveries SET status = 'failed', \
             last_error = 'destination deactivated or deleted', updated_at = $2 \
             WHERE status = 'pending' AND destination_id <> ALL($1::TEXT[])",
            &[&active_destination_ids, &big(now)],
        )
        .await
        .ctx("fail_undeliverable")
    }

    async fn list_attempts(&self, q: &AttemptQuery) -> Result<Vec<DeliveryAttempt>> {
        let conn = self.conn().await?;
        let found = conn
            .query(
                &format!(
                    "SELECT {ATTEMPT_COLUMNS} FROM delivery_attempts WHERE pool = $1 \
                     AND ($2::TEXT IS NULL OR job_id = $2) \
                     AND ($3::TEXT IS NULL OR destination_id = $3) AND id < $4 \
                     ORDER BY id DESC LIMIT $5"
                ),
                &[
                    &q.pool,
                    &q.job_id,
                    &q.destination_id,
                    &q.before.map_or(i64::MAX, big),
                    &i64::from(q.limit.clamp(1, 1000)),
                ],
            )
            .await
            .ctx("list_attempts")?;
        rows(found, attempt_from_row)
    }

    async fn job_deliveries(&self, job_id: &str) -> Result<Vec<DeliveryState>> {
        let conn = self.conn().await?;
        let found = conn
            .query(
                &format!("SELECT {DELIVERY_COLUMNS} FROM deliveries WHERE job_id = $1 ORDER BY id"),
                &[&job_id],
            )
            .await
            .ctx("job_deliveries")?;
        rows(found, delivery_from_row)
    }

    async fn redeliver_job(
        &self,
        pool: &str,
        job_id: &str,
        destination_ids: &[String],
        now: u64,
    ) -> Result<Redeliver> {
        let mut conn = self.conn().await?;
        let tx = conn.transaction().await.ctx("redeliver_job")?;
        let found = tx
            .query_opt(
                "SELECT status FROM jobs WHERE id = $1 AND pool = $2 FOR UPDATE",
                &[&job_id, &pool],
            )
            .await
            .ctx("redeliver_job")?;
        let Some(job_status) = found.as_ref().map(|r| get::<String>(r, 0)).transpose()? else {
            return Ok(Redeliver::NoSuchJob);
        };
        if !status::is_terminal(&job_status) {
            return Ok(Redeliver::NotTerminal);
        }
        let upsert = tx
            .prepare(
                "INSERT INTO deliveries (job_id, destination_id, status, attempts, \
                 next_attempt_at, created_at, updated_at, manual, round, round_attempts, \
                 request_id) \
                 VALUES ($1, $2, 'pending', 0, $3, $3, $3, TRUE, 0, 0, \
                 (SELECT request_id FROM jobs WHERE id = $1)) \
                 ON CONFLICT (job_id, destination_id) DO UPDATE SET status = 'pending', \
                 next_attempt_at = excluded.next_attempt_at, updated_at = excluded.updated_at, \
                 manual = TRUE, round = deliveries.round + 1, round_attempts = 0, \
                 delivered_at = NULL",
            )
            .await
            .ctx("redeliver_job")?;
        let mut queued = 0u32;
        for d in destination_ids {
            let n = tx
                .execute(&upsert, &[&job_id, d, &big(now)])
                .await
                .ctx("redeliver_job")?;
            queued += u32::try_from(n).unwrap_or(0);
        }
        tx.commit().await.ctx("redeliver_job")?;
        Ok(Redeliver::Queued(queued))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use crate::JobRequest;
    use nthbouncer_testkit::pg::TestDb;

    /// The predicates spelled to keep partial indexes out of a plan say what their names say,
    /// over every status a job can have.
    #[test]
    fn the_status_predicates_spelled_by_exclusion_cover_every_status() {
        let names = |predicate: &str, s: &str| predicate.contains(&format!("'{s}'"));
        for s in status::ALL {
            assert_eq!(names(NOT_TERMINAL, s), status::is_terminal(s), "{s}");
            assert_eq!(names(STILL_RUNNING, s), s != status::RUNNING, "{s}");
            assert_eq!(names(UNFINISHED, s), !status::is_terminal(s), "{s}");
        }
    }

    fn destination(id: &str) -> StoredDestination {
        StoredDestination {
            id: id.into(),
            pool: "p".into(),
            url: format!("https://hooks.example.com/{id}"),
            secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into(),
            active: true,
            deactivate_after: 20,
            consecutive_failures: 0,
            deactivated_at: None,
            managed_by: "api".into(),
            created_at: 1,
            previous_secret: None,
            previous_secret_expires_at: None,
        }
    }

    /// Job `id` as the intake writes it (queued).
    fn new_job(id: &str) -> NewJob {
        NewJob {
            id: id.into(),
            pool: "p".into(),
            reason: "requested".into(),
            key_id: "key_1".into(),
            fairness: 1,
            priority: "normal".into(),
            created_at: 1_000,
            expires_at: 90_000_000,
            retention_ms: 86_400_000,
            destinations: 1,
            request: JobRequest {
                method: "GET".into(),
                path_and_query: "/".into(),
                headers: vec![],
                body: vec![],
            },
            request_id: None,
        }
    }

    /// Finishes job `id` with one pending delivery to `dest`.
    async fn finished(store: &PgStore, id: &str, dest: &str) {
        store.insert_jobs(&[new_job(id)]).await.unwrap();
        let attempt = store.start_attempt(id, 1_000).await.unwrap().unwrap();
        let failed = Finish::Failed("x".into());
        assert!(store
            .finish_attempt(id, attempt, &failed, 1_000, &[dest.to_string()])
            .await
            .unwrap());
    }

    /// The plan `record_attempts` ran for `records`, as `EXPLAIN ANALYZE` shows it; only the
    /// lines of its sweep (`sw`) of a deactivated destination's pending deliveries.
    async fn sweep_plan(store: &PgStore, records: &[AttemptRecord]) -> String {
        let sql = format!("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) {RECORD_ATTEMPTS}");
        let plan: Vec<String> = store
            .run_record_attempts(&sql, records)
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let start = plan.iter().position(|l| l.trim() == "CTE sw").unwrap();
        let indent = plan[start].len() - plan[start].trim_start().len();
        let end = plan[start + 1..]
            .iter()
            .position(|l| l.len() - l.trim_start().len() <= indent)
            .map_or(plan.len(), |n| start + 1 + n);
        plan[start..end].join("\n")
    }

    /// The plan's reads of `deliveries` (not its updates of it).
    fn deliveries_scans(plan: &str) -> Vec<&str> {
        plan.lines()
            .filter(|l| l.contains(" on deliveries") && !l.contains("Update on"))
            .collect()
    }

    /// A batch that deactivates nothing reads none of the other destinations' pending
    /// deliveries (however many): the sweep's scan is gated by a one-time filter and never
    /// runs. A batch that deactivates its destination runs it.
    #[tokio::test]
    async fn the_deactivation_sweep_reads_nothing_unless_a_destination_was_deactivated() {
        let db = TestDb::create().await;
        let store = PgStore::connect_node(&db.url, 60_000).await.unwrap();
        for id in ["wh_a", "wh_b"] {
            store.create_destination(&destination(id)).await.unwrap();
        }
        for n in 0..40 {
            finished(&store, &format!("job_b{n}"), "wh_b").await;
        }
        finished(&store, "job_a1", "wh_a").await;
        finished(&store, "job_a2", "wh_a").await;
        let due = store.due_deliveries("wh_a", 2_000, 10, &[]).await.unwrap();
        assert_eq!(due.len(), 2);
        let record = |d: &DueDelivery, status: u16, next: DeliveryNext| AttemptRecord {
            delivery_id: d.id,
            round: d.round,
            job_id: d.job.id.clone(),
            destination_id: d.destination.id.clone(),
            pool: d.job.pool.clone(),
            attempt: d.attempts + 1,
            at: 2_000,
            status_code: Some(status),
            latency_ms: 3,
            response_body: None,
            error: None,
            manual: false,
            next,
            gone: status == 410,
        };

        let delivered = sweep_plan(&store, &[record(&due[0], 200, DeliveryNext::Delivered)]).await;
        assert!(delivered.contains("One-Time Filter"), "{delivered}");
        assert!(delivered.contains("never executed"), "{delivered}");
        let scans = deliveries_scans(&delivered);
        assert!(!scans.is_empty(), "{delivered}");
        assert!(
            scans.iter().all(|l| l.contains("never executed")),
            "{delivered}"
        );

        // 410 Gone: wh_a is deactivated, and the sweep runs (and fails its other delivery).
        let gone = sweep_plan(&store, &[record(&due[1], 410, DeliveryNext::Failed)]).await;
        let scans = deliveries_scans(&gone);
        assert!(!scans.is_empty(), "{gone}");
        assert!(
            scans.iter().all(|l| !l.contains("never executed")),
            "{gone}"
        );
    }

    /// `sql` under `EXPLAIN ANALYZE` (it runs): the plan's lines.
    fn explained(sql: &str) -> String {
        format!("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) {sql}")
    }

    /// The plan finds its jobs by their primary key and reads no unfinished jobs' index.
    fn assert_probes_the_key(plan: &str) {
        assert!(plan.contains("Index Scan using jobs_pkey"), "{plan}");
        assert!(!plan.contains("jobs_unfinished"), "{plan}");
    }

    fn plan_of(rows: Vec<Row>) -> String {
        rows.iter()
            .map(|r| r.get::<_, String>(0))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// A batch of starts and a batch of finishes find their jobs by key however far the
    /// statistics lag: analyzed while every job was finished, then 600 jobs queued behind
    /// them, a batch of 8 probes the primary key and reads no unfinished jobs' index. (Tested
    /// with the unfinished jobs' own predicate, `status IN (…)` or `status = 'running'`, both
    /// read `jobs_unfinished_pool` whole, all 600 entries.)
    #[tokio::test]
    async fn batches_of_starts_and_finishes_probe_the_key_whatever_the_statistics_say() {
        const QUEUED: usize = 5_000;
        let db = TestDb::create().await;
        let store = PgStore::connect_node(&db.url, 60_000).await.unwrap();
        store
            .create_destination(&destination("wh_a"))
            .await
            .unwrap();
        for n in 0..20 {
            finished(&store, &format!("job_done{n:02}"), "wh_a").await;
        }
        let conn = store.conn().await.unwrap();
        conn.batch_execute("ANALYZE jobs").await.unwrap();
        // Enough rows that reading them all costs more than 8 probes even to a planner that
        // expects none of them unfinished.
        let queued: Vec<NewJob> = (0..QUEUED)
            .map(|n| new_job(&format!("job_q{n:05}")))
            .collect();
        for chunk in queued.chunks(500) {
            store.insert_jobs(chunk).await.unwrap();
        }

        let batch: Vec<(String, u64)> = (0..8).map(|n| (format!("job_q{n:05}"), 2_000)).collect();
        let starts = store
            .run_start_batch(&explained(&start_batch_sql()), &batch)
            .await
            .unwrap();
        assert_probes_the_key(&plan_of(starts));

        // The plan above ran: the 8 jobs run their first attempt.
        let failed = Finish::Failed("x".into());
        let dests = vec!["wh_a".to_string()];
        let ends: Vec<AttemptEnd<'_>> = batch
            .iter()
            .map(|(id, _)| AttemptEnd {
                id,
                attempt: 1,
                finish: &failed,
                now: 3_000,
                destination_ids: &dests,
            })
            .collect();
        let finishes = store
            .run_finish_batch(&explained(&finish_batch_sql()), &ends)
            .await
            .unwrap();
        assert_probes_the_key(&plan_of(finishes));
        let job = store.get_job("p", "job_q00007").await.unwrap().unwrap();
        assert_eq!(job.status, status::FAILED, "the finish batch ran too");
    }
}
