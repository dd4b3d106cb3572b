//! The lock leases outstanding on SQLite, kept as an append-only journal: each batch the lease
//! book commits (the grants, the releases and the time they were written at) is one row of
//! `lease_journal`, packed with postcard. Reading the outstanding leases replays the journal.
//!
//! Why a journal: a lease is granted and released within moments, and as rows of a table each
//! pair cost an insert and a delete in a B-tree and its deadline index, about a quarter of a
//! lock pair's instructions. An append to the end of a rowid table is the cheapest write SQLite
//! has. Every [`COMPACT_EVERY`] rows the journal is folded into one row holding only what is
//! still outstanding, so it stays short.
//!
//! Replay rules, the same as the table had: a grant of a slot id already granted replaces it;
//! a release forgets it; a lease whose request deadline is at or before the latest `now`
//! written (or the `now` read with) is not outstanding.
//!
//! Owns the `lease_journal` table; knows nothing of gates or HTTP.

use std::collections::BTreeMap;

use rusqlite::{params, Connection, Transaction};
use serde::{Deserialize, Serialize};

use crate::sqlite::{Ctx, SqliteStore};
use crate::{LeaseRecord, Result, StoreError};

/// Journal rows past which a write folds the journal into one.
const COMPACT_EVERY: i64 = 256;

/// Schema v10.
pub(crate) const SCHEMA_V10: &str = "CREATE TABLE IF NOT EXISTS lease_journal (
        seq  INTEGER PRIMARY KEY,
        body BLOB NOT NULL
    );";

/// One batch. Field order is the format: append new fields at the end only.
#[derive(Serialize, Deserialize, Default)]
struct Batch {
    /// Epoch ms the batch was written at: leases due by then are gone.
    now: u64,
    granted: Vec<(String, String, u64)>,
    released: Vec<String>,
}

impl Batch {
    fn of(granted: &[LeaseRecord], released: &[String], now: u64) -> Batch {
        Batch {
            now,
            granted: granted
                .iter()
                .map(|l| (l.slot_id.clone(), l.pool.clone(), l.request_deadline))
                .collect(),
            released: released.to_vec(),
        }
    }
}

/// One batch, one transaction.
fn commit(conn: &mut Connection, batch: &Batch) -> Result<()> {
    let tx = conn.transaction().ctx("apply_leases")?;
    append(&tx, batch)?;
    tx.commit().ctx("apply_leases")
}

impl crate::LeaseWriter for SqliteStore {
    fn apply(&mut self, granted: &[LeaseRecord], released: &[String], now: u64) -> Result<()> {
        let batch = Batch::of(granted, released, now);
        self.write_here(|conn| commit(conn, &batch))
    }
}

fn encode(batch: &Batch) -> Result<Vec<u8>> {
    postcard::to_allocvec(batch)
        .map_err(|e| StoreError::Backend(format!("packing lease records: {e}")))
}

/// Slot id → (pool, request deadline).
type Outstanding = BTreeMap<String, (String, u64)>;

/// The leases outstanding after replaying every row, and the latest `now` seen.
fn replay(conn: &Connection) -> Result<(Outstanding, u64)> {
    let mut stmt = conn
        .prepare_cached("SELECT body FROM lease_journal ORDER BY seq")
        .ctx("reading lease records")?;
    let mut rows = stmt.query([]).ctx("reading lease records")?;
    let mut leases = BTreeMap::new();
    let mut latest = 0;
    while let Some(row) = rows.next().ctx("reading lease records")? {
        let body = row.get_ref(0).ctx("reading lease records")?;
        let body = body
            .as_blob()
            .map_err(|e| StoreError::Backend(format!("reading lease records: {e}")))?;
        let batch: Batch = postcard::from_bytes(body)
            .map_err(|e| StoreError::Backend(format!("reading lease records: {e}")))?;
        for (slot_id, pool, deadline) in batch.granted {
            leases.insert(slot_id, (pool, deadline));
        }
        for slot_id in &batch.released {
            leases.remove(slot_id);
        }
        latest = latest.max(batch.now);
        leases.retain(|_, (_, deadline)| *deadline > latest);
    }
    Ok((leases, latest))
}

/// Appends one batch; folds the journal when it has grown long.
fn append(tx: &Transaction<'_>, batch: &Batch) -> Result<()> {
    let body = encode(batch)?;
    tx.prepare_cached("INSERT INTO lease_journal (body) VALUES (?1)")
        .and_then(|mut stmt| stmt.execute([body]))
        .ctx("apply_leases")?;
    if tx.last_insert_rowid() % COMPACT_EVERY == 0 {
        compact(tx)?;
    }
    Ok(())
}

/// Replaces the journal with one row holding what is outstanding. Row ids keep growing (the
/// new row takes the next one), so the compaction cadence stays the same.
fn compact(tx: &Transaction<'_>) -> Result<()> {
    let (leases, latest) = replay(tx)?;
    let folded = Batch {
        now: latest,
        granted: leases
            .into_iter()
            .map(|(slot_id, (pool, deadline))| (slot_id, pool, deadline))
            .collect(),
        released: Vec::new(),
    };
    let last = tx.last_insert_rowid();
    tx.execute("DELETE FROM lease_journal WHERE seq <= ?1", [last])
        .ctx("compacting lease records")?;
    tx.execute(
        "INSERT INTO lease_journal (seq, body) VALUES (?1, ?2)",
        params![last + 1, encode(&folded)?],
    )
    .ctx("compacting lease records")?;
    Ok(())
}

/// Migration v9 → v10: the `leases` table's rows become the journal's first row.
pub(crate) fn migrate_table_to_journal(tx: &Transaction<'_>) -> rusqlite::Result<()> {
    tx.execute_batch(SCHEMA_V10)?;
    let has_old: bool = tx.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'leases')",
        [],
        |row| row.get(0),
    )?;
    if !has_old {
        return Ok(());
    }
    let granted: Vec<(String, String, u64)> = {
        let mut stmt = tx.prepare("SELECT slot_id, pool, request_deadline FROM leases")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    if !granted.is_empty() {
        let batch = Batch {
            now: 0,
            granted,
            released: Vec::new(),
        };
        let body = encode(&batch).map_err(|e| {
            rusqlite::Error::ToSqlConversionFailure(Box::new(std::io::Error::other(e.to_string())))
        })?;
        tx.execute("INSERT INTO lease_journal (body) VALUES (?1)", [body])?;
    }
    tx.execute_batch("DROP TABLE leases;")
}

impl SqliteStore {
    pub(crate) async fn journal_leases(
        &self,
        granted: &[LeaseRecord],
        released: &[String],
        now: u64,
    ) -> Result<()> {
        let batch = Batch::of(granted, released, now);
        self.write(move |conn| commit(conn, &batch)).await
    }

    pub(crate) async fn replay_leases(&self, now: u64) -> Result<Vec<LeaseRecord>> {
        self.read(move |conn| {
            let (leases, _) = replay(conn)?;
            let mut out: Vec<LeaseRecord> = leases
                .into_iter()
                .filter(|(_, (_, deadline))| *deadline > now)
                .map(|(slot_id, (pool, request_deadline))| LeaseRecord {
                    slot_id,
                    pool,
                    request_deadline,
                })
                .collect();
            out.sort_by(|a, b| (&a.pool, &a.slot_id).cmp(&(&b.pool, &b.slot_id)));
            Ok(out)
        })
        .await
    }
}
