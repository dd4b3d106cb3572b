//! The stores' tests, in one binary: the conformance tests run against SQLite (real database
//! files in temp dirs) and PostgreSQL (a database of each test's own on 127.0.0.1:5432).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod backend;
mod backlog;
mod deliveries;
mod postgres;
mod store;
