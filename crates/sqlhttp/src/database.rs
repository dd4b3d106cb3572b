//! `Database`: one pool's connections to its PostgreSQL, and the execution of a request on one
//! of them (a statement, or a batch in one transaction).
//!
//! Owns the connection pool (deadpool, capped at the pool's effective limit), the rule that a
//! connection goes back only when idle outside any transaction, and cancellation: a request
//! whose future is dropped, or whose answer grows past the cap, has its statement cancelled on
//! the server and its connection closed. Must not know HTTP, keys or the gate: the server
//! admits a caller first, then calls `execute`.

use std::fmt;
use std::sync::Arc;

use deadpool::managed::{self, Object, PoolError, RecycleError, RecycleResult};

use crate::answer::{Answer, AnswerWriter};
use crate::config::{Limits, Target};
use crate::conn::{Connection, QueryError};
use crate::error::SqlHttpError;
use crate::request::{Query, SqlRequest, WireOptions};

/// A database pool's upstream: connections opened on demand, at most `max_connections` at once.
/// Cheap to clone (clones share the pool).
#[derive(Clone)]
pub struct Database {
    pool: managed::Pool<Manager>,
    target: Arc<Target>,
    max_response_bytes: usize,
}

impl fmt::Debug for Database {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Database")
            .field("target", &self.target.redacted())
            .field("max_connections", &self.pool.status().max_size)
            .field("max_response_bytes", &self.max_response_bytes)
            .finish()
    }
}

/// How many connections the pool holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStatus {
    /// The cap (`Limits::max_connections`, or the last `set_max_connections`).
    pub max: usize,
    /// Connections open, in use or idle.
    pub open: usize,
    /// Open connections waiting in the pool.
    pub idle: usize,
}

impl Database {
    /// Prepares a pool for `url` (`postgres://user:password@host:port/db?sslmode=…`). Opens
    /// nothing: the first request connects, so a database that is down does not stop start-up.
    /// TLS certificates are checked against the public web roots.
    pub fn new(url: &str, limits: Limits) -> Result<Database, SqlHttpError> {
        Self::build(url, limits, None)
    }

    /// `new`, also trusting the CA certificates in `ca_pem` (PEM) for `sslmode=require`.
    pub fn with_ca(url: &str, limits: Limits, ca_pem: &[u8]) -> Result<Database, SqlHttpError> {
        Self::build(url, limits, Some(ca_pem))
    }

    fn build(url: &str, limits: Limits, ca: Option<&[u8]>) -> Result<Database, SqlHttpError> {
        let target = Arc::new(Target::parse(url, &limits, ca)?);
        let manager = Manager {
            target: target.clone(),
            max_row_bytes: limits.max_response_bytes,
        };
        let pool = managed::Pool::builder(manager)
            .max_size(limits.max_connections)
            .runtime(deadpool::Runtime::Tokio1)
            .build()
            .map_err(|e| SqlHttpError::Config {
                message: format!("database pool: {e}"),
            })?;
        Ok(Database {
            pool,
            target,
            max_response_bytes: limits.max_response_bytes,
        })
    }

    /// Runs a request and encodes its answer. A single statement runs on its own (in
    /// PostgreSQL's implicit transaction); a batch runs in one transaction, rolled back on any
    /// error. Waits for a connection when all are in use.
    ///
    /// Dropping the returned future while a statement runs cancels that statement on the
    /// server (from a spawned task) and closes its connection.
    pub async fn execute(
        &self,
        request: &SqlRequest,
        options: &WireOptions,
    ) -> Result<Answer, SqlHttpError> {
        let mut lease = Lease::new(self.pool.get().await.map_err(pool_error)?);
        let mut answer = AnswerWriter::new(
            matches!(request, SqlRequest::Batch(_)),
            self.max_response_bytes,
        );
        let result = match (request, lease.conn()) {
            (_, Err(e)) => Err(e),
            (SqlRequest::Single(query), Ok(conn)) => {
                run_statement(conn, &mut answer, query, options).await
            }
            (SqlRequest::Batch(queries), Ok(conn)) => {
                run_batch(conn, &mut answer, queries, options).await
            }
        };
        match result {
            Ok(()) => Ok(answer.finish()),
            Err(QueryError::TooLarge) => {
                lease.cancel_now().await;
                Err(SqlHttpError::ResponseTooLarge {
                    max_bytes: self.max_response_bytes,
                })
            }
            Err(e) => Err(self.query_error(e)),
        }
    }

    /// Opens (or reuses) a connection and runs `SELECT 1`: is the database reachable with the
    /// configured credentials?
    pub async fn check(&self) -> Result<(), SqlHttpError> {
        let mut lease = Lease::new(self.pool.get().await.map_err(pool_error)?);
        let result = match lease.conn() {
            Ok(conn) => conn.simple("SELECT 1").await,
            Err(e) => Err(e),
        };
        result.map_err(|e| self.query_error(e))
    }

    /// Changes the cap (the pool's effective limit moved). Connections past a lowered cap close
    /// as they are returned.
    pub fn set_max_connections(&self, max: usize) {
        self.pool.resize(max.max(1));
    }

    pub fn status(&self) -> PoolStatus {
        let s = self.pool.status();
        PoolStatus {
            max: s.max_size,
            open: s.size,
            idle: s.available,
        }
    }

    /// The upstream as logs may show it: `postgres://user@host:port/db`, no password.
    pub fn redacted_url(&self) -> String {
        self.target.redacted()
    }

    /// Closes the pool: idle connections close now, others when returned; later requests fail.
    pub fn close(&self) {
        self.pool.close();
    }

    fn query_error(&self, e: QueryError) -> SqlHttpError {
        match e {
            QueryError::Db(db) => SqlHttpError::Sql(db),
            QueryError::TooLarge => SqlHttpError::ResponseTooLarge {
                max_bytes: self.max_response_bytes,
            },
            QueryError::Lost(why) => SqlHttpError::ConnectionLost {
                message: format!(
                    "the connection to {} failed during the request: {why}",
                    self.target.redacted()
                ),
            },
            QueryError::Protocol(why) => SqlHttpError::Protocol {
                message: format!("unexpected answer from {}: {why}", self.target.redacted()),
            },
            QueryError::Input(why) => SqlHttpError::invalid("query", why),
        }
    }
}

async fn run_statement(
    conn: &mut Connection,
    answer: &mut AnswerWriter,
    query: &Query,
    options: &WireOptions,
) -> Result<(), QueryError> {
    let mut writer = answer.statement(
        query.array_mode.unwrap_or(options.array_mode),
        options.raw_text_output,
    );
    let tag = conn.query(&query.query, &query.params, &mut writer).await?;
    writer
        .finish(tag.as_deref())
        .map_err(|_| QueryError::TooLarge)
}

/// BEGIN (with the batch's isolation level, read-only and deferrable settings), each statement,
/// COMMIT. On a statement's error: ROLLBACK, and that error is the answer.
async fn run_batch(
    conn: &mut Connection,
    answer: &mut AnswerWriter,
    queries: &[Query],
    options: &WireOptions,
) -> Result<(), QueryError> {
    conn.simple(&options.begin_statement()).await?;
    for query in queries {
        match run_statement(conn, answer, query, options).await {
            Ok(()) => {}
            Err(QueryError::Db(db)) => {
                // If the rollback fails too the session is left in a transaction and is closed
                // rather than pooled (`Lease`), which rolls it back on the server.
                let _ = conn.simple("ROLLBACK").await;
                return Err(QueryError::Db(db));
            }
            // Too large: the statement still runs and is cancelled by the caller; lost: the
            // server rolls back when the session ends. Either way the session is closed.
            Err(e) => return Err(e),
        }
    }
    conn.simple("COMMIT").await
}

fn pool_error(e: PoolError<SqlHttpError>) -> SqlHttpError {
    match e {
        PoolError::Backend(e) => e,
        PoolError::Timeout(_) => SqlHttpError::Unreachable {
            message: "timed out waiting for a database connection".into(),
        },
        PoolError::Closed => SqlHttpError::Unreachable {
            message: "the database pool is closed".into(),
        },
        other => SqlHttpError::Config {
            message: format!("database pool: {other}"),
        },
    }
}

/// Opens and vets connections for deadpool.
struct Manager {
    target: Arc<Target>,
    max_row_bytes: usize,
}

impl managed::Manager for Manager {
    type Type = Connection;
    type Error = SqlHttpError;

    async fn create(&self) -> Result<Connection, SqlHttpError> {
        Connection::connect(self.target.clone(), self.max_row_bytes).await
    }

    async fn recycle(
        &self,
        conn: &mut Connection,
        _: &managed::Metrics,
    ) -> RecycleResult<SqlHttpError> {
        if conn.probe() {
            Ok(())
        } else {
            Err(RecycleError::message(
                "the connection is not idle or was closed",
            ))
        }
    }
}

/// A connection out of the pool for one request. Its drop decides where the connection goes:
/// back to the pool only when idle outside a transaction; closed otherwise; and when a
/// statement is still running (the request's future was dropped), cancelled first.
struct Lease {
    object: Option<Object<Manager>>,
    cancel_sent: bool,
}

impl Lease {
    fn new(object: Object<Manager>) -> Lease {
        Lease {
            object: Some(object),
            cancel_sent: false,
        }
    }

    /// The connection. `object` is taken only by `drop`, so this cannot fail in practice.
    fn conn(&mut self) -> Result<&mut Connection, QueryError> {
        self.object
            .as_deref_mut()
            .ok_or_else(|| QueryError::Protocol("the connection was already released".into()))
    }

    /// Cancels the running statement and waits until the server has taken the request. Only
    /// while one runs: a cancel sent to an idle session could land on the next caller's query
    /// once the session is back in the pool.
    async fn cancel_now(&mut self) {
        if let Some(object) = self.object.as_ref().filter(|o| o.is_busy()) {
            let key = object.cancel_key();
            if let Err(e) = key.cancel().await {
                tracing::warn!(error = %e, "could not cancel a statement whose answer was too large");
            }
            self.cancel_sent = true;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(object) = self.object.take() else {
            return;
        };
        if object.is_busy() && !self.cancel_sent {
            // The request's future was dropped mid-statement. Cancel on the server, then close
            // the connection; it keeps its pool slot until the cancel went out, so the backend
            // winding down still counts against the cap.
            let key = object.cancel_key();
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        if let Err(e) = key.cancel().await {
                            tracing::warn!(error = %e, "could not cancel an abandoned statement");
                        }
                        drop(Object::take(object));
                    });
                }
                // No runtime (shutting down): closing the socket is all that is left.
                Err(_) => drop(Object::take(object)),
            }
        } else if !object.is_idle() {
            // An open or failed transaction, an interrupted exchange, a broken socket: never
            // hand this session to another caller. Closing it rolls back on the server.
            drop(Object::take(object));
        }
        // Otherwise `object` drops here and returns to the pool.
    }
}
