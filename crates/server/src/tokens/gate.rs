//! A pool's token budget as the serving path uses it: the pure [`TokenBudget`] behind a lock,
//! waiters parked on oneshot channels, and one task per pool that wakes when the budget says
//! something may change (a charge leaves the window, the announced budget refills, a waiter's
//! hold starts). In process only: on Redis each node keeps its own (see the README).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use nthbouncer_coord::{Clock, Priority};
use nthbouncer_governor::{TokenAdmit, TokenBudget, TokenSettings, TokenSnapshot, TokenWindow};
use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};

/// Why the budget did not admit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenRefusal {
    /// Larger than the whole budget: `400 exceeds_token_budget`.
    Exceeds { estimate: u64, budget: u64 },
    /// No room and no wait budget: `429`, with a hint when the budget gives one.
    NoRoom { retry_after_ms: Option<u64> },
    /// The wait budget ran out: `504 queue_timeout`.
    Timeout,
}

struct State {
    budget: TokenBudget,
    waiters: HashMap<u128, oneshot::Sender<Option<u64>>>,
}

/// One pool's token budget, shared by every settings version of the pool.
pub struct TokenGate {
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    wake: Arc<Notify>,
    /// Whether a budget was ever configured or announced. Most pools never have one, and every
    /// proxied answer asks [`TokenGate::active`]: they are answered without the lock.
    engaged: AtomicBool,
}

impl TokenGate {
    /// A gate with its wake-up task (which ends when the gate is dropped).
    pub fn open(settings: TokenSettings, clock: Arc<dyn Clock>) -> Arc<TokenGate> {
        let gate = Arc::new(TokenGate {
            state: Mutex::new(State {
                budget: TokenBudget::new(settings),
                waiters: HashMap::new(),
            }),
            clock,
            wake: Arc::new(Notify::new()),
            engaged: AtomicBool::new(settings.tpm > 0),
        });
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::spawn(ticker(Arc::downgrade(&gate), gate.wake.clone()));
        }
        gate
    }

    fn now(&self) -> u64 {
        self.clock.monotonic_ms()
    }

    /// Whether any budget is in force (configured, or learned from the origin).
    pub fn active(&self) -> bool {
        if !self.engaged.load(Ordering::Acquire) {
            return false;
        }
        self.state.lock().budget.active(self.now())
    }

    pub fn reconfigure(&self, settings: TokenSettings) {
        if settings.tpm > 0 {
            self.engaged.store(true, Ordering::Release);
        }
        self.state.lock().budget.reconfigure(settings);
        self.wake.notify_one();
    }

    /// Waits up to `wait_ms` for `cost` tokens. Dropping the future leaves the queue; a grant
    /// that races it is refunded.
    pub async fn acquire(
        &self,
        id: u128,
        cost: u64,
        priority: Priority,
        wait_ms: u64,
    ) -> Result<Option<u64>, TokenRefusal> {
        let rx = {
            let mut s = self.state.lock();
            let now = self.now();
            match s.budget.try_admit(now, id, cost, priority, wait_ms > 0) {
                TokenAdmit::Admitted { remaining } => return Ok(remaining),
                TokenAdmit::Exceeds { estimate, budget } => {
                    return Err(TokenRefusal::Exceeds { estimate, budget })
                }
                TokenAdmit::Refused { retry_after_ms } => {
                    return Err(TokenRefusal::NoRoom { retry_after_ms })
                }
                TokenAdmit::Queued => {
                    let (tx, rx) = oneshot::channel();
                    s.waiters.insert(id, tx);
                    rx
                }
            }
        };
        self.wake.notify_one();
        let mut parked = Parked {
            gate: self,
            id,
            armed: true,
        };
        let deadline = self.now().saturating_add(wait_ms);
        let answer = tokio::select! {
            granted = rx => granted.ok(),
            () = self.clock.sleep_until_monotonic(deadline) => None,
        };
        parked.armed = false;
        match answer {
            Some(remaining) => Ok(remaining),
            None => {
                let mut s = self.state.lock();
                s.waiters.remove(&id);
                if s.budget.cancel(id) {
                    return Err(TokenRefusal::Timeout);
                }
                // Granted as the wait ran out: take it.
                Ok(s.budget.remaining(self.now()))
            }
        }
    }

    /// Takes a charge back whole (its request never reached the origin).
    pub fn refund(&self, id: u128) {
        self.state.lock().budget.refund(id);
        self.wake.notify_one();
    }

    /// The request of charge `id` ended; its answer reported `usage` tokens, if any.
    pub fn finish(&self, id: u128, usage: Option<u64>) {
        let now = self.now();
        self.state.lock().budget.finish(now, id, usage);
        self.wake.notify_one();
    }

    /// The origin's word on its token budget, from the answer to charge `id` (if known).
    pub fn observe(&self, id: Option<u128>, window: TokenWindow) {
        let now = self.now();
        self.state.lock().budget.observe(now, id, window);
        self.engaged.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    pub fn remaining(&self) -> Option<u64> {
        self.state.lock().budget.remaining(self.now())
    }

    pub fn snapshot(&self) -> TokenSnapshot {
        self.state.lock().budget.snapshot(self.now())
    }

    /// Admits every waiter that may go now; the next time to look again.
    fn dispatch(&self) -> Option<u64> {
        let mut s = self.state.lock();
        let now = self.now();
        while let Some((id, remaining)) = s.budget.dispatch(now) {
            let delivered = s
                .waiters
                .remove(&id)
                .is_some_and(|tx| tx.send(remaining).is_ok());
            if !delivered {
                // Its caller went away: the charge is not spent.
                s.budget.refund(id);
            }
        }
        s.budget.next_wakeup(now)
    }
}

/// Leaves the queue if the acquire future is dropped while parked.
struct Parked<'a> {
    gate: &'a TokenGate,
    id: u128,
    armed: bool,
}

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut s = self.gate.state.lock();
        s.waiters.remove(&self.id);
        if !s.budget.cancel(self.id) {
            s.budget.refund(self.id);
        }
    }
}

async fn ticker(gate: Weak<TokenGate>, wake: Arc<Notify>) {
    loop {
        let Some(g) = gate.upgrade() else { return };
        let next = g.dispatch();
        let clock = g.clock.clone();
        drop(g);
        // Hold no strong reference while asleep, so a dropped gate ends the task; look again
        // at least once a second.
        let now = clock.monotonic_ms();
        let until = next.map_or(now + 1_000, |t| t.clamp(now + 1, now + 1_000));
        tokio::select! {
            () = clock.sleep_until_monotonic(until) => {}
            () = wake.notified() => {}
        }
    }
}
