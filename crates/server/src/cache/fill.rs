//! Storing a leader's answer while it streams to its own caller: the body is passed through
//! frame by frame and copied aside (up to `max_entry_bytes`); once it ended whole, the copy
//! becomes the entry and lands the flight. Followers get it then, complete (not streamed).

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};

use super::policy::{self, Storable};
use super::store::{Entry, Ticket};

/// A leader's miss on its way to the origin: what storing its answer needs.
pub struct Fill {
    pub(super) ticket: Ticket,
    /// The request's headers, for the origin's `Vary`.
    pub(super) request: HeaderMap,
    pub(super) path: String,
}

impl Fill {
    /// The answer's body, copied aside as it streams when the answer may be kept (its status
    /// and `headers`, hop-by-hop ones already out); otherwise as it is, and the waiters go to
    /// the origin themselves at once.
    pub fn answer(self, status: StatusCode, headers: &HeaderMap, body: Body) -> Body {
        let Some(storable) = policy::storable(self.ticket.spec(), status, headers, &self.request)
        else {
            return body;
        };
        let mut kept = headers.clone();
        // Ours are per request (gate state, request id): a hit gets its own.
        let ours: Vec<_> = kept
            .keys()
            .filter(|n| n.as_str().starts_with("x-nthpool-") || n.as_str() == "x-request-id")
            .cloned()
            .collect();
        for name in ours {
            kept.remove(name);
        }
        let pending = Pending {
            received_at: self.ticket.now(),
            ticket: self.ticket,
            status,
            headers: kept,
            storable,
            path: self.path,
            copy: BytesMut::new(),
        };
        let mut tee = Tee {
            inner: body,
            pending: Some(pending),
        };
        // A body already over (HEAD, 204) is never polled.
        if tee.inner.is_end_stream() {
            tee.complete();
        }
        Body::new(tee)
    }
}

struct Pending {
    ticket: Ticket,
    status: StatusCode,
    headers: HeaderMap,
    storable: Storable,
    path: String,
    /// Monotonic ms when the answer's head arrived: its age counts from then.
    received_at: u64,
    copy: BytesMut,
}

struct Tee {
    inner: Body,
    /// Dropped (landing nothing) once the answer cannot be kept after all.
    pending: Option<Pending>,
}

impl Tee {
    fn complete(&mut self) {
        let Some(p) = self.pending.take() else { return };
        let body = p.copy.freeze();
        let weight = Entry::weigh(p.ticket.key(), &p.headers, &body, &p.path);
        let entry = Entry {
            status: p.status,
            headers: p.headers,
            body,
            path: p.path,
            stored_at: p.received_at,
            fresh_until: p.received_at.saturating_add(p.storable.fresh_ms),
            initial_age_s: p.storable.initial_age_s,
            vary: p.storable.vary,
            weight,
        };
        p.ticket.land(entry);
    }

    fn copy(&mut self, data: &Bytes) {
        let Some(p) = self.pending.as_mut() else {
            return;
        };
        let max = p.ticket.spec().max_entry_bytes;
        if (p.copy.len() + data.len()) as u64 > max {
            self.pending = None;
        } else {
            p.copy.extend_from_slice(data);
        }
    }
}

impl HttpBody for Tee {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match polled {
            Some(Ok(frame)) => {
                match frame.data_ref() {
                    Some(data) => self.copy(data),
                    // Trailers are not kept: an answer with them is not stored.
                    None => self.pending = None,
                }
                // The server may not poll again once the body says it is over.
                if self.inner.is_end_stream() {
                    self.complete();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => {
                self.pending = None;
                Poll::Ready(Some(Err(e)))
            }
            None => {
                self.complete();
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
