//! The access log on PostgreSQL: a plain table, one row per entry, written a batch per
//! statement (with the batch's bumps of folded rows' counts). Ids come from the table's identity sequence, taken for the whole batch before the
//! insert, so a batch's entries get increasing ids in their order (the trait returns them in
//! order) and ids stay unique across every node writing the same table.

use deadpool_postgres::Object;

use crate::postgres::{big, Ctx};
use crate::{AccessLogEntry, Result};

/// Inserts `entries` and adds each of `bumps` (`(id, more)`) to its row's `count`, in one
/// statement (one round trip, one transaction: all of it or none); returns the new rows' ids,
/// in order.
pub(crate) async fn append(
    conn: &Object,
    entries: &[AccessLogEntry],
    bumps: &[(u64, u64)],
) -> Result<Vec<u64>> {
    // As on SQLite: a time past a signed 64-bit integer is no time at all.
    if let Some(e) = entries.iter().find(|e| i64::try_from(e.at).is_err()) {
        return Err(crate::StoreError::Backend(format!(
            "append_access_log: entry time {} is out of range",
            e.at
        )));
    }
    let col = |f: fn(&AccessLogEntry) -> i64| entries.iter().map(f).collect::<Vec<i64>>();
    let text = |f: fn(&AccessLogEntry) -> &str| entries.iter().map(f).collect::<Vec<&str>>();
    let opt = |f: fn(&AccessLogEntry) -> Option<&str>| {
        entries.iter().map(f).collect::<Vec<Option<&str>>>()
    };
    let opt_n =
        |f: fn(&AccessLogEntry) -> Option<i64>| entries.iter().map(f).collect::<Vec<Option<i64>>>();
    let bump_ids: Vec<i64> = bumps.iter().map(|(id, _)| big(*id)).collect();
    let bump_more: Vec<i64> = bumps.iter().map(|(_, more)| big(*more)).collect();
    // The ids are taken for the whole batch, then handed out in increasing order to the
    // entries in theirs. A row bumped twice gets both bumps (one UPDATE sees a row once).
    let found = conn
        .query(
            "WITH t AS (SELECT nextval(pg_get_serial_sequence('access_log', 'id')) AS id \
               FROM generate_series(1, cardinality($1::BIGINT[]))), \
             ids AS (SELECT id, row_number() OVER (ORDER BY id) AS n FROM t), \
             e AS (SELECT * FROM UNNEST($1::BIGINT[], $2::TEXT[], $3::TEXT[], $4::TEXT[], \
               $5::TEXT[], $6::TEXT[], $7::TEXT[], $8::BIGINT[], $9::BIGINT[], $10::BIGINT[], \
               $11::BIGINT[], $12::BIGINT[], $13::TEXT[]) WITH ORDINALITY AS u(at, pool, \
               key_id, client_addr, route, outcome, reason, status, queued_ms, upstream_status, \
               upstream_latency_ms, count, request_id, n)), \
             i AS (INSERT INTO access_log (id, pool, at, key_id, client_addr, route, outcome, \
               reason, status, queued_ms, upstream_status, upstream_latency_ms, count, \
               request_id) \
               SELECT ids.id, pool, at, key_id, client_addr, route, outcome, reason, status, \
               queued_ms, upstream_status, upstream_latency_ms, count, request_id \
               FROM e JOIN ids ON ids.n = e.n), \
             b AS (UPDATE access_log a SET count = a.count + m.more \
               FROM (SELECT id, SUM(more)::BIGINT AS more \
                     FROM UNNEST($14::BIGINT[], $15::BIGINT[]) AS x(id, more) GROUP BY id) m \
               WHERE a.id = m.id) \
             SELECT id FROM ids ORDER BY n",
            &[
                &col(|e| big(e.at)),
                &text(|e| &e.pool),
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
                &bump_ids,
                &bump_more,
            ],
        )
        .await
        .ctx("append_access_log")?;
    found
        .iter()
        .map(|r| r.try_get::<_, i64>(0).map(|id| id.max(0) as u64))
        .collect::<std::result::Result<Vec<u64>, _>>()
        .ctx("append_access_log: ids")
}
