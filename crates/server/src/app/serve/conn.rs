//! The bounds of one client connection (SPEC §1): it must send its first byte and its request
//! head within `server.header_read_timeout_ms`, it closes after `server.idle_timeout_ms` with
//! no request in flight, and past `server.max_connections` it is answered `503 overloaded` and
//! closed.
//!
//! hyper alone cannot keep these: hyper-util's HTTP/1-or-2 sniff waits for the first bytes with
//! no timeout, HTTP/2 has no idle timeout, and hyper's HTTP/1 header timer also runs between
//! keep-alive requests, so an idle connection would close after the header timeout instead of
//! the idle one. So each connection keeps its own [`Activity`]: requests in flight (counted by
//! the service and by the response body, so a long poll or a long stream is not idle) and one
//! deadline, which a [`Watchdog`] polled beside the connection enforces. Per request this costs
//! two atomic counts; no lock, no task, no timer.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use crate::core::time;

/// How many over-limit connections may be held at once to be answered `503 overloaded`;
/// past this a new connection is closed at once, so refusing costs bounded descriptors too.
pub(super) const REFUSING_AT_ONCE: usize = 64;

/// The open connections, against `server.max_connections` (given at each admission: a reload
/// may change it; connections already open above a lowered one stay, and no new one is served
/// until the count is under it).
pub(super) struct Connections {
    open: AtomicUsize,
    refusing: AtomicUsize,
    /// Whether the last connection was refused: an overload is logged once, not per socket.
    overloaded: AtomicBool,
}

/// What becomes of a connection just accepted.
pub(super) enum Admission {
    /// Served; counted among the open connections until the socket is closed.
    Serve(Counted),
    /// Over the limit: answered `503 overloaded` and closed.
    Refuse(Counted),
    /// Over the limit with as many refusals under way as we hold: closed at once.
    Close,
}

impl Connections {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Connections {
            open: AtomicUsize::new(0),
            refusing: AtomicUsize::new(0),
            overloaded: AtomicBool::new(false),
        })
    }

    pub(super) fn admit(self: &Arc<Self>, max_connections: u64) -> Admission {
        let max = usize::try_from(max_connections).unwrap_or(usize::MAX);
        if let Some(counted) = self.take(&self.open, max, Kind::Open) {
            if self.overloaded.swap(false, Ordering::Relaxed) {
                tracing::info!(max, "connections back under server.max_connections");
            }
            return Admission::Serve(counted);
        }
        if !self.overloaded.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                max,
                "server.max_connections reached: refusing new connections with 503 overloaded"
            );
        }
        match self.take(&self.refusing, REFUSING_AT_ONCE, Kind::Refusing) {
            Some(counted) => Admission::Refuse(counted),
            None => Admission::Close,
        }
    }

    fn take(self: &Arc<Self>, counter: &AtomicUsize, max: usize, kind: Kind) -> Option<Counted> {
        counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Counted {
                connections: self.clone(),
                kind,
            })
    }

    /// Connections open and served now.
    #[cfg(test)]
    fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Open,
    Refusing,
}

/// One accepted connection in the count; dropping it (the socket closed, on every path) takes
/// it out.
pub(super) struct Counted {
    connections: Arc<Connections>,
    kind: Kind,
}

impl Drop for Counted {
    fn drop(&mut self) {
        let counter = match self.kind {
            Kind::Open => &self.connections.open,
            Kind::Refusing => &self.connections.refusing,
        };
        counter.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The two timeouts a connection is held to.
#[derive(Clone, Copy)]
pub(super) struct Timeouts {
    pub(super) header_read_ms: u64,
    pub(super) idle_ms: u64,
}

/// One connection's requests in flight and its deadline, shared by its socket (bytes read),
/// its service (requests begun), its response bodies (requests ended) and its [`Watchdog`].
pub(super) struct Activity {
    epoch: Instant,
    timeouts: Timeouts,
    in_flight: AtomicUsize,
    /// Milliseconds after `epoch` past which the connection closes if nothing is in flight.
    deadline_ms: AtomicU64,
    /// Whether the deadline is one to close outright at: a request head's (the first byte
    /// included), or a shutdown's that was asked for. Otherwise it is the idle deadline, at
    /// which the connection is shut down gracefully.
    outright: AtomicBool,
    /// HTTP/1: the first bytes on an idle connection start the next request head, which gets
    /// `header_read_ms` from then. Not HTTP/2, where an idle connection reads pings and
    /// window updates.
    heads_on_read: AtomicBool,
    watchdog: AtomicWaker,
}

impl Activity {
    /// A connection just accepted: its first byte and its first head are due within the header
    /// timeout.
    pub(super) fn new(timeouts: Timeouts) -> Arc<Self> {
        Arc::new(Activity {
            epoch: time::now(),
            timeouts,
            in_flight: AtomicUsize::new(0),
            deadline_ms: AtomicU64::new(timeouts.header_read_ms),
            outright: AtomicBool::new(true),
            heads_on_read: AtomicBool::new(true),
            watchdog: AtomicWaker::new(),
        })
    }

    fn now_ms(&self) -> u64 {
        let since = time::now().saturating_duration_since(self.epoch);
        u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
    }

    fn deadline(&self) -> Instant {
        self.epoch + Duration::from_millis(self.deadline_ms.load(Ordering::Acquire))
    }

    fn set_deadline_in(&self, ms: u64) {
        self.deadline_ms
            .store(self.now_ms().saturating_add(ms), Ordering::Release);
        self.watchdog.wake();
    }

    /// A request's head has arrived; it is in flight until its response body is dropped.
    pub(super) fn begin(self: &Arc<Self>, version: http::Version) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        if version == http::Version::HTTP_2 && self.heads_on_read.load(Ordering::Relaxed) {
            self.heads_on_read.store(false, Ordering::Relaxed);
        }
        InFlight(self.clone())
    }

    /// Bytes arrived. On an idle HTTP/1 connection they start a head, due within the header
    /// timeout.
    fn on_read(&self) {
        if self.heads_on_read.load(Ordering::Relaxed)
            && self.in_flight.load(Ordering::Acquire) == 0
            && !self.outright.swap(true, Ordering::AcqRel)
        {
            self.set_deadline_in(self.timeouts.header_read_ms);
        }
    }

    /// The connection was asked to shut down; if it has not closed within the header timeout
    /// (an HTTP/2 client that never answers the GOAWAY's ping), it is closed outright.
    pub(super) fn closing(&self) {
        self.outright.store(true, Ordering::Release);
        self.set_deadline_in(self.timeouts.header_read_ms);
    }
}

/// A request in flight on its connection; dropped with the response body.
pub(super) struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let activity = &self.0;
        if activity.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            activity.outright.store(false, Ordering::Release);
            activity.set_deadline_in(activity.timeouts.idle_ms);
        }
    }
}

/// What the [`Watchdog`] found when the deadline passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expired {
    /// No first byte or no whole request head in time, or a shutdown not finished in time:
    /// close outright.
    Overdue,
    /// No request for the idle timeout: shut down gracefully (HTTP/2: GOAWAY).
    Idle,
}

/// Waits for a connection's deadline to pass with nothing in flight. Polled in the
/// connection's own task beside the connection, so a connection costs one timer, re-armed only
/// when its deadline moves.
pub(super) struct Watchdog {
    activity: Arc<Activity>,
    sleep: Pin<Box<Sleep>>,
}

impl Watchdog {
    pub(super) fn new(activity: Arc<Activity>) -> Self {
        let sleep = Box::pin(tokio::time::sleep_until(activity.deadline()));
        Watchdog { activity, sleep }
    }

    pub(super) fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<Expired> {
        let activity = &self.activity;
        // Registered first, so a request ending after the checks below wakes us.
        activity.watchdog.register(cx.waker());
        loop {
            if activity.in_flight.load(Ordering::Acquire) > 0 {
                return Poll::Pending;
            }
            let at = activity.deadline();
            if self.sleep.deadline() != at {
                self.sleep.as_mut().reset(at);
            }
            ready!(self.sleep.as_mut().poll(cx));
            // A request may have begun, or the deadline moved, while the timer ran out.
            if activity.in_flight.load(Ordering::Acquire) == 0 && activity.deadline() <= at {
                return Poll::Ready(if activity.outright.load(Ordering::Acquire) {
                    Expired::Overdue
                } else {
                    Expired::Idle
                });
            }
        }
    }
}

/// The client's socket: tells its [`Activity`] when bytes arrive, and holds the connection's
/// place in the count for as long as the socket is open.
pub(super) struct ConnIo {
    stream: TcpStream,
    activity: Arc<Activity>,
    _counted: Counted,
}

impl ConnIo {
    pub(super) fn new(stream: TcpStream, activity: Arc<Activity>, counted: Counted) -> Self {
        ConnIo {
            stream,
            activity,
            _counted: counted,
        }
    }
}

impl AsyncRead for ConnIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.on_read();
        }
        polled
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// A response body that keeps its request in flight until the last byte is handed over or
/// the body is dropped: a long stream is not an idle connection.
pub(super) struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl TrackedBody {
    pub(super) fn new(inner: Body, in_flight: InFlight) -> Self {
        TrackedBody {
            inner,
            _in_flight: in_flight,
        }
    }
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn every_connection_counted_is_uncounted_when_dropped() {
        let connections = Connections::new();
        let (Admission::Serve(a), Admission::Serve(b)) =
            (connections.admit(2), connections.admit(2))
        else {
            panic!("two connections fit under a limit of two");
        };
        let mut refused = Vec::new();
        for _ in 0..REFUSING_AT_ONCE {
            match connections.admit(2) {
                Admission::Refuse(c) => refused.push(c),
                _ => panic!("past the limit a connection is refused"),
            }
        }
        assert!(matches!(connections.admit(2), Admission::Close));
        drop(refused.pop());
        assert!(matches!(connections.admit(2), Admission::Refuse(_)));
        drop(a);
        assert_eq!(connections.open(), 1);
        assert!(matches!(connections.admit(2), Admission::Serve(_)));
        // A limit lowered under the open count serves nobody new; raised, it serves again.
        assert!(matches!(connections.admit(1), Admission::Refuse(_)));
        assert!(matches!(connections.admit(3), Admission::Serve(_)));
        drop(b);
        assert_eq!(connections.open(), 0);
    }
}
