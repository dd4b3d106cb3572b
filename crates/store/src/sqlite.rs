//! The embedded SQLite implementation of [`Store`].
//!
//! This module owns the on-disk schema (tables, indexes, `PRAGMA user_version` migrations), the
//! connection settings, and the bridge that keeps blocking SQLite calls off the async runtime.
//! It must not interpret pool specs (they stay opaque JSON text) and must not grow behaviour the
//! [`Store`] trait does not promise, so a PostgreSQL implementation can match it call for call.
//!
//! Concurrency model: one writer connection and a few read-only connections, each behind a
//! `std::sync::Mutex`, with every call run on tokio's blocking pool. WAL mode lets the readers
//! proceed while the writer commits; serialising writes in-process means SQLite's own write
//! lock is never contended from here (`busy_timeout` covers other processes and checkpoints).
//!
//! Access-log time filters are half-open: `since <= at < until`, matching the exclusive
//! `before` id cursor.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::Duration;

use rusqlite::types::Type;
use rusqlite::{ffi, params, Connection, OptionalExtension, Row, TransactionBehavior};

use crate::{
    AccessLogEntry, AccessLogQuery, LeaseRecord, NonceRecord, Result, Store, StoreError, StoredKey,
    StoredPool,
};

/// File name used by [`SqliteStore::open_in_dir`].
pub const DB_FILE_NAME: &str = "nthbouncer.db";

/// Schema migrations, applied in order. Entry `i` moves the database from `user_version = i` to
/// `i + 1`. Append only: never edit a step that has shipped, add a new one instead.
const MIGRATIONS: &[Step] = &[
    // v1: pools, keys, access log.
    //
    // `keys.pool` deliberately has no foreign key: keys may belong to pools that exist only in
    // the config file. `delete_pool` removes a pool's keys and log rows explicitly instead.
    // `access_log` uses AUTOINCREMENT so ids are never reused after rows are deleted; the id
    // is the pagination cursor and must stay monotonic.
    Step::Sql(
        "CREATE TABLE IF NOT EXISTS pools (
        name       TEXT PRIMARY KEY NOT NULL,
        spec       TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    );
    CREATE TABLE IF NOT EXISTS keys (
        id         TEXT PRIMARY KEY NOT NULL,
        pool       TEXT NOT NULL,
        hash       TEXT NOT NULL UNIQUE,
        label      TEXT,
        created_at INTEGER NOT NULL,
        expires_at INTEGER,
        revoked_at INTEGER
    );
    CREATE INDEX IF NOT EXISTS keys_pool ON keys (pool);
    CREATE TABLE IF NOT EXISTS access_log (
        id                  INTEGER PRIMARY KEY AUTOINCREMENT,
        pool                TEXT NOT NULL,
        at                  INTEGER NOT NULL,
        key_id              TEXT,
        client_addr         TEXT NOT NULL,
        route               TEXT NOT NULL,
        outcome             TEXT NOT NULL,
        reason              TEXT,
        status              INTEGER NOT NULL,
        queued_ms           INTEGER NOT NULL,
        upstream_status     INTEGER,
        upstream_latency_ms INTEGER
    );
    CREATE INDEX IF NOT EXISTS access_log_pool_id ON access_log (pool, id);",
    ),
    // v2: async jobs, their history, webhook destinations and the delivery outbox.
    Step::Sql(
        "CREATE TABLE IF NOT EXISTS jobs (
        id           TEXT PRIMARY KEY NOT NULL,
        pool         TEXT NOT NULL,
        status       TEXT NOT NULL,
        reason       TEXT NOT NULL,
        key_id       TEXT NOT NULL,
        fairness     INTEGER NOT NULL,
        priority     TEXT NOT NULL,
        created_at   INTEGER NOT NULL,
        updated_at   INTEGER NOT NULL,
        expires_at   INTEGER NOT NULL,
        retention_ms INTEGER NOT NULL,
        attempt      INTEGER NOT NULL DEFAULT 0,
        destinations INTEGER NOT NULL DEFAULT 0,
        error        TEXT,
        request      TEXT NOT NULL,
        request_body BLOB NOT NULL,
        result       TEXT,
        result_body  BLOB
    );
    CREATE INDEX IF NOT EXISTS jobs_pool_created ON jobs (pool, created_at, id);
    CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status);
    CREATE TABLE IF NOT EXISTS job_events (
        job_id  TEXT NOT NULL,
        at      INTEGER NOT NULL,
        status  TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        detail  TEXT
    );
    CREATE INDEX IF NOT EXISTS job_events_job ON job_events (job_id);
    CREATE TABLE IF NOT EXISTS webhook_destinations (
        id                   TEXT PRIMARY KEY NOT NULL,
        pool                 TEXT NOT NULL,
        url                  TEXT NOT NULL,
        secret               TEXT NOT NULL,
        active               INTEGER NOT NULL,
        deactivate_after     INTEGER NOT NULL,
        consecutive_failures INTEGER NOT NULL DEFAULT 0,
        deactivated_at       INTEGER,
        managed_by           TEXT NOT NULL,
        created_at           INTEGER NOT NULL
    );
    CREATE INDEX IF NOT EXISTS webhook_destinations_pool ON webhook_destinations (pool);
    CREATE TABLE IF NOT EXISTS deliveries (
        id             INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id         TEXT NOT NULL,
        destination_id TEXT NOT NULL,
        status         TEXT NOT NULL,
        attempts       INTEGER NOT NULL DEFAULT 0,
        next_attempt_at INTEGER NOT NULL,
        created_at     INTEGER NOT NULL,
        updated_at     INTEGER NOT NULL,
        UNIQUE (job_id, destination_id)
    );
    CREATE INDEX IF NOT EXISTS deliveries_due ON deliveries (status, next_attempt_at);",
    ),
    // v3: webhook delivery: the attempt log, redelivery rounds, secret rotation.
    //
    // `deliveries.round` fences an attempt's result to the round it started in (a redelivery
    // asked for meanwhile starts a new one); `round_attempts` drives the retry schedule.
    // `delivery_attempts` keeps `pool` so the admin reads filter without a join, and
    // AUTOINCREMENT ids as the (monotonic) pagination cursor.
    Step::Sql(
        "ALTER TABLE webhook_destinations ADD COLUMN previous_secret TEXT;
    ALTER TABLE webhook_destinations ADD COLUMN previous_secret_expires_at INTEGER;
    ALTER TABLE deliveries ADD COLUMN manual INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE deliveries ADD COLUMN round INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE deliveries ADD COLUMN round_attempts INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE deliveries ADD COLUMN last_status INTEGER;
    ALTER TABLE deliveries ADD COLUMN last_error TEXT;
    ALTER TABLE deliveries ADD COLUMN delivered_at INTEGER;
    CREATE INDEX IF NOT EXISTS deliveries_destination_due
        ON deliveries (destination_id, status, next_attempt_at);
    CREATE TABLE IF NOT EXISTS delivery_attempts (
        id             INTEGER PRIMARY KEY AUTOINCREMENT,
        delivery_id    INTEGER NOT NULL,
        job_id         TEXT NOT NULL,
        destination_id TEXT NOT NULL,
        pool           TEXT NOT NULL,
        attempt        INTEGER NOT NULL,
        at             INTEGER NOT NULL,
        status_code    INTEGER,
        latency_ms     INTEGER NOT NULL,
        response_body  TEXT,
        error          TEXT,
        manual         INTEGER NOT NULL DEFAULT 0,
        outcome        TEXT NOT NULL
    );
    CREATE INDEX IF NOT EXISTS delivery_attempts_pool ON delivery_attempts (pool, id);
    CREATE INDEX IF NOT EXISTS delivery_attempts_job ON delivery_attempts (job_id, id);
    CREATE INDEX IF NOT EXISTS delivery_attempts_destination
        ON delivery_attempts (destination_id, id);",
    ),
    // v3 -> v4: lock leases outstanding, so a restart holds their slots back.
    Step::Sql(
        "CREATE TABLE IF NOT EXISTS leases (
        slot_id          TEXT PRIMARY KEY,
        pool             TEXT NOT NULL,
        request_deadline INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX IF NOT EXISTS leases_deadline ON leases (request_deadline);",
    ),
    // v4 -> v5: HMAC nonces seen, so a restart does not reopen a replay window. Digests only;
    // `expires_at` drives the purge and the start-up load.
    Step::Sql(
        "CREATE TABLE IF NOT EXISTS nonces (
        pool       TEXT NOT NULL,
        digest     BLOB NOT NULL,
        expires_at INTEGER NOT NULL,
        PRIMARY KEY (pool, digest)
    ) WITHOUT ROWID;
    CREATE INDEX IF NOT EXISTS nonces_expires ON nonces (expires_at);",
    ),
    // v5 -> v6: the unfinished backlog, read in pages at start-up and counted per pool for
    // `async.max_pending`. Partial indexes: they hold only the (few) unfinished jobs, however
    // many finished ones are retained. Queries must repeat the `status IN (...)` text for the
    // planner to use them.
    Step::Sql(
        "CREATE INDEX IF NOT EXISTS jobs_unfinished_created
        ON jobs (created_at, id) WHERE status IN ('accepted', 'queued', 'running');
    CREATE INDEX IF NOT EXISTS jobs_unfinished_pool
        ON jobs (pool) WHERE status IN ('accepted', 'queued', 'running');",
    ),
    // v6 -> v7: refusals folded into one access-log row carry how many requests they stand for.
    Step::AddColumn {
        table: "access_log",
        column: "count",
        decl: "INTEGER NOT NULL DEFAULT 1",
    },
    // v7 -> v8 (#13): the request id (`x-request-id`) of the request an access-log row, a job
    // and each of its deliveries came from. Nullable: rows written before have none.
    Step::AddColumns(&[
        ("access_log", "request_id", "TEXT"),
        ("jobs", "request_id", "TEXT"),
        ("deliveries", "request_id", "TEXT"),
    ]),
    // v8 -> v9: the access log in packed pages, one row per pool and batch instead of one per
    // request (`sqlite_log`); the old rows move into pages with their ids and counts.
    Step::Rust(crate::sqlite_log::migrate_rows_to_pages),
    // v9 -> v10: the outstanding lock leases as an append-only journal (`sqlite_leases`)
    // instead of a table written and deleted from once per lease.
    Step::Rust(crate::sqlite_leases::migrate_table_to_journal),
];

/// One migration step.
enum Step {
    /// SQL run as is.
    Sql(&'static str),
    /// `ALTER TABLE … ADD COLUMN`, which SQLite cannot write idempotently: skipped when the
    /// column is there already (or the table is missing).
    AddColumn {
        table: &'static str,
        column: &'static str,
        decl: &'static str,
    },
    /// Several [`Step::AddColumn`]s as one version: `(table, column, decl)`.
    AddColumns(&'static [(&'static str, &'static str, &'static str)]),
    /// A step SQL alone cannot write.
    Rust(fn(&rusqlite::Transaction<'_>) -> rusqlite::Result<()>),
}

impl Step {
    fn apply(&self, tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<()> {
        match self {
            Step::Sql(sql) => tx.execute_batch(sql),
            Step::AddColumn {
                table,
                column,
                decl,
            } => add_column(tx, table, column, decl),
            Step::AddColumns(columns) => columns
                .iter()
                .try_for_each(|(table, column, decl)| add_column(tx, table, column, decl)),
            Step::Rust(step) => step(tx),
        }
    }
}

fn add_column(
    tx: &rusqlite::Transaction<'_>,
    table: &str,
    column: &str,
    decl: &str,
) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare("SELECT name FROM pragma_table_info(?1)")?;
    let columns = stmt
        .query_map([table], |row| row.get::<_, String>(0))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    if columns.is_empty() || columns.iter().any(|c| c == column) {
        return Ok(());
    }
    tx.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column} {decl};"))
}

/// The schema version this build writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: u32 = MIGRATIONS.len() as u32;

/// Read-only connections kept open next to the writer. Reads are short indexed lookups, so a
/// handful is plenty; each one costs a file handle and its own page cache.
const READERS: usize = 4;

/// How long a connection waits on SQLite's file lock before giving up with `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

const POOL_COLUMNS: &str = "name, spec, created_at, updated_at";
const KEY_COLUMNS: &str = "id, pool, hash, label, created_at, expires_at, revoked_at";

/// SQLite-backed [`Store`]. Cheap to clone; clones share the same connections.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    writer: Mutex<Connection>,
    readers: Vec<Mutex<Connection>>,
    next_reader: AtomicUsize,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .field("readers", &self.inner.readers.len())
            .finish()
    }
}

/// Opens (creating if needed) the database file at `path`. See [`SqliteStore::open`].
pub fn open(path: &Path) -> Result<SqliteStore> {
    SqliteStore::open(path)
}

/// Opens (creating if needed) `data_dir/nthbouncer.db`. See [`SqliteStore::open_in_dir`].
pub fn open_in_dir(data_dir: &Path) -> Result<SqliteStore> {
    SqliteStore::open_in_dir(data_dir)
}

impl SqliteStore {
    /// Opens the database at `path`, creating its parent directory and the file if missing,
    /// and brings the schema up to [`SCHEMA_VERSION`].
    ///
    /// This does blocking file I/O; it is meant for start-up. Fails if the file was written by
    /// a newer build (a higher schema version than this one knows).
    pub fn open(path: &Path) -> Result<Self> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| {
                StoreError::Backend(format!("creating directory {}: {e}", parent.display()))
            })?;
        }

        let mut writer = Connection::open(path).ctx("opening database")?;
        // journal_mode must be set outside a transaction and before anything else writes.
        let mode: String = writer
            .pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))
            .ctx("setting journal_mode")?;
        if !mode.eq_ignore_ascii_case("wal") {
            // Some filesystems (network mounts) cannot do WAL; SQLite then keeps the old mode.
            // Still correct, only slower and with readers blocking the writer.
            tracing::warn!(path = %path.display(), mode, "SQLite refused WAL journal mode");
        }
        configure(&writer).ctx("configuring writer connection")?;
        migrate(&mut writer)?;

        let mut readers = Vec::with_capacity(READERS);
        for _ in 0..READERS {
            let conn = Connection::open(path).ctx("opening reader connection")?;
            configure(&conn).ctx("configuring reader connection")?;
            // Guards against a write slipping onto a reader, which would bypass the writer lock.
            conn.pragma_update(None, "query_only", true)
                .ctx("configuring reader connection")?;
            readers.push(Mutex::new(conn));
        }

        Ok(Self {
            inner: Arc::new(Inner {
                path: path.to_path_buf(),
                writer: Mutex::new(writer),
                readers,
                next_reader: AtomicUsize::new(0),
            }),
        })
    }

    /// Opens `data_dir/nthbouncer.db`, creating `data_dir` if needed.
    pub fn open_in_dir(data_dir: &Path) -> Result<Self> {
        Self::open(&data_dir.join(DB_FILE_NAME))
    }

    /// The database file this store was opened on.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Runs `f` on the writer connection, on the calling thread (which it blocks).
    pub(crate) fn write_here<T>(&self, f: impl FnOnce(&mut Connection) -> Result<T>) -> Result<T> {
        f(&mut lock(&self.inner.writer))
    }

    /// Runs `f` on the writer connection on the blocking pool.
    pub(crate) async fn write<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        run_blocking(move || f(&mut lock(&inner.writer))).await
    }

    /// Runs `f` on one of the read-only connections on the blocking pool.
    pub(crate) async fn read<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        run_blocking(move || f(&inner.reader())).await
    }
}

impl Inner {
    /// Picks a free reader if there is one, otherwise waits on the next in round-robin order.
    fn reader(&self) -> MutexGuard<'_, Connection> {
        let n = self.readers.len();
        let start = self.next_reader.fetch_add(1, Ordering::Relaxed) % n;
        for i in 0..n {
            match self.readers[(start + i) % n].try_lock() {
                Ok(guard) => return guard,
                Err(TryLockError::Poisoned(p)) => return recover(p),
                Err(TryLockError::WouldBlock) => {}
            }
        }
        lock(&self.readers[start])
    }
}

/// Locks a connection, recovering from poisoning. A panic while a connection was held cannot
/// leave it half-written: an open `rusqlite::Transaction` rolls back when dropped during
/// unwinding, so the connection is still consistent and refusing it would only turn one panic
/// into a permanently broken store.
fn lock(m: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
    m.lock().unwrap_or_else(recover)
}

fn recover<'a>(p: PoisonError<MutexGuard<'a, Connection>>) -> MutexGuard<'a, Connection> {
    tracing::warn!("SQLite connection mutex was poisoned by a panic; reusing the connection");
    p.into_inner()
}

async fn run_blocking<T, F>(f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Backend(format!("storage task failed: {e}")))?
}

/// Per-connection settings (none of these persist in the file except journal_mode).
fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "foreign_keys", true)?;
    // The access-log query has up to 32 filter combinations, each its own cached statement.
    conn.set_prepared_statement_cache_capacity(64);
    Ok(())
}

/// Brings the schema to [`SCHEMA_VERSION`]. Runs in one IMMEDIATE transaction so two processes
/// opening the same fresh file cannot both apply a step.
fn migrate(conn: &mut Connection) -> Result<()> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .ctx("starting migration")?;
    let current: u32 = tx
        .pragma_query_value(None, "user_version", |row| row.get(0))
        .ctx("reading schema version")?;
    if current > SCHEMA_VERSION {
        return Err(StoreError::Backend(format!(
            "database schema version {current} is newer than this build supports \
             ({SCHEMA_VERSION}); upgrade nthbouncer"
        )));
    }
    if current == SCHEMA_VERSION {
        return Ok(());
    }
    for (from, step) in MIGRATIONS.iter().enumerate().skip(current as usize) {
        tracing::info!(from, to = from + 1, "migrating store schema");
        step.apply(&tx)
            .ctx(&format!("migrating schema to version {}", from + 1))?;
    }
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)
        .ctx("writing schema version")?;
    tx.commit().ctx("committing migration")
}

/// Maps rusqlite errors into [`StoreError`] with a note on what was being done.
pub(crate) trait Ctx<T> {
    fn ctx(self, what: &str) -> Result<T>;
}

impl<T> Ctx<T> for rusqlite::Result<T> {
    fn ctx(self, what: &str) -> Result<T> {
        self.map_err(|e| {
            if is_unique_violation(&e) {
                StoreError::Conflict(format!("{what}: {e}"))
            } else {
                StoreError::Backend(format!("{what}: {e}"))
            }
        })
    }
}

pub(crate) fn is_unique_violation(e: &rusqlite::Error) -> bool {
    matches!(
        e,
        rusqlite::Error::SqliteFailure(err, _)
            if err.extended_code == ffi::SQLITE_CONSTRAINT_UNIQUE
                || err.extended_code == ffi::SQLITE_CONSTRAINT_PRIMARYKEY
    )
}

/// Values beyond SQLite's signed 64-bit range only appear as open-ended filter bounds, where
/// `i64::MAX` means the same thing ("no limit").
pub(crate) fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn pool_from_row(row: &Row<'_>) -> rusqlite::Result<StoredPool> {
    let spec: String = row.get(1)?;
    let spec = serde_json::from_str(&spec)
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(1, Type::Text, Box::new(e)))?;
    Ok(StoredPool {
        name: row.get(0)?,
        spec,
        created_at: row.get(2)?,
        updated_at: row.get(3)?,
    })
}

fn key_from_row(row: &Row<'_>) -> rusqlite::Result<StoredKey> {
    Ok(StoredKey {
        id: row.get(0)?,
        pool: row.get(1)?,
        hash: row.get(2)?,
        label: row.get(3)?,
        created_at: row.get(4)?,
        expires_at: row.get(5)?,
        revoked_at: row.get(6)?,
    })
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    async fn settings_version(&self) -> Result<Option<u64>> {
        Ok(None) // one process writes it: nothing changes behind this node's back
    }

    async fn ping(&self) -> Result<()> {
        // A reader, not the writer: the probe must stay cheap and answer promptly even while a
        // large log batch or trim holds the writer.
        self.read(|conn| {
            conn.query_row("SELECT 1", [], |row| row.get::<_, i64>(0))
                .ctx("ping")
                .map(drop)
        })
        .await
    }

    async fn list_pools(&self) -> Result<Vec<StoredPool>> {
        self.read(|conn| {
            let mut stmt = conn
                .prepare_cached(&format!("SELECT {POOL_COLUMNS} FROM pools ORDER BY name"))
                .ctx("list_pools")?;
            let rows = stmt.query_map([], pool_from_row).ctx("list_pools")?;
            rows.collect::<rusqlite::Result<Vec<_>>>().ctx("list_pools")
        })
        .await
    }

    async fn get_pool(&self, name: &str) -> Result<Option<StoredPool>> {
        let name = name.to_owned();
        self.read(move |conn| {
            let mut stmt = conn
                .prepare_cached(&format!("SELECT {POOL_COLUMNS} FROM pools WHERE name = ?1"))
                .ctx("get_pool")?;
            stmt.query_row([&name], pool_from_row)
                .optional()
                .ctx("get_pool")
        })
        .await
    }

    async fn create_pool(&self, pool: &StoredPool) -> Result<()> {
        let pool = pool.clone();
        let spec = serde_json::to_string(&pool.spec)
            .map_err(|e| StoreError::Backend(format!("create_pool: encoding spec: {e}")))?;
        self.write(move |conn| {
            let mut stmt = conn
                .prepare_cached(
                    "INSERT INTO pools (name, spec, created_at, updated_at) \
                     VALUES (?1, ?2, ?3, ?4)",
                )
                .ctx("create_pool")?;
            match stmt.execute(params![pool.name, spec, pool.created_at, pool.updated_at]) {
                Ok(_) => Ok(()),
                Err(e) if is_unique_violation(&e) => {
                    Err(StoreError::Conflict(format!("pool {}", pool.name)))
                }
                Err(e) => Err(e).ctx("create_pool"),
            }
        })
        .await
    }

    async fn update_pool(&self, name: &str, spec: &serde_json::Value, now: u64) -> Result<bool> {
        let name = name.to_owned();
        let spec = serde_json::to_string(spec)
            .map_err(|e| StoreError::Backend(format!("update_pool: encoding spec: {e}")))?;
        self.write(move |conn| {
            let mut stmt = conn
                .prepare_cached("UPDATE pools SET spec = ?2, updated_at = ?3 WHERE name = ?1")
                .ctx("update_pool")?;
            let changed = stmt.execute(params![name, spec, now]).ctx("update_pool")?;
            Ok(changed > 0)
        })
        .await
    }

    async fn delete_pool(&self, name: &str) -> Result<bool> {
        let name = name.to_owned();
        self.write(move |conn| {
            let tx = conn.transaction().ctx("delete_pool")?;
            let deleted = tx
                .execute("DELETE FROM pools WHERE name = ?1", [&name])
                .ctx("delete_pool")?;
            // Only a pool that exists here owns its keys and log here. Keys of a pool defined
            // solely in the config file must survive a mistaken delete of that name.
            if deleted == 0 {
                return Ok(false);
            }
            tx.execute("DELETE FROM keys WHERE pool = ?1", [&name])
                .ctx("delete_pool: keys")?;
            crate::sqlite_log::delete_pool(&tx, &name)?;
            tx.commit().ctx("delete_pool")?;
            Ok(true)
        })
        .await
    }

    async fn create_key(&self, key: &StoredKey) -> Result<()> {
        let key = key.clone();
        self.write(move |conn| {
            let mut stmt = conn
                .prepare_cached(
                    "INSERT INTO keys (id, pool, hash, label, created_at, expires_at, revoked_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                )
                .ctx("create_key")?;
            let res = stmt.execute(params![
                key.id,
                key.pool,
                key.hash,
                key.label,
                key.created_at,
                key.expires_at,
                key.revoked_at
            ]);
            match res {
                Ok(_) => Ok(()),
                // Name the clashing column, never the hash value itself.
                Err(rusqlite::Error::SqliteFailure(err, Some(msg)))
                    if err.extended_code == ffi::SQLITE_CONSTRAINT_UNIQUE
                        && msg.contains("keys.hash") =>
                {
                    Err(StoreError::Conflict("a key with that hash".to_owned()))
                }
                Err(e) if is_unique_violation(&e) => {
                    Err(StoreError::Conflict(format!("key {}", key.id)))
                }
                Err(e) => Err(e).ctx("create_key"),
            }
        })
        .await
    }

    async fn list_keys(&self, pool: &str) -> Result<Vec<StoredKey>> {
        let pool = pool.to_owned();
        self.read(move |conn| {
            let mut stmt = conn
                .prepare_cached(&format!(
                    "SELECT {KEY_COLUMNS} FROM keys WHERE pool = ?1 ORDER BY created_at, rowid"
                ))
                .ctx("list_keys")?;
            let rows = stmt.query_map([&pool], key_from_row).ctx("list_keys")?;
            rows.collect::<rusqlite::Result<Vec<_>>>().ctx("list_keys")
        })
        .await
    }

    async fn list_all_keys(&self) -> Result<Vec<StoredKey>> {
        self.read(|conn| {
            let mut stmt = conn
                .prepare_cached(&format!(
                    "SELECT {KEY_COLUMNS} FROM keys ORDER BY pool, created_at, rowid"
                ))
                .ctx("list_all_keys")?;
            let rows = stmt.query_map([], key_from_row).ctx("list_all_keys")?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
                .ctx("list_all_keys")
        })
        .await
    }

    async fn revoke_key(&self, pool: &str, id: &str, now: u64) -> Result<bool> {
        let (pool, id) = (pool.to_owned(), id.to_owned());
        self.write(move |conn| {
            let mut stmt = conn
                .prepare_cached(
                    "UPDATE keys SET revoked_at = ?3 \
                     WHERE pool = ?1 AND id = ?2 AND revoked_at IS NULL",
                )
                .ctx("revoke_key")?;
            let changed = stmt.execute(params![pool, id, now]).ctx("revoke_key")?;
            Ok(changed > 0)
        })
        .await
    }

    async fn append_access_log_folded(
        &self,
        entries: Vec<AccessLogEntry>,
        bumps: Vec<(u64, u64)>,
    ) -> Result<Vec<u64>> {
        if entries.is_empty() && bumps.is_empty() {
            return Ok(Vec::new());
        }
        self.append_log_pages(entries, bumps).await
    }

    async fn query_access_log(
        &self,
        pool: &str,
        query: &AccessLogQuery,
    ) -> Result<Vec<AccessLogEntry>> {
        self.query_log_pages(pool, query).await
    }

    async fn trim_access_log(&self, pool: &str, keep: u64) -> Result<u64> {
        self.trim_log_pages(pool, keep).await
    }

    async fn apply_leases(
        &self,
        granted: &[LeaseRecord],
        released: &[String],
        now: u64,
    ) -> Result<()> {
        self.journal_leases(granted, released, now).await
    }

    fn lease_writer(&self) -> Option<Box<dyn crate::LeaseWriter>> {
        Some(Box::new(self.clone()))
    }

    async fn remember_nonces(&self, nonces: &[NonceRecord], now: u64) -> Result<Vec<bool>> {
        let nonces = nonces.to_vec();
        let now = clamp_i64(now);
        self.write(move |conn| {
            let tx = conn.transaction().ctx("remember_nonces")?;
            let mut fresh = Vec::with_capacity(nonces.len());
            {
                // An expired record is replaced (the nonce is new again); an unexpired one is
                // left alone and counts as a replay: the upsert then changes no row.
                let mut upsert = tx
                    .prepare_cached(
                        "INSERT INTO nonces (pool, digest, expires_at) VALUES (?1, ?2, ?3)                          ON CONFLICT (pool, digest) DO UPDATE SET expires_at = excluded.expires_at                          WHERE nonces.expires_at <= ?4",
                    )
                    .ctx("remember_nonces")?;
                for n in &nonces {
                    let changed = upsert
                        .execute(params![n.pool, n.digest, clamp_i64(n.expires_at), now])
                        .ctx("remember_nonces")?;
                    fresh.push(changed > 0);
                }
            }
            tx.commit().ctx("remember_nonces")?;
            Ok(fresh)
        })
        .await
    }

    async fn unexpired_nonces(&self, now: u64) -> Result<Vec<NonceRecord>> {
        let now = clamp_i64(now);
        self.read(move |conn| {
            let mut stmt = conn
                .prepare_cached(
                    "SELECT pool, digest, expires_at FROM nonces WHERE expires_at > ?1                      ORDER BY expires_at",
                )
                .ctx("unexpired_nonces")?;
            let rows = stmt
                .query_map([now], |r| {
                    Ok(NonceRecord {
                        pool: r.get(0)?,
                        digest: r.get(1)?,
                        expires_at: r.get(2)?,
                    })
                })
                .ctx("unexpired_nonces")?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
                .ctx("unexpired_nonces")
        })
        .await
    }

    async fn purge_nonces(&self, now: u64) -> Result<u64> {
        let now = clamp_i64(now);
        self.write(move |conn| {
            let removed = conn
                .execute("DELETE FROM nonces WHERE expires_at <= ?1", [now])
                .ctx("purge_nonces")?;
            Ok(removed as u64)
        })
        .await
    }

    async fn outstanding_leases(&self, now: u64) -> Result<Vec<LeaseRecord>> {
        self.replay_leases(now).await
    }
}
