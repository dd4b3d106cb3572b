//! Start-up: opens the store, wires every feature's state, loads the pools, binds the
//! listener and starts serving.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use nthbouncer_config::{Config, ConfigError, ServerSpec};
use nthbouncer_coord::{Clock, SystemClock};
use nthbouncer_store::{JobStore, Store};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::serve::{accept_loop, Dispatcher};
use crate::access::keys::Accept;
use crate::admin::Admin;
use crate::app::state::{AppState, StartError};
use crate::cache::Caches;
use crate::core::access_log::AccessLog;
use crate::database::DatabaseApi;
use crate::jobs::{JobIntake, Jobs};
use crate::lock::leases::LeaseBook;
use crate::lock::LockApi;
use crate::pools::guard::Guard;
use crate::pools::{Pools, PoolsParts};
use crate::proxy::Proxy;
use crate::webhooks::Webhooks;

/// What the embedding program may inject (tests inject a manual clock).
#[derive(Default)]
pub struct Options {
    pub clock: Option<Arc<dyn Clock>>,
}

/// A running server.
pub struct Running {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    /// A token that, when cancelled, starts the graceful shutdown.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Stops accepting, drains in-flight requests (bounded by `shutdown_grace_ms`), flushes the
    /// access log.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }

    /// Runs until the shutdown token is cancelled and the drain is done.
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Opens the store, loads the pools, binds the listener and starts serving.
pub async fn start(config: Config, options: Options) -> Result<Running, StartError> {
    config.validate().map_err(StartError::Config)?;
    let server = config.server.clone();
    let (listener, addr) = bind(&server).await?;
    let clock = options
        .clock
        .unwrap_or_else(|| Arc::new(SystemClock::new()));
    let (store, job_store) = open_store(&server).await?;
    let (access_log, access_log_task) = AccessLog::start(store.clone(), server.access_log_keep);
    let state = wire(Parts {
        public_url: server.public_url(addr.port()),
        server,
        clock,
        store,
        job_store,
        access_log,
    })?;
    state.pools.load_pools(&config).await?;
    crate::lock::leases::reserve_outstanding(&*state.store, &state.pools, state.clock.now_ms())
        .await;
    // Before serving: every unfinished job has its runner and its place in the backlog before a
    // new job can be accepted (or picked up twice).
    crate::jobs::resume(&state.jobs).await;
    let background = tokio::spawn(crate::jobs::run_sweeper(state.jobs.clone()));
    // Ends when the jobs' `stopping` is cancelled; pending deliveries go out at the next start.
    let webhooks = tokio::spawn(crate::webhooks::run_dispatcher(state.webhooks.clone()));

    let dispatcher = Arc::new(Dispatcher {
        api: crate::app::router::router(&state),
        state: state.clone(),
    });
    let cancel = CancellationToken::new();
    let cancel2 = cancel.clone();
    let task = tokio::spawn(async move {
        accept_loop(listener, dispatcher, cancel2, access_log_task).await;
        // Unfinished jobs stay in the store and resume at the next start.
        background.abort();
        webhooks.abort();
    });
    let pools = state.pools.snapshot().pools.len();
    tracing::info!(%addr, api_host = %state.pools.api_host(), pools, "nthbouncer listening");
    Ok(Running {
        addr,
        state,
        cancel,
        task,
    })
}

/// What [`wire`] builds the state from.
struct Parts {
    server: ServerSpec,
    public_url: String,
    clock: Arc<dyn Clock>,
    store: Arc<dyn Store>,
    job_store: Arc<dyn JobStore>,
    access_log: AccessLog,
}

/// Builds every feature's state from the shared parts: the one place that sees them all.
/// The scheme of a database pool's `pollUrl`s: a deployment behind TLS says so in its public URL.
fn poll_scheme(public_url: &str) -> &'static str {
    if public_url.starts_with("https://") {
        "https"
    } else {
        "http"
    }
}

fn wire(parts: Parts) -> Result<Arc<AppState>, StartError> {
    let Parts {
        server,
        public_url,
        clock,
        store,
        job_store,
        access_log,
    } = parts;
    let admin_token = server.admin_token().map_err(StartError::Config)?;
    let client = crate::upstream::build_client(&server).map_err(StartError::Client)?;
    let deliveries_pending = Arc::new(Notify::new());
    let scheme = poll_scheme(&public_url);
    let coordination = Arc::new(nthbouncer_coord::in_process::InProcessCoordination::new(
        clock.clone(),
    ));
    let pools = Arc::new(Pools::new(PoolsParts {
        store: store.clone(),
        jobs: job_store.clone(),
        coordination,
        clock: clock.clone(),
        api_host: server.api_host.clone(),
        pool_domain: server.pool_domain.clone(),
        destinations_changed: deliveries_pending.clone(),
        nonces: crate::access::NonceJournal::start(store.clone(), clock.clone()),
        allow_private_webhooks: server.allow_private_webhooks,
        max_destinations_per_pool: server.max_destinations_per_pool,
        upstream_timeouts: crate::upstream::ClientTimeouts::of(&server),
    }));
    let jobs = Arc::new(Jobs {
        intake: JobIntake::start(job_store.clone()),
        store: job_store,
        pools: pools.clone(),
        client: client.clone(),
        clock: clock.clone(),
        public_url,
        stopping: CancellationToken::new(),
        deliveries_pending,
        drain: crate::jobs::drain::Drain::new(),
        backlog: crate::jobs::backlog::Backlog::new(),
    });
    let trusted_proxies: Arc<[ipnet::IpNet]> = server.trusted_proxy_nets().into();
    let cache = Arc::new(Caches::new(pools.clone(), clock.clone()));
    Ok(Arc::new(AppState {
        tls: listener_tls(&server, &pools)?,
        database: Arc::new(DatabaseApi {
            http: client.clone(),
            trusted_proxies: trusted_proxies.clone(),
            access_log: access_log.clone(),
            clock: clock.clone(),
            jobs: jobs.clone(),
            max_body_bytes: server.max_body_bytes,
            body_read_timeout: std::time::Duration::from_millis(server.header_read_timeout_ms),
            scheme,
        }),
        proxy: Arc::new(Proxy {
            client: client.clone(),
            trusted_proxies: trusted_proxies.clone(),
            access_log: access_log.clone(),
            clock: clock.clone(),
            jobs: jobs.clone(),
            max_body_bytes: server.max_body_bytes,
            header_read_timeout: std::time::Duration::from_millis(server.header_read_timeout_ms),
            cache: cache.clone(),
        }),
        lock: Arc::new(LockApi {
            pools: pools.clone(),
            access_log: access_log.clone(),
            clock: clock.clone(),
            leases: LeaseBook::start(store.clone(), clock.clone()),
        }),
        admin: Arc::new(Admin {
            pools: pools.clone(),
            store: store.clone(),
            clock: clock.clone(),
            admin_token,
            cache: cache.clone(),
        }),
        webhooks: Arc::new(Webhooks {
            jobs: jobs.clone(),
            pools: pools.clone(),
            server: server.clone(),
        }),
        guard: Arc::new(Guard {
            pools: pools.clone(),
            http: client,
            trusted_proxies,
            access_log: access_log.clone(),
            clock: clock.clone(),
        }),
        clock,
        store,
        pools,
        jobs,
        cache,
        access_log,
        draining: AtomicBool::new(false),
        server,
    }))
}

/// `[server.tls]`, read now; client certificates are asked for while any pool wants them.
fn listener_tls(
    server: &ServerSpec,
    pools: &Arc<Pools>,
) -> Result<Option<Arc<crate::tls::ListenerTls>>, StartError> {
    let Some(spec) = &server.tls else {
        return Ok(None);
    };
    let pools = Arc::downgrade(pools);
    let wants = Arc::new(move || {
        pools.upgrade().is_some_and(|p| {
            p.snapshot()
                .pools
                .values()
                .any(|pool| pool.access.requires_client_cert())
        })
    });
    let tls = crate::tls::ListenerTls::load(spec, wants).map_err(StartError::Config)?;
    Ok(Some(Arc::new(tls)))
}

async fn bind(server: &ServerSpec) -> Result<(TcpListener, SocketAddr), StartError> {
    let listen_error = |source| StartError::Listen {
        addr: server.listen.clone(),
        source,
    };
    let addr = server.listen_addr().map_err(StartError::Config)?;
    let listener = TcpListener::bind(addr).await.map_err(listen_error)?;
    let addr = listener.local_addr().map_err(listen_error)?;
    Ok((listener, addr))
}

/// Opens the embedded store (off the async runtime: SQLite blocks).
async fn open_store(
    server: &ServerSpec,
) -> Result<(Arc<dyn Store>, Arc<dyn JobStore>), StartError> {
    let dir = server.data_dir.clone();
    let sqlite = tokio::task::spawn_blocking(move || {
        nthbouncer_store::sqlite::SqliteStore::open_in_dir(&dir)
    })
    .await
    .map_err(|e| StartError::Store(e.to_string()))?
    .map_err(|e| StartError::Store(e.to_string()))?;
    Ok((Arc::new(sqlite.clone()), Arc::new(sqlite)))
}

/// Validates a config the way `serve` would, without binding anything.
pub fn check_config(config: &Config) -> Result<(), ConfigError> {
    config.validate()?;
    if let Some(tls) = &config.server.tls {
        crate::tls::ListenerTls::check(tls)?;
    }
    for (i, p) in config.pools.iter().enumerate() {
        let at = format!("pools[{i}]");
        match p.kind {
            nthbouncer_config::PoolKind::Proxy => {
                crate::upstream::Target::parse(&at, &p.upstream)?;
            }
            // Opens nothing: the URL, the limits and the CA file are checked.
            nthbouncer_config::PoolKind::Database => {
                crate::pools::registry::open_database(&at, p)?;
            }
        }
        p.resolved_upstream_headers(&at)?;
        if let Some(t) = &p.upstream_tls {
            crate::tls::upstream_client_config(&format!("{at}.upstream_tls"), t)?;
        }
        p.key_digests(&at)?;
        let keys = Arc::default();
        let accept = Accept::of(&p.auth_methods());
        crate::access::AccessPolicy::build(&format!("{at}.access"), &p.access, accept, keys)?;
    }
    Ok(())
}
