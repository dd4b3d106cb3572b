//! Everything about calling an origin that the proxy and the job runner share, as pingora-core
//! is to pingora: the one client, the one way a request for the origin is prepared
//! ([`prepare`]), what holds the slot while the origin works ([`slot`]), and one error that
//! knows where a call failed and whether a retry is safe ([`error`]). Upstream answers become
//! governor outcomes in [`outcome`]. A database pool's origin is PostgreSQL: [`sql`] runs one
//! SQL-over-HTTP request on it.
//!
//! It must not know pools, keys or features: callers hand it a target, headers and a slot.

pub mod client;
pub mod connector;
pub mod direct;
pub mod error;
pub mod outcome;
pub mod prepare;
pub mod slot;
pub mod sql;
pub mod target;

use axum::body::Body;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

pub use client::{
    build_client, build_tls_client, enter_lane, CallClient, ClientTimeouts, SharedClient,
    UpstreamClient,
};
pub use connector::ConnectionClosed;
pub use error::{Stage, UpstreamError};
pub use slot::{Exchange, Fence, Fenced, SlotBody, SlotGuard};
pub use target::{PathRefused, Target};

/// An origin's response head, the slot it holds, and the connection it came on when cutting
/// its body closes that connection (HTTP/1; see [`ConnectionClosed::of`]).
pub struct Answer {
    pub resp: Response<Incoming>,
    pub guard: SlotGuard,
    pub closed: Option<ConnectionClosed>,
}

/// Sends `req` holding `guard`'s slot and waits for the response head until `deadline`. If
/// the caller goes away first, the call runs on detached and keeps the slot ([`Exchange`]). A
/// slot whose lease is lost meanwhile cuts the call off ([`Fence`]): the error is [`Fenced`].
pub async fn exchange(
    client: &CallClient,
    req: Request<Body>,
    guard: SlotGuard,
    deadline: Instant,
) -> Result<Answer, UpstreamError> {
    let mut fence = guard.fence();
    let call = Exchange::send(client, req, guard, deadline);
    tokio::select! {
        sent = tokio::time::timeout_at(deadline, call) => match sent {
            Ok((Ok((resp, closed)), guard)) => Ok(Answer { resp, guard, closed }),
            Ok((Err(e), _slot_freed)) => Err(UpstreamError::from_client(e)),
            Err(_) => Err(UpstreamError::deadline(Stage::ResponseHead)),
        },
        () = fence.lost() => Err(UpstreamError::new(Stage::Send, Fenced)),
    }
}

/// A response body read whole up to `max` bytes (the rest is cut off), until `deadline`.
pub struct Collected {
    pub body: Vec<u8>,
    pub truncated: bool,
}

/// Reads a response body up to `max` bytes before `deadline`. A body cut short (too long, too
/// late, broken) returns only once its connection (`closed`) is closed: the caller frees the
/// slot next.
pub async fn collect(
    resp: Response<Incoming>,
    closed: Option<ConnectionClosed>,
    max: usize,
    deadline: Instant,
) -> Result<(http::response::Parts, Collected), UpstreamError> {
    let (parts, mut body) = resp.into_parts();
    let read = async move {
        let mut collected = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| UpstreamError::new(Stage::Body, e))?;
            if let Some(data) = frame.data_ref() {
                let room = max.saturating_sub(collected.len());
                if data.len() > room {
                    collected.extend_from_slice(&data[..room]);
                    return Ok(Collected {
                        body: collected,
                        truncated: true,
                    });
                }
                collected.extend_from_slice(data);
            }
        }
        Ok(Collected {
            body: collected,
            truncated: false,
        })
    };
    let collected = tokio::time::timeout_at(deadline, read)
        .await
        .map_err(|_| UpstreamError::deadline(Stage::Body))
        .and_then(|read| read);
    let cut = !matches!(&collected, Ok(c) if !c.truncated);
    if cut {
        ConnectionClosed::after_cut(closed).await;
    }
    collected.map(|c| (parts, c))
}
