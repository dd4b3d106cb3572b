//! A real gateway started in-process on loopback (temp data dir, test admin token), and the
//! requests tests make of it.

use std::path::Path;
use std::sync::Arc;

use nthbouncer_client::LockClient;
use nthbouncer_config::Config;
use nthbouncer_coord::{Clock, ManualClock};
use serde_json::Value;

use crate::loopback::{call, json_of, send, spawn_send};
use crate::wait::eventually;
use crate::{ADMIN_TOKEN, API_HOST, KEY, T0};

pub struct Gateway {
    pub running: nthbouncer_server::Running,
    /// `http://127.0.0.1:PORT`
    pub base: String,
    /// Keeps no idle connections, so a test sees every request as a new connection.
    pub client: reqwest::Client,
    dir: tempfile::TempDir,
}

/// Starts a gateway from TOML (its `[server]` gets a loopback port, a temp data dir and the
/// test admin token unless the TOML sets them).
pub async fn gateway(pools_toml: &str) -> Gateway {
    gateway_with(pools_toml, None).await
}

pub async fn gateway_with(pools_toml: &str, clock: Option<Arc<dyn Clock>>) -> Gateway {
    let dir = tempfile::tempdir().unwrap();
    let mut config =
        Config::from_toml_str(pools_toml).unwrap_or_else(|e| panic!("test config: {e}"));
    config.server.listen = "127.0.0.1:0".into();
    if config.server.data_dir == nthbouncer_config::ServerSpec::default().data_dir {
        config.server.data_dir = dir.path().to_path_buf();
    }
    if config.server.admin_token.is_none() {
        config.server.admin_token = Some(ADMIN_TOKEN.into());
    }
    let running = nthbouncer_server::start(
        config,
        nthbouncer_server::Options {
            clock,
            ..Default::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("gateway start: {e}"));
    let base = format!("http://{}", running.addr);
    Gateway {
        running,
        base,
        client: crate::unpooled_client(),
        dir,
    }
}

/// A gateway whose clock is a `ManualClock` starting at [`T0`], and that clock.
pub async fn clocked(toml: &str) -> (Gateway, Arc<ManualClock>) {
    clocked_at(toml, T0).await
}

/// A gateway whose clock is a `ManualClock` starting at `start_ms`, and that clock.
pub async fn clocked_at(toml: &str, start_ms: u64) -> (Gateway, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(start_ms));
    let gw = gateway_with(toml, Some(clock.clone())).await;
    (gw, clock)
}

impl Gateway {
    /// The gateway's temp dir (its data dir unless the TOML set one).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Writes the access log's buffered entries to the store, so the admin API lists them.
    pub async fn flush_access_log(&self) {
        self.running.state.access_log.flush().await;
    }

    /// The pool's access-log rows matching `query` (`?…` or empty), newest first, after a
    /// flush.
    pub async fn access_log(&self, pool: &str, query: &str) -> Vec<Value> {
        self.flush_access_log().await;
        let page = self
            .admin_json(&format!("/admin/pools/{pool}/access-log{query}"))
            .await;
        page["items"].as_array().unwrap().clone()
    }

    /// A request to a pool's host.
    pub fn pool(&self, pool: &str, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("{}{}", self.base, path))
            .header("host", format!("{pool}.localhost"))
    }

    /// A GET through pool `pool` with the test key.
    pub fn get(&self, pool: &str, path: &str) -> reqwest::RequestBuilder {
        self.pool(pool, reqwest::Method::GET, path)
            .header("x-nthpool-key", KEY)
    }

    /// A request to the API host with the admin token.
    pub fn api(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.api_anon(method, path).bearer_auth(ADMIN_TOKEN)
    }

    /// A request to the API host with no credentials at all.
    pub fn api_anon(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("{}{}", self.base, path))
            .header("host", API_HOST)
    }

    /// A GET through pool `pool` with the test key that asks not to queue.
    pub fn no_queue(&self, pool: &str, path: &str) -> reqwest::RequestBuilder {
        self.get(pool, path).header("x-nthpool-no-queue", "1")
    }

    /// A GET through pool `pool` with the test key that asks to run as an async job.
    pub fn get_async(&self, pool: &str, path: &str) -> reqwest::RequestBuilder {
        self.get(pool, path).header("x-nthpool-async", "1")
    }

    /// A POST through pool `pool` with the test key that asks to run as an async job.
    pub fn post_async(&self, pool: &str, path: &str) -> reqwest::RequestBuilder {
        self.pool(pool, reqwest::Method::POST, path)
            .header("x-nthpool-key", KEY)
            .header("x-nthpool-async", "1")
    }

    /// A job's poll: `GET /pools/{pool}/jobs/{job}` on the API host with the test key.
    pub fn poll_job(&self, pool: &str, job: &str) -> reqwest::RequestBuilder {
        self.api_anon(reqwest::Method::GET, &format!("/pools/{pool}/jobs/{job}"))
            .header("x-nthpool-key", KEY)
    }

    /// A raw POST to the API host with the test key (for what the lock client would not do).
    pub async fn raw_post(&self, path: &str) -> reqwest::Response {
        send(
            self.api_anon(reqwest::Method::POST, path)
                .header("x-nthpool-key", KEY),
        )
        .await
    }

    /// A lock client of `pool` with the test key, connecting by IP with the API host named.
    pub fn lock_client(&self, pool: &str) -> LockClient {
        LockClient::new(&self.base, pool, KEY)
            .unwrap()
            .with_host(API_HOST)
            .unwrap()
    }

    /// An admin API call with the admin token (and `body` as JSON, if any): the status and the
    /// JSON body (`Null` when the body is empty or not JSON).
    pub async fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let rb = self.api(method, path);
        call(match body {
            Some(b) => rb.json(&b),
            None => rb,
        })
        .await
    }

    /// An admin POST of `body`: the status and the JSON body.
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.admin(reqwest::Method::POST, path, Some(body)).await
    }

    /// An admin PUT of `body`: the status and the JSON body.
    pub async fn put(&self, path: &str, body: Value) -> (u16, Value) {
        self.admin(reqwest::Method::PUT, path, Some(body)).await
    }

    /// An admin PATCH of `body`: the status and the JSON body.
    pub async fn patch(&self, path: &str, body: Value) -> (u16, Value) {
        self.admin(reqwest::Method::PATCH, path, Some(body)).await
    }

    /// An admin DELETE: the status and the JSON body.
    pub async fn delete(&self, path: &str) -> (u16, Value) {
        self.admin(reqwest::Method::DELETE, path, None).await
    }

    /// The JSON body of an admin GET (the status is not checked; the body must be JSON).
    pub async fn admin_json(&self, path: &str) -> Value {
        json_of(send(self.api(reqwest::Method::GET, path)).await).await
    }

    /// The pool's live governor state (`GET /admin/pools/{pool}/state`, 200 asserted).
    pub async fn state(&self, pool: &str) -> Value {
        let r = send(self.api(reqwest::Method::GET, &format!("/admin/pools/{pool}/state"))).await;
        assert_eq!(r.status(), 200, "state of {pool}");
        r.json().await.unwrap()
    }

    /// The pool's slots in flight.
    pub async fn in_flight(&self, pool: &str) -> u64 {
        self.state(pool).await["inFlight"].as_u64().unwrap()
    }

    /// Waits (bounded) until exactly `n` requests wait in the pool's queue (`what` names them).
    pub async fn wait_queued(&self, pool: &str, n: u64, what: &str) -> Value {
        self.wait_state(pool, what, |s| s["queued"] == n).await
    }

    /// Waits (bounded) until the pool holds no slot (`what` says why it should be so).
    pub async fn wait_freed(&self, pool: &str, what: &str) -> Value {
        self.wait_state(pool, what, |s| s["inFlight"] == 0).await
    }

    /// A GET of `/hold` through pool `pool` with the test key and `x-seq: seq`, sent on a task
    /// of its own: the counting upstream holds it until released.
    pub fn hold(&self, pool: &str, seq: &str) -> tokio::task::JoinHandle<reqwest::Response> {
        spawn_send(self.get(pool, "/hold").header("x-seq", seq))
    }

    /// Waits (bounded) until the pool's live state satisfies `pred`.
    pub async fn wait_state(&self, pool: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        eventually(&format!("pool {pool}: {what}"), async || {
            let s = self.state(pool).await;
            pred(&s).then_some(s)
        })
        .await
    }
}
