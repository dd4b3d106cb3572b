//! The rate-limit parser's tests, in one binary: the dialects as origins document them, no
//! panic on any input (proptest), and the fuzz target's saved inputs replayed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod dialects;
mod fuzz_regressions;
mod no_panic;
