//! Replays the `config` fuzz target's seeds and saved crashes (`fuzz/seeds/config/`,
//! `fuzz/regressions/config/`) through its harness, so a crash the fuzzer found stays fixed
//! without nightly or libFuzzer. See `fuzz/run`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../../fuzz/harness/config.rs"]
mod harness;
#[path = "../../../fuzz/harness/replay.rs"]
mod replay;

#[test]
fn config_fuzz_inputs_replay() {
    let n = replay::replay(env!("CARGO_MANIFEST_DIR"), "config", harness::run);
    assert!(n > 0, "no seeds found under fuzz/seeds/config");
}
