//! A pool's gate that also counts, second by second, what it decides (the pool's
//! [`History`]): every admission, refusal, queue wait and reported origin `429` of a pool goes
//! through its gate, whoever asks (proxy, lock, jobs, SQL), so this is the one place to count.
//! The counting is a few atomic adds beside the inner gate's own work.

use std::sync::Arc;

use nthbouncer_coord::{
    AcquireRequest, Clock, Grant, LeaseWatch, Outcome, PoolGate, PoolSettings, Refusal, RenewError,
    SlotId, Snapshot,
};

use crate::core::history::{Event, History};

pub struct CountedGate {
    inner: Arc<dyn PoolGate>,
    history: Arc<History>,
    clock: Arc<dyn Clock>,
}

impl CountedGate {
    pub fn wrap(
        inner: Arc<dyn PoolGate>,
        history: Arc<History>,
        clock: Arc<dyn Clock>,
    ) -> Arc<dyn PoolGate> {
        Arc::new(CountedGate {
            inner,
            history,
            clock,
        })
    }

    fn count_origin_429s(&self, n: u32) {
        // Nearly every release reports none: no clock reading for them.
        if n > 0 {
            self.history.add(self.clock.now_ms(), Event::Origin429, n);
        }
    }
}

#[async_trait::async_trait]
impl PoolGate for CountedGate {
    async fn acquire(&self, req: AcquireRequest) -> Result<Grant, Refusal> {
        let answer = self.inner.acquire(req).await;
        let now = self.clock.now_ms();
        let queued_ms = match &answer {
            Ok(grant) => {
                self.history.add(now, Event::Admitted, 1);
                grant.headers.queued_ms
            }
            Err(Refusal::TooManyRequests { headers, .. } | Refusal::QueueTimeout { headers }) => {
                self.history.add(now, Event::Refused, 1);
                headers.queued_ms
            }
            Err(Refusal::PoolClosed | Refusal::CoordinationUnavailable { .. }) => 0,
        };
        if queued_ms > 0 {
            self.history.add(now, Event::Queued, 1);
        }
        answer
    }

    async fn renew(&self, slot: SlotId) -> Result<u64, RenewError> {
        self.inner.renew(slot).await
    }

    async fn release(&self, slot: SlotId, outcome: Option<Outcome>) -> bool {
        // Counted only when the release freed a slot: the gate learns nothing from any other.
        let throttled = outcome.as_ref().map_or(0, origin_429s);
        let released = self.inner.release(slot, outcome).await;
        if released {
            self.count_origin_429s(throttled);
        }
        released
    }

    async fn report(&self, outcome: Outcome) {
        self.count_origin_429s(origin_429s(&outcome));
        self.inner.report(outcome).await;
    }

    async fn reconfigure(&self, settings: PoolSettings) {
        self.inner.reconfigure(settings).await;
    }

    async fn snapshot(&self) -> Snapshot {
        self.inner.snapshot().await
    }

    async fn close(&self) {
        self.inner.close().await;
    }

    fn lease_watch(&self, slot: SlotId) -> Option<LeaseWatch> {
        self.inner.lease_watch(slot)
    }
}

/// The origin `429`s an outcome reports: its count, or one if its final status was `429`.
fn origin_429s(outcome: &Outcome) -> u32 {
    outcome
        .throttled
        .max(u32::from(outcome.status == Some(429)))
}
