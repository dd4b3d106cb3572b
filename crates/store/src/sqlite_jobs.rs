//! [`JobStore`] on SQLite: the `jobs`, `job_events`, `webhook_destinations`, `deliveries` and
//! `delivery_attempts` tables (schema v2 and v3 in `sqlite.rs`). Request and result heads are
//! JSON text; bodies are BLOBs.

use rusqlite::{params, Connection, OptionalExtension, Row, Transaction};

use crate::jobs::{delivery_status, status};
use crate::sqlite::{clamp_i64, Ctx, SqliteStore};
use crate::{
    AttemptApplied, AttemptQuery, AttemptRecord, DeliveryAttempt, DeliveryNext, DeliveryState,
    DueDelivery, Finish, JobCursor, JobEvent, JobRequest, JobResult, JobStore, NewJob, Redeliver,
    Released, Result, StoreError, StoredDestination, StoredJob, UnfinishedJob,
};

// A terminal job's `destinations` is the number of its deliveries (the destinations that were
// active when it ended, plus any a redelivery added), so `delivered + failed <= destinations`
// always holds in the poll body; before that it is the count taken at accept time. The unary `+`
// keeps the planner on the (job_id, …) index: on the status index each count would scan every
// delivered row of every job.
const JOB_COLUMNS: &str =
    "id, pool, status, reason, key_id, fairness, priority, created_at, updated_at, expires_at, \
     retention_ms, attempt, \
     CASE WHEN status IN ('completed', 'failed', 'expired') \
          THEN (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id) ELSE destinations END, \
     error, request, request_body, result, result_body, \
     (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id AND +d.status = 'delivered'), \
     (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id AND +d.status = 'failed'), \
     request_id";

/// [`JOB_COLUMNS`] with an empty request body (column 15) and the body's length appended
/// (column 21): the resume pages leave bodies on disk. Keep the two in step.
const JOB_HEAD_COLUMNS: &str =
    "id, pool, status, reason, key_id, fairness, priority, created_at, updated_at, expires_at, \
     retention_ms, attempt, \
     CASE WHEN status IN ('completed', 'failed', 'expired') \
          THEN (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id) ELSE destinations END, \
     error, request, X'', result, result_body, \
     (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id AND +d.status = 'delivered'), \
     (SELECT COUNT(*) FROM deliveries d WHERE d.job_id = jobs.id AND +d.status = 'failed'), \
     request_id, length(request_body)";

/// The statuses of a job not yet terminal, as SQL, in the exact text of the partial indexes.
const UNFINISHED: &str = "status IN ('accepted', 'queued', 'running')";

const DEST_COLUMNS: &str =
    "id, pool, url, secret, active, deactivate_after, consecutive_failures, deactivated_at, managed_by, created_at, \
     previous_secret, previous_secret_expires_at";

const DELIVERY_COLUMNS: &str = "id, job_id, destination_id, status, attempts, next_attempt_at, \
     manual, last_status, last_error, delivered_at, updated_at, request_id";

const ATTEMPT_COLUMNS: &str = "id, delivery_id, job_id, destination_id, attempt, at, status_code, \
     latency_ms, response_body, error, manual, outcome";

/// A job's request without its body, stored as JSON text (on PostgreSQL too).
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct RequestHead {
    pub(crate) method: String,
    pub(crate) path_and_query: String,
    pub(crate) headers: Vec<(String, String)>,
}

/// A job's result without its body, stored as JSON text (on PostgreSQL too).
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct ResultHead {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) truncated: bool,
}

pub(crate) fn encode<T: serde::Serialize>(what: &str, v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| StoreError::Backend(format!("{what}: encoding: {e}")))
}

fn decode_err(col: usize, e: serde_json::Error) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(col, rusqlite::types::Type::Text, Box::new(e))
}

fn job_from_row(row: &Row<'_>) -> rusqlite::Result<StoredJob> {
    let request: String = row.get(14)?;
    let request: RequestHead = serde_json::from_str(&request).map_err(|e| decode_err(14, e))?;
    let result: Option<String> = row.get(16)?;
    let result = match result {
        Some(text) => {
            let head: ResultHead = serde_json::from_str(&text).map_err(|e| decode_err(16, e))?;
            let body: Option<Vec<u8>> = row.get(17)?;
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
        id: row.get(0)?,
        pool: row.get(1)?,
        status: row.get(2)?,
        reason: row.get(3)?,
        key_id: row.get(4)?,
        fairness: row.get::<_, i64>(5)? as u64,
        priority: row.get(6)?,
        created_at: row.get(7)?,
        updated_at: row.get(8)?,
        expires_at: row.get(9)?,
        retention_ms: row.get(10)?,
        attempt: row.get(11)?,
        destinations: row.get(12)?,
        error: row.get(13)?,
        request: JobRequest {
            method: request.method,
            path_and_query: request.path_and_query,
            headers: request.headers,
            body: row.get(15)?,
        },
        result,
        delivered: row.get(18)?,
        failed: row.get(19)?,
        request_id: row.get(20)?,
    })
}

fn dest_from_row(row: &Row<'_>) -> rusqlite::Result<StoredDestination> {
    Ok(StoredDestination {
        id: row.get(0)?,
        pool: row.get(1)?,
        url: row.get(2)?,
        secret: row.get(3)?,
        active: row.get(4)?,
        deactivate_after: row.get(5)?,
        consecutive_failures: row.get(6)?,
        deactivated_at: row.get(7)?,
        managed_by: row.get(8)?,
        created_at: row.get(9)?,
        previous_secret: row.get(10)?,
        previous_secret_expires_at: row.get(11)?,
    })
}

fn delivery_from_row(row: &Row<'_>) -> rusqlite::Result<DeliveryState> {
    let status: String = row.get(3)?;
    let next: u64 = row.get(5)?;
    Ok(DeliveryState {
        id: row.get(0)?,
        job_id: row.get(1)?,
        destination_id: row.get(2)?,
        next_attempt_at: (status == delivery_status::PENDING).then_some(next),
        status,
        attempts: row.get(4)?,
        manual: row.get(6)?,
        last_status: row.get(7)?,
        last_error: row.get(8)?,
        delivered_at: row.get(9)?,
        updated_at: row.get(10)?,
        request_id: row.get(11)?,
    })
}

fn attempt_from_row(row: &Row<'_>) -> rusqlite::Result<DeliveryAttempt> {
    Ok(DeliveryAttempt {
        id: row.get(0)?,
        delivery_id: row.get(1)?,
        job_id: row.get(2)?,
        destination_id: row.get(3)?,
        attempt: row.get(4)?,
        at: row.get(5)?,
        status_code: row.get(6)?,
        latency_ms: row.get(7)?,
        response_body: row.get(8)?,
        error: row.get(9)?,
        manual: row.get(10)?,
        outcome: row.get(11)?,
    })
}

/// Builds the attempt-log SELECT for the filters that are set (each combination its own cached
/// statement, so the planner can seek the matching `(…, id)` index).
fn attempts_sql(q: &AttemptQuery) -> (String, Vec<rusqlite::types::Value>) {
    use rusqlite::types::Value;
    let mut sql = format!("SELECT {ATTEMPT_COLUMNS} FROM delivery_attempts WHERE pool = ?");
    let mut args = vec![Value::Text(q.pool.clone())];
    if let Some(job) = &q.job_id {
        sql.push_str(" AND job_id = ?");
        args.push(Value::Text(job.clone()));
    }
    if let Some(dest) = &q.destination_id {
        sql.push_str(" AND destination_id = ?");
        args.push(Value::Text(dest.clone()));
    }
    if let Some(before) = q.before {
        sql.push_str(" AND id < ?");
        args.push(Value::Integer(i64::try_from(before).unwrap_or(i64::MAX)));
    }
    sql.push_str(" ORDER BY id DESC LIMIT ?");
    args.push(Value::Integer(i64::from(q.limit.clamp(1, 1000))));
    (sql, args)
}

/// Applies one attempt inside the caller's transaction (see [`JobStore::record_attempts`]).
fn apply_attempt(tx: &Transaction<'_>, r: &AttemptRecord) -> Result<AttemptApplied> {
    let mut applied = apply_streak(tx, r)?;
    // A deactivated destination gets no retries.
    let next = match r.next {
        DeliveryNext::Retry { .. } if applied.deactivated => DeliveryNext::Failed,
        other => other,
    };
    applied.recorded = apply_delivery(tx, r, next)?;
    if applied.deactivated {
        tx.prepare_cached(
            "UPDATE deliveries SET status = 'failed', last_error = 'destination deactivated', updated_at = ?2 \
             WHERE destination_id = ?1 AND status = 'pending'",
        )
        .ctx("record_attempts")?
        .execute(params![r.destination_id, r.at])
        .ctx("record_attempts")?;
    }
    Ok(applied)
}

/// The destination's failure streak and deactivation after one attempt.
fn apply_streak(tx: &Transaction<'_>, r: &AttemptRecord) -> Result<AttemptApplied> {
    let mut applied = AttemptApplied::default();
    let success = r.next == DeliveryNext::Delivered;
    if success {
        let n = tx
            .prepare_cached(
                "UPDATE webhook_destinations SET consecutive_failures = 0 \
                 WHERE id = ?1 AND consecutive_failures != 0",
            )
            .ctx("record_attempts")?
            .execute([&r.destination_id])
            .ctx("record_attempts")?;
        applied.streak_changed = n > 0;
    } else {
        if !r.manual {
            let n = tx
                .prepare_cached(
                    "UPDATE webhook_destinations SET consecutive_failures = consecutive_failures + 1 \
                     WHERE id = ?1 AND active = 1",
                )
                .ctx("record_attempts")?
                .execute([&r.destination_id])
                .ctx("record_attempts")?;
            applied.streak_changed = n > 0;
        }
        let n = if r.gone {
            tx.prepare_cached(
                "UPDATE webhook_destinations SET active = 0, deactivated_at = ?2 WHERE id = ?1 AND active = 1",
            )
            .ctx("record_attempts")?
            .execute(params![r.destination_id, r.at])
            .ctx("record_attempts")?
        } else if !r.manual {
            tx.prepare_cached(
                "UPDATE webhook_destinations SET active = 0, deactivated_at = ?2 \
                 WHERE id = ?1 AND active = 1 AND consecutive_failures >= deactivate_after",
            )
            .ctx("record_attempts")?
            .execute(params![r.destination_id, r.at])
            .ctx("record_attempts")?
        } else {
            0
        };
        applied.deactivated = n > 0;
    }
    Ok(applied)
}

/// The delivery's new state and the attempt's log row; `false` if the delivery is gone.
fn apply_delivery(tx: &Transaction<'_>, r: &AttemptRecord, next: DeliveryNext) -> Result<bool> {
    let exists = tx
        .prepare_cached("UPDATE deliveries SET attempts = attempts + 1 WHERE id = ?1")
        .ctx("record_attempts")?
        .execute([r.delivery_id])
        .ctx("record_attempts")?
        > 0;
    if exists {
        // Fenced by the round: a redelivery asked for while this attempt ran stays pending.
        match next {
            DeliveryNext::Delivered => tx
                .prepare_cached(
                    "UPDATE deliveries SET status = 'delivered', round_attempts = round_attempts + 1, \
                     last_status = ?3, last_error = NULL, delivered_at = ?4, updated_at = ?4 \
                     WHERE id = ?1 AND round = ?2 AND status != 'delivered'",
                )
                .ctx("record_attempts")?
                .execute(params![r.delivery_id, r.round, r.status_code, r.at])
                .ctx("record_attempts")?,
            DeliveryNext::Retry { at } => tx
                .prepare_cached(
                    "UPDATE deliveries SET round_attempts = round_attempts + 1, next_attempt_at = ?5, \
                     last_status = ?3, last_error = ?6, updated_at = ?4 \
                     WHERE id = ?1 AND round = ?2 AND status = 'pending'",
                )
                .ctx("record_attempts")?
                .execute(params![r.delivery_id, r.round, r.status_code, r.at, at, r.error])
                .ctx("record_attempts")?,
            DeliveryNext::Failed => tx
                .prepare_cached(
                    "UPDATE deliveries SET status = 'failed', round_attempts = round_attempts + 1, \
                     last_status = ?3, last_error = ?5, updated_at = ?4 \
                     WHERE id = ?1 AND round = ?2 AND status = 'pending'",
                )
                .ctx("record_attempts")?
                .execute(params![r.delivery_id, r.round, r.status_code, r.at, r.error])
                .ctx("record_attempts")?,
        };
        let outcome = match next {
            DeliveryNext::Delivered => delivery_status::DELIVERED,
            DeliveryNext::Retry { .. } => "retrying",
            DeliveryNext::Failed => delivery_status::FAILED,
        };
        tx.prepare_cached(
            "INSERT INTO delivery_attempts (delivery_id, job_id, destination_id, pool, attempt, at, \
             status_code, latency_ms, response_body, error, manual, outcome) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
        )
        .ctx("record_attempts")?
        .execute(params![
            r.delivery_id,
            r.job_id,
            r.destination_id,
            r.pool,
            r.attempt,
            r.at,
            r.status_code,
            r.latency_ms,
            r.response_body,
            r.error,
            r.manual,
            outcome
        ])
        .ctx("record_attempts")?;
    }
    Ok(exists)
}

fn event(
    tx: &Connection,
    id: &str,
    at: u64,
    status: &str,
    attempt: u32,
    detail: Option<&str>,
) -> Result<()> {
    tx.prepare_cached(
        "INSERT INTO job_events (job_id, at, status, attempt, detail) VALUES (?1, ?2, ?3, ?4, ?5)",
    )
    .ctx("job event")?
    .execute(params![id, at, status, attempt, detail])
    .ctx("job event")?;
    Ok(())
}

fn enqueue_deliveries(
    tx: &Transaction<'_>,
    id: &str,
    now: u64,
    destination_ids: &[String],
) -> Result<()> {
    let mut stmt = tx
        .prepare_cached(
            "INSERT OR IGNORE INTO deliveries (job_id, destination_id, status, attempts, next_attempt_at, created_at, updated_at, \
             request_id) \
             VALUES (?1, ?2, 'pending', 0, ?3, ?3, ?3, (SELECT request_id FROM jobs WHERE id = ?1))",
        )
        .ctx("outbox")?;
    for d in destination_ids {
        stmt.execute(params![id, d, now]).ctx("outbox")?;
    }
    Ok(())
}

/// Inserts a batch of jobs, `queued`, and their first two history steps in one transaction.
fn insert_batch(conn: &mut Connection, rows: &[(NewJob, String)]) -> Result<()> {
    let tx = conn.transaction().ctx("insert_jobs")?;
    {
        let mut stmt = tx
            .prepare_cached(
                "INSERT INTO jobs (id, pool, status, reason, key_id, fairness, priority, created_at, updated_at, \
                 expires_at, retention_ms, attempt, destinations, request, request_body, request_id) \
                 VALUES (?1, ?2, 'queued', ?3, ?4, ?5, ?6, ?7, ?7, ?8, ?9, 0, ?10, ?11, ?12, ?13)",
            )
            .ctx("insert_jobs")?;
        for (j, head) in rows {
            stmt.execute(params![
                j.id,
                j.pool,
                j.reason,
                j.key_id,
                j.fairness as i64,
                j.priority,
                j.created_at,
                j.expires_at,
                j.retention_ms,
                j.destinations,
                head,
                j.request.body,
                j.request_id
            ])
            .ctx("insert_jobs")?;
            event(
                &tx,
                &j.id,
                j.created_at,
                status::ACCEPTED,
                0,
                Some(&j.reason),
            )?;
            event(&tx, &j.id, j.created_at, status::QUEUED, 0, None)?;
        }
    }
    tx.commit().ctx("insert_jobs")
}

#[async_trait::async_trait]
impl JobStore for SqliteStore {
    async fn insert_jobs(&self, jobs: &[NewJob]) -> Result<()> {
        let mut rows = Vec::with_capacity(jobs.len());
        for j in jobs {
            let head = RequestHead {
                method: j.request.method.clone(),
                path_and_query: j.request.path_and_query.clone(),
                headers: j.request.headers.clone(),
            };
            rows.push((j.clone(), encode("insert_jobs", &head)?));
        }
        self.write(move |conn| {
            // A 202 promises the job survives power loss, not only a crashed process: this
            // commit fsyncs (and with it every earlier commit in the WAL). Other writes keep
            // `synchronous=NORMAL`, which survives process crashes; group commit keeps the
            // fsync per batch, not per job.
            conn.pragma_update(None, "synchronous", "FULL")
                .ctx("insert_jobs")?;
            let committed = insert_batch(conn, &rows);
            conn.pragma_update(None, "synchronous", "NORMAL")
                .ctx("insert_jobs")?;
            committed
        })
        .await
    }

    async fn get_job(&self, pool: &str, id: &str) -> Result<Option<StoredJob>> {
        let (pool, id) = (pool.to_owned(), id.to_owned());
        self.read(move |conn| {
            conn.prepare_cached(&format!(
                "SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?1 AND pool = ?2"
            ))
            .ctx("get_job")?
            .query_row(params![id, pool], job_from_row)
            .optional()
            .ctx("get_job")
        })
        .await
    }

    async fn list_jobs(
        &self,
        pool: &str,
        status: Option<&str>,
        before: Option<&str>,
        limit: u32,
    ) -> Result<Vec<StoredJob>> {
        let (pool, status, before) = (
            pool.to_owned(),
            status.map(str::to_owned),
            before.map(str::to_owned),
        );
        let limit = limit.clamp(1, 1000);
        self.read(move |conn| {
            // Newest first by (created_at, id); the cursor is the last id of the previous page.
            let sql = format!(
                "SELECT {JOB_COLUMNS} FROM jobs WHERE pool = ?1 AND (?2 IS NULL OR status = ?2) \
                 AND (?3 IS NULL OR (created_at, id) < (SELECT created_at, id FROM jobs WHERE id = ?3)) \
                 ORDER BY created_at DESC, id DESC LIMIT ?4"
            );
            let mut stmt = conn.prepare_cached(&sql).ctx("list_jobs")?;
            let rows = stmt.query_map(params![pool, status, before, limit], job_from_row).ctx("list_jobs")?;
            rows.collect::<rusqlite::Result<Vec<_>>>().ctx("list_jobs")
        })
        .await
    }

    async fn job_events(&self, id: &str) -> Result<Vec<JobEvent>> {
        let id = id.to_owned();
        self.read(move |conn| {
            let mut stmt = conn
                .prepare_cached("SELECT at, status, attempt, detail FROM job_events WHERE job_id = ?1 ORDER BY rowid")
                .ctx("job_events")?;
            let rows = stmt
                .query_map([id], |r| Ok(JobEvent { at: r.get(0)?, status: r.get(1)?, attempt: r.get(2)?, detail: r.get(3)? }))
                .ctx("job_events")?;
            rows.collect::<rusqlite::Result<Vec<_>>>().ctx("job_events")
        })
        .await
    }

    async fn unfinished_jobs(&self) -> Result<Vec<StoredJob>> {
        self.read(|conn| {
            let mut stmt = conn
                .prepare_cached(&format!(
                    "SELECT {JOB_COLUMNS} FROM jobs WHERE status IN ('accepted', 'queued', 'running') ORDER BY created_at, id"
                ))
                .ctx("unfinished_jobs")?;
            let rows = stmt.query_map([], job_from_row).ctx("unfinished_jobs")?;
            rows.collect::<rusqlite::Result<Vec<_>>>().ctx("unfinished_jobs")
        })
        .await
    }

    async fn unfinished_jobs_page(
        &self,
        after: Option<&JobCursor>,
        limit: u32,
    ) -> Result<Vec<UnfinishedJob>> {
        let (after_at, after_id) = match after {
            Some(c) => (Some(clamp_i64(c.created_at)), Some(c.id.clone())),
            None => (None, None),
        };
        let limit = limit.clamp(1, 1000);
        self.read(move |conn| {
            // A (created_at, id) position, not a row lookup: valid even if that job is gone.
            // `INDEXED BY`: without statistics the planner picks `jobs_status` and sorts every
            // unfinished job for each page; the partial index walks them in order instead (and
            // the statement fails to prepare, loudly, if the index ever stops applying).
            let sql = format!(
                "SELECT {JOB_HEAD_COLUMNS} FROM jobs INDEXED BY jobs_unfinished_created \
                 WHERE {UNFINISHED} \
                 AND (?1 IS NULL OR (created_at, id) > (?1, ?2)) \
                 ORDER BY created_at, id LIMIT ?3"
            );
            let mut stmt = conn.prepare_cached(&sql).ctx("unfinished_jobs_page")?;
            let rows = stmt
                .query_map(params![after_at, after_id, limit], |row| {
                    Ok(UnfinishedJob {
                        job: job_from_row(row)?,
                        body_len: row.get(21)?,
                    })
                })
                .ctx("unfinished_jobs_page")?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
                .ctx("unfinished_jobs_page")
        })
        .await
    }

    async fn claim_jobs(
        &self,
        _now: u64,
        _held: &[String],
        _limit: u32,
    ) -> Result<Option<Vec<UnfinishedJob>>> {
        Ok(None) // one node: every unfinished job is its own, resumed at start
    }

    async fn release_claims(&self, _deliveries: bool) -> Result<Released> {
        Ok(Released::default()) // one node: nothing is claimed
    }

    async fn job_request_body(&self, id: &str) -> Result<Option<Vec<u8>>> {
        let id = id.to_owned();
        self.read(move |conn| {
            conn.prepare_cached("SELECT request_body FROM jobs WHERE id = ?1")
                .ctx("job_request_body")?
                .query_row([id], |r| r.get(0))
                .optional()
                .ctx("job_request_body")
        })
        .await
    }

    async fn count_unfinished_jobs(&self, pool: &str) -> Result<u64> {
        let pool = pool.to_owned();
        self.read(move |conn| {
            conn.prepare_cached(&format!(
                "SELECT COUNT(*) FROM jobs INDEXED BY jobs_unfinished_pool \
                 WHERE pool = ?1 AND {UNFINISHED}"
            ))
            .ctx("count_unfinished_jobs")?
            .query_row([pool], |r| r.get(0))
            .ctx("count_unfinished_jobs")
        })
        .await
    }

    async fn unfinished_job_counts(&self) -> Result<Vec<(String, u64)>> {
        self.read(move |conn| {
            let mut stmt = conn
                .prepare_cached(&format!(
                    "SELECT pool, COUNT(*) FROM jobs WHERE {UNFINISHED} GROUP BY pool ORDER BY pool"
                ))
                .ctx("unfinished_job_counts")?;
            let rows = stmt
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .ctx("unfinished_job_counts")?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
                .ctx("unfinished_job_counts")
        })
        .await
    }

    async fn mark_queued(&self, id: &str, now: u64) -> Result<()> {
        let id = id.to_owned();
        self.write(move |conn| {
            let tx = conn.transaction().ctx("mark_queued")?;
            let n = tx
                .execute("UPDATE jobs SET status = 'queued', updated_at = ?2 WHERE id = ?1 AND status = 'accepted'", params![id, now])
                .ctx("mark_queued")?;
            if n > 0 {
                event(&tx, &id, now, status::QUEUED, 0, None)?;
            }
            tx.commit().ctx("mark_queued")
        })
        .await
    }

    async fn start_attempt(&self, id: &str, now: u64) -> Result<Option<u32>> {
        let id = id.to_owned();
        self.write(move |conn| {
            let tx = conn.transaction().ctx("start_attempt")?;
            let attempt: Option<u32> = tx
                .query_row(
                    "UPDATE jobs SET status = 'running', attempt = attempt + 1, updated_at = ?2 \
                     WHERE id = ?1 AND status IN ('accepted', 'queued', 'running') RETURNING attempt",
                    params![id, now],
                    |r| r.get(0),
                )
                .optional()
                .ctx("start_attempt")?;
            if let Some(a) = attempt {
                event(&tx, &id, now, status::RUNNING, a, None)?;
            }
            tx.commit().ctx("start_attempt")?;
            Ok(attempt)
        })
        .await
    }

    async fn retry_attempt(&self, id: &str, attempt: u32, now: u64, detail: &str) -> Result<bool> {
        let (id, detail) = (id.to_owned(), detail.to_owned());
        self.write(move |conn| {
            let tx = conn.transaction().ctx("retry_attempt")?;
            let n = tx
                .execute(
                    "UPDATE jobs SET status = 'queued', updated_at = ?3, error = ?4 \
                     WHERE id = ?1 AND attempt = ?2 AND status = 'running'",
                    params![id, attempt, now, detail],
                )
                .ctx("retry_attempt")?;
            if n > 0 {
                event(&tx, &id, now, status::QUEUED, attempt, Some(&detail))?;
            }
            tx.commit().ctx("retry_attempt")?;
            Ok(n > 0)
        })
        .await
    }

    async fn finish_attempt(
        &self,
        id: &str,
        attempt: u32,
        finish: &Finish,
        now: u64,
        destination_ids: &[String],
    ) -> Result<bool> {
        let id = id.to_owned();
        let dests = destination_ids.to_vec();
        let (new_status, error, head, body) = match finish {
            Finish::Completed(r) => {
                let head = ResultHead {
                    status: r.status,
                    headers: r.headers.clone(),
                    truncated: r.truncated,
                };
                (
                    status::COMPLETED,
                    None,
                    Some(encode("finish_attempt", &head)?),
                    Some(r.body.clone()),
                )
            }
            Finish::Failed(e) => (status::FAILED, Some(e.clone()), None, None),
        };
        self.write(move |conn| {
            let tx = conn.transaction().ctx("finish_attempt")?;
            let n = tx
                .execute(
                    "UPDATE jobs SET status = ?3, updated_at = ?4, error = ?5, result = ?6, result_body = ?7 \
                     WHERE id = ?1 AND attempt = ?2 AND status = 'running'",
                    params![id, attempt, new_status, now, error, head, body],
                )
                .ctx("finish_attempt")?;
            if n > 0 {
                event(&tx, &id, now, new_status, attempt, error.as_deref())?;
                enqueue_deliveries(&tx, &id, now, &dests)?;
            }
            tx.commit().ctx("finish_attempt")?;
            Ok(n > 0)
        })
        .await
    }

    async fn expire_jobs(
        &self,
        now: u64,
        active_destinations: &std::collections::HashMap<String, Vec<String>>,
    ) -> Result<Vec<String>> {
        let due: Vec<(String, String)> = self
            .read(move |conn| {
                let mut stmt = conn
                    .prepare_cached("SELECT id, pool FROM jobs WHERE status IN ('accepted', 'queued', 'running') AND expires_at <= ?1")
                    .ctx("expire_jobs")?;
                let rows = stmt.query_map([now], |r| Ok((r.get(0)?, r.get(1)?))).ctx("expire_jobs")?;
                rows.collect::<rusqlite::Result<Vec<_>>>().ctx("expire_jobs")
            })
            .await?;
        if due.is_empty() {
            return Ok(Vec::new());
        }
        let with_dests: Vec<(String, Vec<String>)> = due
            .into_iter()
            .map(|(id, pool)| {
                let d = active_destinations.get(&pool).cloned().unwrap_or_default();
                (id, d)
            })
            .collect();
        self.write(move |conn| {
            let tx = conn.transaction().ctx("expire_jobs")?;
            let mut expired = Vec::new();
            for (id, dests) in &with_dests {
                let n = tx
                    .execute(
                        "UPDATE jobs SET status = 'expired', updated_at = ?2 \
                         WHERE id = ?1 AND status IN ('accepted', 'queued', 'running')",
                        params![id, now],
                    )
                    .ctx("expire_jobs")?;
                if n > 0 {
                    event(&tx, id, now, status::EXPIRED, 0, None)?;
                    enqueue_deliveries(&tx, id, now, dests)?;
                    expired.push(id.clone());
                }
            }
            tx.commit().ctx("expire_jobs")?;
            Ok(expired)
        })
        .await
    }

    async fn delete_retained(&self, now: u64) -> Result<u64> {
        self.write(move |conn| {
            let tx = conn.transaction().ctx("delete_retained")?;
            let cond =
                "status IN ('completed', 'failed', 'expired') AND updated_at + retention_ms <= ?1";
            tx.execute(
                &format!(
                    "DELETE FROM job_events WHERE job_id IN (SELECT id FROM jobs WHERE {cond})"
                ),
                [now],
            )
            .ctx("delete_retained")?;
            tx.execute(
                &format!(
                    "DELETE FROM delivery_attempts WHERE job_id IN (SELECT id FROM jobs WHERE {cond})"
                ),
                [now],
            )
            .ctx("delete_retained")?;
            tx.execute(
                &format!(
                    "DELETE FROM deliveries WHERE job_id IN (SELECT id FROM jobs WHERE {cond})"
                ),
                [now],
            )
            .ctx("delete_retained")?;
            let n = tx
                .execute(&format!("DELETE FROM jobs WHERE {cond}"), [now])
                .ctx("delete_retained")?;
            tx.commit().ctx("delete_retained")?;
            Ok(n as u64)
        })
        .await
    }

    async fn list_destinations(&self, pool: Option<&str>) -> Result<Vec<StoredDestination>> {
        let pool = pool.map(str::to_owned);
        self.read(move |conn| {
            let mut stmt = conn
                .prepare_cached(&format!(
                    "SELECT {DEST_COLUMNS} FROM webhook_destinations WHERE ?1 IS NULL OR pool = ?1 ORDER BY created_at, id"
                ))
                .ctx("list_destinations")?;
            let rows = stmt.query_map([pool], dest_from_row).ctx("list_destinations")?;
            rows.collect::<rusqlite::Result<Vec<_>>>().ctx("list_destinations")
        })
        .await
    }

    async fn create_destination(&self, d: &StoredDestination) -> Result<()> {
        let d = d.clone();
        self.write(move |conn| {
            conn.execute(
                &format!("INSERT INTO webhook_destinations ({DEST_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)"),
                params![
                    d.id,
                    d.pool,
                    d.url,
                    d.secret,
                    d.active,
                    d.deactivate_after,
                    d.consecutive_failures,
                    d.deactivated_at,
                    d.managed_by,
                    d.created_at,
                    d.previous_secret,
                    d.previous_secret_expires_at
                ],
            )
            .ctx("create_destination")
            .map(drop)
        })
        .await
    }

    async fn update_destination(&self, d: &StoredDestination) -> Result<bool> {
        let d = d.clone();
        self.write(move |conn| {
            let n = conn
                .execute(
                    "UPDATE webhook_destinations SET url = ?3, secret = ?4, active = ?5, deactivate_after = ?6, \
                     consecutive_failures = ?7, deactivated_at = ?8 WHERE id = ?1 AND pool = ?2",
                    params![d.id, d.pool, d.url, d.secret, d.active, d.deactivate_after, d.consecutive_failures, d.deactivated_at],
                )
                .ctx("update_destination")?;
            Ok(n > 0)
        })
        .await
    }

    async fn delete_destination(&self, pool: &str, id: &str) -> Result<bool> {
        let (pool, id) = (pool.to_owned(), id.to_owned());
        self.write(move |conn| {
            let n = conn
                .execute(
                    "DELETE FROM webhook_destinations WHERE id = ?1 AND pool = ?2",
                    params![id, pool],
                )
                .ctx("delete_destination")?;
            Ok(n > 0)
        })
        .await
    }

    async fn rotate_destination_secret(
        &self,
        pool: &str,
        id: &str,
        secret: &str,
        previous_expires_at: Option<u64>,
    ) -> Result<bool> {
        let (pool, id, secret) = (pool.to_owned(), id.to_owned(), secret.to_owned());
        self.write(move |conn| {
            let n = conn
                .execute(
                    "UPDATE webhook_destinations SET \
                     previous_secret = CASE WHEN ?4 IS NULL THEN NULL ELSE secret END, \
                     previous_secret_expires_at = ?4, secret = ?3 WHERE id = ?1 AND pool = ?2",
                    params![id, pool, secret, previous_expires_at],
                )
                .ctx("rotate_destination_secret")?;
            Ok(n > 0)
        })
        .await
    }

    async fn due_deliveries(
        &self,
        destination_id: &str,
        now: u64,
        limit: u32,
        exclude: &[u64],
    ) -> Result<Vec<DueDelivery>> {
        let destination_id = destination_id.to_owned();
        let exclude = encode("due_deliveries", &exclude)?;
        self.read(move |conn| {
            let destination = conn
                .prepare_cached(&format!(
                    "SELECT {DEST_COLUMNS} FROM webhook_destinations WHERE id = ?1 AND active = 1"
                ))
                .ctx("due_deliveries")?
                .query_row([&destination_id], dest_from_row)
                .optional()
                .ctx("due_deliveries")?;
            let Some(destination) = destination else {
                return Ok(Vec::new());
            };
            let rows: Vec<(u64, String, u32, u32, u32, bool)> = {
                let mut stmt = conn
                    .prepare_cached(
                        "SELECT id, job_id, attempts, round_attempts, round, manual FROM deliveries \
                         WHERE destination_id = ?1 AND status = 'pending' AND next_attempt_at <= ?2 \
                         AND id NOT IN (SELECT value FROM json_each(?4)) \
                         ORDER BY next_attempt_at, id LIMIT ?3",
                    )
                    .ctx("due_deliveries")?;
                let rows = stmt
                    .query_map(params![destination_id, now, limit, exclude], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?))
                    })
                    .ctx("due_deliveries")?;
                rows.collect::<rusqlite::Result<Vec<_>>>()
                    .ctx("due_deliveries")?
            };
            let mut job_stmt = conn
                .prepare_cached(&format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?1"))
                .ctx("due_deliveries")?;
            let mut due = Vec::with_capacity(rows.len());
            for (id, job_id, attempts, round_attempts, round, manual) in rows {
                // Deliveries go with their job at retention; a missing job has nothing to send.
                if let Some(job) = job_stmt
                    .query_row([&job_id], job_from_row)
                    .optional()
                    .ctx("due_deliveries")?
                {
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
            }
            Ok(due)
        })
        .await
    }

    async fn next_delivery_at(&self, destination_id: &str, after: u64) -> Result<Option<u64>> {
        let destination_id = destination_id.to_owned();
        self.read(move |conn| {
            conn.prepare_cached(
                "SELECT MIN(next_attempt_at) FROM deliveries \
                 WHERE destination_id = ?1 AND status = 'pending' AND next_attempt_at > ?2",
            )
            .ctx("next_delivery_at")?
            .query_row(params![destination_id, after], |r| r.get(0))
            .ctx("next_delivery_at")
        })
        .await
    }

    async fn record_attempts(&self, records: &[AttemptRecord]) -> Result<Vec<AttemptApplied>> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let records = records.to_vec();
        self.write(move |conn| {
            let tx = conn.transaction().ctx("record_attempts")?;
            let mut applied = Vec::with_capacity(records.len());
            for r in &records {
                applied.push(apply_attempt(&tx, r)?);
            }
            tx.commit().ctx("record_attempts")?;
            Ok(applied)
        })
        .await
    }

    async fn fail_undeliverable(&self, active_destination_ids: &[String], now: u64) -> Result<u64> {
        let active = encode("fail_undeliverable", &active_destination_ids)?;
        self.write(move |conn| {
            let n = conn
                .execute(
                    "UPDATE deliveries SET status = 'failed', \
                     last_error = 'destination deactivated or deleted', updated_at = ?2 \
                     WHERE status = 'pending' AND destination_id NOT IN (SELECT value FROM json_each(?1))",
                    params![active, now],
                )
                .ctx("fail_undeliverable")?;
            Ok(n as u64)
        })
        .await
    }

    async fn list_attempts(&self, query: &AttemptQuery) -> Result<Vec<DeliveryAttempt>> {
        let (sql, args) = attempts_sql(query);
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(&sql).ctx("list_attempts")?;
            let rows = stmt
                .query_map(rusqlite::params_from_iter(args), attempt_from_row)
                .ctx("list_attempts")?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
                .ctx("list_attempts")
        })
        .await
    }

    async fn job_deliveries(&self, job_id: &str) -> Result<Vec<DeliveryState>> {
        let job_id = job_id.to_owned();
        self.read(move |conn| {
            let mut stmt = conn
                .prepare_cached(&format!(
                    "SELECT {DELIVERY_COLUMNS} FROM deliveries WHERE job_id = ?1 ORDER BY id"
                ))
                .ctx("job_deliveries")?;
            let rows = stmt
                .query_map([job_id], delivery_from_row)
                .ctx("job_deliveries")?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
                .ctx("job_deliveries")
        })
        .await
    }

    async fn redeliver_job(
        &self,
        pool: &str,
        job_id: &str,
        destination_ids: &[String],
        now: u64,
    ) -> Result<Redeliver> {
        let (pool, job_id, dests) = (pool.to_owned(), job_id.to_owned(), destination_ids.to_vec());
        self.write(move |conn| {
            let tx = conn.transaction().ctx("redeliver_job")?;
            let job_status: Option<String> = tx
                .query_row(
                    "SELECT status FROM jobs WHERE id = ?1 AND pool = ?2",
                    params![job_id, pool],
                    |r| r.get(0),
                )
                .optional()
                .ctx("redeliver_job")?;
            let Some(job_status) = job_status else {
                return Ok(Redeliver::NoSuchJob);
            };
            if !status::is_terminal(&job_status) {
                return Ok(Redeliver::NotTerminal);
            }
            let mut queued = 0u32;
            {
                let mut stmt = tx
                    .prepare_cached(
                        "INSERT INTO deliveries (job_id, destination_id, status, attempts, next_attempt_at, \
                         created_at, updated_at, manual, round, round_attempts, request_id) \
                         VALUES (?1, ?2, 'pending', 0, ?3, ?3, ?3, 1, 0, 0, \
                         (SELECT request_id FROM jobs WHERE id = ?1)) \
                         ON CONFLICT (job_id, destination_id) DO UPDATE SET status = 'pending', \
                         next_attempt_at = excluded.next_attempt_at, updated_at = excluded.updated_at, \
                         manual = 1, round = round + 1, round_attempts = 0, delivered_at = NULL",
                    )
                    .ctx("redeliver_job")?;
                for d in &dests {
                    queued += stmt.execute(params![job_id, d, now]).ctx("redeliver_job")? as u32;
                }
            }
            tx.commit().ctx("redeliver_job")?;
            Ok(Redeliver::Queued(queued))
        })
        .await
    }
}
