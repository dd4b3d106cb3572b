//! Test support shared by the end-to-end tests of the server, the client and the binary: a
//! real gateway on loopback ([`gateway`]), a real upstream that counts what it sees
//! ([`upstream`]), loopback HTTP servers ([`loopback`]), the real binary as a child process
//! ([`binary`]), a PostgreSQL database of the test's own ([`pg`]), raw sockets ([`raw`]), the
//! access-policy fixtures ([`access`]) and bounded
//! polling ([`wait`]).
//!
//! The few server internals a test reaches into are named once, in [`internals`] and
//! [`gateway::Gateway::flush_access_log`], so that a move in the server is one edit here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod access;
pub mod binary;
pub mod gateway;
pub mod loopback;
pub mod pg;
pub mod raw;
pub mod tls;
pub mod upstream;
pub mod wait;

pub use gateway::{clocked, clocked_at, gateway, gateway_with, Gateway};
pub use loopback::{
    accepted_id, call, expect_error, header, item_where, json_of, ok, read_body, refused_port,
    send, serve_http, spawn_send,
};
pub use upstream::{Seen, Upstream};
pub use wait::{bounded, eventually, poll, until, wait_until};

/// Where every manual clock starts (epoch ms).
pub const T0: u64 = 1_700_000_000_000;
/// The admin token of every test gateway.
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";
/// A valid legacy-format key used by most test pools.
pub const KEY: &str = "test-key-0123456789abcdef";
/// The second key of every [`pool_toml`] pool.
pub const KEY2: &str = "test-key-second-0123456789";
/// The gateway's default API host.
pub const API_HOST: &str = "api.localhost";
/// A webhook signing secret in the `whsec_` format.
pub const WEBHOOK_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// An upstream nothing listens on: for lock pools, whose holders call the origin themselves.
pub const NO_UPSTREAM: &str = "http://127.0.0.1:9";

/// The server internals the tests use, in one place.
pub mod internals {
    pub use nthbouncer_server::access::MAX_FAILURES;
    pub use nthbouncer_server::webhooks::{secret_key, sign};
}

/// A `[[pools]]` entry in TOML: `name` in front of `upstream`, keys [`KEY`] and [`KEY2`], and
/// `concurrency` (TOML lines) as its `[pools.concurrency]` table.
pub fn pool_toml(name: &str, upstream: &str, concurrency: &str) -> String {
    format!(
        "[[pools]]\nname = \"{name}\"\nupstream = \"{upstream}\"\nkeys = [\"{KEY}\", \"{KEY2}\"]\n[pools.concurrency]\n{concurrency}\n"
    )
}

/// A counting upstream and a gateway with one pool `p` in front of it ([`pool_toml`] with
/// `concurrency`).
pub async fn proxied_pool(concurrency: &str) -> (Upstream, Gateway) {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), concurrency)).await;
    (up, gw)
}

/// [`proxied_pool`] with `server` (TOML lines, if any) as the gateway's `[server]` table and
/// `extra` (more TOML for pool `p`, such as its `[pools.auth]`) after the pool.
pub async fn proxied_pool_with(
    server: &str,
    concurrency: &str,
    extra: &str,
) -> (Upstream, Gateway) {
    let up = Upstream::start().await;
    let server = if server.is_empty() {
        String::new()
    } else {
        format!("[server]\n{server}\n")
    };
    let pool = pool_toml("p", &up.url(), concurrency);
    let gw = gateway(&format!("{server}{pool}{extra}")).await;
    (up, gw)
}

/// A lock pool in TOML. Its upstream is never called: lock holders call the origin themselves.
pub fn lock_pool_toml(name: &str, concurrency: &str) -> String {
    pool_toml(name, NO_UPSTREAM, concurrency)
}

/// A `[[pools.webhooks]]` destination at `url`, signed with [`WEBHOOK_SECRET`].
pub fn webhook_toml(url: &str) -> String {
    format!("[[pools.webhooks]]\nurl = \"{url}\"\nsecret = \"{WEBHOOK_SECRET}\"\n")
}

/// Where an async pool's destination points when no test listens: nothing answers there.
pub const NO_WEBHOOK: &str = "http://127.0.0.1:9/hook";

/// `pool` (a `[[pools]]` entry) with async jobs on (`async_extra`: more `[pools.async]` lines)
/// and one destination at `webhook`, on a gateway that may deliver to private addresses.
pub fn async_pool_toml(pool: &str, async_extra: &str, webhook: &str) -> String {
    format!(
        "[server]\nallow_private_webhooks = true\n{pool}[pools.async]\nenabled = true\n{async_extra}\n{}",
        webhook_toml(webhook)
    )
}

/// An HTTP client that keeps no idle connections, so the server sees every request as a new
/// connection (and a readiness check holds none open).
pub fn unpooled_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

/// The wall clock in epoch ms.
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}
