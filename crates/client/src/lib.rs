//! A Rust client of nthbouncer's lock API (SPEC §5): take a slot of a pool's concurrency limit,
//! call the upstream yourself, and give the slot back with what the upstream answered.
//!
//! This crate owns the client side of the lease protocol: the three calls (acquire, renew,
//! release) and their errors ([`LockClient`], [`LockError`]), the [`SlotGuard`] that renews a
//! lease in the background every `renewIntervalMs` and releases it exactly once, and the
//! [`Outcome`] report that feeds the pool's adaptive learning. It makes no admission decision
//! of its own: what the gateway answers is what the caller gets.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use nthbouncer_client::{LeaseState, LockClient, LockError, Outcome};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let locks = LockClient::new("http://127.0.0.1:8080", "prod-acme", "nb_live_…")?
//!     .with_host("api.localhost")?; // the gateway routes by Host; needed when connecting by IP
//!
//! // Wait up to 5 s in the queue for a slot (None: fail fast).
//! let guard = match locks.acquire(Some(Duration::from_secs(5))).await {
//!     Ok(guard) => guard,
//!     Err(LockError::NoSlot { retry_after }) => {
//!         eprintln!("pool full; retry after {retry_after:?}");
//!         return Ok(());
//!     }
//!     Err(e) => return Err(e.into()),
//! };
//!
//! // The guard renews the lease in the background while the upstream call runs.
//! let http = reqwest::Client::new();
//! let call = http.get("https://api.example.com/v1/things").send();
//! let response = tokio::select! {
//!     r = call => r?,
//!     state = guard.lost() => {
//!         // Lost (reclaimed) or Capped (reached the pool's request timeout).
//!         eprintln!("lease ended early: {state:?}");
//!         return Ok(());
//!     }
//! };
//! assert_eq!(guard.state(), LeaseState::Held);
//!
//! // Release with the upstream's status and rate-limit headers, so the pool learns from them.
//! let outcome = Outcome::from_response(response.status().as_u16(), response.headers());
//! guard.release(outcome).await?;
//! # Ok(())
//! # }
//! ```
//!
//! Dropping a guard without releasing it releases the slot in the background, with no outcome.

#![forbid(unsafe_code)]

mod client;
mod error;
mod guard;
mod outcome;
pub mod signing;

pub use client::{AcquireOptions, LockClient, Priority};
pub use error::LockError;
pub use guard::{Grant, LeaseState, SlotGuard};
pub use outcome::{Outcome, Rate};
