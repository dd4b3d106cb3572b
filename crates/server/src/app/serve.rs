//! Serving: one listener for every host, dispatch by `Host` (SPEC §1), and the graceful
//! shutdown (stop accepting, let in-flight requests finish within a bound).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::IntoResponse;
use axum::Router;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::app::state::AppState;
use crate::core::error::ApiError;

pub(super) struct Dispatcher {
    pub(super) state: Arc<AppState>,
    pub(super) api: Router,
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
        if host == self.state.pools.api_host() {
            req.extensions_mut().insert(ConnectInfo(peer));
            return match self.api.clone().oneshot(req).await {
                Ok(resp) => resp,
                Err(never) => match never {},
            };
        }
        match self.state.pools.by_host(&host) {
            Some(pool) => {
                let original_host = req.headers().get(http::header::HOST).cloned();
                let proxy = self.state.proxy.clone();
                crate::proxy::handle(proxy, pool, req, peer, original_host).await
            }
            None => ApiError::pool_not_found().into_response(),
        }
    }
}

pub(super) async fn accept_loop(
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
    state.jobs.stopping.cancel();
    state.access_log.flush().await;
    for pool in state.pools.snapshot().pools.values() {
        pool.gate.close().await;
    }
    drop(dispatcher);
    drop(state);
    // The writer ends once the last sender is gone; if a handle is still held elsewhere, the
    // flush above already committed everything.
    access_log_task.abort();
}
