//! Serving: one listener for every host, dispatch by `Host` (SPEC §1), and the pools' own
//! listeners (everything arriving on one is its pool's); the bounds every connection is held
//! to, on every listener alike (`conn`: header and idle timeouts, `max_connections`); and the
//! graceful shutdown (stop accepting, let in-flight requests finish within a bound).

mod conn;
mod threads;

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
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
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use self::conn::{
    Activity, Admission, ConnIo, Connections, Counted, Expired, Timeouts, TrackedBody, Watchdog,
};
pub(crate) use self::threads::ConnectionThreads;
use crate::app::state::AppState;
use crate::core::error::{ApiError, ErrorCode};
use crate::core::peer::Peer;
use crate::core::request_id::{self, RequestId};
use crate::pools::listeners::Opened;
use crate::pools::registry::PoolRuntime;
use crate::pools::HostRole;
use crate::tls::PeerTls;
use nthbouncer_config::PoolKind;

pub(super) struct Dispatcher {
    pub(super) state: Arc<AppState>,
    pub(super) api: Router,
}

/// The host a request names: `Host` (or the HTTP/2 authority), port dropped, case folded
/// (copied only when it has upper case: clients send it lower case).
fn request_host(req: &Request<Incoming>) -> Option<Cow<'_, str>> {
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
    let host = host.trim_end_matches('.');
    Some(if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    })
}

/// A request on a TLS connection opened for another name (SNI) than its `Host`, for a pool
/// that checks client certificates: a connection opened (and perhaps authenticated) for one
/// host must not be reused for such a pool (HTTP/2 coalescing); `421` makes the client open
/// a new connection, whose handshake asks for the certificate.
fn misdirected(pool: &PoolRuntime, req: &Request<Incoming>, host: &str) -> bool {
    pool.access.requires_client_cert()
        && PeerTls::of_request(req.extensions()).is_some_and(|t| t.sni.as_deref() != Some(host))
}

/// How a listener's requests find their role.
#[derive(Clone)]
enum Route {
    /// The main listener: by `Host`.
    ByHost,
    /// A pool's own listener: every request is that pool's, whatever its `Host`.
    Pool(Arc<str>),
}

impl Dispatcher {
    /// Gives the request its id (SPEC §12) before anything else looks at it, and puts the id
    /// on whatever answer comes back: features never handle it themselves. The request's
    /// `x-request-id` header is rewritten to the id, so what is forwarded upstream (by the
    /// proxy, and by every attempt of a job taken from this request) is the same id.
    async fn dispatch(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        peer: Peer,
        route: &Route,
    ) -> Response<Body> {
        let id = RequestId::assign(req.headers());
        req.headers_mut()
            .insert(request_id::HEADER, id.header_value());
        let resp = self.route(req, peer, route, &id).await;
        request_id::stamp(&id, resp).await
    }

    /// Where the request goes. Handlers that read the request's id from its extensions (the
    /// API's routes, a database pool's) find it there; the proxy is handed it: an extension
    /// costs a request a map allocated and hashed into (~500 instructions, bench/RESULTS.md).
    async fn route(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        peer: Peer,
        route: &Route,
        id: &RequestId,
    ) -> Response<Body> {
        if let Route::Pool(name) = route {
            // A pool deleted since its listener accepted this connection is gone here too.
            let Some(pool) = self.state.pools.get(name) else {
                return ApiError::pool_not_found().into_response();
            };
            return self.pool_host(pool, req, peer, id).await;
        }
        let Some(host) = request_host(&req) else {
            return ApiError::pool_not_found().into_response();
        };
        match self.state.pools.host_role(&host) {
            HostRole::Api => {
                req.extensions_mut().insert(id.clone());
                req.extensions_mut().insert(ConnectInfo(peer.addr()));
                match self.api.clone().oneshot(req).await {
                    Ok(resp) => resp,
                    Err(never) => match never {},
                }
            }
            HostRole::Pool(pool) if misdirected(&pool, &req, &host) => ApiError::new(
                ErrorCode::Misdirected,
                "this connection was opened for another host; open a new one for this host",
            )
            .into_response(),
            HostRole::Pool(pool) => self.pool_host(pool, req, peer, id).await,
            HostRole::Unknown => ApiError::pool_not_found().into_response(),
        }
    }

    /// A request for a pool's host: the proxy's, or on a database pool the SQL routes'.
    async fn pool_host(
        &self,
        pool: Arc<PoolRuntime>,
        mut req: Request<Incoming>,
        peer: Peer,
        id: &RequestId,
    ) -> Response<Body> {
        match pool.spec.kind {
            PoolKind::Proxy => {
                let original_host = req.headers().get(http::header::HOST).cloned();
                let proxy = self.state.proxy.clone();
                let request_id = Some(id.0.clone());
                crate::proxy::handle(proxy, pool, req, peer, original_host, request_id).await
            }
            PoolKind::Database => {
                req.extensions_mut().insert(id.clone());
                let database = self.state.database.clone();
                crate::database::handle(database, pool, req, peer.addr()).await
            }
        }
    }
}

/// What every connection task shares: the dispatcher, the protocol settings, the count it is
/// held to, and the signal that the server is draining. Its bounds (`max_connections`, the
/// header and idle timeouts) are read from the live settings at each accept, so a reload
/// applies them to the connections accepted after it.
struct Serving {
    dispatcher: Arc<Dispatcher>,
    builder: auto::Builder<TokioExecutor>,
    connections: Arc<Connections>,
    drain: watch::Sender<()>,
    /// Where connections are served: their own threads (`threads`), or this runtime's tasks.
    threads: Option<ConnectionThreads>,
}

pub(super) async fn accept_loop(
    listener: TcpListener,
    dispatcher: Arc<Dispatcher>,
    threads: Option<ConnectionThreads>,
    cancel: CancellationToken,
    access_log_task: JoinHandle<()>,
) -> Drained {
    let state = dispatcher.state.clone();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Our watchdog (`conn`) times the first byte and every request head: hyper's own header
        // timer would also run while a keep-alive connection is idle, and close it after the
        // header timeout instead of the idle one.
        .header_read_timeout(None);
    builder.http2().timer(TokioTimer::new());
    let serving = Arc::new(Serving {
        dispatcher,
        builder,
        connections: Connections::new(),
        drain: watch::channel(()).0,
        threads,
    });
    // Pools' own listeners, opened at start and whenever the admin API gives a pool one.
    let mut opened = state.pools.listeners.take_opened();
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
            Some(pool) = async { opened.as_mut()?.recv().await } => {
                tokio::spawn(accept_pool_listener(serving.clone(), pool, cancel.clone()));
                continue;
            }
        };
        match accepted {
            Ok((stream, peer)) => serving.serve(stream, peer, Route::ByHost),
            Err(e) => accept_failed(e).await,
        }
    }
    drop(listener);
    let drained = shut_down(&state, &serving.drain).await;
    if let Some(threads) = &serving.threads {
        threads.stop();
    }
    drop(serving);
    drop(state);
    // The writer ends once the last sender is gone; if a handle is still held elsewhere, the
    // flush above already committed everything.
    access_log_task.abort();
    drained
}

/// How the graceful shutdown left the job and webhook attempts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Drained {
    /// Every attempt in flight had its result recorded.
    Recorded,
    /// `shutdown_grace_ms` ran out with attempts still in flight: they were abandoned.
    Abandoned,
}

/// Accepts on a pool's own listener until the pool stops listening there or the server stops.
async fn accept_pool_listener(serving: Arc<Serving>, opened: Opened, cancel: CancellationToken) {
    let route = Route::Pool(Arc::from(opened.pool.as_str()));
    tracing::info!(pool = %opened.pool, addr = ?opened.listener.local_addr().ok(), "pool listener open");
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            _ = opened.stop.cancelled() => break,
            accepted = opened.listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => serving.serve(stream, peer, route.clone()),
            Err(e) => accept_failed(e).await,
        }
    }
}

/// Out of file descriptors and the like: back off instead of spinning.
async fn accept_failed(e: std::io::Error) {
    tracing::warn!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// The graceful shutdown: every connection is asked to finish (HTTP/1 after its request in
/// flight, HTTP/2 with a GOAWAY), no job is accepted and no job or webhook attempt starts, and
/// the requests and attempts in flight get `shutdown_grace_ms` to finish (an attempt: to have
/// its result recorded); then the rest is closed down.
async fn shut_down(state: &AppState, drain: &watch::Sender<()>) -> Drained {
    state.draining.store(true, Ordering::Relaxed);
    let attempts = state.jobs.drain.clone();
    attempts.start();
    let grace = state.live.load().shutdown_grace;
    tracing::info!(
        grace_ms = grace.as_millis() as u64,
        attempts_in_flight = attempts.in_flight(),
        "shutting down: draining in-flight requests and job attempts"
    );
    let _ = drain.send(());
    // Every connection task holds a receiver until its connection is closed.
    let both = async { tokio::join!(drain.closed(), attempts.idle()) };
    let timed_out = tokio::time::timeout(grace, both).await.is_err();
    // Counted before `stopping` cancels what is left (no attempt enters once draining): a grace
    // that ran out on a slow connection alone abandoned no attempt.
    let drained = if attempts.in_flight() == 0 {
        Drained::Recorded
    } else {
        Drained::Abandoned
    };
    if timed_out {
        tracing::warn!(
            attempts_in_flight = attempts.in_flight(),
            "shutdown grace elapsed with requests or attempts still in flight; those attempts \
             run again at the next start"
        );
    }
    state.jobs.stopping.cancel();
    state.access_log.flush().await;
    state.lock.leases.flush().await;
    for pool in state.pools.snapshot().pools.values() {
        pool.gate.close().await;
    }
    drained
}

impl Serving {
    /// Counts a connection just accepted and spawns its task: served under the limit, answered
    /// `503 overloaded` over it. With `[server.tls]` the task first completes the handshake,
    /// within the header timeout (a slow handshake holds nothing longer than a slow head).
    fn serve(self: &Arc<Self>, stream: TcpStream, peer: SocketAddr, route: Route) {
        let (max_connections, bounds) = {
            let live = self.dispatcher.state.live.load();
            let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
            let bounds = Timeouts {
                header_read_ms: ms(live.header_read_timeout),
                idle_ms: ms(live.idle_timeout),
            };
            (live.max_connections, bounds)
        };
        let (counted, refused) = match self.connections.admit(max_connections) {
            Admission::Serve(counted) => (counted, false),
            Admission::Refuse(counted) => (counted, true),
            // Dropping the socket closes it: refusals are bounded too.
            Admission::Close => return,
        };
        let _ = stream.set_nodelay(true);
        let timeouts = Timeouts {
            // A refused connection closes as soon as its answer is out.
            idle_ms: if refused { 0 } else { bounds.idle_ms },
            ..bounds
        };
        let conn = Conn {
            peer,
            route,
            refused,
            activity: Activity::new(timeouts),
        };
        let this = self.clone();
        let Some(threads) = &self.threads else {
            tokio::spawn(this.connection(stream, counted, conn, timeouts));
            return;
        };
        // The socket moves to the thread's own I/O driver: out of this runtime's, into that
        // one's (registered there, by `from_std`, on that thread).
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => return tracing::debug!(error = %e, %peer, "cannot hand a connection over"),
        };
        threads.spawn(async move {
            match TcpStream::from_std(stream) {
                Ok(stream) => this.connection(stream, counted, conn, timeouts).await,
                Err(e) => tracing::debug!(error = %e, %peer, "cannot take a connection over"),
            }
        });
    }

    /// One connection's task: with `[server.tls]` the handshake first.
    async fn connection(
        self: Arc<Self>,
        stream: TcpStream,
        counted: Counted,
        conn: Conn,
        timeouts: Timeouts,
    ) {
        let io = ConnIo::new(stream, conn.activity.clone(), counted);
        let Some(tls) = self.dispatcher.state.tls.clone() else {
            return self.run(io, None, conn).await;
        };
        // Boxed: a TLS stream (rustls' connection state) makes its handshake and its
        // connection's future several KiB larger, and a task is as large as its largest
        // state; unboxed, every plain connection's task would carry that size too.
        let peer = conn.peer;
        Box::pin(serve_tls(self, tls, io, conn, timeouts, peer)).await
    }

    /// Serves one connection (plain, or TLS after its handshake) to its end.
    async fn run<I>(&self, io: I, tls: Option<Arc<PeerTls>>, conn: Conn)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let Conn {
            peer,
            route,
            refused,
            activity,
        } = conn;
        let d = self.dispatcher.clone();
        let requests = activity.clone();
        // Formatted once here, for every request's `X-Forwarded-For` and log line.
        let client = Peer::new(peer);
        // Each request is in flight, for the watchdog, until its response body is done.
        let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
            let in_flight = requests.begin(req.version());
            let h2 = req.version() == http::Version::HTTP_2;
            if let Some(tls) = &tls {
                req.extensions_mut().insert(tls.clone());
            }
            let d = d.clone();
            let route = route.clone();
            let client = client.clone();
            // Boxed: HTTP/2 spawns each stream's future as a task, and hyper moves it (the
            // whole routed state machine, every feature's future inlined) several times on
            // the way into the task; a box moves as a pointer.
            Box::pin(async move {
                let mut resp = if refused {
                    let id = RequestId::assign(req.headers());
                    request_id::stamp(&id, overloaded(req.version())).await
                } else {
                    d.dispatch(req, client, &route).await
                };
                if h2 {
                    keep_date_out_of_hpack(resp.headers_mut());
                }
                Ok::<_, Infallible>(resp.map(|body| TrackedBody::new(body, in_flight)))
            })
        });
        let conn = self
            .builder
            .serve_connection_with_upgrades(TokioIo::new(io), service)
            .into_owned();
        let watchdog = Watchdog::new(activity.clone());
        let drain = self.drain.subscribe();
        let closed = drive(conn, |c| c.graceful_shutdown(), watchdog, activity, drain);
        match closed.await {
            Closed::Done(Err(e)) => {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
            Closed::Done(Ok(())) => {}
            Closed::Expired(why) => {
                tracing::debug!(?why, %peer, "connection closed by its timeout");
            }
        }
    }
}

/// A TLS connection: the handshake within the header timeout, then the connection to its end.
async fn serve_tls(
    this: Arc<Serving>,
    tls: Arc<crate::tls::ListenerTls>,
    io: ConnIo,
    conn: Conn,
    timeouts: Timeouts,
    peer: SocketAddr,
) {
    let budget = Duration::from_millis(timeouts.header_read_ms);
    match tokio::time::timeout(budget, tls.acceptor().accept(io)).await {
        Ok(Ok(stream)) => {
            let peer_tls = Arc::new(PeerTls::of(stream.get_ref().1));
            this.run(stream, Some(peer_tls), conn).await;
        }
        Ok(Err(e)) => tracing::debug!(error = %e, %peer, "TLS handshake failed"),
        Err(_) => tracing::debug!(%peer, "TLS handshake not done within the header timeout"),
    }
}

/// One accepted connection, handed from the accept to its task.
struct Conn {
    peer: SocketAddr,
    route: Route,
    refused: bool,
    activity: Arc<Activity>,
}

/// The answer on a connection past `server.max_connections`; HTTP/1 says the connection
/// closes (HTTP/2 has no such header: its GOAWAY follows the answer).
fn overloaded(version: http::Version) -> Response<Body> {
    let mut error = ApiError::new(
        ErrorCode::Overloaded,
        "the server has too many open connections; retry shortly",
    );
    error.retry_after_s = Some(1);
    let mut resp = error.into_response();
    if version < http::Version::HTTP_2 {
        resp.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
    }
    resp
}

/// An HTTP/2 answer's `date` (an origin's, passed through) goes as a never-indexed literal, as
/// request ids do (`core::request_id`): a new value every second, each of which HPACK would
/// insert into the connection's table, and the `h2` crate's encoder compares a value with every
/// entry of its name, oldest first. Over a connection's first minute that was 43 comparisons per
/// answer on average, growing with its age until the table evicts them (bench/RESULTS.md).
/// A `date` hyper adds itself (answers without one) is not ours to mark.
fn keep_date_out_of_hpack(headers: &mut http::HeaderMap) {
    if let Some(date) = headers.get_mut(http::header::DATE) {
        date.set_sensitive(true);
    }
}

/// How a connection's task ended.
enum Closed<E> {
    /// The connection finished (the client closed it, or it was shut down and done).
    Done(Result<(), E>),
    /// Its timeout closed it outright.
    Expired(Expired),
}

/// Drives one connection to its end: the graceful shutdown when the server drains or the
/// connection has been idle too long, closed outright when a head is late or a shutdown does
/// not finish within the header timeout.
async fn drive<C, E>(
    conn: C,
    shutdown: impl Fn(Pin<&mut C>),
    mut watchdog: Watchdog,
    activity: Arc<Activity>,
    mut drain: watch::Receiver<()>,
) -> Closed<E>
where
    C: Future<Output = Result<(), E>>,
{
    let mut conn = std::pin::pin!(conn);
    let mut draining = false;
    loop {
        tokio::select! {
            done = conn.as_mut() => return Closed::Done(done),
            // Also when the sender is gone: either way the server is going down.
            _ = drain.changed(), if !draining => {
                draining = true;
                shutdown(conn.as_mut());
                activity.closing();
            }
            why = std::future::poll_fn(|cx| watchdog.poll_expired(cx)) => match why {
                Expired::Overdue => return Closed::Expired(why),
                Expired::Idle => {
                    shutdown(conn.as_mut());
                    activity.closing();
                }
            },
        }
    }
}
