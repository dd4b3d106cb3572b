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
//! two atomic counts and two clock readings; no lock, no task, no timer, and no wake-up of the
//! connection's task (its timer fires at most once per period, the shorter of the two timeouts,
//! to look at the deadline).

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
    /// Milliseconds after `epoch` at which the [`Watchdog`]'s timer is set to fire (0 before it
    /// is first set). A deadline set at or after it needs no wake-up: the timer fires first
    /// and the watchdog looks again. Only a deadline moved before it wakes the watchdog.
    armed_ms: AtomicU64,
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
            armed_ms: AtomicU64::new(0),
            watchdog: AtomicWaker::new(),
        })
    }

    fn now_ms(&self) -> u64 {
        let since = time::now().saturating_duration_since(self.epoch);
        u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
    }

    /// The instant `ms` milliseconds after the epoch.
    fn instant(&self, ms: u64) -> Instant {
        self.epoch + Duration::from_millis(ms)
    }

    /// Moves the deadline to `ms` from now. The watchdog is woken only when its timer would
    /// fire too late for it: every request moves the deadline twice (its head arriving, its
    /// answer done), and a wake-up would poll the whole connection again for nothing.
    fn set_deadline_in(&self, ms: u64) {
        let at = self.now_ms().saturating_add(ms);
        // SeqCst with the watchdog's `armed_ms` store and deadline load: either it reads this
        // deadline after setting its timer, or this reads the timer it set.
        self.deadline_ms.store(at, Ordering::SeqCst);
        if at < self.armed_ms.load(Ordering::SeqCst) {
            self.watchdog.wake();
        }
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
    /// When `sleep` fires, in milliseconds after the activity's epoch (mirrored in
    /// `Activity::armed_ms` for the deadline's setters).
    armed_ms: u64,
    sleep: Pin<Box<Sleep>>,
}

impl Watchdog {
    pub(super) fn new(activity: Arc<Activity>) -> Self {
        let at = activity.deadline_ms.load(Ordering::SeqCst);
        activity.armed_ms.store(at, Ordering::SeqCst);
        let sleep = Box::pin(tokio::time::sleep_until(activity.instant(at)));
        Watchdog {
            activity,
            armed_ms: at,
            sleep,
        }
    }

    /// Ready once the deadline has passed with nothing in flight. The timer is set to the
    /// deadline or to one period from now (the shorter of the two timeouts), whichever comes
    /// first, and while requests are in flight to one period from now: so the deadline each
    /// request moves twice moves past the timer, which needs no wake-up, only a look when the
    /// timer fires, at most once per period per connection.
    pub(super) fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<Expired> {
        let activity = &*self.activity;
        // Registered first, so a deadline moved earlier after the checks below wakes us.
        activity.watchdog.register(cx.waker());
        // Neither a head arriving (header timeout) nor a request ending (idle timeout) can
        // move the deadline before a timer set this far ahead. A refused connection's idle
        // timeout (0) is left out: it closes as soon as its answer is out.
        let Timeouts {
            header_read_ms,
            idle_ms,
        } = activity.timeouts;
        let period = match idle_ms {
            0 => header_read_ms,
            idle => header_read_ms.min(idle),
        }
        .max(1);
        loop {
            let idle = activity.in_flight.load(Ordering::SeqCst) == 0;
            let deadline = activity.deadline_ms.load(Ordering::SeqCst);
            // The watchdog is polled with its connection, twice per request: the clock is
            // read only when the timer has fired.
            let target = if self.sleep.is_elapsed() {
                // The timer is due: a look at the deadline, then the next one.
                // Not before the time it fired for: the next timer is then always a later one.
                let now = activity.now_ms().max(self.armed_ms);
                if idle && deadline <= now {
                    return Poll::Ready(if activity.outright.load(Ordering::Acquire) {
                        Expired::Overdue
                    } else {
                        Expired::Idle
                    });
                }
                let next = now.saturating_add(period);
                if idle {
                    deadline.min(next)
                } else {
                    next
                }
            } else if idle && deadline < self.armed_ms {
                deadline
            } else {
                self.armed_ms
            };
            if target != self.armed_ms {
                self.armed_ms = target;
                activity.armed_ms.store(target, Ordering::SeqCst);
                self.sleep.as_mut().reset(activity.instant(target));
                // A deadline set before that store may not have seen the new timer.
                if activity.deadline_ms.load(Ordering::SeqCst) != deadline {
                    continue;
                }
            }
            ready!(self.sleep.as_mut().poll(cx));
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

    /// Counts its wake-ups: each one would poll the whole connection again.
    struct CountingWaker(AtomicUsize);

    impl std::task::Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Polled {
        watchdog: Watchdog,
        wakes: Arc<CountingWaker>,
    }

    impl Polled {
        fn new(timeouts: Timeouts) -> (Arc<Activity>, Polled) {
            let activity = Activity::new(timeouts);
            let watchdog = Watchdog::new(activity.clone());
            let wakes = Arc::new(CountingWaker(AtomicUsize::new(0)));
            (activity, Polled { watchdog, wakes })
        }

        fn poll(&mut self) -> Poll<Expired> {
            let waker = std::task::Waker::from(self.wakes.clone());
            self.watchdog.poll_expired(&mut Context::from_waker(&waker))
        }

        fn wakes(&self) -> usize {
            self.wakes.0.load(Ordering::SeqCst)
        }

        /// Polls every 50 ms of the (paused) clock until the watchdog is ready: why, and after
        /// how long. Not past `at_most_ms`.
        async fn expiry(&mut self, at_most_ms: u64) -> (Expired, u64) {
            let mut waited_ms = 0;
            loop {
                if let Poll::Ready(why) = self.poll() {
                    return (why, waited_ms);
                }
                tokio::time::advance(Duration::from_millis(50)).await;
                waited_ms += 50;
                assert!(waited_ms <= at_most_ms, "not closed within {at_most_ms} ms");
            }
        }
    }

    /// One keep-alive request: its first bytes, its head, its answer done.
    fn request(activity: &Arc<Activity>) {
        activity.on_read();
        drop(activity.begin(http::Version::HTTP_11));
    }

    #[tokio::test(start_paused = true)]
    async fn requests_move_the_deadline_without_waking_the_connection() {
        let timeouts = Timeouts {
            header_read_ms: 10_000,
            idle_ms: 60_000,
        };
        let (activity, mut polled) = Polled::new(timeouts);
        assert!(polled.poll().is_pending());
        for _ in 0..100 {
            request(&activity);
            tokio::time::advance(Duration::from_millis(7)).await;
        }
        assert_eq!(polled.wakes(), 0, "no request woke the watchdog");
        // Its timer fires once per header timeout to look; the idle deadline still holds.
        let mut looks = 0;
        let mut waited_ms = 0;
        while polled.poll().is_pending() {
            tokio::time::advance(Duration::from_millis(1_000)).await;
            waited_ms += 1_000;
            looks = polled.wakes();
            assert!(waited_ms <= 61_000, "idle past its deadline");
        }
        assert!(
            waited_ms >= 59_000,
            "closed {waited_ms} ms after the last request"
        );
        assert!(
            (5..=8).contains(&looks),
            "{looks} timer wake-ups over a minute, one per header timeout expected"
        );
        assert!(matches!(polled.poll(), Poll::Ready(Expired::Idle)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_moved_before_the_timer_wakes_the_watchdog() {
        // A refused connection: its idle timeout (0) closes it once its answer is out.
        let (activity, mut polled) = Polled::new(Timeouts {
            header_read_ms: 10_000,
            idle_ms: 0,
        });
        let in_flight = activity.begin(http::Version::HTTP_11);
        assert!(polled.poll().is_pending());
        tokio::time::advance(Duration::from_millis(5)).await;
        assert_eq!(polled.wakes(), 0);
        drop(in_flight);
        assert_eq!(polled.wakes(), 1, "the earlier deadline woke the watchdog");
        assert!(matches!(polled.poll(), Poll::Ready(Expired::Idle)));

        // A shutdown's deadline (the header timeout from now) comes after the idle one's
        // timer here, which fires first and is set again to it.
        let (activity, mut polled) = Polled::new(Timeouts {
            header_read_ms: 300,
            idle_ms: 60_000,
        });
        request(&activity);
        assert!(polled.poll().is_pending());
        activity.closing();
        let (why, waited_ms) = polled.expiry(400).await;
        assert_eq!(why, Expired::Overdue);
        assert!(waited_ms >= 300, "closed after {waited_ms} ms");
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_begun_on_an_idle_connection_is_due_within_the_header_timeout() {
        let (activity, mut polled) = Polled::new(Timeouts {
            header_read_ms: 300,
            idle_ms: 60_000,
        });
        request(&activity);
        assert!(polled.poll().is_pending());
        tokio::time::advance(Duration::from_millis(1_000)).await;
        // Bytes of a head, and no more: overdue one header timeout later, not at the idle one.
        activity.on_read();
        let (why, waited_ms) = polled.expiry(400).await;
        assert_eq!(why, Expired::Overdue);
        assert!(waited_ms >= 250, "closed after {waited_ms} ms");
    }

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
