//! Listening and serving: one listener for every host, dispatch by `Host` (SPEC §1), and the
//! graceful shutdown (stop accepting, let in-flight requests finish within a bound).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::IntoResponse;
use axum::Router;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use nthbouncer_config::{Config, ConfigError};
use nthbouncer_coord::{Clock, SystemClock};
use nthbouncer_store::Store;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::app::state::{AppState, StartError};
use crate::core::access_log::AccessLog;
use crate::core::error::ApiError;
use crate::pools::registry::Registry;

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
    let addr = server.listen_addr().map_err(StartError::Config)?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Listen {
            addr: server.listen.clone(),
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| StartError::Listen {
        addr: server.listen.clone(),
        source,
    })?;

    let clock = options
        .clock
        .unwrap_or_else(|| Arc::new(SystemClock::new()));
    let dir = server.data_dir.clone();
    let sqlite = tokio::task::spawn_blocking(move || {
        nthbouncer_store::sqlite::SqliteStore::open_in_dir(&dir)
    })
    .await
    .map_err(|e| StartError::Store(e.to_string()))?
    .map_err(|e| StartError::Store(e.to_string()))?;
    let store: Arc<dyn Store> = Arc::new(sqlite.clone());
    let jobs: Arc<dyn nthbouncer_store::JobStore> = Arc::new(sqlite);
    let admin_token = server.admin_token().map_err(StartError::Config)?;
    let client = crate::upstream::build_client(&server).map_err(StartError::Client)?;
    let (access_log, access_log_task) = AccessLog::start(store.clone(), server.access_log_keep);
    let state = Arc::new(AppState {
        api_host: server.api_host.to_ascii_lowercase(),
        pool_suffix: format!(".{}", server.pool_domain.to_ascii_lowercase()),
        public_url: server.public_url(addr.port()),
        trusted_proxies: server.trusted_proxy_nets(),
        admin_token,
        coordination: Arc::new(nthbouncer_coord::in_process::InProcessCoordination::new(
            clock.clone(),
        )),
        leases: crate::lock::leases::LeaseBook::start(store.clone(), clock.clone()),
        clock,
        store,
        job_intake: crate::jobs::JobIntake::start(jobs.clone()),
        jobs,
        deliveries_pending: tokio::sync::Notify::new(),
        stopping: CancellationToken::new(),
        registry: ArcSwap::from_pointee(Registry::default()),
        admin_lock: tokio::sync::Mutex::new(()),
        client,
        access_log,
        draining: AtomicBool::new(false),
        server,
    });
    state.load_pools(&config).await?;
    crate::lock::leases::reserve_outstanding(&state).await;
    let background = tokio::spawn(crate::jobs::resume_and_sweep(state.clone()));
    // Ends when `state.stopping` is cancelled; pending deliveries go out at the next start.
    let webhooks = tokio::spawn(crate::webhooks::run_dispatcher(state.clone()));

    let dispatcher = Arc::new(Dispatcher {
        api: crate::app::router::router(state.clone()),
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
    tracing::info!(%addr, api_host = %state.api_host, pools = state.registry.load().pools.len(), "nthbouncer listening");
    Ok(Running {
        addr,
        state,
        cancel,
        task,
    })
}

struct Dispatcher {
    state: Arc<AppState>,
    api: Router,
}

/// The host a request names: `Host` (or the HTTP/2 authority), port dropped, case folded.
fn request_host(req: &Request<Incoming>) -> Option<String> {
    let raw = match req.headers().get(http::header::HOST) {
        Some(h) => h.to_str().ok()?,
        None => req.uri().authority()?.as_str(),
    };
    let host = if let Some(rest) = raw.strip_prefix('[') {
        rest.split(']').next()?
    } else {
        raw.rsplit_once(':').map_or(raw, |(h, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                raw
            }
        })
    };
    Some(host.trim_end_matches('.').to_ascii_lowercase())
}

impl Dispatcher {
    async fn dispatch(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<Body> {
        let Some(host) = request_host(&req) else {
            return ApiError::pool_not_found().into_response();
        };
        if host == self.state.api_host {
            req.extensions_mut().insert(ConnectInfo(peer));
            return match self.api.clone().oneshot(req).await {
                Ok(resp) => resp,
                Err(never) => match never {},
            };
        }
        let pool = self
            .state
            .registry
            .load()
            .by_host(&host, &self.state.pool_suffix)
            .cloned();
        match pool {
            Some(pool) => {
                let original_host = req.headers().get(http::header::HOST).cloned();
                crate::proxy::handle(self.state.clone(), pool, req, peer, original_host).await
            }
            None => ApiError::pool_not_found().into_response(),
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    dispatcher: Arc<Dispatcher>,
    cancel: CancellationToken,
    access_log_task: JoinHandle<()>,
) {
    let state = dispatcher.state.clone();
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Slowloris guard: a client gets this long to send its request head.
        .header_read_timeout(Duration::from_millis(state.server.header_read_timeout_ms));
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let d = dispatcher.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let d = d.clone();
            async move { Ok::<_, Infallible>(d.dispatch(req, peer).await) }
        });
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
        let conn = graceful.watch(conn.into_owned());
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
        });
    }
    drop(listener);
    state.draining.store(true, Ordering::Relaxed);
    let grace = Duration::from_millis(state.server.shutdown_grace_ms);
    tracing::info!(
        grace_ms = grace.as_millis() as u64,
        "shutting down: draining in-flight requests"
    );
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("shutdown grace elapsed with requests still in flight");
    }
    state.stopping.cancel();
    state.access_log.flush().await;
    for pool in state.registry.load().pools.values() {
        pool.gate.close().await;
    }
    drop(dispatcher);
    drop(state);
    // The writer ends once the last sender is gone; if a handle is still held elsewhere, the
    // flush above already committed everything.
    access_log_task.abort();
}

/// Validates a config the way `serve` would, without binding anything.
pub fn check_config(config: &Config) -> Result<(), ConfigError> {
    config.validate()?;
    for (i, p) in config.pools.iter().enumerate() {
        let at = format!("pools[{i}]");
        crate::upstream::Target::parse(&at, &p.upstream)?;
        p.resolved_upstream_headers(&at)?;
        p.key_digests(&at)?;
        crate::access::AccessPolicy::build(&format!("{at}.access"), &p.access)?;
    }
    Ok(())
}
