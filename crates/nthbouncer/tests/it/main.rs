//! The real binary end to end, in one binary: the CLI, `nthbouncer lock`, chaos, and crashes
//! with a restart on the same data dir. Support is in `nthbouncer-testkit`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod chaos;
mod cli;
mod connections;
mod jobs_crash;
mod jobs_sigterm;
mod lock_cli;
mod lock_restart;
mod nonce_restart;
mod pg_backlog;
mod pg_migrate;
mod pg_nodes;
mod pg_outage;
mod pg_sigterm;
mod pg_store;
mod reload;
mod scale_out;
mod scale_out_tokens;
mod sdk;
mod soak;
mod tls_sighup;
mod webhooks_crash;

/// The binary under test (only this crate's tests know its path).
const BIN: &str = env!("CARGO_BIN_EXE_nthbouncer");
