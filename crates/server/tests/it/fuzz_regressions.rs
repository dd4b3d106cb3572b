//! Replays the `lock_bodies` and `hmac_headers` fuzz targets' seeds and saved crashes
//! (`fuzz/seeds/<target>/`, `fuzz/regressions/<target>/`) through their harnesses, so a crash
//! the fuzzer found stays fixed without nightly or libFuzzer. See `fuzz/run`.

#[path = "../../../../fuzz/harness/hmac_headers.rs"]
mod hmac_headers;
#[path = "../../../../fuzz/harness/lock_bodies.rs"]
mod lock_bodies;
#[path = "../../../../fuzz/harness/replay.rs"]
mod replay;

#[test]
fn lock_bodies_fuzz_inputs_replay() {
    let n = replay::replay(env!("CARGO_MANIFEST_DIR"), "lock_bodies", lock_bodies::run);
    assert!(n > 0, "no seeds found under fuzz/seeds/lock_bodies");
}

#[test]
fn hmac_headers_fuzz_inputs_replay() {
    let n = replay::replay(
        env!("CARGO_MANIFEST_DIR"),
        "hmac_headers",
        hmac_headers::run,
    );
    assert!(n > 0, "no seeds found under fuzz/seeds/hmac_headers");
}
