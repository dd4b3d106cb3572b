//! The coordination crate's one test binary: the in-process gate, and the Redis gate against
//! the machine's Redis (127.0.0.1:6379, or `NB_TEST_REDIS`).

mod in_process;
mod on_redis;
