//! Server-sent-event bodies that keep their request in flight while they
//! stream: the in-flight slot travels with the body and is released just
//! before `data: [DONE]` goes out, or when the body is dropped because the
//! client went away.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream;
use parking_lot::Mutex;

use crate::state::InFlightGuard;

/// Hands a request's in-flight slot from the governing middleware to a
/// handler that wants it to outlive the handler (streams). Cloneable only so
/// it can ride in request extensions; exactly one party ever takes the guard.
#[derive(Debug, Clone)]
pub(crate) struct GuardSlot(Arc<Mutex<Option<InFlightGuard>>>);

impl GuardSlot {
    pub(crate) fn new(guard: InFlightGuard) -> Self {
        Self(Arc::new(Mutex::new(Some(guard))))
    }

    /// Takes the guard, if nobody has yet.
    pub(crate) fn take(&self) -> Option<InFlightGuard> {
        self.0.lock().take()
    }
}

struct SseState {
    events: std::vec::IntoIter<String>,
    interval: Duration,
    sent_first: bool,
    finished: bool,
    /// Dropped with the stream, so an abandoned stream frees its slot.
    guard: Option<InFlightGuard>,
}

/// Streams `events` as `data: <event>` frames `interval` apart (the first one
/// immediately), then `data: [DONE]`.
pub(crate) fn sse_response(
    events: Vec<String>,
    interval: Duration,
    guard: Option<InFlightGuard>,
) -> Response {
    let state = SseState {
        events: events.into_iter(),
        interval,
        sent_first: false,
        finished: false,
        guard,
    };
    let frames = stream::unfold(state, |mut st| async move {
        if st.finished {
            return None;
        }
        match st.events.next() {
            Some(event) => {
                if st.sent_first && !st.interval.is_zero() {
                    tokio::time::sleep(st.interval).await;
                }
                st.sent_first = true;
                let frame = Bytes::from(format!("data: {event}\n\n"));
                Some((Ok::<_, Infallible>(frame), st))
            }
            None => {
                // Free the slot before [DONE] is yielded, so a client that has
                // read [DONE] already sees in_flight back down.
                drop(st.guard.take());
                st.finished = true;
                Some((Ok(Bytes::from_static(b"data: [DONE]\n\n")), st))
            }
        }
    });
    (
        StatusCode::OK,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        Body::from_stream(frames),
    )
        .into_response()
}
