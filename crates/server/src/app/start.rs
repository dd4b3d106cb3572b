//! Start-up: opens the store, wires every feature's state, loads the pools, binds the
//! listener and starts serving.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use nthbouncer_config::Coordination as CoordinationSpec;
use nthbouncer_config::{Config, ConfigError, ServerSpec, StoreSpec};
use nthbouncer_coord::in_process::InProcessCoordination;
use nthbouncer_coord::redis::{RedisCoordination, RedisOptions};
use nthbouncer_coord::{Clock, Coordination, SystemClock};
use nthbouncer_store::{JobStore, Store};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::serve::{accept_loop, ConnectionThreads, Dispatcher, Drained};
use crate::access::keys::Accept;
use crate::access::{NonceJournal, NonceSource};
use crate::admin::Admin;
use crate::app::state::{AppState, StartError};
use crate::cache::Caches;
use crate::core::access_log::AccessLog;
use crate::core::live::{LiveServer, ServerSettings};
use crate::database::DatabaseApi;
use crate::jobs::{JobIntake, Jobs};
use crate::lock::leases::LeaseBook;
use crate::lock::LockApi;
use crate::pools::guard::Guard;
use crate::pools::{Pools, PoolsParts};
use crate::proxy::Proxy;
use crate::upstream::SharedClient;
use crate::webhooks::Webhooks;

/// What the embedding program may inject (tests inject a manual clock).
#[derive(Default)]
pub struct Options {
    pub clock: Option<Arc<dyn Clock>>,
    /// The file `config` was read from: a reload (SIGHUP, `POST /admin/reload`) re-reads it.
    pub config_path: Option<std::path::PathBuf>,
    /// Serve connections on this many threads of their own, one runtime each
    /// (`app::serve::threads`); `None`: on the caller's runtime, as tasks (tests, benchmarks
    /// that embed the server). The binary gives one per core.
    pub connection_threads: Option<usize>,
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
    let (store, job_store, claim_lease_ms) = open_store(&server).await?;
    let shared = open_coordination(&server, clock.clone()).await?;
    let settings = ServerSettings::of(&server, addr.port()).map_err(StartError::Config)?;
    let live = Arc::new(LiveServer::new(settings, addr.port()));
    let (access_log, access_log_task) = AccessLog::start(store.clone(), live.clone());
    let state = wire(Parts {
        live,
        server,
        clock,
        store,
        job_store,
        access_log,
        shared: shared.clone(),
        connection_threads: options.connection_threads.unwrap_or(0),
    })?;
    state.pools.load_pools(&config).await?;
    if let Some(path) = options.config_path {
        state.reload.set_source(path, config.clone()).await;
    }
    if shared.is_none() {
        // On Redis the leases outlive this node in Redis itself: nothing to hold back.
        let now = state.clock.now_ms();
        crate::lock::leases::reserve_outstanding(&*state.store, &state.pools, now).await;
    }
    // Before serving: every unfinished job has its runner and its place in the backlog before a
    // new job can be accepted (or picked up twice). On a shared store, only the jobs no live
    // node holds, by the first claim pass; then a pass every little while.
    let shared_store = match claim_lease_ms {
        None => {
            crate::jobs::resume(&state.jobs).await;
            None
        }
        Some(lease_ms) => {
            match crate::jobs::claims::claim_pass(&state.jobs).await {
                Ok(Some(taken)) if taken > 0 => {
                    tracing::info!(jobs = taken, "resuming unfinished jobs no live node holds")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot claim unfinished jobs yet; retrying"),
            }
            let jobs = tokio::spawn(crate::jobs::claims::run_claims(
                state.jobs.clone(),
                lease_ms,
            ));
            let settings = tokio::spawn(crate::pools::sync::run(state.pools.clone()));
            Some((jobs, settings))
        }
    };
    let background = tokio::spawn(crate::jobs::run_sweeper(state.jobs.clone()));
    // Ends when the jobs' `stopping` is cancelled; pending deliveries go out at the next start.
    let webhooks = tokio::spawn(crate::webhooks::run_dispatcher(state.webhooks.clone()));

    let dispatcher = Arc::new(Dispatcher {
        api: crate::app::router::router(&state),
        state: state.clone(),
    });
    let threads = match options.connection_threads {
        Some(count) => Some(ConnectionThreads::start(count).map_err(StartError::Threads)?),
        None => None,
    };
    let cancel = CancellationToken::new();
    let cancel2 = cancel.clone();
    let jobs = state.jobs.clone();
    let task = tokio::spawn(async move {
        let drained = accept_loop(listener, dispatcher, threads, cancel2, access_log_task).await;
        // Unfinished jobs stay in the store and resume at the next start (on a shared store:
        // are taken over by the other nodes, at once for those given back here).
        background.abort();
        match shared_store {
            None => webhooks.abort(),
            Some((claims, settings)) => {
                settings.abort();
                let idle = drained == Drained::Recorded;
                crate::jobs::claims::release_on_stop(&jobs, claims, webhooks, idle).await;
            }
        }
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
    /// The `[server]` settings a reload changes.
    live: Arc<LiveServer>,
    clock: Arc<dyn Clock>,
    store: Arc<dyn Store>,
    job_store: Arc<dyn JobStore>,
    access_log: AccessLog,
    /// The shared coordination (Redis) when configured; `None`: in process.
    shared: Option<Arc<RedisCoordination>>,
    /// How many connection threads will serve: each gets its own upstream client.
    connection_threads: usize,
}

/// Builds every feature's state from the shared parts: the one place that sees them all.
fn wire(parts: Parts) -> Result<Arc<AppState>, StartError> {
    let Parts {
        server,
        live,
        clock,
        store,
        job_store,
        access_log,
        shared,
        connection_threads,
    } = parts;
    let timeouts = crate::upstream::ClientTimeouts::of(&live.load());
    let lanes = 1 + connection_threads;
    let client = Arc::new(SharedClient::new(timeouts, lanes).map_err(StartError::Client)?);
    let deliveries_pending = Arc::new(Notify::new());
    let (coordination, nonces, leases) = coordination_parts(shared.clone(), &store, &clock)?;
    let pools = Arc::new(Pools::new(PoolsParts {
        store: store.clone(),
        jobs: job_store.clone(),
        coordination,
        token_ledgers: shared.clone(),
        clock: clock.clone(),
        destinations_changed: deliveries_pending.clone(),
        nonces,
        live: live.clone(),
    }));
    let jobs = jobs_part(
        &job_store,
        &pools,
        &client,
        &clock,
        &live,
        deliveries_pending,
    );
    let cache = Arc::new(Caches::new(pools.clone(), clock.clone()));
    let tls = listener_tls(&server, &pools)?;
    Ok(Arc::new(AppState {
        dashboard: Arc::new(crate::dashboard::Dashboard::new(
            pools.clone(),
            (store.clone(), job_store),
            live.clone(),
            clock.clone(),
            tls.is_some(),
        )),
        tls,
        database: Arc::new(DatabaseApi {
            http: client.clone(),
            live: live.clone(),
            access_log: access_log.clone(),
            clock: clock.clone(),
            jobs: jobs.clone(),
        }),
        proxy: Arc::new(Proxy {
            client: client.clone(),
            live: live.clone(),
            access_log: access_log.clone(),
            clock: clock.clone(),
            jobs: jobs.clone(),
            cache: cache.clone(),
        }),
        lock: Arc::new(LockApi {
            pools: pools.clone(),
            access_log: access_log.clone(),
            clock: clock.clone(),
            leases,
        }),
        admin: Arc::new(Admin {
            pools: pools.clone(),
            store: store.clone(),
            clock: clock.clone(),
            live: live.clone(),
            cache: cache.clone(),
        }),
        webhooks: Arc::new(Webhooks {
            jobs: jobs.clone(),
            pools: pools.clone(),
            live: live.clone(),
        }),
        guard: Arc::new(Guard {
            pools: pools.clone(),
            http: client.clone(),
            live: live.clone(),
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
        shared,
        live,
        upstream: client,
        reload: Default::default(),
        server,
    }))
}

/// The async jobs' part of the state: intake, runner bookkeeping and the deliveries' wake-up.
fn jobs_part(
    job_store: &Arc<dyn JobStore>,
    pools: &Arc<Pools>,
    client: &Arc<SharedClient>,
    clock: &Arc<dyn Clock>,
    live: &Arc<LiveServer>,
    deliveries_pending: Arc<Notify>,
) -> Arc<Jobs> {
    Arc::new(Jobs {
        intake: JobIntake::start(job_store.clone()),
        attempt_writes: crate::jobs::attempt_writes::AttemptWrites::start(job_store.clone()),
        store: job_store.clone(),
        pools: pools.clone(),
        client: client.clone(),
        clock: clock.clone(),
        live: live.clone(),
        stopping: CancellationToken::new(),
        deliveries_pending,
        drain: crate::jobs::drain::Drain::new(),
        backlog: crate::jobs::backlog::Backlog::new(),
        running: crate::jobs::claims::Running::new(),
    })
}

/// The gates, the nonce stores and the lease book, all in process or all on Redis.
fn coordination_parts(
    shared: Option<Arc<RedisCoordination>>,
    store: &Arc<dyn Store>,
    clock: &Arc<dyn Clock>,
) -> Result<(Arc<dyn Coordination>, NonceSource, LeaseBook), StartError> {
    Ok(match shared {
        Some(redis) => (redis.clone(), NonceSource::Shared(redis), LeaseBook::off()),
        None => (
            Arc::new(InProcessCoordination::new(clock.clone())),
            NonceSource::Journal(NonceJournal::start(store.clone(), clock.clone())),
            LeaseBook::start(store.clone(), clock.clone()).map_err(StartError::LeaseBook)?,
        ),
    })
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

/// Opens the store `server.store` names: the embedded SQLite file (off the async runtime: SQLite
/// blocks), or the PostgreSQL database, migrated to this build's schema. A database that does
/// not answer at start stops the start (nothing durable could be promised). The third part is
/// the claim lease of a store several nodes share (`None`: SQLite, one node).
async fn open_store(
    server: &ServerSpec,
) -> Result<(Arc<dyn Store>, Arc<dyn JobStore>, Option<u64>), StartError> {
    match server.store().map_err(StartError::Config)? {
        StoreSpec::Sqlite => {
            let dir = server.data_dir.clone();
            let sqlite = tokio::task::spawn_blocking(move || {
                nthbouncer_store::sqlite::SqliteStore::open_in_dir(&dir)
            })
            .await
            .map_err(|e| StartError::Store(e.to_string()))?
            .map_err(|e| StartError::Store(e.to_string()))?;
            Ok((Arc::new(sqlite.clone()), Arc::new(sqlite), None))
        }
        StoreSpec::Postgres {
            url,
            claim_lease_ms,
        } => {
            // The store's messages name the database without its password.
            let pg = nthbouncer_store::postgres::PgStore::connect_node(&url, claim_lease_ms)
                .await
                .map_err(|e| StartError::Store(format!("server.store: {e}")))?;
            tracing::info!(
                database = pg.target(),
                node = pg.node_id(),
                claim_lease_ms,
                "storing state in PostgreSQL"
            );
            Ok((Arc::new(pg.clone()), Arc::new(pg), Some(claim_lease_ms)))
        }
    }
}

/// Connects to the shared coordination store, if the config names one. Failing closed, a node
/// that cannot reach Redis at start does not start (it could admit nothing); failing open, it
/// starts on its share of each limit and joins Redis once it answers.
async fn open_coordination(
    server: &ServerSpec,
    clock: Arc<dyn Clock>,
) -> Result<Option<Arc<RedisCoordination>>, StartError> {
    let spec = match server.coordination().map_err(StartError::Config)? {
        CoordinationSpec::InProcess => return Ok(None),
        CoordinationSpec::Redis(spec) => spec,
    };
    let timeout = std::time::Duration::from_millis(spec.timeout_ms);
    let mut options = RedisOptions::new(spec.url);
    options.key_prefix = spec.key_prefix;
    options.fail_open = spec.fail_open;
    options.command_timeout = timeout;
    options.connect_timeout = timeout;
    // The URL is not quoted: it may carry a password.
    let redis = RedisCoordination::new(options, clock)
        .map_err(|e| StartError::Coordination(format!("server.coordination: {e}")))?;
    match redis.ping().await {
        Ok(()) => {
            tracing::info!(node = redis.node_id(), "coordinating through Redis");
            if let Ok(Some((maxmemory, policy))) = redis.eviction_risk().await {
                tracing::warn!(
                    maxmemory,
                    policy = %policy,
                    "Redis (server.coordination) may evict keys when it reaches maxmemory, and \
                     every key nthbouncer keeps there expires, so volatile-* policies evict them \
                     too: a lost key undercounts slots or tokens until it is rebuilt. Set \
                     maxmemory-policy noeviction (or no maxmemory) for exact limits"
                );
            }
        }
        Err(e) if spec.fail_open.is_some() => tracing::warn!(
            error = %e,
            "Redis (server.coordination) does not answer; admitting this node's share of each \
             limit until it does (coordination_fail = \"open\")"
        ),
        Err(e) => {
            return Err(StartError::Coordination(format!(
                "Redis (server.coordination) does not answer: {e}; start it, or set \
                 server.coordination_fail = \"open\" to start on this node's share of each limit"
            )))
        }
    }
    Ok(Some(Arc::new(redis)))
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
