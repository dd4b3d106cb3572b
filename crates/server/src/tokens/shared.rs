//! The node-local half of a token budget shared on Redis (coordination on Redis): the ledger
//! and its rules are in Redis (`nthbouncer_coord::redis::RedisTokens`), so every node sharing
//! the key prefix admits against one budget. Here: this node's callers waiting for room (parked
//! on oneshot channels, retried by one ticker task per pool, in class then arrival order; the
//! first that has waited `hold_ms` asks Redis to hold the budget for it, which keeps every
//! node's newcomers out), the reports of ended calls and announcements (sent in order by one
//! task, so a charge's announcement is never applied after its end), and the last view of the
//! budget Redis gave (for `x-nthpool-tpm-remaining` between calls).
//!
//! Redis unreachable, as the slot gate: refused with `coordination_unavailable` (fail closed),
//! or with `fail_open`, admitted against this node's own budget of `tpm / expected_nodes` (and
//! what its own answers announce) until Redis answers again.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use nthbouncer_coord::redis::{RedisTokens, SharedAdmit, TokenReport, TokenView, HOLD_RENEW_MS};
use nthbouncer_coord::Priority;
use nthbouncer_governor::{TokenAdmit, TokenCost, TokenPart, TokenSettings, TokenWindow, Usage};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot, Notify};

use super::gate::{TokenGate, TokenRefusal};

/// What a waiter is told: admitted (with what remains), or refused.
pub(super) type Answer = Result<Option<u64>, TokenRefusal>;

struct Waiter {
    id: u128,
    cost: TokenCost,
    rank: u8,
    seq: u64,
    since: u64,
    tx: oneshot::Sender<Answer>,
}

pub(super) struct Shared {
    ledger: Arc<RedisTokens>,
    settings: Mutex<TokenSettings>,
    view: Mutex<TokenView>,
    queue: Mutex<Vec<Waiter>>,
    seq: AtomicU64,
    reports: mpsc::UnboundedSender<TokenReport>,
    /// Fail open: until this monotonic ms, admission skips Redis (it just failed).
    down_until: AtomicU64,
    /// Fail open: charges admitted by this node's own budget (ended there, not in Redis).
    local: Mutex<HashSet<u128>>,
    wake: Notify,
}

fn rank(p: Priority) -> u8 {
    match p {
        Priority::High => 0,
        Priority::Normal => 1,
        Priority::Low => 2,
    }
}

/// This node's own budget while Redis is away (fail open): its share of the configured one.
pub(super) fn share(settings: TokenSettings, expected_nodes: u32) -> TokenSettings {
    let tpm = match settings.tpm {
        0 => 0,
        t => (t / u64::from(expected_nodes.max(1))).max(1),
    };
    TokenSettings { tpm, ..settings }
}

impl Shared {
    pub(super) fn new(ledger: Arc<RedisTokens>, settings: TokenSettings) -> Arc<Shared> {
        let (reports, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            ledger,
            settings: Mutex::new(settings),
            view: Mutex::new(TokenView::default()),
            queue: Mutex::new(Vec::new()),
            seq: AtomicU64::new(0),
            reports,
            down_until: AtomicU64::new(0),
            local: Mutex::new(HashSet::new()),
            wake: Notify::new(),
        });
        shared
            .ledger
            .runtime()
            .spawn(reporter(Arc::downgrade(&shared), rx));
        shared
    }

    /// The node's runtime, where this budget's tasks run.
    pub(super) fn runtime(&self) -> &tokio::runtime::Handle {
        self.ledger.runtime()
    }

    pub(super) fn settings(&self) -> TokenSettings {
        *self.settings.lock()
    }

    pub(super) fn reconfigure(&self, settings: TokenSettings) {
        *self.settings.lock() = settings;
        self.wake.notify_one();
    }

    pub(super) fn fail_open(&self) -> Option<u32> {
        self.ledger.fail_open()
    }

    /// Whether this node is on its own now (fail open, Redis failed a moment ago).
    fn down(&self, now: u64) -> bool {
        now < self.down_until.load(Ordering::Acquire)
    }

    fn went_down(&self, now: u64) {
        let until = now.saturating_add(self.ledger.retry_after_ms());
        self.down_until.store(until, Ordering::Release);
    }

    fn seen(&self, view: TokenView) {
        *self.view.lock() = view;
    }

    pub(super) fn view(&self) -> TokenView {
        *self.view.lock()
    }

    pub(super) fn waiting(&self) -> u32 {
        u32::try_from(self.queue.lock().len()).unwrap_or(u32::MAX)
    }

    /// Whether charge `id` was admitted by this node's own budget.
    pub(super) fn is_local(&self, id: u128) -> bool {
        self.local.lock().contains(&id)
    }

    /// Forgets that charge `id` was local; whether it was.
    pub(super) fn take_local(&self, id: u128) -> bool {
        self.local.lock().remove(&id)
    }

    pub(super) fn finish(&self, id: u128, usage: Option<Usage>) {
        let _ = self.reports.send(TokenReport::Finish(id, usage));
    }

    pub(super) fn refund(&self, id: u128) {
        let _ = self.reports.send(TokenReport::Refund(id));
    }

    pub(super) fn observe(&self, id: Option<u128>, part: TokenPart, window: TokenWindow) {
        let _ = self.reports.send(TokenReport::Observe(id, part, window));
    }

    /// The budget as Redis has it now (the last view if it does not answer).
    pub(super) async fn peek(&self) -> TokenView {
        let settings = self.settings();
        match self.ledger.peek(&settings).await {
            Ok(v) => {
                self.seen(v);
                v
            }
            Err(_) => self.view(),
        }
    }
}

/// Admission on a shared budget: Redis, or (fail open, Redis away) this node's own budget;
/// a caller that may wait and does not fit is parked for the ticker.
pub(super) async fn acquire(
    gate: &TokenGate,
    sh: &Arc<Shared>,
    id: u128,
    cost: TokenCost,
    priority: Priority,
    wait_ms: u64,
) -> Answer {
    let now = gate.now();
    // Dropped while Redis has the admission (its caller went away), a charge it may have made
    // is taken back: the refund follows it on the same connection.
    let mut attempt = Attempt {
        sh,
        done: false,
        id,
    };
    let tried = try_once(gate, sh, id, cost, false, now).await;
    attempt.done = true;
    match tried {
        Tried::Admitted(r) => return Ok(r),
        Tried::Failed(refusal) => return Err(refusal),
        Tried::NoRoom(retry_after_ms) if wait_ms == 0 => {
            return Err(TokenRefusal::NoRoom { retry_after_ms })
        }
        Tried::NoRoom(_) => {}
    }
    let (tx, rx) = oneshot::channel();
    sh.queue.lock().push(Waiter {
        id,
        cost,
        rank: rank(priority),
        seq: sh.seq.fetch_add(1, Ordering::Relaxed),
        since: now,
        tx,
    });
    sh.wake.notify_one();
    let mut parked = Parked {
        sh,
        id,
        rx,
        armed: true,
    };
    let deadline = now.saturating_add(wait_ms);
    let answer = tokio::select! {
        a = &mut parked.rx => a.ok(),
        () = gate.clock().sleep_until_monotonic(deadline) => None,
    };
    parked.armed = false;
    if let Some(a) = answer {
        return a;
    }
    if parked.leave() {
        return Err(TokenRefusal::Timeout);
    }
    // Admitted as the wait ran out (answers are sent under the queue's lock): take it.
    parked.rx.try_recv().unwrap_or(Err(TokenRefusal::Timeout))
}

/// The first admission attempt of a caller, under way.
struct Attempt<'a> {
    sh: &'a Shared,
    done: bool,
    id: u128,
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.done && !self.sh.take_local(self.id) {
            self.sh.refund(self.id);
        }
    }
}

enum Tried {
    Admitted(Option<u64>),
    NoRoom(Option<u64>),
    Failed(TokenRefusal),
}

/// One admission attempt for `id`, on Redis or (fail open, Redis away) on this node's own.
async fn try_once(
    gate: &TokenGate,
    sh: &Shared,
    id: u128,
    cost: TokenCost,
    holder: bool,
    now: u64,
) -> Tried {
    if !sh.down(now) {
        let settings = sh.settings();
        match sh.ledger.admit(&settings, id, cost, holder).await {
            Ok(SharedAdmit::Admitted(v)) => {
                sh.seen(v);
                return Tried::Admitted(v.remaining);
            }
            Ok(SharedAdmit::Exceeds { estimate, budget }) => {
                return Tried::Failed(TokenRefusal::Exceeds { estimate, budget });
            }
            Ok(SharedAdmit::Refused {
                view,
                retry_after_ms,
            }) => {
                sh.seen(view);
                return Tried::NoRoom(retry_after_ms);
            }
            Err(e) => {
                tracing::debug!(error = %e, "token ledger on redis did not answer");
                if sh.fail_open().is_none() {
                    return Tried::Failed(TokenRefusal::Unavailable {
                        retry_after_ms: sh.ledger.retry_after_ms(),
                    });
                }
                sh.went_down(now);
            }
        }
    }
    // On this node's own: never parked there (the ticker retries).
    match gate.local_admit(id, cost, Priority::Normal) {
        TokenAdmit::Admitted { remaining } => {
            sh.local.lock().insert(id);
            Tried::Admitted(remaining)
        }
        TokenAdmit::Exceeds { estimate, budget } => {
            Tried::Failed(TokenRefusal::Exceeds { estimate, budget })
        }
        TokenAdmit::Refused { retry_after_ms } => Tried::NoRoom(retry_after_ms),
        TokenAdmit::Queued => Tried::NoRoom(None),
    }
}

/// Leaves the queue if the acquire future is dropped while parked; an admission that raced
/// the drop is refunded.
struct Parked<'a> {
    sh: &'a Arc<Shared>,
    id: u128,
    rx: oneshot::Receiver<Answer>,
    armed: bool,
}

impl Parked<'_> {
    /// Takes the waiter out of the queue; `true` iff it was still there (then it lets go of
    /// any hold it had).
    fn leave(&self) -> bool {
        let mut q = self.sh.queue.lock();
        let before = q.len();
        q.retain(|w| w.id != self.id);
        let left = q.len() != before;
        drop(q);
        if left {
            let _ = self.sh.reports.send(TokenReport::Unhold(self.id));
        }
        left
    }
}

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        if !self.armed || self.leave() {
            return;
        }
        if let Ok(Ok(_)) = self.rx.try_recv() {
            if !self.sh.take_local(self.id) {
                self.sh.refund(self.id);
            }
        }
    }
}

/// The ticker of a shared budget's waiters on this node: retries them (the holder alone, if
/// one has waited its hold; else each that may fit, by class then arrival) whenever the
/// budget may have room, and at least every [`HOLD_RENEW_MS`] (which also keeps a hold).
/// Ends when the gate is dropped.
pub(super) async fn ticker(gate: Weak<TokenGate>) {
    loop {
        let Some(g) = gate.upgrade() else { return };
        let Some(sh) = g.shared().cloned() else {
            return;
        };
        let next = round(&g, &sh).await;
        let clock = g.clock().clone();
        drop(g);
        let now = clock.monotonic_ms();
        let until = next.map_or(now.saturating_add(1_000), |t| {
            t.clamp(now.saturating_add(5), now.saturating_add(HOLD_RENEW_MS))
        });
        tokio::select! {
            () = clock.sleep_until_monotonic(until) => {}
            () = sh.wake.notified() => {}
        }
    }
}

/// One pass over the waiters; when to look again (`None`: nobody waits).
async fn round(g: &TokenGate, sh: &Shared) -> Option<u64> {
    let hold_ms = sh.settings().hold_ms;
    let mut order: Vec<(u128, TokenCost, u64)> = {
        let mut q = sh.queue.lock();
        q.sort_by_key(|w| (w.rank, w.seq));
        q.iter().map(|w| (w.id, w.cost, w.since)).collect()
    };
    if order.is_empty() {
        return None;
    }
    let now = g.now();
    let holder = order
        .iter()
        .position(|&(_, _, since)| now.saturating_sub(since) >= hold_ms);
    if let Some(i) = holder {
        // Nothing else of this node moves while the budget is held for it.
        order = vec![order[i]];
    }
    let mut next = order
        .iter()
        .map(|&(_, _, since)| since.saturating_add(hold_ms))
        .filter(|&t| t > now)
        .min();
    let mut room: Option<u64> = None;
    for (id, cost, _) in order {
        if room.is_some_and(|r| cost.total() > r) {
            continue;
        }
        match try_once(g, sh, id, cost, holder.is_some(), g.now()).await {
            Tried::Admitted(remaining) => {
                deliver(sh, id, Ok(remaining));
                room = remaining;
            }
            Tried::NoRoom(retry) => {
                room = sh.view().remaining.or(Some(0));
                let at = retry.map(|r| g.now().saturating_add(r));
                next = [next, at].into_iter().flatten().min();
                if sh.view().held && !sh.down(g.now()) {
                    break;
                }
            }
            Tried::Failed(refusal) => deliver(sh, id, Err(refusal)),
        }
    }
    Some(next.unwrap_or_else(|| g.now().saturating_add(HOLD_RENEW_MS)))
}

/// Hands `answer` to waiter `id` if it still waits; an admission nobody takes is taken back.
fn deliver(sh: &Shared, id: u128, answer: Answer) {
    let mut q = sh.queue.lock();
    let waiter = q.iter().position(|w| w.id == id).map(|i| q.swap_remove(i));
    let delivered = waiter.is_some_and(|w| w.tx.send(answer).is_ok());
    drop(q);
    if !delivered && answer.is_ok() && !sh.take_local(id) {
        sh.refund(id);
    }
}

/// The most reports taken from the queue at once.
const REPORTS_AT_ONCE: usize = 64;

/// Sends this node's reports to the ledger in order, all those at hand in one call. A call
/// that fails drops them, and is not tried again: each loss errs on the safe side (a finish
/// lost leaves its charge at its estimate and in flight until it is taken as ended after a
/// while, a refund lost leaves the estimate charged, an unhold lost lapses, an announcement
/// lost is replaced by the next), while a batch that did reach Redis, sent again, would not
/// count the same (an announcement without its request, replayed after the batch's later
/// finishes, would take them as known to it).
async fn reporter(sh: Weak<Shared>, mut rx: mpsc::UnboundedReceiver<TokenReport>) {
    let mut reports = Vec::with_capacity(REPORTS_AT_ONCE);
    while rx.recv_many(&mut reports, REPORTS_AT_ONCE).await > 0 {
        let Some(sh) = sh.upgrade() else { return };
        let settings = sh.settings();
        // With no budget in force here, most releases were never charged (a lock's releasing
        // node cannot tell): the ledger is asked which were, for all the finishes at hand in
        // one call, and only those are finished. Reports make no charge, so asking before the
        // reports ahead of a finish are sent gives the same answer.
        let uncharged_likely = settings.tpm == 0 && sh.view().source.is_none();
        let charged = if uncharged_likely {
            charged_among(&sh, &reports).await
        } else {
            None
        };
        reports.retain(|r| match r {
            TokenReport::Finish(id, _) => charged.as_ref().is_none_or(|c| c.contains(id)),
            TokenReport::Observe(..) => settings.learn,
            TokenReport::Refund(_) | TokenReport::Unhold(_) => true,
        });
        if !reports.is_empty() {
            match sh.ledger.report(&settings, &reports).await {
                Ok(view) => {
                    sh.seen(view);
                    // Room may have come back for this node's waiters.
                    sh.wake.notify_one();
                }
                Err(e) => {
                    tracing::debug!(error = %e, reports = reports.len(), "token reports to redis dropped");
                }
            }
        }
        reports.clear();
    }
}

/// Which of the finishes among `reports` the ledger holds charges for (`None`: all of them,
/// when asking failed, so that none is lost).
async fn charged_among(sh: &Shared, reports: &[TokenReport]) -> Option<HashSet<u128>> {
    let ids: Vec<u128> = reports
        .iter()
        .filter_map(|r| match r {
            TokenReport::Finish(id, _) => Some(*id),
            _ => None,
        })
        .collect();
    match sh.ledger.charged(&ids).await {
        Ok(found) => Some(
            ids.iter()
                .zip(found)
                .filter_map(|(id, charged)| charged.then_some(*id))
                .collect(),
        ),
        Err(e) => {
            tracing::debug!(error = %e, "could not ask redis which calls were charged");
            None
        }
    }
}
