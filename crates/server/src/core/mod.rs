//! What every layer above shares and nothing here depends on: the one error type, the
//! translation of gate answers to HTTP, the access log, pagination, metrics and address checks.
//! It must not import any other module of this crate.

pub mod access_log;
pub mod admission;
pub mod error;
pub mod extract;
pub mod metrics;
pub mod netcheck;
pub mod pagination;
