//! Property tests of the token budget: random interleavings of admissions, waits, dispatches,
//! reconciliations, refunds and cancellations against a small model of what was charged.
//! - the configured budget is never exceeded: the tokens charged in any rolling window (after
//!   downward reconciliation) stay within `tpm`;
//! - an estimate larger than the budget is refused at once and never waits;
//! - no starvation: once the window has passed and every hold has started, draining `dispatch`
//!   leaves no waiter behind.

use std::collections::HashMap;

use nthbouncer_governor::{Priority, TokenAdmit, TokenBudget, TokenSettings};
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
