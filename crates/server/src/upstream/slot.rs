//! What holds a slot while an origin works: [`SlotGuard`] (frees the slot when dropped),
//! [`Exchange`] (the call up to the response head, which runs on detached if its caller goes
//! away) and [`SlotBody`] (the response body, which keeps the slot until its last byte).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http::Response;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::{capture_connection, CaptureConnection};
use hyper_util::client::legacy::ResponseFuture;
use nthbouncer_coord::{LeaseWatch, Outcome, PoolGate, SlotId};
use parking_lot::Mutex;

use super::connector::ConnectionClosed;
use super::direct::{DirectError, Picked};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Frees a slot when dropped; carries the upstream outcome to adaptive learning.
pub struct SlotGuard {
    gate: Arc<dyn PoolGate>,
    slot: SlotId,
    pub outcome: Option<Outcome>,
    fence: Fence,
}

impl SlotGuard {
    pub fn new(gate: Arc<dyn PoolGate>, slot: SlotId) -> Self {
        let fence = Fence(gate.lease_watch(slot));
        SlotGuard {
            gate,
            slot,
            outcome: None,
            fence,
        }
    }

    /// Tells when the slot can no longer be confirmed (see [`Fence`]).
    pub fn fence(&self) -> Fence {
        self.fence.clone()
    }
}

/// Self-fencing: a gate that keeps a slot's lease alive behind its holder's back (Redis)
/// reports when it could not confirm it: reclaimed, or the coordination store unreachable past
/// its deadline. The slot may then be someone else's, so the call holding it is cut off like
/// one past its deadline rather than left running uncounted. Never fires on a gate that cannot
/// lose a held slot that way (in process).
#[derive(Clone, Debug)]
pub struct Fence(Option<LeaseWatch>);

impl Fence {
    pub fn is_lost(&self) -> bool {
        self.0.as_ref().is_some_and(LeaseWatch::is_lost)
    }

    /// Resolves once the lease is lost; never on a gate that cannot lose it.
    pub async fn lost(&mut self) {
        match &mut self.0 {
            Some(watch) => watch.lost().await,
            None => std::future::pending().await,
        }
    }
}

/// The error of a call cut off because its slot's lease could not be confirmed.
#[derive(Debug, thiserror::Error)]
#[error(
    "the slot's lease could not be confirmed with the coordination store; the call was cut off"
)]
pub struct Fenced;

impl Drop for SlotGuard {
    fn drop(&mut self) {
        // Release is async at the seam (a Redis gate talks to Redis) and dropping must not
        // block: poll it once here, and only if it is not done at once (the in-process gate
        // always is) hand the rest to a task. That saves a task per request on the hot path.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::error!(
                "slot released outside the runtime; it will be reclaimed at its deadline"
            );
            return;
        };
        let gate = self.gate.clone();
        let slot = self.slot;
        let outcome = self.outcome.take();
        let mut release = Box::pin(async move {
            gate.release(slot, outcome).await;
        });
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if release.as_mut().poll(&mut cx).is_pending() {
            rt.spawn(release);
        }
    }
}

/// The upstream call up to its response head, holding the slot.
///
/// If the caller goes away first (this future is dropped), the origin is still working on the
/// call: the rest of it runs detached and the slot is freed only when the origin answers or the
/// request deadline passes. Freeing it at once would let the next waiter reach the origin while
/// the origin still counts the abandoned call: one over the limit, seen from the origin. A call
/// cut at the deadline frees its slot once its connection is closed, for the same reason.
pub struct Exchange {
    call: Option<Call>,
    guard: Option<SlotGuard>,
    deadline: tokio::time::Instant,
    connection: Connection,
    fence: Fence,
}

/// The call in flight, on the client that took it.
enum Call {
    Pooled(ResponseFuture),
    Direct(Pin<Box<dyn Future<Output = Result<Response<Incoming>, DirectError>> + Send>>),
}

/// How a cut call finds the connection it was sent on.
#[derive(Clone)]
enum Connection {
    Pooled(CaptureConnection),
    Direct(Picked),
}

impl Connection {
    /// The connection the call was sent on, when cutting it closes the connection.
    fn closed(&self) -> Option<ConnectionClosed> {
        match self {
            Connection::Pooled(capture) => ConnectionClosed::of_capture(capture),
            Connection::Direct(picked) => picked.lock().clone(),
        }
    }

    /// The connection `resp` came on, when cutting its body closes the connection: the pooled
    /// client puts it in the response's extensions; a direct call's is the one it picked last
    /// (an extension would cost every call a map allocated and hashed into).
    fn answered(&self, resp: &Response<Incoming>) -> Option<ConnectionClosed> {
        match self {
            Connection::Pooled(_) => ConnectionClosed::of(resp),
            Connection::Direct(picked) => picked.lock().clone(),
        }
    }
}

/// A response head and the connection it came on (see [`Connection::answered`]).
pub type Answered = (Response<Incoming>, Option<ConnectionClosed>);

impl Future for Call {
    type Output = UpstreamResult;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<UpstreamResult> {
        match self.get_mut() {
            Call::Pooled(call) => Pin::new(call).poll(cx).map_err(CallError::Pooled),
            Call::Direct(call) => call.as_mut().poll(cx).map_err(CallError::Direct),
        }
    }
}

impl Exchange {
    /// Sends `req` on `client`; the exchange holds `guard` until it ends. A plain-HTTP origin
    /// is called through the lane's direct HTTP/1 pool when `client` has one.
    pub fn send(
        client: &super::CallClient,
        mut req: http::Request<axum::body::Body>,
        guard: SlotGuard,
        deadline: tokio::time::Instant,
    ) -> Self {
        let fence = guard.fence();
        let (call, connection) = match &client.direct {
            Some(direct) if req.uri().scheme() == Some(&http::uri::Scheme::HTTP) => {
                let picked = Picked::default();
                let call = direct.clone().send(req, picked.clone());
                (Call::Direct(Box::pin(call)), Connection::Direct(picked))
            }
            _ => {
                let capture = capture_connection(&mut req);
                (
                    Call::Pooled(client.pooled.request(req)),
                    Connection::Pooled(capture),
                )
            }
        };
        Exchange {
            call: Some(call),
            guard: Some(guard),
            deadline,
            connection,
            fence,
        }
    }
}

/// Why a call failed before its response head, as the client that took it says.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error(transparent)]
    Pooled(hyper_util::client::legacy::Error),
    #[error(transparent)]
    Direct(DirectError),
}

pub type UpstreamResult = Result<Response<Incoming>, CallError>;

impl Future for Exchange {
    type Output = (Result<Answered, CallError>, SlotGuard);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let (Some(call), Some(_)) = (this.call.as_mut(), this.guard.as_ref()) else {
            // Polled after completion: never happens through `.await`.
            return Poll::Pending;
        };
        let result = std::task::ready!(Pin::new(call).poll(cx)).map(|resp| {
            let closed = this.connection.answered(&resp);
            (resp, closed)
        });
        this.call = None;
        match this.guard.take() {
            Some(guard) => Poll::Ready((result, guard)),
            None => Poll::Pending,
        }
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let (Some(call), Some(guard)) = (self.call.take(), self.guard.take()) else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if crate::core::time::now() >= self.deadline || self.fence.is_lost() {
            // The request timed out (SPEC §4), or its slot was lost (self-fencing): the call is
            // cut, and its slot is freed once its connection is closed.
            drop(call);
            let closed = self.connection.closed();
            if closed.is_some() {
                rt.spawn(async move {
                    ConnectionClosed::after_cut(closed).await;
                    drop(guard);
                });
            }
            return;
        }
        let deadline = self.deadline;
        let connection = self.connection.clone();
        let mut fence = self.fence.clone();
        rt.spawn(async move {
            // The answer is discarded: its caller is gone. Whether the call answered (its
            // body is dropped unread) or the deadline (or a lost lease) cut it, its connection
            // closes first.
            let answered = tokio::select! {
                answered = tokio::time::timeout_at(deadline, call) => answered.ok(),
                () = fence.lost() => None,
            };
            let closed = match answered {
                Some(Ok(resp)) if resp.body().is_end_stream() => None,
                Some(Ok(resp)) => connection.answered(&resp),
                Some(Err(_)) => None,
                None => connection.closed(),
            };
            ConnectionClosed::after_cut(closed).await;
            drop(guard);
        });
    }
}

/// What a streaming answer holds while it streams: the upstream body, its connection and the
/// slot.
struct Held {
    body: Incoming,
    closed: Option<ConnectionClosed>,
    guard: SlotGuard,
}

impl Held {
    /// Ends the exchange: drops the body and, if it had not ended (which closes its
    /// connection), frees the slot only once that connection is closed.
    async fn cut(self) {
        let Held {
            body,
            closed,
            guard,
        } = self;
        let ended = body.is_end_stream();
        drop(body);
        if !ended {
            ConnectionClosed::after_cut(closed).await;
        }
        drop(guard);
    }
}

/// Shared by a [`SlotBody`] and its watchdog.
struct Shared {
    held: Mutex<Option<Held>>,
    /// The task polling the body, woken when the watchdog ends the exchange under it.
    waker: AtomicWaker,
}

/// An upstream response body that holds its slot until the last frame has been handed to the
/// client, the client goes away (the body is dropped), or the request deadline passes.
///
/// The deadline holds whether or not anyone polls the body: a client that stops reading (or
/// reads slower than the upstream sends) stops hyper from polling it, so a watchdog ends the
/// exchange at the deadline: it drops the upstream body first (which closes that upstream
/// connection) and only then frees the slot, so the origin never serves the next caller beside
/// a call it still streams. The watchdog is started only for a body that did not end at its
/// first poll, and stopped when the body ends.
pub struct SlotBody {
    shared: Arc<Shared>,
    deadline: tokio::time::Instant,
    fence: Fence,
    watchdog: Option<tokio::task::AbortHandle>,
    /// The end (or the deadline's error) was handed out.
    done: bool,
}

impl SlotBody {
    pub fn new(
        body: Incoming,
        guard: SlotGuard,
        deadline: tokio::time::Instant,
        closed: Option<ConnectionClosed>,
    ) -> Self {
        let fence = guard.fence();
        SlotBody {
            fence,
            shared: Arc::new(Shared {
                held: Mutex::new(Some(Held {
                    body,
                    closed,
                    guard,
                })),
                waker: AtomicWaker::new(),
            }),
            deadline,
            watchdog: None,
            done: false,
        }
    }

    fn arm_watchdog(&mut self) {
        if self.watchdog.is_some() {
            return;
        }
        let shared = self.shared.clone();
        let deadline = self.deadline;
        let mut fence = self.fence.clone();
        let task = tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {}
                () = fence.lost() => {}
            }
            let held = shared.held.lock().take();
            // Wake the reader first: it gets the deadline's error while the slot waits for
            // the upstream connection to close.
            shared.waker.wake();
            if let Some(held) = held {
                held.cut().await;
            }
        });
        self.watchdog = Some(task.abort_handle());
    }

    fn finish(&mut self) -> Option<Held> {
        self.done = true;
        let held = self.shared.held.lock().take();
        // A watchdog that already took the exchange is ending it (waiting for its connection
        // to close before it frees the slot): aborting it would free the slot early.
        if let (Some(w), Some(_)) = (self.watchdog.take(), held.as_ref()) {
            w.abort();
        }
        held
    }
}

impl Drop for SlotBody {
    fn drop(&mut self) {
        // The body ended, or the client went away.
        end(self.finish());
    }
}

/// Frees the slot of an exchange that ended: at once if its body ended, else once its
/// connection (which the dropped body closes) is closed.
fn end(held: Option<Held>) {
    let Some(held) = held else { return };
    if held.body.is_end_stream() || held.closed.is_none() {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn(held.cut())),
        Err(_) => drop(held),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("upstream response exceeded the request timeout")]
pub struct DeadlineExceeded;

impl HttpBody for SlotBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        self.shared.waker.register(cx.waker());
        let polled = {
            let mut held = self.shared.held.lock();
            let Some(h) = held.as_mut() else {
                drop(held);
                // The watchdog ended the exchange at the deadline.
                self.finish();
                return Poll::Ready(Some(Err(Box::new(DeadlineExceeded))));
            };
            let polled = Pin::new(&mut h.body).poll_frame(cx);
            (polled, h.body.is_end_stream())
        };
        match polled {
            (Poll::Ready(None), _) => {
                drop(self.finish());
                Poll::Ready(None)
            }
            (Poll::Ready(Some(Err(e))), _) => {
                end(self.finish());
                Poll::Ready(Some(Err(Box::new(e))))
            }
            (Poll::Ready(Some(Ok(frame))), ended) => {
                if !ended {
                    self.arm_watchdog();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            (Poll::Pending, _) => {
                self.arm_watchdog();
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
            || self
                .shared
                .held
                .lock()
                .as_ref()
                .is_none_or(|h| h.body.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.shared
            .held
            .lock()
            .as_ref()
            .map_or_else(SizeHint::default, |h| h.body.size_hint())
    }
}
