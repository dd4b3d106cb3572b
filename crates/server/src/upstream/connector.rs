//! The upstream connector: the HTTP connector with each connection's socket tracked, so that a
//! slot whose exchange was cut (the deadline passed, the client went away, the job runner
//! stopped reading) is freed only once that socket is really closed.
//!
//! Dropping a response body that has not ended makes hyper close its HTTP/1 connection, but on
//! the connection's own task, some time later. Freeing the slot at once let the next caller
//! reach the origin while the cut call's socket was still open, and the origin counted both.
//! Every HTTP/1 response carries the [`ConnectionClosed`] of its connection (through
//! `Connected::extra`), which [`ConnectionClosed::after_cut`] waits on, bounded by
//! [`CLOSE_WAIT`].

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Response, Uri, Version};
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{
    CaptureConnection, Connected, Connection, HttpConnector,
};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// The longest a cut exchange waits for its socket to close before freeing its slot anyway
/// (hyper closes it on the connection's next turn, so this is a bound, not a delay).
pub const CLOSE_WAIT: Duration = Duration::from_secs(1);

/// One upstream connection's socket: signalled once it is closed.
#[derive(Clone, Debug, Default)]
pub struct ConnectionClosed(Arc<Signal>);

#[derive(Debug, Default)]
struct Signal {
    closed: AtomicBool,
    notify: Notify,
}

impl ConnectionClosed {
    /// The connection of `resp`, when cutting its body closes it (HTTP/1: a stream of an
    /// HTTP/2 connection is reset, the connection stays).
    pub fn of<B>(resp: &Response<B>) -> Option<ConnectionClosed> {
        if resp.version() >= Version::HTTP_2 {
            return None;
        }
        resp.extensions().get::<ConnectionClosed>().cloned()
    }

    /// The connection a request was sent on, once the client has picked one (see
    /// [`hyper_util::client::legacy::connect::capture_connection`]): for a call cut before its
    /// response head. `None` for HTTP/2 (cutting resets the stream, the connection stays) and
    /// while no connection was picked yet (then the origin has seen nothing to count).
    pub fn of_capture(capture: &CaptureConnection) -> Option<ConnectionClosed> {
        let connected = capture.connection_metadata();
        let connected = connected.as_ref()?;
        if connected.is_negotiated_h2() {
            return None;
        }
        let mut extensions = http::Extensions::new();
        connected.get_extras(&mut extensions);
        extensions.get::<ConnectionClosed>().cloned()
    }

    fn close(&self) {
        self.0.closed.store(true, Ordering::Release);
        self.0.notify.notify_waiters();
    }

    /// Waits until the socket is closed.
    pub async fn closed(&self) {
        loop {
            let notified = self.0.notify.notified();
            if self.0.closed.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// After a body that had not ended was dropped: waits (at most [`CLOSE_WAIT`]) for its
    /// connection's socket to close. Without a connection to wait on, returns at once.
    pub async fn after_cut(closed: Option<ConnectionClosed>) {
        if let Some(c) = closed {
            if tokio::time::timeout(CLOSE_WAIT, c.closed()).await.is_err() {
                tracing::debug!("a cut upstream connection did not close in time");
            }
        }
    }
}

/// [`HttpConnector`] whose connections signal their close.
#[derive(Clone)]
pub struct TrackedConnector(pub HttpConnector);

type ConnectFuture = Pin<
    Box<
        dyn Future<Output = Result<TrackedStream, Box<dyn std::error::Error + Send + Sync>>> + Send,
    >,
>;

impl tower::Service<Uri> for TrackedConnector {
    type Response = TrackedStream;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.0.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            Ok(TrackedStream {
                io: Some(io),
                closed: ConnectionClosed::default(),
            })
        })
    }
}

/// A connection's socket that signals its [`ConnectionClosed`] when dropped (closed).
pub struct TrackedStream {
    io: Option<TokioIo<TcpStream>>,
    closed: ConnectionClosed,
}

impl TrackedStream {
    /// Signalled once this socket is closed.
    pub fn closed(&self) -> ConnectionClosed {
        self.closed.clone()
    }
}

impl Drop for TrackedStream {
    fn drop(&mut self) {
        drop(self.io.take()); // closes the socket
        self.closed.close();
    }
}

fn gone() -> std::io::Error {
    std::io::Error::from(std::io::ErrorKind::NotConnected)
}

impl Read for TrackedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.io.as_mut() {
            Some(io) => Pin::new(io).poll_read(cx, buf),
            None => Poll::Ready(Err(gone())),
        }
    }
}

impl Write for TrackedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.io.as_mut() {
            Some(io) => Pin::new(io).poll_write(cx, buf),
            None => Poll::Ready(Err(gone())),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.io.as_mut() {
            Some(io) => Pin::new(io).poll_write_vectored(cx, bufs),
            None => Poll::Ready(Err(gone())),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(|io| io.is_write_vectored())
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.io.as_mut() {
            Some(io) => Pin::new(io).poll_flush(cx),
            None => Poll::Ready(Err(gone())),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.io.as_mut() {
            Some(io) => Pin::new(io).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

impl Connection for TrackedStream {
    fn connected(&self) -> Connected {
        match &self.io {
            Some(io) => io.connected().extra(self.closed.clone()),
            None => Connected::new(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn closed_is_signalled_once_and_for_every_waiter() {
        let c = ConnectionClosed::default();
        let (a, b) = (c.clone(), c.clone());
        let waiters = tokio::spawn(async move { tokio::join!(a.closed(), b.closed()) });
        tokio::task::yield_now().await;
        c.close();
        waiters.await.unwrap();
        // Already closed: returns at once.
        c.closed().await;
    }
}
