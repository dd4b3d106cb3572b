//! Test support: a real gateway on loopback (temp data dir, test admin token) and a look at its
//! live pool state through the admin API.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use nthbouncer_client::LockClient;
use nthbouncer_config::Config;
use serde_json::Value;

pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";
/// A valid legacy-format pool key.
pub const KEY: &str = "test-key-0123456789abcdef";
/// The gateway's default API host.
pub const API_HOST: &str = "api.localhost";

pub struct Gateway {
    pub running: nthbouncer_server::Running,
    /// `http://127.0.0.1:PORT`
    pub base: String,
    admin: reqwest::Client,
    _dir: tempfile::TempDir,
}

/// A lock pool in TOML. Its upstream is never called: lock holders call the origin themselves.
pub fn pool(name: &str, concurrency: &str) -> String {
    format!(
        "[[pools]]\nname = \"{name}\"\nupstream = \"http://127.0.0.1:9\"\nkeys = [\"{KEY}\"]\n[pools.concurrency]\n{concurrency}\n"
    )
}

impl Gateway {
    /// Starts a gateway serving `pools_toml` on a loopback port.
    pub async fn start(pools_toml: &str) -> Gateway {
        let dir = tempfile::tempdir().unwrap();
        let mut config =
            Config::from_toml_str(pools_toml).unwrap_or_else(|e| panic!("test config: {e}"));
        config.server.listen = "127.0.0.1:0".into();
        config.server.data_dir = dir.path().to_path_buf();
        config.server.admin_token = Some(ADMIN_TOKEN.into());
        let running = nthbouncer_server::start(config, nthbouncer_server::Options::default())
            .await
            .unwrap_or_else(|e| panic!("gateway start: {e}"));
        let base = format!("http://{}", running.addr);
        Gateway {
            running,
            base,
            admin: reqwest::Client::new(),
            _dir: dir,
        }
    }

    /// A lock client of `pool` connecting by IP with the API host named.
    pub fn client(&self, pool: &str) -> LockClient {
        LockClient::new(&self.base, pool, KEY)
            .unwrap()
            .with_host(API_HOST)
            .unwrap()
    }

    /// The pool's live governor state (`GET /admin/pools/{pool}/state`).
    pub async fn state(&self, pool: &str) -> Value {
        let r = self
            .admin
            .get(format!("{}/admin/pools/{pool}/state", self.base))
            .header("host", API_HOST)
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "state of {pool}");
        r.json().await.unwrap()
    }

    pub async fn in_flight(&self, pool: &str) -> u64 {
        self.state(pool).await["inFlight"].as_u64().unwrap()
    }

    /// Polls the pool's state (bounded, 10 s) until `pred` holds; panics naming `what`.
    pub async fn wait_state(&self, pool: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        for _ in 0..1000 {
            let s = self.state(pool).await;
            if pred(&s) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for pool {pool}: {what}");
    }

    /// A raw lock-API call (for what the client itself would not do).
    pub async fn raw_post(&self, path: &str) -> reqwest::Response {
        self.admin
            .post(format!("{}{path}", self.base))
            .header("host", API_HOST)
            .header("x-nthpool-key", KEY)
            .send()
            .await
            .unwrap()
    }
}

/// Bounds a wait on the client so that a bug hangs no test (not a timing assertion).
pub async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}
