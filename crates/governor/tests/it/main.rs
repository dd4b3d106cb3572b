//! The governor's tests at its public boundary, in one binary: proptest properties of its
//! invariants and closed-loop convergence on a simulated clock.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod convergence;
mod properties;
mod tokens;
