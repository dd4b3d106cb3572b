//! The server end to end over loopback, in one binary: the real router and a real counting
//! upstream (`nthbouncer-testkit`), one module per feature, and the fuzz targets' saved inputs
//! replayed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod access;
mod access_log_flood;
mod admin;
mod cache;
mod connections;
mod dashboard;
mod database;
mod fuzz_regressions;
mod governor;
mod job_upstream;
mod jobs;
mod jobs_backlog;
mod jobs_faults;
mod key_races;
mod lock;
mod pool_listener;
mod proxy;
mod request_id;
mod tls;
mod tokens;
mod webhooks;
