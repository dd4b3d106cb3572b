//! The client against a real gateway on loopback (`nthbouncer-testkit`), in one binary.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod lock;
