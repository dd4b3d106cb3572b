//! What every layer above shares and nothing here depends on: the one error type, the
//! translation of gate answers to HTTP, the access log, pagination, metrics and address checks.
//! It must not import any other module of this crate.

pub mod access_log;
pub mod admission;
pub mod batch;
pub mod error;
pub mod extract;
pub mod history;
pub mod live;
pub mod metrics;
pub mod netcheck;
pub mod pagination;
pub mod peer;
pub mod request_id;
pub mod time;

/// Who owns a pool's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ManagedBy {
    /// Declared in the config file: read-only through the admin API.
    Config,
    /// Created through the admin API: lives in the store.
    Api,
}

impl ManagedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            ManagedBy::Config => "config",
            ManagedBy::Api => "api",
        }
    }
}
