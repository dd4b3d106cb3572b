//! The coordination crate's one test binary: the conformance suite run against both
//! implementations (`conformance`), and what only the in-process gate or only the Redis gate
//! does (`in_process`, `on_redis`, against the machine's Redis: 127.0.0.1:6379, or
//! `NB_TEST_REDIS`).

mod conformance;
mod in_process;
mod kept;
mod on_redis;
