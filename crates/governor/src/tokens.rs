//! A pool's token budget (SPEC §12, tokens per minute): the rules that admit a request by its
//! estimated cost in tokens, beside the slot and RPM rules of [`crate::Governor`].
//!
//! Two budgets may be in force, and the smaller of what they leave is what remains:
//! - **configured** (`concurrency.tpm`): at most `tpm` tokens admitted in any rolling window
//!   (a minute by default), counted from the charges this budget made;
//! - **announced**: the origin's last word on its token budget (limit, remaining and the time
//!   until it is full again). The origin refills continuously (a token bucket), so what remains
//!   grows linearly from the announced `remaining` to `limit` at the reset. Charges admitted
//!   after the request whose answer carried the announcement are not in it yet, and are taken
//!   off it (in flight or done: the origin counted neither); so are those admitted before it
//!   whose answers had not come back when it was admitted: they may have reached the origin
//!   after it, even if they are done by the time its answer comes back (requests overtake one
//!   another on a busy machine). Only a charge whose answer came back before the request was
//!   admitted is surely in its announcement. The announced figures are taken at their most
//!   cautious: `remaining` as said (the origin rounds it down), the refill as starting when the
//!   answer is seen, not when the origin wrote it, and reaching `limit` at the reset (rounded
//!   up): the model is never ahead of a token bucket that refills linearly.
//!
//! Every admission charges its estimate; when the answer reports its real usage the charge is
//! corrected by the difference ([`TokenBudget::finish`]), which moves what remains either way.
//! A charge whose request never started (refused by the slot gate after this one admitted it)
//! is taken back whole ([`TokenBudget::refund`]).
//!
//! **Split budgets**: an origin that announces its input and output tokens apart (Anthropic's
//! `input-tokens` and `output-tokens`) has three budgets in force at once: the total, and one
//! per part ([`TokenPart`]). A charge's cost is its prompt (input) and its output cap (output)
//! ([`TokenCost`]); it fits when the total fits the total budget and each part fits its own
//! announced one. Each part's announcement is modelled as the total's is, from the charges'
//! part in it. A configured `tpm` limits the total only.
//!
//! Waiting: a waiter that does not fit lets later ones that do fit pass, for at most
//! `hold_ms`; from then on the budget is held for it (the oldest such waiter of the highest
//! class), so neither small nor large requests starve. An estimate larger than the whole budget
//! could never fit and is refused at once ([`TokenAdmit::Exceeds`]).
//!
//! Like the rest of this crate: no IO, no clock reads; `now` is the caller's monotonic ms.

use std::collections::VecDeque;

use crate::Priority;

/// Default length of the configured budget's rolling window.
pub const DEFAULT_TOKEN_WINDOW_MS: u64 = 60_000;
/// How long after an announcement is seen its refill is taken to start. The origin wrote it
/// earlier, but our clock counts whole milliseconds: without this the model could be up to a
/// millisecond's refill ahead of the origin's bucket. With it, the model's line from `remaining`
/// to `limit` starts no earlier and ends no earlier than the origin's, so it never promises a
/// token the origin has not refilled yet.
pub const REFILL_DELAY_MS: u64 = 1;
/// Default longest time a waiter that does not fit lets others pass before the budget is held
/// for it.
pub const DEFAULT_TOKEN_HOLD_MS: u64 = 5_000;

/// The token budget's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenSettings {
    /// Tokens per rolling window; 0 = no configured budget (an announced one may still apply).
    pub tpm: u64,
    /// Length of the configured budget's window.
    pub window_ms: u64,
    /// How long a waiter that does not fit lets later ones pass.
    pub hold_ms: u64,
    /// Learn a budget from the origin's announcements.
    pub learn: bool,
}

impl Default for TokenSettings {
    fn default() -> Self {
        TokenSettings {
            tpm: 0,
            window_ms: DEFAULT_TOKEN_WINDOW_MS,
            hold_ms: DEFAULT_TOKEN_HOLD_MS,
            learn: true,
        }
    }
}

/// A request's cost in tokens: its prompt (input) and its requested output (output). A bare
/// number is a cost whose parts are not known apart: all input.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenCost {
    pub input: u64,
    pub output: u64,
}

impl TokenCost {
    pub fn total(self) -> u64 {
        self.input.saturating_add(self.output)
    }

    fn part(self, part: TokenPart) -> u64 {
        match part {
            TokenPart::Total => self.total(),
            TokenPart::Input => self.input,
            TokenPart::Output => self.output,
        }
    }
}

impl From<u64> for TokenCost {
    fn from(total: u64) -> Self {
        TokenCost {
            input: total,
            output: 0,
        }
    }
}

/// Which budget an announcement is of: the total, or one part of a split budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenPart {
    Total,
    Input,
    Output,
}

const PARTS: [TokenPart; 3] = [TokenPart::Total, TokenPart::Input, TokenPart::Output];

impl TokenPart {
    fn index(self) -> usize {
        match self {
            TokenPart::Total => 0,
            TokenPart::Input => 1,
            TokenPart::Output => 2,
        }
    }
}

/// The usage an answer reported: its total only, or its parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    /// The parts are not known apart: the charge keeps its output estimate as far as the total
    /// allows, the rest is input.
    Total(u64),
    Split(TokenCost),
}

/// What an origin said about its token budget, durations relative to the answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenWindow {
    pub limit: Option<u64>,
    pub remaining: Option<u64>,
    /// Until the budget is full again.
    pub reset_ms: Option<u64>,
}

/// Where the budget in force comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetSource {
    Configured,
    Announced,
    /// Both are in force; the smaller remainder binds.
    Both,
}

impl BudgetSource {
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetSource::Configured => "configured",
            BudgetSource::Announced => "announced",
            BudgetSource::Both => "configured+announced",
        }
    }
}

/// The answer to [`TokenBudget::try_admit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenAdmit {
    /// Charged; `remaining` is what the budget has left after it (none without a budget).
    Admitted { remaining: Option<u64> },
    /// Parked; a later [`TokenBudget::dispatch`] admits it.
    Queued,
    /// The estimate is larger than the whole budget: it can never fit.
    Exceeds { estimate: u64, budget: u64 },
    /// Does not fit and may not wait; `retry_after_ms` when the budget says when it would.
    Refused { retry_after_ms: Option<u64> },
}

/// Live state of the budget, for the pool state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenSnapshot {
    /// The whole budget in force (the smaller of configured and announced limits).
    pub budget: Option<u64>,
    pub remaining: Option<u64>,
    pub source: Option<BudgetSource>,
    pub waiting: u32,
    /// The budget is held for a waiter that has waited its `hold_ms`: nobody else is admitted
    /// until it is.
    pub held: bool,
    /// Tokens charged in total (estimates, corrected by reconciliation).
    pub admitted_tokens: u64,
    /// What the origin's announced input and output budgets have left, when it splits them.
    pub input_remaining: Option<u64>,
    pub output_remaining: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
struct Charge {
    id: u128,
    seq: u64,
    at: u64,
    cost: TokenCost,
    /// When its request ended: the sequence number of the last admission then.
    finished_seq: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
struct Announced {
    limit: Option<u64>,
    remaining: Option<u64>,
    /// When its refill starts: [`REFILL_DELAY_MS`] after the announcement was observed.
    at: u64,
    /// When the budget is full again (`None`: not said).
    full_at: Option<u64>,
    /// Charges with a larger sequence number are not in the announcement.
    basis: u64,
    /// Charges admitted before the answered request whose own answers had not come back when
    /// it was admitted: they may have reached the origin after it, so they are taken off it too
    /// (at their cost when the announcement came).
    in_flight_then: u64,
}

#[derive(Clone, Copy, Debug)]
struct Waiter {
    id: u128,
    cost: TokenCost,
    priority: Priority,
    seq: u64,
    since: u64,
}

/// One pool's token budget. See the module docs.
#[derive(Clone, Debug)]
pub struct TokenBudget {
    settings: TokenSettings,
    /// Charges in admission order (sequence and time non-decreasing).
    ledger: VecDeque<Charge>,
    /// The origin's last announcement of each budget, by [`TokenPart::index`].
    announced: [Option<Announced>; 3],
    waiters: Vec<Waiter>,
    seq: u64,
    clock: u64,
    admitted_tokens: u64,
}

fn rank(p: Priority) -> u8 {
    match p {
        Priority::High => 0,
        Priority::Normal => 1,
        Priority::Low => 2,
    }
}

fn min_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl TokenBudget {
    pub fn new(settings: TokenSettings) -> Self {
        TokenBudget {
            settings,
            ledger: VecDeque::new(),
            announced: [None; 3],
            waiters: Vec::new(),
            seq: 0,
            clock: 0,
            admitted_tokens: 0,
        }
    }

    pub fn settings(&self) -> &TokenSettings {
        &self.settings
    }

    /// New settings; charges and waiters stay. The caller then drains [`TokenBudget::dispatch`].
    pub fn reconfigure(&mut self, settings: TokenSettings) {
        if !settings.learn {
            self.announced = [None; 3];
        }
        self.settings = settings;
    }

    /// Whether any budget is in force at `now` (a configured one, or an announcement).
    pub fn active(&self, now: u64) -> bool {
        let now = self.at(now);
        self.settings.tpm > 0
            || PARTS
                .iter()
                .any(|&p| self.announced_remaining(p, now).is_some())
    }

    /// The whole budget: the smaller of the configured and the announced limit.
    pub fn budget(&self, now: u64) -> Option<u64> {
        let now = self.at(now);
        let configured = Some(self.settings.tpm).filter(|&t| t > 0);
        min_opt(configured, self.announced_limit(TokenPart::Total, now))
    }

    /// The whole announced budget of `part`, while its announcement is in force.
    fn announced_limit(&self, part: TokenPart, now: u64) -> Option<u64> {
        self.announced[part.index()]
            .filter(|_| self.announced_remaining(part, now).is_some())
            .and_then(|a| a.limit)
    }

    /// What the announced budget of one part of a split budget has left at `now`.
    pub fn part_remaining(&self, part: TokenPart, now: u64) -> Option<u64> {
        self.announced_remaining(part, self.at(now))
    }

    /// What remains to admit at `now`, if any budget is in force.
    pub fn remaining(&self, now: u64) -> Option<u64> {
        let now = self.at(now);
        min_opt(
            self.configured_remaining(now),
            self.announced_remaining(TokenPart::Total, now),
        )
    }

    pub fn source(&self, now: u64) -> Option<BudgetSource> {
        let now = self.at(now);
        let announced = PARTS
            .iter()
            .any(|&p| self.announced_remaining(p, now).is_some());
        match (self.settings.tpm > 0, announced) {
            (true, true) => Some(BudgetSource::Both),
            (true, false) => Some(BudgetSource::Configured),
            (false, true) => Some(BudgetSource::Announced),
            (false, false) => None,
        }
    }

    /// Admits `id` at a cost of `cost` tokens now if it fits and no waiter holds the budget;
    /// parks it when `may_wait`; otherwise refuses.
    pub fn try_admit(
        &mut self,
        now: u64,
        id: u128,
        cost: impl Into<TokenCost>,
        priority: Priority,
        may_wait: bool,
    ) -> TokenAdmit {
        let now = self.tick(now);
        let cost = cost.into();
        if let Some(exceeds) = self.exceeds(now, cost) {
            return exceeds;
        }
        if self.holder(now).is_none() && self.fits(now, cost) {
            return TokenAdmit::Admitted {
                remaining: self.charge(now, id, cost),
            };
        }
        if may_wait {
            self.seq += 1;
            self.waiters.push(Waiter {
                id,
                cost,
                priority,
                seq: self.seq,
                since: now,
            });
            return TokenAdmit::Queued;
        }
        TokenAdmit::Refused {
            retry_after_ms: self.fits_at(now, cost).map(|t| t.saturating_sub(now)),
        }
    }

    /// Admits the next waiter that may go: the holder if one holds the budget, else the first
    /// (by class, then arrival) that fits. Call until `None`.
    pub fn dispatch(&mut self, now: u64) -> Option<(u128, Option<u64>)> {
        let now = self.tick(now);
        let pick = match self.holder(now) {
            Some(i) => Some(i).filter(|&i| self.fits(now, self.waiters[i].cost)),
            None => self
                .order()
                .into_iter()
                .find(|&i| self.fits(now, self.waiters[i].cost)),
        }?;
        let w = self.waiters.remove(pick);
        Some((w.id, self.charge(now, w.id, w.cost)))
    }

    /// Removes a waiter; `true` iff it was waiting.
    pub fn cancel(&mut self, id: u128) -> bool {
        let before = self.waiters.len();
        self.waiters.retain(|w| w.id != id);
        self.waiters.len() != before
    }

    pub fn is_waiting(&self, id: u128) -> bool {
        self.waiters.iter().any(|w| w.id == id)
    }

    /// Takes a charge back whole: its request never reached the origin.
    pub fn refund(&mut self, id: u128) -> bool {
        let Some(i) = self.ledger.iter().rposition(|c| c.id == id) else {
            return false;
        };
        if let Some(c) = self.ledger.remove(i) {
            self.admitted_tokens = self.admitted_tokens.saturating_sub(c.cost.total());
        }
        true
    }

    /// The request of charge `id` ended; `actual` is the usage its answer reported, if any,
    /// which corrects the charge by the difference. Returns the correction (actual - estimate).
    pub fn finish(&mut self, now: u64, id: u128, actual: Option<u64>) -> Option<i64> {
        self.finish_usage(now, id, actual.map(Usage::Total))
    }

    /// [`TokenBudget::finish`] with the usage's parts when the answer reported them apart.
    pub fn finish_usage(&mut self, now: u64, id: u128, actual: Option<Usage>) -> Option<i64> {
        self.tick(now);
        let seq = self.seq;
        let c = self.ledger.iter_mut().rev().find(|c| c.id == id)?;
        c.finished_seq.get_or_insert(seq);
        let actual = match actual? {
            Usage::Split(cost) => cost,
            Usage::Total(total) => {
                let output = c.cost.output.min(total);
                TokenCost {
                    input: total - output,
                    output,
                }
            }
        };
        let (was, now_total) = (c.cost.total(), actual.total());
        let delta =
            i64::try_from(now_total).unwrap_or(i64::MAX) - i64::try_from(was).unwrap_or(i64::MAX);
        self.admitted_tokens = self
            .admitted_tokens
            .saturating_sub(was)
            .saturating_add(now_total);
        c.cost = actual;
        Some(delta)
    }

    /// An announcement of the origin's token budget, carried by the answer to the request of
    /// charge `id` (when known): charges admitted after that one are not in it. Without `id`
    /// (a lock holder's report), every charge still in flight is taken to be missing from it.
    /// An announcement older than the one in force (an answer overtaken by a later request's)
    /// is ignored.
    pub fn observe(&mut self, now: u64, id: Option<u128>, window: TokenWindow) {
        self.observe_part(now, id, TokenPart::Total, window);
    }

    /// [`TokenBudget::observe`] of one budget of an origin that splits them.
    pub fn observe_part(
        &mut self,
        now: u64,
        id: Option<u128>,
        part: TokenPart,
        window: TokenWindow,
    ) {
        let now = self.tick(now);
        if !self.settings.learn || (window.remaining.is_none() && window.limit.is_none()) {
            return;
        }
        let answered = id.and_then(|id| self.ledger.iter().rev().find(|c| c.id == id));
        let basis = answered.map_or(self.seq, |c| c.seq);
        // A charge whose answer came back before this one was admitted is surely in the
        // announcement; any other may have reached the origin after it. Without the request,
        // the charges still in flight now.
        let settled_before = answered.map_or(self.seq.saturating_add(1), |c| c.seq);
        let in_flight_then = self
            .ledger
            .iter()
            .filter(|c| {
                c.seq <= basis
                    && Some(c.id) != id
                    && c.finished_seq.is_none_or(|f| f >= settled_before)
            })
            .map(|c| c.cost.part(part))
            .fold(0, u64::saturating_add);
        let slot = &mut self.announced[part.index()];
        if slot.is_some_and(|a| a.basis > basis) {
            return;
        }
        let at = now.saturating_add(REFILL_DELAY_MS);
        *slot = Some(Announced {
            limit: window.limit,
            remaining: window.remaining,
            at,
            full_at: window.reset_ms.map(|r| at.saturating_add(r)),
            basis,
            in_flight_then,
        });
        self.prune(now);
    }

    /// When something may change for the waiters without a call: a waiter's hold starts, or
    /// the budget refills enough for one of them. `None` without waiters.
    pub fn next_wakeup(&self, now: u64) -> Option<u64> {
        let now = self.at(now);
        if self.waiters.is_empty() {
            return None;
        }
        if let Some(i) = self.holder(now) {
            // Nothing else moves while the budget is held.
            return self.fits_at(now, self.waiters[i].cost);
        }
        let fits = self
            .waiters
            .iter()
            .filter_map(|w| self.fits_at(now, w.cost))
            .min();
        let holds = self
            .waiters
            .iter()
            .map(|w| w.since.saturating_add(self.settings.hold_ms))
            .filter(|&t| t > now)
            .min();
        min_opt(fits, holds)
    }

    pub fn snapshot(&self, now: u64) -> TokenSnapshot {
        let now = self.at(now);
        TokenSnapshot {
            budget: self.budget(now),
            remaining: self.remaining(now),
            source: self.source(now),
            waiting: u32::try_from(self.waiters.len()).unwrap_or(u32::MAX),
            held: self.holder(now).is_some(),
            admitted_tokens: self.admitted_tokens,
            input_remaining: self.announced_remaining(TokenPart::Input, now),
            output_remaining: self.announced_remaining(TokenPart::Output, now),
        }
    }

    // ---- internals ----

    fn tick(&mut self, now: u64) -> u64 {
        self.clock = self.clock.max(now);
        self.clock
    }

    fn at(&self, now: u64) -> u64 {
        self.clock.max(now)
    }

    fn fits(&self, now: u64, cost: TokenCost) -> bool {
        self.remaining(now).is_none_or(|r| cost.total() <= r)
            && [TokenPart::Input, TokenPart::Output].iter().all(|&p| {
                self.announced_remaining(p, now)
                    .is_none_or(|r| cost.part(p) <= r)
            })
    }

    /// The refusal of a cost larger than a whole budget (the total, or a part's): it could
    /// never fit.
    fn exceeds(&self, now: u64, cost: TokenCost) -> Option<TokenAdmit> {
        let whole = [
            (cost.total(), self.budget(now)),
            (cost.input, self.announced_limit(TokenPart::Input, now)),
            (cost.output, self.announced_limit(TokenPart::Output, now)),
        ];
        whole.into_iter().find_map(|(estimate, budget)| {
            let budget = budget?;
            (estimate > budget).then_some(TokenAdmit::Exceeds { estimate, budget })
        })
    }

    /// Waiter indices by class, then arrival.
    fn order(&self) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.waiters.len()).collect();
        idx.sort_by_key(|&i| (rank(self.waiters[i].priority), self.waiters[i].seq));
        idx
    }

    /// The waiter the budget is held for: the first (by class, then arrival) that has waited
    /// `hold_ms`.
    fn holder(&self, now: u64) -> Option<usize> {
        self.order()
            .into_iter()
            .find(|&i| now.saturating_sub(self.waiters[i].since) >= self.settings.hold_ms)
    }

    fn charge(&mut self, now: u64, id: u128, cost: TokenCost) -> Option<u64> {
        self.seq += 1;
        self.ledger.push_back(Charge {
            id,
            seq: self.seq,
            at: now,
            cost,
            finished_seq: None,
        });
        self.admitted_tokens = self.admitted_tokens.saturating_add(cost.total());
        self.prune(now);
        self.remaining(now)
    }

    /// Drops charges that neither budget counts any more: out of the window, and answered
    /// before the request of the announcement in force was admitted (so in it, and in any
    /// later one), or, without an announcement, answered.
    fn prune(&mut self, now: u64) {
        let window = self.settings.window_ms;
        // The oldest announcement in force decides: a charge it does not know must stay.
        let basis = self.announced.iter().flatten().map(|a| a.basis).min();
        while let Some(c) = self.ledger.front() {
            let out_of_window = c.at.saturating_add(window) <= now;
            let settled = c.finished_seq.is_some_and(|f| basis.is_none_or(|b| f < b));
            if out_of_window && settled {
                self.ledger.pop_front();
            } else {
                break;
            }
        }
    }

    fn spent_in_window(&self, now: u64) -> u64 {
        let window = self.settings.window_ms;
        self.ledger
            .iter()
            .filter(|c| c.at.saturating_add(window) > now)
            .map(|c| c.cost.total())
            .fold(0, u64::saturating_add)
    }

    fn spent_after(&self, part: TokenPart, basis: u64) -> u64 {
        self.ledger
            .iter()
            .filter(|c| c.seq > basis)
            .map(|c| c.cost.part(part))
            .fold(0, u64::saturating_add)
    }

    fn configured_remaining(&self, now: u64) -> Option<u64> {
        let tpm = Some(self.settings.tpm).filter(|&t| t > 0)?;
        Some(tpm.saturating_sub(self.spent_in_window(now)))
    }

    /// The announced budget's level at `now` before the charges it does not know: `remaining`
    /// refilling linearly to `limit` at the reset. `None` once it says nothing any more (past
    /// its reset without a limit, or a window after it without a reset).
    fn announced_level(&self, part: TokenPart, now: u64) -> Option<u64> {
        let a = self.announced[part.index()]?;
        match (a.remaining, a.limit, a.full_at) {
            (Some(r), Some(limit), Some(full_at)) if full_at > a.at && limit > r => {
                if now >= full_at {
                    return Some(limit);
                }
                let span = u128::from(full_at - a.at);
                let gained = u128::from(limit - r) * u128::from(now.saturating_sub(a.at)) / span;
                Some(r.saturating_add(u64::try_from(gained).unwrap_or(u64::MAX)))
            }
            (Some(r), limit, Some(full_at)) => {
                if now < full_at {
                    Some(r)
                } else {
                    limit
                }
            }
            (Some(r), limit, None) => {
                if now < a.at.saturating_add(self.settings.window_ms) {
                    Some(r)
                } else {
                    limit
                }
            }
            (None, limit, _) => limit,
        }
    }

    fn announced_remaining(&self, part: TokenPart, now: u64) -> Option<u64> {
        let a = self.announced[part.index()]?;
        let level = self.announced_level(part, now)?;
        let unknown = self
            .spent_after(part, a.basis)
            .saturating_add(a.in_flight_then);
        Some(level.saturating_sub(unknown))
    }

    /// The earliest time `cost` fits, if the budget alone will ever let it (a charge leaves the
    /// window, or the announced budget refills); `Some(now)` if it fits now.
    fn fits_at(&self, now: u64, cost: TokenCost) -> Option<u64> {
        if self.fits(now, cost) {
            return Some(now);
        }
        let mut at = now.saturating_add(1);
        for part in PARTS {
            let need = cost.part(part);
            let fits = match self.announced[part.index()] {
                None => Some(now),
                Some(_)
                    if self
                        .announced_remaining(part, now)
                        .is_none_or(|r| r >= need) =>
                {
                    Some(now)
                }
                Some(a) => self.announced_fits_at(now, part, a, need),
            };
            at = at.max(fits?);
        }
        Some(at.max(self.configured_fits_at(now, cost.total())?))
    }

    /// When the configured budget alone lets `cost` in, if ever.
    fn configured_fits_at(&self, now: u64, cost: u64) -> Option<u64> {
        match Some(self.settings.tpm).filter(|&t| t > 0) {
            None => Some(now),
            Some(tpm) if cost > tpm => None,
            Some(tpm) => {
                // Walk the window's charges oldest first until enough have left.
                let window = self.settings.window_ms;
                let mut spent = self.spent_in_window(now);
                let mut at = Some(now);
                for c in self.ledger.iter().filter(|c| c.at + window > now) {
                    if tpm.saturating_sub(spent) >= cost {
                        break;
                    }
                    spent = spent.saturating_sub(c.cost.total());
                    at = Some(c.at.saturating_add(window));
                }
                at.filter(|_| tpm.saturating_sub(spent) >= cost)
            }
        }
    }

    fn announced_fits_at(&self, now: u64, part: TokenPart, a: Announced, cost: u64) -> Option<u64> {
        let need = cost
            .saturating_add(self.spent_after(part, a.basis))
            .saturating_add(a.in_flight_then);
        let full_at = a
            .full_at
            .unwrap_or(a.at.saturating_add(self.settings.window_ms));
        match (a.remaining, a.limit) {
            (Some(r), Some(limit)) if limit > r && full_at > a.at => {
                if need > limit {
                    // Only charges leaving (a new announcement) can make room.
                    return None;
                }
                let span = u128::from(full_at - a.at);
                let want = u128::from(need.saturating_sub(r)) * span;
                let dt = want.div_ceil(u128::from(limit - r));
                Some(a.at.saturating_add(u64::try_from(dt).unwrap_or(u64::MAX)))
            }
            _ => Some(full_at.max(now.saturating_add(1))),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn budget(tpm: u64) -> TokenBudget {
        TokenBudget::new(TokenSettings {
            tpm,
            window_ms: 60_000,
            hold_ms: 1_000,
            learn: true,
        })
    }

    fn admit(b: &mut TokenBudget, now: u64, id: u128, cost: impl Into<TokenCost>) -> TokenAdmit {
        b.try_admit(now, id, cost, Priority::Normal, true)
    }

    #[test]
    fn without_a_budget_everything_passes() {
        let mut b = budget(0);
        assert!(!b.active(0));
        assert_eq!(
            admit(&mut b, 0, 1, 1_000_000),
            TokenAdmit::Admitted { remaining: None }
        );
    }

    #[test]
    fn configured_budget_rolls_with_its_window() {
        let mut b = budget(100);
        assert_eq!(
            admit(&mut b, 0, 1, 60),
            TokenAdmit::Admitted {
                remaining: Some(40)
            }
        );
        assert_eq!(admit(&mut b, 10, 2, 50), TokenAdmit::Queued);
        // Its hold starts first, then the window lets it in.
        assert_eq!(b.next_wakeup(10), Some(1_010));
        assert_eq!(b.next_wakeup(1_010), Some(60_000));
        assert_eq!(b.dispatch(59_999), None);
        assert_eq!(b.dispatch(60_000), Some((2, Some(50))));
        assert_eq!(b.snapshot(60_000).source, Some(BudgetSource::Configured));
    }

    #[test]
    fn larger_than_the_whole_budget_is_refused_at_once() {
        let mut b = budget(100);
        assert_eq!(
            admit(&mut b, 0, 1, 101),
            TokenAdmit::Exceeds {
                estimate: 101,
                budget: 100
            }
        );
        assert_eq!(b.snapshot(0).waiting, 0);
    }

    #[test]
    fn fail_fast_gets_a_retry_hint() {
        let mut b = budget(100);
        admit(&mut b, 0, 1, 100);
        assert_eq!(
            b.try_admit(5, 2, 10, Priority::Normal, false),
            TokenAdmit::Refused {
                retry_after_ms: Some(59_995)
            }
        );
    }

    #[test]
    fn reconciliation_moves_the_budget_both_ways() {
        let mut b = budget(1_000);
        admit(&mut b, 0, 1, 400);
        assert_eq!(b.remaining(0), Some(600));
        assert_eq!(b.finish(1, 1, Some(100)), Some(-300));
        assert_eq!(b.remaining(1), Some(900));
        admit(&mut b, 2, 2, 100);
        assert_eq!(b.finish(3, 2, Some(500)), Some(400));
        assert_eq!(b.remaining(3), Some(400));
        // Without a usage report the estimate stands.
        admit(&mut b, 4, 3, 50);
        assert_eq!(b.finish(5, 3, None), None);
        assert_eq!(b.remaining(5), Some(350));
        assert!(b.refund(3));
        assert_eq!(b.remaining(5), Some(400));
    }

    #[test]
    fn a_waiter_that_does_not_fit_lets_small_ones_pass_until_its_hold() {
        let mut b = budget(100);
        admit(&mut b, 0, 1, 50);
        assert_eq!(admit(&mut b, 1, 2, 80), TokenAdmit::Queued);
        // Small ones pass while the large one has waited less than its hold.
        assert!(matches!(
            admit(&mut b, 2, 3, 20),
            TokenAdmit::Admitted { .. }
        ));
        assert_eq!(b.next_wakeup(2), Some(1_001));
        // From its hold on, the budget is kept for it.
        assert_eq!(admit(&mut b, 1_001, 4, 10), TokenAdmit::Queued);
        assert_eq!(b.dispatch(1_001), None);
        // It goes first once enough has left the window, then the small one.
        assert_eq!(b.next_wakeup(1_001), Some(60_000));
        assert_eq!(b.dispatch(60_000), Some((2, Some(0))));
        assert_eq!(b.dispatch(60_000), None);
        assert_eq!(b.dispatch(60_002), Some((4, Some(10))));
    }

    #[test]
    fn higher_classes_are_served_first() {
        let mut b = budget(100);
        admit(&mut b, 0, 1, 100);
        b.try_admit(1, 2, 10, Priority::Low, true);
        b.try_admit(2, 3, 10, Priority::High, true);
        assert_eq!(b.dispatch(60_000).map(|d| d.0), Some(3));
        assert_eq!(b.dispatch(60_000).map(|d| d.0), Some(2));
        assert!(!b.cancel(2));
    }

    #[test]
    fn announced_budget_less_what_was_admitted_after_it() {
        let mut b = budget(0);
        admit(&mut b, 0, 1, 10);
        admit(&mut b, 0, 2, 30);
        // The answer to request 1: 100 left of 1000, full in 60 s; request 2 is not in it.
        b.observe(
            10,
            Some(1),
            TokenWindow {
                limit: Some(1_000),
                remaining: Some(100),
                reset_ms: Some(60_000),
            },
        );
        assert!(b.active(10));
        assert_eq!(b.budget(10), Some(1_000));
        assert_eq!(b.remaining(10), Some(70));
        assert_eq!(b.source(10), Some(BudgetSource::Announced));
        // It refills linearly, from a millisecond after it was seen: 900 over 60 s is 15 per
        // second.
        assert_eq!(b.remaining(2_011), Some(100));
        // A waiter of 100 fits once 30 more have refilled.
        assert_eq!(admit(&mut b, 10, 3, 100), TokenAdmit::Queued);
        assert_eq!(b.next_wakeup(10), Some(1_010));
        assert_eq!(b.next_wakeup(1_010), Some(11 + 2_000));
        assert_eq!(b.dispatch(2_010), None);
        assert_eq!(b.dispatch(2_011), Some((3, Some(0))));
        // Reconciling a charge the announcement does not know moves it.
        let before = b.remaining(2_011).unwrap_or(0);
        b.finish(2_011, 3, Some(40));
        assert_eq!(b.remaining(2_011), Some(before + 60));
        // An older answer does not overwrite a newer one.
        let w = |remaining| TokenWindow {
            limit: Some(1_000),
            remaining: Some(remaining),
            reset_ms: Some(60_000),
        };
        b.observe(2_012, Some(3), w(50));
        b.observe(2_012, Some(1), w(1_000));
        // (Requests 1 and 2, admitted before 3 and still in flight, may have reached the
        // origin after it: they are taken off too.)
        assert_eq!(b.remaining(2_012), Some(50 - 10 - 30));
    }

    #[test]
    fn a_request_that_overtook_an_earlier_one_does_not_forget_it() {
        let w = |remaining| TokenWindow {
            limit: Some(3_000),
            remaining: Some(remaining),
            reset_ms: Some(60_000),
        };
        let mut b = budget(0);
        admit(&mut b, 0, 1, 10);
        b.observe(0, Some(1), w(2_990));
        b.finish(0, 1, Some(10));
        // A, then X, each 1000: X reaches the origin first (2990 -> 1990), then A (-> 990).
        admit(&mut b, 0, 2, 1_000);
        admit(&mut b, 0, 3, 1_000);
        // A's answer comes back first and is relayed to its caller before X's is seen.
        b.observe(0, Some(2), w(990));
        b.finish(0, 2, Some(1_000));
        // X's announcement does not know A, which was still on its way when X was admitted.
        b.observe(0, Some(3), w(1_990));
        assert_eq!(b.remaining(0), Some(990));
        assert_eq!(
            b.try_admit(0, 4, 1_500, Priority::Normal, false),
            TokenAdmit::Refused {
                retry_after_ms: Some(30_299)
            }
        );
        // A charge answered before X was admitted is in X's announcement: not taken off again.
        b.finish(0, 3, Some(1_000));
        admit(&mut b, 0, 5, 100);
        b.observe(0, Some(5), w(890));
        assert_eq!(b.remaining(0), Some(890));
    }

    #[test]
    fn an_announcement_without_the_request_counts_what_is_in_flight() {
        let mut b = budget(0);
        admit(&mut b, 0, 1, 10);
        admit(&mut b, 0, 2, 30);
        b.finish(1, 1, None);
        b.observe(
            1,
            None,
            TokenWindow {
                limit: Some(100),
                remaining: Some(100),
                reset_ms: Some(1_000),
            },
        );
        assert_eq!(b.remaining(1), Some(70));
    }

    #[test]
    fn the_smaller_budget_binds() {
        let mut b = budget(500);
        b.observe(
            0,
            None,
            TokenWindow {
                limit: Some(200),
                remaining: Some(150),
                reset_ms: Some(60_000),
            },
        );
        assert_eq!(b.budget(0), Some(200));
        assert_eq!(b.remaining(0), Some(150));
        assert_eq!(b.source(0), Some(BudgetSource::Both));
        assert!(matches!(
            admit(&mut b, 0, 1, 300),
            TokenAdmit::Exceeds { budget: 200, .. }
        ));
    }

    #[test]
    fn split_budgets_admit_each_part_against_its_own() {
        let w = |limit, remaining| TokenWindow {
            limit: Some(limit),
            remaining: Some(remaining),
            reset_ms: Some(60_000),
        };
        let cost = |input, output| TokenCost { input, output };
        let mut b = budget(0);
        // Anthropic: 10 000 tokens in all, 8 000 input and 1 000 output.
        b.observe_part(0, None, TokenPart::Total, w(10_000, 10_000));
        b.observe_part(0, None, TokenPart::Input, w(8_000, 8_000));
        b.observe_part(0, None, TokenPart::Output, w(1_000, 1_000));
        assert_eq!(b.source(0), Some(BudgetSource::Announced));
        // An output cap larger than the whole output budget could never fit.
        assert_eq!(
            admit(&mut b, 0, 1, cost(10, 1_500)),
            TokenAdmit::Exceeds {
                estimate: 1_500,
                budget: 1_000
            }
        );
        assert_eq!(
            admit(&mut b, 0, 2, cost(1_000, 800)),
            TokenAdmit::Admitted {
                remaining: Some(8_200)
            }
        );
        let s = b.snapshot(0);
        assert_eq!(
            (s.input_remaining, s.output_remaining),
            (Some(7_000), Some(200))
        );
        // The total and the input have room for this one; the output does not.
        assert!(matches!(
            b.try_admit(0, 3, cost(100, 300), Priority::Normal, false),
            TokenAdmit::Refused { .. }
        ));
        // A prompt-heavy one the output has room for passes.
        assert!(matches!(
            admit(&mut b, 0, 4, cost(6_000, 100)),
            TokenAdmit::Admitted { .. }
        ));
        // Its input is now what binds the next.
        assert!(matches!(
            b.try_admit(0, 5, cost(1_500, 10), Priority::Normal, false),
            TokenAdmit::Refused { .. }
        ));
        // The first used 900 input and 50 output: its output comes back to the output budget.
        b.finish_usage(1, 2, Some(Usage::Split(cost(900, 50))));
        assert_eq!(b.part_remaining(TokenPart::Output, 1), Some(850));
        assert_eq!(b.part_remaining(TokenPart::Input, 1), Some(1_100));
        // A usage without its parts keeps the output estimate as far as it goes.
        b.finish_usage(1, 4, Some(Usage::Total(6_050)));
        assert_eq!(b.part_remaining(TokenPart::Output, 1), Some(850));
        assert_eq!(b.part_remaining(TokenPart::Input, 1), Some(1_150));
        assert_eq!(b.snapshot(1).admitted_tokens, 950 + 6_050);
    }

    #[test]
    fn learning_off_ignores_announcements() {
        let mut b = TokenBudget::new(TokenSettings {
            learn: false,
            ..TokenSettings::default()
        });
        b.observe(
            0,
            None,
            TokenWindow {
                limit: Some(1),
                remaining: Some(0),
                reset_ms: Some(1_000),
            },
        );
        assert!(!b.active(0));
    }
}
