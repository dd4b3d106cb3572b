//! The work in flight that a graceful stop waits for: job attempts (from `start_attempt` to the
//! committed result) and webhook attempts (from the request to its committed record).
//!
//! Each attempt enters before it starts and holds the [`Entered`] guard until its result is
//! recorded. Once [`Drain::start`] is called no attempt enters any more, and
//! [`Drain::idle`] resolves when the last one held is done, so the shutdown can wait for it
//! (within `server.shutdown_grace_ms`) instead of abandoning a fetch the origin is working on.

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;

#[derive(Default)]
struct Inner {
    draining: bool,
    in_flight: usize,
}

/// Attempts in flight, and whether new ones may start.
#[derive(Default)]
pub struct Drain {
    inner: Mutex<Inner>,
    idle: Notify,
}

/// One attempt in flight: dropping it (however the attempt ended) counts it out.
pub struct Entered(Arc<Drain>);

impl Drop for Entered {
    fn drop(&mut self) {
        let now_idle = {
            let mut inner = self.0.inner.lock();
            inner.in_flight = inner.in_flight.saturating_sub(1);
            inner.in_flight == 0
        };
        if now_idle {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    pub fn new() -> Arc<Drain> {
        Arc::new(Drain::default())
    }

    /// Counts an attempt about to start; `None` once draining (start nothing new).
    pub fn enter(self: &Arc<Self>) -> Option<Entered> {
        let mut inner = self.inner.lock();
        if inner.draining {
            return None;
        }
        inner.in_flight += 1;
        Some(Entered(self.clone()))
    }

    /// From now on no attempt enters.
    pub fn start(&self) {
        self.inner.lock().draining = true;
    }

    pub fn is_draining(&self) -> bool {
        self.inner.lock().draining
    }

    /// Attempts in flight.
    pub fn in_flight(&self) -> usize {
        self.inner.lock().in_flight
    }

    /// Resolves when no attempt is in flight (at once if none is).
    pub async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            // Registered before the check, so a guard dropped in between still wakes us.
            notified.as_mut().enable();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn idle_waits_for_every_guard_and_draining_refuses_new_ones() {
        let drain = Drain::new();
        drain.idle().await; // nothing in flight
        let a = drain.enter().unwrap();
        let b = drain.enter().unwrap();
        drain.start();
        assert!(drain.enter().is_none());
        assert_eq!(drain.in_flight(), 2);
        let waiter = tokio::spawn({
            let drain = drain.clone();
            async move { drain.idle().await }
        });
        drop(a);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(b);
        waiter.await.unwrap();
        assert_eq!(drain.in_flight(), 0);
    }
}
