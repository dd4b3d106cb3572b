//! Calls to plain-HTTP origins over HTTP/1.1 through a pool of our own: hyper's connection
//! (`hyper::client::conn::http1`) with the idle connections kept per origin, instead of
//! hyper-util's pooled client.
//!
//! Why: the pooled client's bookkeeping cost a proxied request about 7,500 instructions of
//! ~82,000 (bench/RESULTS.md, "Direct HTTP/1 pool"): its pool key (scheme and authority) is
//! SipHashed on every checkout and every return, each call's connection is captured through a
//! shared cell and an extension chain, and checkout races a connect it may not need. Here a
//! checkout is one lock, one fast hash of the authority and a `Vec::pop`; the connection that
//! serves a call is known to it directly.
//!
//! What is kept: each connection's socket is a [`TrackedStream`] (a cut call's slot is freed
//! once the socket closes, [`ConnectionClosed`]); a request that found its reused connection
//! closed before any byte of it was written is sent again on another one (as hyper-util does);
//! idle connections are dropped after the idle timeout (checked at checkout, and by a task that
//! sweeps every timeout while the pool lives); each connection is driven by its own task on
//! the runtime that opened it, so a connection thread's calls stay on that thread (one pool per
//! lane, `client`). HTTPS origins and pools with `[pools.upstream_tls]` keep the pooled client
//! (TLS, ALPN `h2`). Owns idle connections only; must not know pools, slots or deadlines.

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::connector::{ConnectionClosed, TrackedConnector, TrackedStream};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The most idle connections kept per origin and lane (hyper-util's was set to the same).
const MAX_IDLE_PER_ORIGIN: usize = 1024;

/// Why a direct call failed.
#[derive(Debug, thiserror::Error)]
pub enum DirectError {
    /// No connection could be made: the origin saw nothing.
    #[error("connect error")]
    Connect(#[source] BoxError),
    /// The connection failed while the request was sent or before the response head came.
    #[error("request error")]
    Send(#[source] hyper::Error),
}

/// One lane's idle HTTP/1 connections to plain-HTTP origins.
pub struct DirectPool {
    connector: TrackedConnector,
    idle_timeout: Duration,
    state: Mutex<State>,
}

struct State {
    /// By the origin's authority (`host:port` as the target URI has it).
    idle: HashMap<Box<str>, Vec<Idle>, foldhash::fast::RandomState>,
    /// Whether the task that closes expired idle connections runs.
    sweeping: bool,
}

struct Idle {
    sender: http1::SendRequest<Body>,
    closed: ConnectionClosed,
    since: Instant,
}

impl Idle {
    fn usable(&mut self, now: Instant, timeout: Duration) -> bool {
        now.saturating_duration_since(self.since) < timeout && self.sender.is_ready()
    }
}

/// The connection a call was last sent on, once it has one: for a call cut before its response
/// head. Replaced when a request is sent again on another connection.
pub type Picked = Arc<Mutex<Option<ConnectionClosed>>>;

impl DirectPool {
    pub fn new(connector: TrackedConnector, idle_timeout: Duration) -> DirectPool {
        DirectPool {
            connector,
            idle_timeout,
            state: Mutex::new(State {
                idle: HashMap::default(),
                sweeping: false,
            }),
        }
    }

    /// Sends `req` (an absolute `http://` URI) on an idle connection to its origin, else on a
    /// new one. The connection it went on is in `picked` (its [`ConnectionClosed`]).
    pub async fn send(
        self: Arc<Self>,
        mut req: Request<Body>,
        picked: Picked,
    ) -> Result<Response<Incoming>, DirectError> {
        let target = req.uri().clone();
        let authority = target.authority().map_or("", |a| a.as_str());
        // HTTP/1 to an origin (not a proxy) sends the origin form: path and query only.
        *req.uri_mut() = match target.path_and_query() {
            Some(pq) => Uri::from(pq.clone()),
            None => Uri::from_static("/"),
        };
        loop {
            let (mut conn, reused) = match self.checkout(authority) {
                Some(idle) => (idle, true),
                None => (self.connect(&target).await?, false),
            };
            *picked.lock() = Some(conn.closed.clone());
            match conn.sender.try_send_request(req).await {
                Ok(resp) => {
                    self.checkin(authority, conn);
                    return Ok(resp);
                }
                Err(mut e) => match e.take_message() {
                    // Not written: the connection was found closed. Another one may serve it.
                    Some(unsent) if reused => req = unsent,
                    _ => return Err(DirectError::Send(e.into_error())),
                },
            }
        }
    }

    fn checkout(&self, authority: &str) -> Option<Idle> {
        let now = crate::core::time::now();
        let mut state = self.state.lock();
        let list = state.idle.get_mut(authority)?;
        // Newest first: the warmest connection, and the oldest expire at the front.
        while let Some(mut idle) = list.pop() {
            if idle.usable(now, self.idle_timeout) {
                return Some(idle);
            }
            // Expired, closed, or (rarely) still busy with a body nobody reads: dropped.
        }
        None
    }

    /// Keeps `conn` for the next call to `authority` once it is ready again: at once when its
    /// response has been read (the usual small answer), else from a task that waits for it.
    fn checkin(self: &Arc<Self>, authority: &str, mut conn: Idle) {
        if conn.sender.is_ready() {
            self.keep(authority, conn);
            return;
        }
        if conn.sender.is_closed() {
            return;
        }
        let pool = Arc::downgrade(self);
        let authority: Box<str> = authority.into();
        tokio::spawn(async move {
            let ready =
                std::future::poll_fn(|cx: &mut Context<'_>| match conn.sender.poll_ready(cx) {
                    Poll::Ready(r) => Poll::Ready(r.is_ok()),
                    Poll::Pending => Poll::Pending,
                })
                .await;
            if let (true, Some(pool)) = (ready, pool.upgrade()) {
                pool.keep(&authority, conn);
            }
        });
    }

    fn keep(self: &Arc<Self>, authority: &str, mut conn: Idle) {
        conn.since = crate::core::time::now();
        let mut state = self.state.lock();
        if !state.sweeping {
            state.sweeping = true;
            self.start_sweeping();
        }
        let list = match state.idle.get_mut(authority) {
            Some(list) => list,
            None => state.idle.entry(authority.into()).or_default(),
        };
        if list.len() >= MAX_IDLE_PER_ORIGIN {
            list.remove(0);
        }
        list.push(conn);
    }

    /// Closes what has been idle past the timeout, every timeout, for as long as the pool
    /// lives: so an origin that gets no more calls does not keep our connections open.
    fn start_sweeping(self: &Arc<Self>) {
        let pool = Arc::downgrade(self);
        let every = self.idle_timeout.max(Duration::from_millis(100));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(pool) = pool.upgrade() else { return };
                pool.sweep();
            }
        });
    }

    fn sweep(&self) {
        let now = crate::core::time::now();
        let timeout = self.idle_timeout;
        // Dropped outside the lock: dropping a sender wakes its connection's task.
        let mut expired = Vec::new();
        {
            let mut state = self.state.lock();
            state.idle.retain(|_, list| {
                let (keep, gone): (Vec<Idle>, Vec<Idle>) =
                    std::mem::take(list).into_iter().partition(|i| {
                        now.saturating_duration_since(i.since) < timeout && !i.sender.is_closed()
                    });
                *list = keep;
                expired.extend(gone);
                !list.is_empty()
            });
        }
        drop(expired);
    }

    async fn connect(&self, target: &Uri) -> Result<Idle, DirectError> {
        let stream: TrackedStream =
            tower::ServiceExt::oneshot(self.connector.clone(), target.clone())
                .await
                .map_err(DirectError::Connect)?;
        let closed = stream.closed();
        let (sender, connection) = http1::handshake(stream)
            .await
            .map_err(|e| DirectError::Connect(e.into()))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        Ok(Idle {
            sender,
            closed,
            since: crate::core::time::now(),
        })
    }

    /// Idle connections kept now (all origins).
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.state.lock().idle.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use hyper_util::client::legacy::connect::HttpConnector;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn pool(idle: Duration) -> Arc<DirectPool> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        Arc::new(DirectPool::new(TrackedConnector(http), idle))
    }

    /// An origin that answers every request on a connection with `hello` and counts the
    /// connections it accepted; it closes each connection after `per_connection` answers.
    async fn origin(per_connection: usize) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut have = Vec::new();
                    let mut answered = 0;
                    while answered < per_connection {
                        let n = s.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        have.extend_from_slice(&buf[..n]);
                        while let Some(end) = have.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&have[..end]).to_string();
                            assert!(head.starts_with("GET /p?q=1 HTTP/1.1"), "{head}");
                            have.drain(..end + 4);
                            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
                                .await
                                .unwrap();
                            answered += 1;
                        }
                    }
                });
            }
        });
        (format!("http://{addr}/p?q=1"), accepted)
    }

    async fn get(pool: &Arc<DirectPool>, url: &str) -> (String, Option<ConnectionClosed>) {
        let req = Request::get(url).body(Body::empty()).unwrap();
        let picked = Picked::default();
        let resp = pool.clone().send(req, picked.clone()).await.unwrap();
        let closed = picked.lock().clone();
        assert!(closed.is_some());
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (String::from_utf8(body.to_vec()).unwrap(), closed)
    }

    #[tokio::test]
    async fn reuses_one_connection_in_origin_form() {
        let (url, accepted) = origin(usize::MAX).await;
        let pool = pool(Duration::from_secs(30));
        for _ in 0..5 {
            let (body, closed) = get(&pool, &url).await;
            assert_eq!(body, "hello");
            assert!(closed.is_some());
            tokio::task::yield_now().await;
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_connection_the_origin_closed_is_replaced() {
        let (url, accepted) = origin(1).await;
        let pool = pool(Duration::from_secs(30));
        for _ in 0..3 {
            let (body, closed) = get(&pool, &url).await;
            assert_eq!(body, "hello");
            // Once the origin's close has ended the connection (its socket closed), the next
            // call must open another rather than write into it.
            tokio::time::timeout(Duration::from_secs(5), closed.unwrap().closed())
                .await
                .unwrap();
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn idle_connections_expire() {
        let (url, accepted) = origin(usize::MAX).await;
        let pool = pool(Duration::from_secs(30));
        assert_eq!(get(&pool, &url).await.0, "hello");
        tokio::task::yield_now().await;
        assert_eq!(pool.idle_count(), 1);
        // The pool reads tokio's clock: past the idle timeout without waiting for it.
        tokio::time::pause();
        tokio::time::advance(Duration::from_secs(31)).await;
        tokio::time::resume();
        assert_eq!(get(&pool, &url).await.0, "hello");
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn idle_connections_are_closed_without_further_calls() {
        let (url, _) = origin(usize::MAX).await;
        let pool = pool(Duration::from_millis(50));
        let (_, closed) = get(&pool, &url).await;
        tokio::task::yield_now().await;
        assert_eq!(pool.idle_count(), 1);
        // The sweeper drops it; its connection's task then closes the socket.
        tokio::time::timeout(Duration::from_secs(5), closed.unwrap().closed())
            .await
            .unwrap();
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn a_refused_connect_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let req = Request::get(format!("http://{addr}/"))
            .body(Body::empty())
            .unwrap();
        let picked = Picked::default();
        let e = pool(Duration::from_secs(1))
            .send(req, picked.clone())
            .await
            .unwrap_err();
        assert!(matches!(e, DirectError::Connect(_)), "{e:?}");
        assert!(picked.lock().is_none());
    }
}
