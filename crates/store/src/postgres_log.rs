//! The access log on PostgreSQL: a plain table, one row per entry, written a batch per
//! statement. Ids come from the table's identity sequence, taken for the whole batch before the
//! insert, so a batch's entries get increasing ids in their order (the trait returns them in
//! order) and ids stay unique across every node writing the same table.

use deadpool_postgres::Transaction;

use crate::postgres::{big, Ctx};
use crate::{AccessLogEntry, Result};

/// Inserts `entries` in the open transaction; returns their ids, in order.
pub(crate) async fn append(tx: &Transaction<'_>, entries: &[AccessLogEntry]) -> Result<Vec<u64>> {
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    // As on SQLite: a time past a signed 64-bit integer is no time at all.
    if let Some(e) = entries.iter().find(|e| i64::try_from(e.at).is_err()) {
        return Err(crate::StoreError::Backend(format!(
            "append_access_log: entry time {} is out of range",
            e.at
        )));
    }
    let n = i64::try_from(entries.len()).unwrap_or(i64::MAX);
    let taken = tx
        .query(
            "SELECT nextval(pg_get_serial_sequence('access_log', 'id')) \
             FROM generate_series(1, $1::BIGINT)",
            &[&n],
        )
        .await
        .ctx("append_access_log: ids")?;
    let mut ids = taken
        .iter()
        .map(|r| r.try_get::<_, i64>(0))
        .collect::<std::result::Result<Vec<i64>, _>>()
        .ctx("append_access_log: ids")?;
    ids.sort_unstable();
    let col = |f: fn(&AccessLogEntry) -> i64| entries.iter().map(f).collect::<Vec<i64>>();
    let text = |f: fn(&AccessLogEntry) -> &str| entries.iter().map(f).collect::<Vec<&str>>();
    let opt = |f: fn(&AccessLogEntry) -> Option<&str>| {
        entries.iter().map(f).collect::<Vec<Option<&str>>>()
    };
    let opt_n =
        |f: fn(&AccessLogEntry) -> Option<i64>| entries.iter().map(f).collect::<Vec<Option<i64>>>();
    tx.execute(
        "INSERT INTO access_log (id, pool, at, key_id, client_addr, route, outcome, reason, \
         status, queued_ms, upstream_status, upstream_latency_ms, count, request_id) \
         SELECT * FROM UNNEST($1::BIGINT[], $2::TEXT[], $3::BIGINT[], $4::TEXT[], $5::TEXT[], \
         $6::TEXT[], $7::TEXT[], $8::TEXT[], $9::BIGINT[], $10::BIGINT[], $11::BIGINT[], \
         $12::BIGINT[], $13::BIGINT[], $14::TEXT[])",
        &[
            &ids,
            &text(|e| &e.pool),
            &col(|e| big(e.at)),
            &opt(|e| e.key_id.as_deref()),
            &text(|e| &e.client_addr),
            &text(|e| &e.route),
            &text(|e| &e.outcome),
            &opt(|e| e.reason.as_deref()),
            &col(|e| i64::from(e.status)),
            &col(|e| big(e.queued_ms)),
            &opt_n(|e| e.upstream_status.map(i64::from)),
            &opt_n(|e| e.upstream_latency_ms.map(big)),
            &col(|e| big(e.count.max(1))),
            &opt(|e| e.request_id.as_deref()),
        ],
    )
    .await
    .ctx("append_access_log")?;
    Ok(ids.into_iter().map(|id| id.max(0) as u64).collect())
}
