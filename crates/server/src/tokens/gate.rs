//! A pool's token budget as the serving path uses it: the pure [`TokenBudget`] behind a lock,
//! waiters parked on oneshot channels, and one task per pool that wakes when the budget says
//! something may change (a charge leaves the window, the announced budget refills, a waiter's
//! hold starts). The task starts with the pool's first waiter: it only ever hands waiters
//! their grants, and most pools never have a budget (1,000 pools would otherwise keep 1,000
//! tasks waking every second). With coordination on Redis the budget itself is in Redis,
//! shared by every node (`shared`); this node's budget then serves only while Redis is away
//! (fail open).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use nthbouncer_coord::redis::RedisTokens;
use nthbouncer_coord::{Clock, Priority};
use nthbouncer_governor::{
    TokenAdmit, TokenBudget, TokenCost, TokenPart, TokenSettings, TokenSnapshot, TokenWindow, Usage,
};
use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};

use super::shared::{self, Shared};

/// Why the budget did not admit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenRefusal {
    /// Larger than the whole budget: `400 exceeds_token_budget`.
    Exceeds { estimate: u64, budget: u64 },
    /// No room and no wait budget: `429`, with a hint when the budget gives one.
    NoRoom { retry_after_ms: Option<u64> },
    /// The wait budget ran out: `504 queue_timeout`.
    Timeout,
    /// The shared budget's Redis is unreachable (fail closed): `503 coordination_unavailable`.
    Unavailable { retry_after_ms: u64 },
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
    engaged: Arc<AtomicBool>,
    /// Shared, not engaged yet: the monotonic ms after which a call may ask Redis whether
    /// another node engaged the budget (at most once a second, and only while called).
    engage_check_at: AtomicU64,
    /// The budget shared on Redis, when coordination is there; `state` then holds this node's
    /// own budget for while Redis is away (fail open).
    shared: Option<Arc<Shared>>,
    /// This gate, for the wake-up task it starts (which holds no strong reference).
    me: Weak<TokenGate>,
    /// Whether the wake-up task was started (with the first waiter).
    ticking: AtomicBool,
}

impl TokenGate {
    /// A gate; its wake-up task starts with its first waiter and ends when the gate is
    /// dropped. With `ledger` (the pool's ledger on Redis) the budget is the one every node
    /// sharing it admits against.
    pub fn open(
        settings: TokenSettings,
        clock: Arc<dyn Clock>,
        ledger: Option<Arc<RedisTokens>>,
    ) -> Arc<TokenGate> {
        let shared = ledger.map(|l| Shared::new(l, settings));
        let own = match shared.as_ref().and_then(|s| s.fail_open()) {
            Some(expected) => shared::share(settings, expected),
            None => settings,
        };
        let gate = Arc::new_cyclic(|me| TokenGate {
            state: Mutex::new(State {
                budget: TokenBudget::new(own),
                waiters: HashMap::new(),
            }),
            clock,
            wake: Arc::new(Notify::new()),
            engaged: Arc::new(AtomicBool::new(settings.tpm > 0)),
            engage_check_at: AtomicU64::new(0),
            shared,
            me: me.clone(),
            ticking: AtomicBool::new(false),
        });
        if let Some(sh) = &gate.shared {
            sh.runtime().spawn(shared::ticker(Arc::downgrade(&gate)));
        }
        gate
    }

    /// Starts the wake-up task if it is not running yet: a waiter is about to park.
    fn ensure_ticking(&self) {
        if self.ticking.load(Ordering::Acquire) || self.ticking.swap(true, Ordering::AcqRel) {
            return;
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::spawn(ticker(self.me.clone(), self.wake.clone()));
        } else {
            self.ticking.store(false, Ordering::Release);
        }
    }

    pub(super) fn now(&self) -> u64 {
        self.clock.monotonic_ms()
    }

    pub(super) fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    pub(super) fn shared(&self) -> Option<&Arc<Shared>> {
        self.shared.as_ref()
    }

    /// Whether any budget is in force (configured, or learned from the origin). Shared, once
    /// one was configured or announced here: Redis says at admission whether one still is
    /// (a pool that never had one never asks it).
    pub fn active(&self) -> bool {
        if !self.engaged.load(Ordering::Acquire) {
            self.check_engaged();
            return false;
        }
        self.shared.is_some() || self.state.lock().budget.active(self.now())
    }

    /// Shared and not engaged here: another node may have learned a budget. Asks Redis in the
    /// background, at most once a second; the call that asks goes on without a budget.
    fn check_engaged(&self) {
        let Some(sh) = &self.shared else { return };
        if !sh.settings().learn {
            // Only a configured budget could apply, and this node's configuration has none.
            return;
        }
        let now = self.now();
        let at = self.engage_check_at.load(Ordering::Acquire);
        if now < at
            || self
                .engage_check_at
                .compare_exchange(
                    at,
                    now.saturating_add(1_000),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err()
        {
            return;
        }
        let (sh, engaged) = (sh.clone(), self.engaged.clone());
        sh.runtime().clone().spawn(async move {
            if sh.peek().await.source.is_some() {
                engaged.store(true, Ordering::Release);
            }
        });
    }

    pub fn reconfigure(&self, settings: TokenSettings) {
        if settings.tpm > 0 {
            self.engaged.store(true, Ordering::Release);
        }
        let own = match &self.shared {
            Some(sh) => {
                sh.reconfigure(settings);
                sh.fail_open()
                    .map_or(settings, |n| shared::share(settings, n))
            }
            None => settings,
        };
        self.state.lock().budget.reconfigure(own);
        self.wake.notify_one();
    }

    /// This node's own budget, without waiting (shared budgets while Redis is away).
    pub(super) fn local_admit(&self, id: u128, cost: TokenCost, priority: Priority) -> TokenAdmit {
        let now = self.now();
        self.state
            .lock()
            .budget
            .try_admit(now, id, cost, priority, false)
    }

    /// Waits up to `wait_ms` for `cost` tokens. Dropping the future leaves the queue; a grant
    /// that races it is refunded.
    pub async fn acquire(
        &self,
        id: u128,
        cost: TokenCost,
        priority: Priority,
        wait_ms: u64,
    ) -> Result<Option<u64>, TokenRefusal> {
        if let Some(sh) = &self.shared {
            return shared::acquire(self, sh, id, cost, priority, wait_ms).await;
        }
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
        self.ensure_ticking();
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
        match &self.shared {
            Some(sh) if !sh.take_local(id) => sh.refund(id),
            _ => {
                self.state.lock().budget.refund(id);
                self.wake.notify_one();
            }
        }
    }

    /// The request of charge `id` ended; its answer reported `usage` tokens, if any.
    pub fn finish(&self, id: u128, usage: Option<Usage>) {
        match &self.shared {
            Some(sh) if !sh.take_local(id) => sh.finish(id, usage),
            _ => {
                let now = self.now();
                self.state.lock().budget.finish_usage(now, id, usage);
                self.wake.notify_one();
            }
        }
    }

    /// The origin's word on its token budget, from the answer to charge `id` (if known).
    /// Shared, it goes to Redis too (this node's own budget learns it for while Redis is
    /// away).
    pub fn observe(&self, id: Option<u128>, window: TokenWindow) {
        self.observe_part(id, TokenPart::Total, window);
    }

    /// [`TokenGate::observe`] of one budget of an origin that splits them (input, output).
    pub fn observe_part(&self, id: Option<u128>, part: TokenPart, window: TokenWindow) {
        let now = self.now();
        if let Some(sh) = &self.shared {
            let local = id.is_some_and(|id| sh.is_local(id));
            sh.observe(id.filter(|_| !local), part, window);
        }
        self.state.lock().budget.observe_part(now, id, part, window);
        self.engaged.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// What remains: shared, as Redis last said (before it said anything, what the answers
    /// seen here announced).
    pub fn remaining(&self) -> Option<u64> {
        let shared = self.shared.as_ref().and_then(|sh| sh.view().remaining);
        shared.or_else(|| self.state.lock().budget.remaining(self.now()))
    }

    /// The budget's state; shared, as Redis has it now, with this node's waiters.
    pub async fn snapshot(&self) -> TokenSnapshot {
        let Some(sh) = &self.shared else {
            return self.state.lock().budget.snapshot(self.now());
        };
        let v = sh.peek().await;
        if v.source.is_some() {
            self.engaged.store(true, Ordering::Release);
        }
        TokenSnapshot {
            budget: v.budget,
            remaining: v.remaining,
            source: v.source,
            waiting: sh.waiting(),
            held: v.held,
            admitted_tokens: v.admitted_tokens,
            input_remaining: v.input_remaining,
            output_remaining: v.output_remaining,
        }
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
