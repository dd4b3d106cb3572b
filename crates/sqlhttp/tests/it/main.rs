//! End-to-end tests against the machine's PostgreSQL (127.0.0.1:5432, trust auth, database
//! `test`; `NTHBOUNCER_TEST_PG_URL` overrides). Each test works in its own schema and its own
//! `application_name`, so tests run in parallel and count only their own backends. Waits are
//! bounded polling loops, never timing assertions.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod batches;
mod cancel;
mod errors;
mod modes;
mod params;
mod pool;
mod support;
mod types;
