//! The HTTP layer of nthbouncer: one listener, routing by `Host` to the API host (lock, admin,
//! ops routes) or to a pool host (the proxy).
//!
//! Layout:
//! - [`serve`]: binding, host dispatch, graceful shutdown; [`start`] is the entry point.
//! - [`state`]: shared state and the operations that change the set of pools.
//! - [`registry`]: the immutable, swap-on-write view of pools the hot path reads.
//! - [`auth`]: pool-key authentication. [`admission`]: wait budgets, priorities, `x-nthpool-*`.
//! - [`access`]: the pool's access policies (HMAC, JWT, Cloudflare Access, IP allowlist, failure
//!   throttling), checked together with the pool key on every pool route.
//! - [`tls`]: the listeners' certificates (by SNI, re-read on SIGHUP), client certificates as a
//!   pool's access policy (`access.mtls`), TLS settings towards private origins.
//! - [`database`]: a database pool's host (`POST /sql` in Neon's wire format, job polls).
//! - [`proxy`]: the proxy and upstream client. [`outcome`]: upstream answers → governor outcomes.
//! - [`api`], [`admin`]: the API host's routes. [`access_log`], [`metrics`]: observability.
//! - [`jobs`], [`jobs_api`]: async jobs and their routes. [`webhooks`]: the delivery outbox's
//!   dispatcher, Standard Webhooks signing, and the client that refuses private addresses.
//! - [`error`]: the one error type, which knows its status and JSON code.
//!
//! Admission decisions belong to the gate (`nthbouncer-coord`); durable state to the store
//! (`nthbouncer-store`). This crate only translates HTTP to and from them.

#![forbid(unsafe_code)]

pub mod access;
pub mod admin;
pub mod app;
pub mod cache;
pub mod core;
pub mod dashboard;
pub mod database;
pub mod jobs;
pub mod lock;
pub mod pools;
pub mod proxy;
pub mod tls;
pub mod tokens;
pub mod upstream;
pub mod webhooks;

pub use app::start::{check_config, start, Options, Running};
pub use app::state::StartError;

#[cfg(test)]
mod tidy;
