//! Fuzz target `config`: a TOML document through `Config::from_toml_str`.
//!
//! Properties: parsing never panics (errors are fine), and a configuration it accepts stays
//! acceptable along the paths the server takes with it: validating again passes, and every
//! pool, stored the way the admin API stores it (`with_hashed_keys`, then JSON), reads back
//! equal and still validates. Masking (the admin API's read view) does not panic either.
//!
//! Shared by `fuzz_targets/config.rs` and `crates/config/tests/fuzz_regressions.rs`.

use nthbouncer_config::{Config, PoolSpec};

pub fn run(data: &[u8]) {
    // The loader reads the file with `read_to_string`: a document is UTF-8 or refused.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = Config::from_toml_str(text) else {
        return;
    };
    if let Err(e) = config.validate() {
        panic!("an accepted config fails validation again: {e}");
    }
    if let Err(e) = config.server.listen_addr() {
        panic!("an accepted config has no listen address: {e}");
    }
    assert_eq!(
        config.server.trusted_proxy_nets().len(),
        config.server.trusted_proxies.len(),
        "every validated trusted proxy is a network"
    );
    let _ = config.server.public_url(8080);
    for (i, pool) in config.pools.iter().enumerate() {
        let at = format!("pools[{i}]");
        let stored = pool.with_hashed_keys();
        if let Err(e) = stored.validate(&at) {
            panic!("pool {at} as stored fails validation: {e}");
        }
        let json = match serde_json::to_value(&stored) {
            Ok(v) => v,
            Err(e) => panic!("pool {at} does not serialise: {e}"),
        };
        let back: PoolSpec = match serde_json::from_value(json) {
            Ok(p) => p,
            Err(e) => panic!("pool {at} as stored does not read back: {e}"),
        };
        assert_eq!(back, stored, "pool {at} changed through its stored JSON");
        if let Err(e) = pool.key_digests(&at) {
            panic!("pool {at}: keys validated but have no digest: {e}");
        }
        let _ = pool.masked();
        let _ = pool.access.ip_allow_nets();
    }
}
