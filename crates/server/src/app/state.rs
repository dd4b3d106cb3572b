//! The application's state: one handle per feature, each holding only what that feature needs,
//! wired here (the composition root) and nowhere else.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use nthbouncer_config::{ConfigError, ServerSpec};
use nthbouncer_coord::Clock;
use nthbouncer_store::Store;

use crate::admin::Admin;
use crate::cache::Caches;
use crate::core::access_log::AccessLog;
use crate::dashboard::Dashboard;
use crate::database::DatabaseApi;
use crate::jobs::Jobs;
use crate::lock::LockApi;
use crate::pools::guard::Guard;
use crate::pools::{LoadError, Pools};
use crate::proxy::Proxy;
use crate::tls::ListenerTls;
use crate::webhooks::Webhooks;

pub struct AppState {
    /// `[server]` as the process started with it: what only a restart changes is read from
    /// here; what a reload changes is read from `live`.
    pub server: ServerSpec,
    pub clock: Arc<dyn Clock>,
    pub store: Arc<dyn Store>,
    pub pools: Arc<Pools>,
    pub jobs: Arc<Jobs>,
    pub proxy: Arc<Proxy>,
    pub database: Arc<DatabaseApi>,
    pub lock: Arc<LockApi>,
    pub admin: Arc<Admin>,
    pub dashboard: Arc<Dashboard>,
    pub webhooks: Arc<Webhooks>,
    pub guard: Arc<Guard>,
    pub cache: Arc<Caches>,
    pub access_log: AccessLog,
    /// Set on SIGTERM: `/readyz` fails so load balancers stop sending traffic.
    pub draining: AtomicBool,
    /// The shared coordination (Redis) when configured, for `/readyz`; `None`: in process.
    pub shared: Option<Arc<nthbouncer_coord::redis::RedisCoordination>>,
    /// The `[server]` settings a reload changes live.
    pub live: Arc<crate::core::live::LiveServer>,
    /// The shared upstream client (a reload that changes its timeouts replaces it).
    pub upstream: Arc<crate::upstream::SharedClient>,
    /// The config file and what was last applied from it (SIGHUP, `POST /admin/reload`).
    pub reload: crate::app::reload::Reloader,
    /// `[server.tls]`: the listeners' certificates ([`ListenerTls::reload`] on SIGHUP).
    pub tls: Option<Arc<ListenerTls>>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(ConfigError),
    #[error("cannot open the store: {0}")]
    Store(String),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("cannot build the upstream client: {0}")]
    Client(#[source] rustls::Error),
    #[error("cannot coordinate through Redis: {0}")]
    Coordination(String),
    #[error("cannot start the connection threads: {0}")]
    Threads(#[source] std::io::Error),
    #[error("cannot start the lease book's thread: {0}")]
    LeaseBook(#[source] std::io::Error),
}

impl From<LoadError> for StartError {
    fn from(e: LoadError) -> Self {
        match e {
            LoadError::Config(e) => StartError::Config(e),
            LoadError::Store(e) => StartError::Store(e),
            LoadError::Listen { at, addr, source } => StartError::Listen {
                addr: format!("{addr} ({at})"),
                source,
            },
        }
    }
}
