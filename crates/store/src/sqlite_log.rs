//! The access log on SQLite, kept in pages: each batch the writer commits becomes one row per
//! pool (`access_log_pages`) whose `body` packs that pool's entries (postcard, oldest first),
//! instead of one SQLite row per request.
//!
//! Why pages: a row per request cost about as much CPU as the rest of the proxied request put
//! together (the insert into the table and its `(pool, id)` index, the AUTOINCREMENT
//! bookkeeping, then the delete when the row is trimmed, each a B-tree walk). A page is written
//! and deleted once for hundreds of entries. Entries keep everything they had: their own
//! monotonic id (the pagination cursor), every column, and their count.
//!
//! - Ids come from `store_meta.access_log_next_id`, advanced once per batch, so an id is never
//!   handed out twice, even after the newest entries were trimmed or their pool deleted.
//! - A pool's pages never overlap in ids (a batch's entries get increasing ids), so pages in
//!   `last_id` order, each read backwards, give the entries newest first.
//! - Folded refusals bumped after their entry was written add to `access_log_counts` (by entry
//!   id) rather than rewriting the page; a read adds them. Counts of entries no page holds any
//!   more are dropped by the next trim.
//! - A trim keeps exactly the newest `keep` entries: whole pages go, and the one page that
//!   straddles the boundary is rewritten with its newer entries only.
//!
//! Owns the three tables named above and nothing else; knows nothing of who writes the log.

use std::collections::HashMap;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use serde::{Deserialize, Serialize};

use crate::sqlite::{clamp_i64, Ctx, SqliteStore};
use crate::{AccessLogEntry, AccessLogQuery, Result, StoreError};

/// Entries in one page at most: small enough that a trim's rewrite of the boundary page and a
/// read of the newest few entries stay cheap, large enough to amortise a row's B-tree work.
pub(crate) const PAGE_ENTRIES: usize = 512;

/// Hard bounds for `AccessLogQuery::limit`.
const MIN_LIMIT: u32 = 1;
const MAX_LIMIT: u32 = 1000;

/// Schema v9: the pages, the later counts of folded refusals, and the id high-water mark.
pub(crate) const SCHEMA_V9: &str = "CREATE TABLE IF NOT EXISTS access_log_pages (
        page     INTEGER PRIMARY KEY,
        pool     TEXT NOT NULL,
        first_id INTEGER NOT NULL,
        last_id  INTEGER NOT NULL,
        min_at   INTEGER NOT NULL,
        max_at   INTEGER NOT NULL,
        entries  INTEGER NOT NULL,
        body     BLOB NOT NULL
    );
    CREATE INDEX IF NOT EXISTS access_log_pages_pool
        ON access_log_pages (pool, last_id, first_id, entries);
    CREATE TABLE IF NOT EXISTS access_log_counts (
        id    INTEGER PRIMARY KEY,
        extra INTEGER NOT NULL
    );
    CREATE TABLE IF NOT EXISTS store_meta (
        name  TEXT PRIMARY KEY NOT NULL,
        value INTEGER NOT NULL
    ) WITHOUT ROWID;";

const NEXT_ID: &str = "access_log_next_id";

/// One entry as a page packs it: the pool is the page's. Field order is the format: append
/// new fields at the end only, as `Option`s (postcard has no field names).
#[derive(Serialize)]
struct PackedRef<'a> {
    id: u64,
    at: u64,
    key_id: Option<&'a str>,
    client_addr: &'a str,
    route: &'a str,
    outcome: &'a str,
    reason: Option<&'a str>,
    status: u16,
    queued_ms: u64,
    upstream_status: Option<u16>,
    upstream_latency_ms: Option<u64>,
    count: u64,
    request_id: Option<&'a str>,
}

/// [`PackedRef`], read back.
#[derive(Deserialize)]
struct Packed {
    id: u64,
    at: u64,
    key_id: Option<String>,
    client_addr: String,
    route: String,
    outcome: String,
    reason: Option<String>,
    status: u16,
    queued_ms: u64,
    upstream_status: Option<u16>,
    upstream_latency_ms: Option<u64>,
    count: u64,
    request_id: Option<String>,
}

impl Packed {
    fn into_entry(self, pool: &str) -> AccessLogEntry {
        AccessLogEntry {
            id: self.id,
            pool: pool.to_owned(),
            at: self.at,
            key_id: self.key_id,
            client_addr: self.client_addr,
            route: self.route,
            outcome: self.outcome,
            reason: self.reason,
            status: self.status,
            queued_ms: self.queued_ms,
            upstream_status: self.upstream_status,
            upstream_latency_ms: self.upstream_latency_ms,
            count: self.count,
            request_id: self.request_id,
        }
    }
}

fn pack(body: &mut Vec<u8>, id: u64, e: &AccessLogEntry) -> Result<()> {
    let packed = PackedRef {
        id,
        at: e.at,
        key_id: e.key_id.as_deref(),
        client_addr: &e.client_addr,
        route: &e.route,
        outcome: &e.outcome,
        reason: e.reason.as_deref(),
        status: e.status,
        queued_ms: e.queued_ms,
        upstream_status: e.upstream_status,
        upstream_latency_ms: e.upstream_latency_ms,
        count: e.count.max(1),
        request_id: e.request_id.as_deref(),
    };
    let taken = std::mem::take(body);
    *body = postcard::to_extend(&packed, taken)
        .map_err(|e| StoreError::Backend(format!("packing an access-log entry: {e}")))?;
    Ok(())
}

/// A page's entries, oldest first.
fn unpack(body: &[u8], entries: usize) -> Result<Vec<Packed>> {
    let mut out = Vec::with_capacity(entries.min(PAGE_ENTRIES));
    let mut rest = body;
    while !rest.is_empty() {
        let (packed, tail) = postcard::take_from_bytes::<Packed>(rest)
            .map_err(|e| StoreError::Backend(format!("reading an access-log page: {e}")))?;
        out.push(packed);
        rest = tail;
    }
    Ok(out)
}

fn next_id(tx: &Transaction<'_>) -> Result<u64> {
    let next: Option<i64> = tx
        .query_row(
            "SELECT value FROM store_meta WHERE name = ?1",
            [NEXT_ID],
            |row| row.get(0),
        )
        .optional()
        .ctx("reading the access log's next id")?;
    Ok(next.map_or(1, |n| u64::try_from(n).unwrap_or(1).max(1)))
}

fn set_next_id(tx: &Transaction<'_>, next: u64) -> Result<()> {
    tx.prepare_cached(
        "INSERT INTO store_meta (name, value) VALUES (?1, ?2) \
         ON CONFLICT (name) DO UPDATE SET value = excluded.value",
    )
    .and_then(|mut stmt| stmt.execute(params![NEXT_ID, clamp_i64(next)]))
    .ctx("writing the access log's next id")
    .map(drop)
}

/// Writes one page of `pool`: `entries` with their ids, oldest first.
fn insert_page(tx: &Transaction<'_>, pool: &str, entries: &[(u64, &AccessLogEntry)]) -> Result<()> {
    let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
        return Ok(());
    };
    let mut body = Vec::with_capacity(entries.len() * 96);
    let (mut min_at, mut max_at) = (u64::MAX, 0);
    for (id, e) in entries {
        pack(&mut body, *id, e)?;
        min_at = min_at.min(e.at);
        max_at = max_at.max(e.at);
    }
    tx.prepare_cached(
        "INSERT INTO access_log_pages (pool, first_id, last_id, min_at, max_at, entries, body) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )
    .and_then(|mut stmt| {
        stmt.execute(params![
            pool,
            clamp_i64(first.0),
            clamp_i64(last.0),
            clamp_i64(min_at),
            clamp_i64(max_at),
            entries.len() as i64,
            body
        ])
    })
    .ctx("append_access_log")
    .map(drop)
}

/// Appends `entries` (ids assigned here, in order) and the later counts `bumps`, in the open
/// transaction. Returns the ids.
pub(crate) fn append(
    tx: &Transaction<'_>,
    entries: &[AccessLogEntry],
    bumps: &[(u64, u64)],
) -> Result<Vec<u64>> {
    // The time bounds of a page are SQL integers; a time past them is no time at all.
    if let Some(e) = entries.iter().find(|e| i64::try_from(e.at).is_err()) {
        return Err(StoreError::Backend(format!(
            "append_access_log: entry time {} is out of range",
            e.at
        )));
    }
    let mut ids = Vec::with_capacity(entries.len());
    if !entries.is_empty() {
        let first = next_id(tx)?;
        // Each pool's entries in batch order, so its pages never overlap in ids.
        let mut by_pool: Vec<(&str, Vec<(u64, &AccessLogEntry)>)> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let id = first + i as u64;
            ids.push(id);
            match by_pool.iter_mut().find(|(pool, _)| *pool == e.pool) {
                Some((_, list)) => list.push((id, e)),
                None => by_pool.push((&e.pool, vec![(id, e)])),
            }
        }
        for (pool, list) in &by_pool {
            for page in list.chunks(PAGE_ENTRIES) {
                insert_page(tx, pool, page)?;
            }
        }
        set_next_id(tx, first + entries.len() as u64)?;
    }
    if !bumps.is_empty() {
        let mut stmt = tx
            .prepare_cached(
                "INSERT INTO access_log_counts (id, extra) VALUES (?1, ?2) \
                 ON CONFLICT (id) DO UPDATE SET extra = extra + excluded.extra",
            )
            .ctx("append_access_log")?;
        for (id, more) in bumps {
            stmt.execute(params![clamp_i64(*id), clamp_i64(*more)])
                .ctx("append_access_log")?;
        }
    }
    Ok(ids)
}

/// The newest entries of `pool` that pass the query's filters, newest first.
pub(crate) fn query(
    conn: &Connection,
    pool: &str,
    q: &AccessLogQuery,
) -> Result<Vec<AccessLogEntry>> {
    let limit = q.limit.clamp(MIN_LIMIT, MAX_LIMIT) as usize;
    let before = q.before.map_or(i64::MAX, clamp_i64);
    let since = q.since.map_or(0, clamp_i64);
    let until = q.until.map_or(i64::MAX, clamp_i64);
    let mut stmt = conn
        .prepare_cached(
            "SELECT entries, body FROM access_log_pages \
             WHERE pool = ?1 AND first_id < ?2 AND max_at >= ?3 AND min_at < ?4 \
             ORDER BY last_id DESC",
        )
        .ctx("query_access_log")?;
    let mut pages = stmt
        .query(params![pool, before, since, until])
        .ctx("query_access_log")?;
    let mut found: Vec<AccessLogEntry> = Vec::new();
    while let Some(page) = pages.next().ctx("query_access_log")? {
        let entries: i64 = page.get(0).ctx("query_access_log")?;
        let body = page.get_ref(1).ctx("query_access_log")?;
        let body = body
            .as_blob()
            .map_err(|e| StoreError::Backend(format!("query_access_log: {e}")))?;
        let unpacked = unpack(body, usize::try_from(entries).unwrap_or(0))?;
        for packed in unpacked.into_iter().rev() {
            let keep = q.before.is_none_or(|b| packed.id < b)
                && q.since.is_none_or(|s| packed.at >= s)
                && q.until.is_none_or(|u| packed.at < u)
                && q.outcome.as_deref().is_none_or(|o| packed.outcome == o)
                && q.key_id
                    .as_deref()
                    .is_none_or(|k| packed.key_id.as_deref() == Some(k));
            if keep {
                found.push(packed.into_entry(pool));
                if found.len() == limit {
                    break;
                }
            }
        }
        if found.len() == limit {
            break;
        }
    }
    add_later_counts(conn, &mut found)?;
    Ok(found)
}

/// Adds what folded refusals counted after their entry was written.
fn add_later_counts(conn: &Connection, found: &mut [AccessLogEntry]) -> Result<()> {
    let (Some(newest), Some(oldest)) = (found.first(), found.last()) else {
        return Ok(());
    };
    let mut stmt = conn
        .prepare_cached("SELECT id, extra FROM access_log_counts WHERE id BETWEEN ?1 AND ?2")
        .ctx("query_access_log")?;
    let extra: HashMap<u64, u64> = stmt
        .query_map(params![clamp_i64(oldest.id), clamp_i64(newest.id)], |row| {
            Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?))
        })
        .ctx("query_access_log")?
        .filter_map(|row| row.ok())
        .map(|(id, n)| (id as u64, n.max(0) as u64))
        .collect();
    if extra.is_empty() {
        return Ok(());
    }
    for e in found.iter_mut() {
        if let Some(n) = extra.get(&e.id) {
            e.count = e.count.saturating_add(*n);
        }
    }
    Ok(())
}

/// Keeps the newest `keep` entries of `pool`, in the open transaction; returns how many went.
pub(crate) fn trim(tx: &Transaction<'_>, pool: &str, keep: u64) -> Result<u64> {
    let pages: Vec<(i64, u64)> = {
        let mut stmt = tx
            .prepare_cached(
                "SELECT page, entries FROM access_log_pages WHERE pool = ?1 ORDER BY last_id DESC",
            )
            .ctx("trim_access_log")?;
        let rows = stmt
            .query_map([pool], |row| {
                Ok((row.get(0)?, row.get::<_, i64>(1)?.max(0) as u64))
            })
            .ctx("trim_access_log")?;
        rows.collect::<rusqlite::Result<_>>()
            .ctx("trim_access_log")?
    };
    let mut kept = 0u64;
    let mut removed = 0u64;
    let mut doomed: Vec<i64> = Vec::new();
    for (page, entries) in pages {
        let room = keep.saturating_sub(kept);
        if room >= entries {
            kept += entries;
        } else if room == 0 {
            removed += entries;
            doomed.push(page);
        } else {
            // The boundary: keep its newest `room` entries.
            rewrite_newest(tx, page, room as usize)?;
            kept += room;
            removed += entries - room;
        }
    }
    if removed == 0 {
        return Ok(0);
    }
    {
        let mut stmt = tx
            .prepare_cached("DELETE FROM access_log_pages WHERE page = ?1")
            .ctx("trim_access_log")?;
        for page in doomed {
            stmt.execute([page]).ctx("trim_access_log")?;
        }
    }
    tx.execute(
        "DELETE FROM access_log_counts \
         WHERE id < (SELECT COALESCE(MIN(first_id), 9223372036854775807) FROM access_log_pages)",
        [],
    )
    .ctx("trim_access_log")?;
    Ok(removed)
}

/// Rewrites `page` with only its newest `keep` entries.
fn rewrite_newest(tx: &Transaction<'_>, page: i64, keep: usize) -> Result<()> {
    let (entries, body): (i64, Vec<u8>) = tx
        .query_row(
            "SELECT entries, body FROM access_log_pages WHERE page = ?1",
            [page],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .ctx("trim_access_log")?;
    let unpacked = unpack(&body, usize::try_from(entries).unwrap_or(0))?;
    let unpacked_len = unpacked.len();
    let newest = &unpacked[unpacked_len.saturating_sub(keep)..];
    let (Some(first), Some(_)) = (newest.first(), newest.last()) else {
        return Ok(());
    };
    let (first_id, kept) = (first.id, newest.len());
    let mut out = Vec::with_capacity(body.len());
    let (mut min_at, mut max_at) = (u64::MAX, 0);
    for p in unpacked.into_iter().skip(unpacked_len - kept) {
        min_at = min_at.min(p.at);
        max_at = max_at.max(p.at);
        // The pool is the page's, not the entry's: none is packed.
        pack(&mut out, p.id, &p.into_entry(""))?;
    }
    tx.execute(
        "UPDATE access_log_pages SET first_id = ?2, min_at = ?3, max_at = ?4, entries = ?5, \
         body = ?6 WHERE page = ?1",
        params![
            page,
            clamp_i64(first_id),
            clamp_i64(min_at),
            clamp_i64(max_at),
            kept as i64,
            out
        ],
    )
    .ctx("trim_access_log")
    .map(drop)
}

/// Deletes every page of `pool`, in the open transaction (its counts go with the next trim).
pub(crate) fn delete_pool(tx: &Transaction<'_>, pool: &str) -> Result<()> {
    tx.execute("DELETE FROM access_log_pages WHERE pool = ?1", [pool])
        .ctx("delete_pool: access log")
        .map(drop)
}

/// Migration v8 → v9: moves the rows of the old `access_log` table into pages, ids and counts
/// kept, and carries its AUTOINCREMENT high-water mark over as the next id.
pub(crate) fn migrate_rows_to_pages(tx: &Transaction<'_>) -> rusqlite::Result<()> {
    tx.execute_batch(SCHEMA_V9)?;
    let has_old: bool = tx.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'access_log')",
        [],
        |row| row.get(0),
    )?;
    if !has_old {
        return Ok(());
    }
    let high: i64 = tx.query_row(
        "SELECT MAX(COALESCE((SELECT MAX(id) FROM access_log), 0), \
                    COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'access_log'), 0))",
        [],
        |row| row.get(0),
    )?;
    let old: Vec<AccessLogEntry> = {
        let mut stmt = tx.prepare(
            "SELECT id, pool, at, key_id, client_addr, route, outcome, reason, status, \
             queued_ms, upstream_status, upstream_latency_ms, count, request_id \
             FROM access_log ORDER BY pool, id",
        )?;
        let rows = stmt.query_map([], |row| {
            Ok(AccessLogEntry {
                id: row.get(0)?,
                pool: row.get(1)?,
                at: row.get(2)?,
                key_id: row.get(3)?,
                client_addr: row.get(4)?,
                route: row.get(5)?,
                outcome: row.get(6)?,
                reason: row.get(7)?,
                status: row.get(8)?,
                queued_ms: row.get(9)?,
                upstream_status: row.get(10)?,
                upstream_latency_ms: row.get(11)?,
                count: row.get(12)?,
                request_id: row.get(13)?,
            })
        })?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    let to_sql = |e: StoreError| {
        rusqlite::Error::ToSqlConversionFailure(Box::new(std::io::Error::other(e.to_string())))
    };
    let mut start = 0;
    while start < old.len() {
        let pool = &old[start].pool;
        let mut end = start;
        while end < old.len() && old[end].pool == *pool && end - start < PAGE_ENTRIES {
            end += 1;
        }
        let page: Vec<(u64, &AccessLogEntry)> = old[start..end].iter().map(|e| (e.id, e)).collect();
        insert_page(tx, pool, &page).map_err(to_sql)?;
        start = end;
    }
    set_next_id(tx, (high.max(0) as u64) + 1).map_err(to_sql)?;
    tx.execute_batch("DROP TABLE access_log;")
}

impl SqliteStore {
    /// The access log's writes, on the writer connection.
    pub(crate) async fn append_log_pages(
        &self,
        entries: Vec<AccessLogEntry>,
        bumps: Vec<(u64, u64)>,
    ) -> Result<Vec<u64>> {
        self.write(move |conn| {
            // One transaction per batch: one WAL commit, and a failure leaves none of it.
            let tx = conn.transaction().ctx("append_access_log")?;
            let ids = append(&tx, &entries, &bumps)?;
            tx.commit().ctx("append_access_log")?;
            Ok(ids)
        })
        .await
    }

    pub(crate) async fn trim_log_pages(&self, pool: &str, keep: u64) -> Result<u64> {
        let pool = pool.to_owned();
        self.write(move |conn| {
            let tx = conn.transaction().ctx("trim_access_log")?;
            let removed = trim(&tx, &pool, keep)?;
            tx.commit().ctx("trim_access_log")?;
            Ok(removed)
        })
        .await
    }

    pub(crate) async fn query_log_pages(
        &self,
        pool: &str,
        q: &AccessLogQuery,
    ) -> Result<Vec<AccessLogEntry>> {
        let (pool, q) = (pool.to_owned(), q.clone());
        self.read(move |conn| query(conn, &pool, &q)).await
    }
}
