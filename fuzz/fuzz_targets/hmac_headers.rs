#![no_main]

#[path = "../harness/hmac_headers.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
