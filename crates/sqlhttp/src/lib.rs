//! Neon's SQL-over-HTTP wire format in front of PostgreSQL, as the `@neondatabase/serverless`
//! HTTP driver speaks it: a JSON body and a few `Neon-*` headers in, a JSON answer out.
//!
//! This crate owns everything between those two: parsing the request (`SqlRequest`,
//! `WireOptions`), a pool of PostgreSQL sessions (`Database`, capped at the pool's effective
//! limit, TLS with rustls), running a statement or a batch transaction, encoding the answer
//! while rows arrive (`Answer`, stopped and cancelled at `max_response_bytes`), cancelling the
//! statement of a caller that went away, and the errors with their HTTP status and JSON body
//! (`SqlHttpError`). It knows nothing of the HTTP server, pool keys or the gate: the server's
//! `database` feature authenticates and admits a caller, then calls `Database::execute`.
//!
//! ```no_run
//! # async fn demo(headers: &http::HeaderMap, body: &[u8]) -> Result<(), nthbouncer_sqlhttp::SqlHttpError> {
//! use nthbouncer_sqlhttp::{Database, Limits, SqlRequest, WireOptions};
//! let db = Database::new("postgres://app:secret@127.0.0.1/shop", Limits::default())?;
//! let request = SqlRequest::from_slice(body)?;
//! let options = WireOptions::from_headers(headers)?;
//! let answer = db.execute(&request, &options).await?; // 200 with answer.body()
//! # Ok(()) }
//! ```

mod answer;
mod config;
mod conn;
mod database;
mod error;
mod request;

pub use answer::Answer;
pub use config::Limits;
pub use database::{Database, PoolStatus};
pub use error::{DbError, SqlHttpError, TOO_MANY_CONNECTIONS};
pub use request::{
    IsolationLevel, Query, SqlRequest, WireOptions, ARRAY_MODE, BATCH_DEFERRABLE,
    BATCH_ISOLATION_LEVEL, BATCH_READ_ONLY, RAW_TEXT_OUTPUT,
};
