#![no_main]

#[path = "../harness/lock_bodies.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
