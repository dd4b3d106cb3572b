//! The SQLite store's tests, in one binary, against real database files in temp dirs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod backlog;
mod deliveries;
mod sqlite;
