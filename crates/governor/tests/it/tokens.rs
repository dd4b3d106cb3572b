//! Property tests of the token budget: random interleavings of admissions, waits, dispatches,
//! reconciliations, refunds and cancellations against a small model of what was charged.
//! - the configured budget is never exceeded: the tokens charged in any rolling window (after
//!   downward reconciliation) stay within `tpm`;
//! - an estimate larger than the budget is refused at once and never waits;
//! - no starvation: once the window has passed and every hold has started, draining `dispatch`
//!   leaves no waiter behind;
//! - against a simulated origin (a token bucket announcing OpenAI-style): once the budget has
//!   been announced, the origin refuses nothing it admits, whatever order the requests reach
//!   the origin and their answers come back in.

use std::collections::HashMap;

use nthbouncer_governor::{Priority, TokenAdmit, TokenBudget, TokenSettings, TokenWindow};
use proptest::prelude::*;

const TPM: u64 = 1_000;
const WINDOW: u64 = 10_000;
const HOLD: u64 = 500;

#[derive(Clone, Debug)]
enum Op {
    Admit {
        cost: u64,
        may_wait: bool,
        high: bool,
    },
    Dispatch,
    Advance(u64),
    Finish {
        pick: usize,
        percent: u64,
    },
    Refund(usize),
    Cancel(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1..1_200u64, any::<bool>(), any::<bool>())
            .prop_map(|(cost, may_wait, high)| Op::Admit { cost, may_wait, high }),
        3 => Just(Op::Dispatch),
        3 => (0..3_000u64).prop_map(Op::Advance),
        2 => (any::<usize>(), 0..=100u64).prop_map(|(pick, percent)| Op::Finish { pick, percent }),
        1 => any::<usize>().prop_map(Op::Refund),
        1 => any::<usize>().prop_map(Op::Cancel),
    ]
}

/// Charges as the caller saw them: id → (admitted at, cost).
#[derive(Default)]
struct Model {
    charges: HashMap<u128, (u64, u64)>,
    /// Waiters and their estimates, in no particular order.
    waiting: Vec<(u128, u64)>,
}

impl Model {
    fn in_window(&self, now: u64) -> u64 {
        self.charges
            .values()
            .filter(|(at, _)| at + WINDOW > now)
            .map(|(_, c)| c)
            .sum()
    }

    fn admitted(&mut self, now: u64, id: u128, cost: u64) {
        self.charges.insert(id, (now, cost));
        assert!(
            self.in_window(now) <= TPM,
            "budget exceeded at {now}: {} > {TPM}",
            self.in_window(now)
        );
    }
}

impl Model {
    fn dispatched(&mut self, now: u64, id: u128) {
        let cost = self.waiting.iter().find(|(w, _)| *w == id).map(|(_, c)| *c);
        assert!(cost.is_some(), "dispatched {id}, which was not waiting");
        self.waiting.retain(|&(w, _)| w != id);
        self.admitted(now, id, cost.unwrap_or(0));
    }
}

fn pick<T: Copy>(items: &[T], i: usize) -> Option<T> {
    (!items.is_empty()).then(|| items[i % items.len()])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn never_exceeds_the_budget_and_never_starves(ops in prop::collection::vec(op(), 1..200)) {
        let mut b = TokenBudget::new(TokenSettings {
            tpm: TPM,
            window_ms: WINDOW,
            hold_ms: HOLD,
            learn: true,
        });
        let mut m = Model::default();
        let mut now = 0u64;
        let mut next_id = 0u128;
        for op in ops {
            match op {
                Op::Admit { cost, may_wait, high } => {
                    next_id += 1;
                    let priority = if high { Priority::High } else { Priority::Normal };
                    match b.try_admit(now, next_id, cost, priority, may_wait) {
                        TokenAdmit::Admitted { .. } => m.admitted(now, next_id, cost),
                        TokenAdmit::Queued => {
                            prop_assert!(cost <= TPM && may_wait);
                            m.waiting.push((next_id, cost));
                        }
                        TokenAdmit::Exceeds { estimate, budget } => {
                            prop_assert!(cost > TPM);
                            prop_assert_eq!((estimate, budget), (cost, TPM));
                        }
                        TokenAdmit::Refused { .. } => prop_assert!(!may_wait),
                    }
                }
                Op::Dispatch => {
                    while let Some((id, _)) = b.dispatch(now) {
                        m.dispatched(now, id);
                    }
                }
                Op::Advance(ms) => now += ms,
                Op::Finish { pick: i, percent } => {
                    let ids: Vec<u128> = m.charges.keys().copied().collect();
                    if let Some(id) = pick(&ids, i) {
                        if let Some(entry) = m.charges.get_mut(&id) {
                            let actual = entry.1 * percent / 100;
                            b.finish(now, id, Some(actual));
                            entry.1 = actual;
                        }
                    }
                }
                Op::Refund(i) => {
                    let ids: Vec<u128> = m.charges.keys().copied().collect();
                    if let Some(id) = pick(&ids, i) {
                        b.refund(id);
                        m.charges.remove(&id);
                    }
                }
                Op::Cancel(i) => {
                    if let Some((id, _)) = pick(&m.waiting, i) {
                        prop_assert!(b.cancel(id));
                        m.waiting.retain(|&(w, _)| w != id);
                    }
                }
            }
        }
        // No starvation: follow the wake-ups; every waiter is admitted in bounded time.
        let mut steps = 0;
        while !m.waiting.is_empty() {
            steps += 1;
            prop_assert!(steps < 10_000, "waiters left behind: {:?}", m.waiting);
            while let Some((id, _)) = b.dispatch(now) {
                m.dispatched(now, id);
            }
            if m.waiting.is_empty() {
                break;
            }
            let wake = b.next_wakeup(now);
            prop_assert!(wake.is_some(), "waiters but no wake-up");
            now = wake.unwrap_or(now).max(now + 1);
        }
    }
}

// ---- against an origin's token bucket ----

/// The origin's hidden budget in the second property: `LIMIT` tokens refilling linearly over
/// `refill_ms` (chosen per case), like OpenAI's (and the sandbox's).
const LIMIT: u64 = 3_000;

/// A token bucket in exact arithmetic on a microsecond clock (ours counts whole
/// milliseconds): the level is kept in tokens × the refill's microseconds, so it gains `LIMIT`
/// units a microsecond. It answers as the sandbox does: `remaining` rounded down, the reset
/// rounded up to the millisecond.
struct Origin {
    refill_us: u64,
    level: u64,
    at_us: u64,
}

impl Origin {
    fn full(&self) -> u64 {
        LIMIT * self.refill_us
    }

    fn refill(&mut self, now_us: u64) {
        let gained = (now_us - self.at_us) * LIMIT;
        self.level = (self.level + gained).min(self.full());
        self.at_us = now_us;
    }

    fn window(&self) -> TokenWindow {
        TokenWindow {
            limit: Some(LIMIT),
            remaining: Some(self.level / self.refill_us),
            reset_ms: Some((self.full() - self.level).div_ceil(LIMIT * 1_000)),
        }
    }

    /// Charges `cost` on arrival; `false` (a 429) when it does not fit.
    fn charge(&mut self, now_us: u64, cost: u64) -> bool {
        self.refill(now_us);
        if cost * self.refill_us > self.level {
            return false;
        }
        self.level -= cost * self.refill_us;
        true
    }

    fn give_back(&mut self, tokens: u64) {
        self.level = (self.level + tokens * self.refill_us).min(self.full());
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// A request of `prompt` tokens asking for up to `cap` more, estimated `over` above that.
    Admit { prompt: u64, cap: u64, over: u64 },
    /// A sent request reaches the origin (any of them: requests overtake one another).
    Arrive { pick: usize, used: u64 },
    /// An answer's head is seen: its announcement teaches the budget.
    Head(usize),
    /// An answer's body has been relayed: its usage reconciles the charge.
    End(usize),
    /// Microseconds pass.
    Advance(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1..400u64, 0..300u64, 0..20u64)
            .prop_map(|(prompt, cap, over)| Step::Admit { prompt, cap, over }),
        3 => (any::<usize>(), 0..=100u64).prop_map(|(pick, used)| Step::Arrive { pick, used }),
        3 => any::<usize>().prop_map(Step::Head),
        3 => any::<usize>().prop_map(Step::End),
        2 => prop_oneof![0..2_000u64, 0..200_000u64].prop_map(Step::Advance),
    ]
}

/// A request on its way: its prompt and output cap as the origin counts them, and whether the
/// budget was known when it was admitted.
#[derive(Clone, Copy, Debug)]
struct Sent {
    id: u128,
    prompt: u64,
    cap: u64,
    known: bool,
}

fn take<T: Copy>(items: &mut Vec<T>, i: usize) -> Option<T> {
    (!items.is_empty()).then(|| items.remove(i % items.len()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    /// Once an announcement has been seen, nothing the budget admits is refused by the origin,
    /// however the requests overtake one another on their way there and back, and however the
    /// announcements' rounding falls.
    #[test]
    fn once_announced_the_origin_refuses_nothing(
        refill_ms in prop_oneof![Just(1_000u64), Just(10_000), Just(60_000)],
        steps in prop::collection::vec(step(), 1..300),
    ) {
        let mut b = TokenBudget::new(TokenSettings { tpm: 0, ..TokenSettings::default() });
        let refill_us = refill_ms * 1_000;
        let mut origin = Origin { refill_us, level: LIMIT * refill_us, at_us: 0 };
        let mut now_us = 0u64;
        let mut next_id = 0u128;
        let mut known = false;
        let mut sent: Vec<Sent> = Vec::new();
        // Answered at the origin, head not seen yet: the request, its announcement, its usage.
        let mut answered: Vec<(Sent, TokenWindow, Option<u64>)> = Vec::new();
        let mut relaying: Vec<(Sent, Option<u64>)> = Vec::new();
        for s in steps {
            match s {
                Step::Admit { prompt, cap, over } => {
                    next_id += 1;
                    let cost = prompt + cap + over;
                    if let TokenAdmit::Admitted { .. } =
                        b.try_admit(now_us / 1_000, next_id, cost, Priority::Normal, false)
                    {
                        sent.push(Sent { id: next_id, prompt, cap, known });
                    }
                }
                Step::Arrive { pick, used } => {
                    if let Some(r) = take(&mut sent, pick) {
                        let ok = origin.charge(now_us, r.prompt + r.cap);
                        prop_assert!(
                            ok || !r.known,
                            "the origin refused {r:?} admitted with the budget known \
                             (origin level {} at {now_us} µs)", origin.level / refill_us
                        );
                        let window = origin.window();
                        let usage = ok.then(|| {
                            let completion = r.cap * used / 100;
                            origin.give_back(r.cap - completion);
                            r.prompt + completion
                        });
                        answered.push((r, window, usage));
                    }
                }
                Step::Head(pick) => {
                    if let Some((r, window, usage)) = take(&mut answered, pick) {
                        b.observe(now_us / 1_000, Some(r.id), window);
                        known = true;
                        relaying.push((r, usage));
                    }
                }
                Step::End(pick) => {
                    if let Some((r, usage)) = take(&mut relaying, pick) {
                        b.finish(now_us / 1_000, r.id, usage);
                    }
                }
                Step::Advance(us) => now_us += us,
            }
        }
    }
}
