//! Adaptive learning: what the upstream's answers teach us about its real limits.
//!
//! Owns the learned concurrency limit, the mirrored request budget, the learned request pace
//! (shown as the learned RPM), the admission pause and the record of the last throttle. Its interface is deliberately small —
//! [`Adaptive::observe`] in, a few getters out — so the learning rules can be refined without
//! touching admission. It never admits, queues or frees anything; the [`crate::Governor`] reads
//! the effective limit, the pace and the pause from here and applies them.
//!
//! # The control law
//!
//! **Which limit a throttle blames.** A throttle is status 429, `throttled > 0`, or 503 with a
//! retry hint. If the same answer reports a spent budget (`remaining = 0` for requests or
//! tokens), the origin's *rate* budget refused us and the concurrency limit is innocent.
//! Otherwise the throttle is blamed on concurrency.
//!
//! **One reaction per overshoot.** Requests admitted together get refused together. Only a
//! throttle of a request admitted *after* the last decrease is new evidence (TCP's "one
//! reduction per window"); for reports not tied to a held slot, a throttle within the pause it
//! caused (at least [`DEFAULT_PAUSE_MS`]) belongs to the same burst. Every throttle still
//! pauses admission for its hint ([`DEFAULT_PAUSE_MS`] without one, at most the pool's
//! `max_pause_ms`, which also caps the slowest pace and a spent budget's pause).
//!
//! **Concurrency: decrease.** A concurrency throttle at effective limit `e`: if a lower level
//! `good` is known to work (a whole window of successes ran at it), step back to `good` — the
//! overshoot was our own probe. Otherwise halve `e` (multiplicative decrease, floor `min_limit`)
//! and forget `good`: the origin got tighter and old knowledge is void. Either way `e` becomes
//! the `ceiling`, a level not retried too soon (see below).
//!
//! **Concurrency: increase.** A success counts only if the limit bound while the request ran
//! (every slot was taken at some point): successes at low concurrency prove nothing about
//! higher ones, and a limit nobody reaches must not creep up unchecked.
//! After `e` counted successes (one window), `e` is a `good` level, and the limit grows: by half
//! the gap to `ceiling - 1` while below it (a fast return to the last level that worked), by one
//! above it (additive probing), and to `ceiling` itself only once [`PROBE_AFTER_MS`] and
//! [`PROBE_AFTER_SUCCESSES`] counted successes have passed since the throttle. In a steady
//! overload that costs about one throttle per probe, under 1 % of the traffic.
//!
//! **Rate.** An announced budget is there to be spent (SPEC §3): a pool never holds a caller
//! back while the origin's budget has room. When an answer announces `remaining` with its
//! `reset`, the pool *mirrors* that budget: its estimate is `remaining`, less the admissions
//! after the observed request's own (they may have reached the origin after it counted), less
//! every admission since. While the estimate is above a margin ([`BUDGET_MARGIN_PERMILLE`] of
//! the announced limit, at least one request: for other consumers of a shared budget) nothing
//! paces admission; once it reaches the margin, admission waits until the announced reset
//! (capped at `max_pause_ms`). Every fresh announcement re-bases the estimate, so a rolling
//! window that lets requests age out, a re-announced window and a budget other consumers
//! spend are all followed answer by answer. After a spent budget's reset, before an answer
//! says how much came back, the sustainable pace (`limit` per window, when the window length
//! is known: a rolling window frees its budget gradually) rules; without a window (a fixed
//! window refills whole) nothing does. An origin that announces `limit` per window but no
//! `remaining` with a `reset` gets that pace (a minimum spacing between admissions at
//! [`RATE_MARGIN_PERMILLE`] of the announced rate, shown as the learned RPM, also enforced as
//! an RPM gate). A spent budget (`remaining = 0`) also pauses admission until its reset,
//! throttle or not; a rate-blamed throttle only pauses, since the next announcement re-bases
//! anyway. A learner whose admissions happen elsewhere (the Redis gate) counts none: its
//! estimate is what the last answer announced.
//!
//! **Decay.** Learned values return towards the configuration when the origin stops
//! complaining. While the limit binds, probing does that (a successful probe clears the ceiling
//! and growth resumes). While it does not bind — another limit such as the pace holds traffic
//! below it, or the pool is idle — nothing tests it, so after [`QUIET_MS`] without a concurrency
//! throttle or a binding moment, and every [`QUIET_MS`] after that, the learned limit closes
//! half its gap to the configured limit and the ceiling is forgotten; an overshoot later steps
//! straight back to the last good level. An announced pace or budget lapses after
//! [`RATE_STALE_MS`] without a fresh announcement. Decay is a pure function of time (the getters take `now`), so
//! admission sees it without any call; it is written back on the next observation.
//!
//! Never below `min_limit`, never above `limit`: every learned value is clamped on the way in
//! and the effective limit is clamped on the way out.

use crate::{Outcome, PoolSettings, RateInfo, Throttle};

/// Pause after a throttle that carried no retry hint, and the shortest spacing between two
/// decreases for reports not tied to a slot (so a burst of 429s with `Retry-After: 0` still
/// decreases only once).
pub(crate) const DEFAULT_PAUSE_MS: u64 = 1_000;

/// How long a concurrency level that drew a throttle is not retried. Each probe of a level the
/// origin refuses costs about one throttle and one pause, so this bounds that waste to one per
/// half minute, while a raised origin limit is still found within a minute or so.
pub(crate) const PROBE_AFTER_MS: u64 = 30_000;

/// ... and at least this many counted successes since the throttle: each probe of a level the
/// origin still refuses costs about one 429, so this keeps probing under 1 % of the traffic
/// even when answers are slow (an LLM taking ten seconds makes only a few requests a minute).
pub(crate) const PROBE_AFTER_SUCCESSES: u32 = 100;

/// A quiet period after which the learned limit decays one step towards the configuration.
/// Quiet means no concurrency throttle *and* the limit never bound (while it binds and holds,
/// the calm is our own doing; probing tests the origin instead). Two minutes: long enough to
/// span many requests of a busy pool, short enough that an idle-then-busy pool does not run on
/// hour-old knowledge.
pub(crate) const QUIET_MS: u64 = 120_000;

/// An announced pace or budget not repeated for this long lapses: the answers that carried it stopped
/// (the origin stopped announcing, or the pool went idle), and stale figures must not bind.
pub(crate) const RATE_STALE_MS: u64 = 120_000;

/// Share of an announced rate the pace uses, in per mille (the pace binds only without a
/// mirrored budget). The last few percent buy nothing but 429s: admission-to-arrival jitter and
/// a burst before the first announcement would otherwise push a rolling window over its limit
/// now and then.
pub(crate) const RATE_MARGIN_PERMILLE: u64 = 970;

/// Share of an announced request limit (in per mille, at least one request) a mirrored budget
/// keeps back: for other consumers of a shared budget and for an answer the origin wrote before
/// it counted a request we had already sent. Spent only at the end of a fixed window; a rolling
/// window carries it along unspent.
pub(crate) const BUDGET_MARGIN_PERMILLE: u64 = 10;

/// A pace change smaller than this share (per mille) of the last one reported is not worth a
/// log line; announcements jitter with every answer.
const RPM_NOTE_PERMILLE: u64 = 100;

const PER_MILLE: u64 = 1_000;

/// The configured range the learned limit lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) limit: u32,
    /// Already clamped to `limit`.
    pub(crate) min_limit: u32,
    /// Longest pause any single report can impose, and the slowest pace
    /// (`PoolSettings::max_pause_ms`).
    pub(crate) max_pause_ms: u64,
}

impl Bounds {
    pub(crate) fn of(settings: &PoolSettings) -> Self {
        Bounds {
            limit: settings.limit,
            min_limit: settings.min_limit.min(settings.limit),
            max_pause_ms: settings.max_pause_ms,
        }
    }

    fn clamp(self, value: u32) -> u32 {
        value.min(self.limit).max(self.min_limit)
    }
}

/// What the governor knows about the observed request beyond its outcome.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Context {
    /// The concurrency limit bound while the observed request ran (every slot was taken at some
    /// point): only then does its success say anything about the limit.
    pub(crate) limited: bool,
    /// When the observed request was admitted, if it is known (it still holds its slot).
    pub(crate) admitted_at: Option<u64>,
    /// The admission count ([`Adaptive::admitted`]) right after the observed request's own
    /// admission, if known: the admissions after it may not be in the budget it announces.
    pub(crate) admitted_seq: Option<u64>,
}

/// Where an announced pace came from, kept as numbers so the hot path formats nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Basis {
    PerWindow { limit: u64, window_ms: u64 },
}

impl std::fmt::Display for Basis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Basis::PerWindow { limit, window_ms } => {
                write!(f, "{limit} requests per {window_ms}ms")
            }
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Pace {
    /// Spacing between requests at the announced rate, in microseconds (before margin/scale).
    announced_us: u64,
    /// When it was last announced.
    at: u64,
    basis: Basis,
}

/// An announced request budget, mirrored: what the origin said was left, less what we admitted
/// since (see the module docs, **Rate**).
#[derive(Clone, Copy, Debug)]
struct Budget {
    /// `remaining` as announced, less the admissions the origin may not have counted yet (those
    /// after the observed request's own).
    left: u64,
    /// The admission count at the announcement: every admission after it comes off `left`.
    base: u64,
    /// When the announced budget resets (refills, at least in part), capped at `max_pause_ms`.
    reset_at: u64,
    /// Kept back ([`BUDGET_MARGIN_PERMILLE`]).
    margin: u64,
    /// When it was announced.
    at: u64,
}

/// What a mirrored budget says about admission at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BudgetState {
    /// No budget announced (or it lapsed): the pace, if any, rules.
    Unknown,
    /// The estimate has room: admit freely.
    Room,
    /// The estimate reached the margin: hold back until the reset.
    SpentUntil(u64),
    /// Spent, and the reset has passed: it refilled by an unknown amount. The sustainable pace
    /// (`limit` per window), if announced, rules until the next announcement re-bases.
    Refilling,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Adaptive {
    /// The learned limit as of `limit_calm_since` (decay applies on top). `None` means "no lower than
    /// configured". Always `< limit` and `>= min_limit` when set.
    learned_limit: Option<u32>,
    /// Highest limit a whole window of successes ran at since the last halving.
    good: Option<u32>,
    /// Lowest limit that drew a concurrency throttle, not retried before `probe_at` and
    /// [`PROBE_AFTER_SUCCESSES`] counted successes.
    ceiling: Option<u32>,
    probe_at: u64,
    /// Counted successes since the last concurrency decrease.
    since_decrease: u32,
    /// Counted successes since the last change of the learned limit or the last throttle.
    successes: u32,
    /// Start of the limit's quiet period: the last concurrency throttle, the last time the
    /// limit bound, or the last decay step written back.
    limit_calm_since: u64,
    last_decrease_at: Option<u64>,
    /// For reports without a slot: a throttle before this instant belongs to the burst that
    /// already decreased.
    no_decrease_before: u64,
    paused_until: Option<u64>,
    pace: Option<Pace>,
    budget: Option<Budget>,
    /// Admissions so far (the governor counts them here), to mirror a budget.
    admissions: u64,
    /// The learned RPM last reported in an adjustment note.
    noted_rpm: Option<u32>,
    last_throttle: Option<Throttle>,
}

impl Adaptive {
    /// `min(limit, learned)`, decayed to `now`, within the bounds.
    pub(crate) fn effective_limit(&self, b: Bounds, now: u64) -> u32 {
        b.clamp(self.learned_limit_at(b, now).unwrap_or(b.limit))
    }

    pub(crate) fn learned_limit(&self, b: Bounds, now: u64) -> Option<u32> {
        self.learned_limit_at(b, now)
    }

    /// The pace in force as requests per minute (at least 1), for display and the RPM gate.
    pub(crate) fn learned_rpm(&self, b: Bounds, now: u64) -> Option<u32> {
        self.pace_us(b, now).map(rpm_of)
    }

    /// When the pace in force at `now` lapses unless announced again, if one is in force.
    pub(crate) fn pace_lapses_at(&self, b: Bounds, now: u64) -> Option<u64> {
        self.pace_us(b, now)?;
        self.pace.map(|p| p.at.saturating_add(RATE_STALE_MS))
    }

    /// The minimum spacing between admissions in microseconds, if a pace is in force at `now`.
    /// The spacing is capped at `max_pause_ms`: a pace is a pause between admissions.
    pub(crate) fn pace_us(&self, b: Bounds, now: u64) -> Option<u64> {
        if matches!(
            self.budget_state(now),
            BudgetState::Room | BudgetState::SpentUntil(_)
        ) {
            // A budget the origin announced is spent, not spread (SPEC §3).
            return None;
        }
        let pace = self
            .pace
            .filter(|p| now.saturating_sub(p.at) < RATE_STALE_MS)?;
        let us = u128::from(pace.announced_us) * u128::from(PER_MILLE)
            / u128::from(RATE_MARGIN_PERMILLE);
        let us = u64::try_from(us)
            .unwrap_or(u64::MAX)
            .min(b.max_pause_ms.saturating_mul(1_000));
        (us > 0).then_some(us)
    }

    /// Counts one admission (the governor calls this for every grant): a mirrored budget
    /// shrinks by one.
    pub(crate) fn admitted(&mut self) {
        self.admissions = self.admissions.saturating_add(1);
    }

    /// The admission count so far, to put in [`Context::admitted_seq`].
    pub(crate) fn admissions(&self) -> u64 {
        self.admissions
    }

    /// What the mirrored budget says about admission at `now`.
    pub(crate) fn budget_state(&self, now: u64) -> BudgetState {
        let Some(budget) = self
            .budget
            .filter(|bu| now.saturating_sub(bu.at) < RATE_STALE_MS)
        else {
            return BudgetState::Unknown;
        };
        let estimate = budget
            .left
            .saturating_sub(self.admissions.saturating_sub(budget.base));
        if estimate > budget.margin {
            BudgetState::Room
        } else if now < budget.reset_at {
            BudgetState::SpentUntil(budget.reset_at)
        } else {
            BudgetState::Refilling
        }
    }

    /// When a spent budget lets the next admission in, if it holds admission back at `now`.
    pub(crate) fn budget_blocked_until(&self, now: u64) -> Option<u64> {
        match self.budget_state(now) {
            BudgetState::SpentUntil(until) => Some(until),
            _ => None,
        }
    }

    /// The end of the admission pause, if admission is paused at `now`.
    pub(crate) fn paused_until(&self, now: u64) -> Option<u64> {
        self.paused_until.filter(|&until| until > now)
    }

    pub(crate) fn last_throttle(&self) -> Option<&Throttle> {
        self.last_throttle.as_ref()
    }

    /// When decay next changes the effective limit, if it will (for waiters blocked on slots).
    pub(crate) fn next_decay(&self, b: Bounds, now: u64) -> Option<u64> {
        self.learned_limit_at(b, now)?;
        let steps = quiet_steps(self.limit_calm_since, now);
        Some(
            self.limit_calm_since
                .saturating_add((steps.saturating_add(1)).saturating_mul(QUIET_MS)),
        )
    }

    /// Learns from one upstream outcome. Returns a note of what changed worth logging: the
    /// effective limit, a new pause, or a pace change of more than [`RPM_NOTE_PERMILLE`].
    pub(crate) fn observe(
        &mut self,
        now: u64,
        outcome: &Outcome,
        b: Bounds,
        ctx: Context,
    ) -> Option<String> {
        let paused_before = self.paused_until(now);
        let budget_before = self.budget_state(now);
        // The limit as last written, before decay: a decay step is a change worth telling.
        let limit_before = b.clamp(self.learned_limit.unwrap_or(b.limit));
        let decayed = self.settle(now, b);
        let throttled = outcome.status == Some(429)
            || outcome.throttled > 0
            || (outcome.status == Some(503) && outcome.retry_after_ms.is_some());
        let mut limit_reason = self
            .record_throttle(now, outcome, b, ctx, throttled)
            .or(decayed);
        if let Some((announced_us, basis)) = outcome.rate.as_ref().and_then(announced_pace) {
            self.pace = Some(Pace {
                announced_us,
                at: now,
                basis,
            });
        }
        if let Some(rate) = outcome.rate.as_ref() {
            self.rebase(now, rate, b, ctx);
        }
        let success =
            !throttled && outcome.throttled == 0 && outcome.status.is_none_or(|s| s < 400);
        if success {
            if let Some(reason) = self.grow(now, b, ctx.limited) {
                limit_reason = Some(reason);
            }
        }
        // Other outcomes (a 404, a 500 without a hint) say nothing about the upstream's capacity:
        // they neither grow the limit nor reset the success streak.
        let before = (limit_before, paused_before, budget_before);
        self.describe_change(now, b, outcome, before, limit_reason)
    }

    /// A throttle or a spent budget: the pauses it imposes (each capped at `max_pause_ms`), the
    /// cause shown, and a decrease of the limit when concurrency is to blame (its reason).
    fn record_throttle(
        &mut self,
        now: u64,
        outcome: &Outcome,
        b: Bounds,
        ctx: Context,
        throttled: bool,
    ) -> Option<String> {
        let spent = spent_budgets(outcome.rate.as_ref());
        let mut causes: Vec<String> = Vec::new();
        let mut limit_reason = None;
        if throttled {
            let pause_ms = outcome
                .retry_after_ms
                .unwrap_or(DEFAULT_PAUSE_MS)
                .min(b.max_pause_ms);
            let until = now.saturating_add(pause_ms);
            self.pause(until);
            if spent.is_empty() {
                self.limit_calm_since = now;
            }
            self.successes = 0;
            causes.push(throttle_cause(outcome, pause_ms));
            let fresh = match ctx.admitted_at {
                Some(at) => self.last_decrease_at.is_none_or(|d| at > d),
                None => now >= self.no_decrease_before,
            };
            // A rate-blamed throttle leaves the limit alone: the pause and the pace answer it.
            if fresh && spent.is_empty() {
                limit_reason = Some(self.decrease(now, b));
                self.last_decrease_at = Some(now);
                self.no_decrease_before = until.max(now.saturating_add(DEFAULT_PAUSE_MS));
            }
        }
        for (what, reset_ms) in &spent {
            if let Some(reset_ms) = reset_ms.filter(|&ms| ms > 0) {
                let pause_ms = reset_ms.min(b.max_pause_ms);
                self.pause(now.saturating_add(pause_ms));
                causes.push(format!("{what} budget spent, resets in {pause_ms}ms"));
            }
        }
        if !causes.is_empty() {
            let mut cause = causes.join("; ");
            cause.push_str(&source_suffix(outcome));
            self.last_throttle = Some(Throttle { at: now, cause });
        }
        limit_reason
    }

    /// What an observation changed, worth a log line: the limit, a new pause, the pace.
    fn describe_change(
        &mut self,
        now: u64,
        b: Bounds,
        outcome: &Outcome,
        (limit_before, paused_before, budget_before): (u32, Option<u64>, BudgetState),
        limit_reason: Option<String>,
    ) -> Option<String> {
        let mut notes: Vec<String> = Vec::new();
        let limit_after = self.effective_limit(b, now);
        if limit_after != limit_before {
            let why = limit_reason.unwrap_or_else(|| "re-fitted".to_owned());
            notes.push(format!("limit {limit_before} -> {limit_after} ({why})"));
        }
        if let Some(until) = self.paused_until(now) {
            let extended = paused_before.is_none_or(|before| until >= before + DEFAULT_PAUSE_MS);
            if extended {
                notes.push(format!("paused for {}ms", until - now));
            }
        }
        let budget = self.budget_state(now);
        // A spent one is told by its pause; one with room is worth a line when it starts.
        if budget_before == BudgetState::Unknown && budget == BudgetState::Room {
            if let Some(bu) = self.budget {
                notes.push(format!(
                    "spending the announced budget ({} requests left, resets in {}ms{})",
                    bu.left,
                    bu.reset_at.saturating_sub(now),
                    source_suffix(outcome)
                ));
            }
        }
        let rpm = self.learned_rpm(b, now);
        let mirrored = matches!(budget, BudgetState::Room | BudgetState::SpentUntil(_));
        // While a budget is mirrored no pace binds; that is no change worth a line each time the
        // estimate crosses its margin. The pace is told when it binds again and differs.
        if !(rpm.is_none() && mirrored) && rpm_changed(self.noted_rpm, rpm) {
            match (rpm, self.pace) {
                (Some(rpm), Some(pace)) => notes.push(format!(
                    "pace {rpm} rpm (from {}{})",
                    pace.basis,
                    source_suffix(outcome)
                )),
                _ => notes.push("pace lifted".to_owned()),
            }
            self.noted_rpm = rpm;
        }
        if notes.is_empty() {
            return None;
        }
        if let Some(t) = self.last_throttle.as_ref().filter(|t| t.at == now) {
            notes.push(format!("cause: {}", t.cause));
        }
        Some(notes.join("; "))
    }

    /// Re-fits learned state into new bounds after a reconfigure.
    pub(crate) fn rebound(&mut self, b: Bounds, now: u64) {
        self.settle(now, b);
        if let Some(learned) = self.learned_limit {
            self.set_learned(learned, b);
        }
        self.good = self.good.map(|g| b.clamp(g));
        self.ceiling = self.ceiling.filter(|&c| c <= b.limit);
        // A lower cap applies to the pause already running too (the pace reads it live).
        let cap = now.saturating_add(b.max_pause_ms);
        self.paused_until = self.paused_until.map(|until| until.min(cap));
    }

    /// Drops everything learned (adaptive switched off): the configured settings rule alone.
    pub(crate) fn forget(&mut self) {
        *self = Adaptive {
            last_throttle: self.last_throttle.take(),
            ..Adaptive::default()
        };
    }

    // ---- internals ----

    fn learned_limit_at(&self, b: Bounds, now: u64) -> Option<u32> {
        let learned = self.learned_limit?;
        let gap = b.limit.saturating_sub(learned);
        let gap = shift_down(u64::from(gap), quiet_steps(self.limit_calm_since, now));
        let value = u64::from(b.limit).saturating_sub(gap);
        let value = u32::try_from(value).unwrap_or(b.limit);
        (value < b.limit).then(|| value.max(b.min_limit))
    }

    /// Writes decay back so that growth and decrease work from the value admission already
    /// sees. Returns why the limit moved, if it did.
    fn settle(&mut self, now: u64, b: Bounds) -> Option<String> {
        let steps = quiet_steps(self.limit_calm_since, now);
        if steps == 0 {
            return None;
        }
        let before = self.learned_limit;
        self.learned_limit = self.learned_limit_at(b, now);
        self.ceiling = None;
        self.limit_calm_since = self
            .limit_calm_since
            .saturating_add(steps.saturating_mul(QUIET_MS));
        (before != self.learned_limit).then(|| {
            format!(
                "no throttle for {}s: decayed towards the configured {}",
                steps.saturating_mul(QUIET_MS) / 1_000,
                b.limit
            )
        })
    }

    /// A concurrency throttle at the current effective limit.
    fn decrease(&mut self, now: u64, b: Bounds) -> String {
        let e = self.effective_limit(b, now);
        self.ceiling = Some(e);
        self.probe_at = now.saturating_add(PROBE_AFTER_MS);
        self.since_decrease = 0;
        self.successes = 0;
        match self.good.filter(|&g| g < e) {
            Some(good) => {
                self.set_learned(good, b);
                format!("throttled at {e}: back to {good}, the last level that held")
            }
            None => {
                self.good = None;
                self.set_learned(e / 2, b);
                format!("throttled at {e}: halved")
            }
        }
    }

    /// Counts one success; after a window of them at the current limit, grows it.
    fn grow(&mut self, now: u64, b: Bounds, limited: bool) -> Option<String> {
        self.learned_limit?;
        if !limited {
            return None;
        }
        // The limit bound and held: our own restraint, not the origin's lenience, kept things
        // quiet, so this is no quiet period. Probing, not decay, finds a raised limit now.
        self.limit_calm_since = now;
        let e = self.effective_limit(b, now);
        self.since_decrease = self.since_decrease.saturating_add(1);
        self.successes += 1;
        if self.successes < e {
            return None;
        }
        self.successes = 0;
        self.good = Some(self.good.map_or(e, |g| g.max(e)));
        if self.ceiling.is_some_and(|c| e >= c) {
            // The level that failed has now held for a whole window: the origin allows more.
            self.ceiling = None;
        }
        let next = match self.ceiling {
            Some(c) if e + 1 >= c => {
                if now < self.probe_at || self.since_decrease < PROBE_AFTER_SUCCESSES {
                    return None;
                }
                e + 1
            }
            Some(c) => e + ((c - 1 - e) / 2).max(1),
            None => e + 1,
        };
        self.set_learned(next, b);
        Some(format!("{e} successes in a row"))
    }

    /// A fresh announcement of `remaining` with its `reset` re-bases the mirrored budget. The
    /// admissions after the observed request's own may have reached the origin after it wrote
    /// its answer, so they come off what it announced (the origin may have counted them already:
    /// then the estimate is a little low until the next answer, never high).
    fn rebase(&mut self, now: u64, rate: &RateInfo, b: Bounds, ctx: Context) {
        let (Some(remaining), Some(reset_ms)) = (rate.remaining, rate.reset_ms) else {
            return;
        };
        if reset_ms == 0 && remaining == 0 {
            // Spent, but due to refill right now: says nothing about what is left.
            return;
        }
        let uncounted = ctx
            .admitted_seq
            .map_or(0, |seq| self.admissions.saturating_sub(seq));
        let scale = rate.limit.filter(|&l| l > 0).unwrap_or(remaining);
        let margin = (scale.saturating_mul(BUDGET_MARGIN_PERMILLE) / PER_MILLE).max(1);
        self.budget = Some(Budget {
            left: remaining.saturating_sub(uncounted),
            base: self.admissions,
            reset_at: now.saturating_add(reset_ms.min(b.max_pause_ms)),
            margin,
            at: now,
        });
    }

    fn pause(&mut self, until: u64) {
        self.paused_until = Some(
            self.paused_until
                .map_or(until, |current| current.max(until)),
        );
    }

    fn set_learned(&mut self, value: u32, b: Bounds) {
        let value = value.max(b.min_limit);
        // A learned limit at (or above) the configured one says nothing: forget it.
        self.learned_limit = if value >= b.limit { None } else { Some(value) };
        self.successes = 0;
    }
}

/// Whole quiet periods from `since` to `now`.
fn quiet_steps(since: u64, now: u64) -> u64 {
    now.saturating_sub(since) / QUIET_MS
}

/// `n >> steps`, 0 once every bit is gone.
fn shift_down(n: u64, steps: u64) -> u64 {
    u32::try_from(steps)
        .ok()
        .and_then(|s| n.checked_shr(s))
        .unwrap_or(0)
}

/// Requests per minute at one per `pace_us`, to the nearest (shown, and used by the RPM gate).
fn rpm_of(pace_us: u64) -> u32 {
    let pace_us = pace_us.max(1);
    let rpm = (60_000_000 + pace_us / 2) / pace_us;
    u32::try_from(rpm).unwrap_or(u32::MAX).max(1)
}

/// True when the pace appeared, lapsed, or moved by more than [`RPM_NOTE_PERMILLE`].
fn rpm_changed(noted: Option<u32>, now: Option<u32>) -> bool {
    match (noted, now) {
        (None, None) => false,
        (Some(a), Some(b)) => {
            u64::from(a.abs_diff(b)) * PER_MILLE > u64::from(a) * RPM_NOTE_PERMILLE
        }
        _ => true,
    }
}

/// The sustainable spacing an announced request limit asks for, in microseconds: `limit` per
/// window, when the window length is known. It binds only while no budget is mirrored (the
/// origin announces no `remaining` with a `reset`), or once a mirrored one is spent and its reset
/// has passed, until the next announcement says how much came back.
fn announced_pace(rate: &RateInfo) -> Option<(u64, Basis)> {
    match (rate.limit, rate.window_ms) {
        (Some(limit), Some(window_ms)) if limit > 0 && window_ms > 0 => Some((
            (window_ms.saturating_mul(1_000) / limit).max(1),
            Basis::PerWindow { limit, window_ms },
        )),
        _ => None,
    }
}

/// The budgets an outcome reports as spent, with their resets.
fn spent_budgets(rate: Option<&RateInfo>) -> Vec<(&'static str, Option<u64>)> {
    let Some(rate) = rate else {
        return Vec::new();
    };
    [
        ("requests", rate.remaining, rate.reset_ms),
        ("tokens", rate.token_remaining, rate.token_reset_ms),
    ]
    .into_iter()
    .filter(|&(_, remaining, _)| remaining == Some(0))
    .map(|(what, _, reset)| (what, reset))
    .collect()
}

/// ` (proxy, openai)`: who saw the answer and which headers spoke, when known.
fn source_suffix(outcome: &Outcome) -> String {
    match (outcome.via, outcome.dialect) {
        (Some(via), Some(dialect)) => format!(" ({via}, {dialect})"),
        (Some(one), None) | (None, Some(one)) => format!(" ({one})"),
        (None, None) => String::new(),
    }
}

fn throttle_cause(outcome: &Outcome, pause_ms: u64) -> String {
    let mut parts = Vec::new();
    if let Some(status) = outcome.status {
        parts.push(format!("status {status}"));
    }
    if outcome.throttled > 0 {
        parts.push(format!("{} throttled", outcome.throttled));
    }
    match outcome.retry_after_ms {
        Some(ms) => parts.push(format!("retry-after {ms}ms")),
        None => parts.push(format!("no retry hint, paused {pause_ms}ms")),
    }
    parts.join(", ")
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
