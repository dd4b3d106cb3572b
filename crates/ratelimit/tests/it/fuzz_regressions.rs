//! Replays the `rate_headers` fuzz target's seeds and saved crashes
//! (`fuzz/seeds/rate_headers/`, `fuzz/regressions/rate_headers/`) through its harness, so a
//! crash the fuzzer found stays fixed without nightly or libFuzzer. See `fuzz/run`.

#[path = "../../../../fuzz/harness/rate_headers.rs"]
mod harness;
#[path = "../../../../fuzz/harness/replay.rs"]
mod replay;

#[test]
fn rate_headers_fuzz_inputs_replay() {
    let n = replay::replay(env!("CARGO_MANIFEST_DIR"), "rate_headers", harness::run);
    assert!(n > 0, "no seeds found under fuzz/seeds/rate_headers");
}
