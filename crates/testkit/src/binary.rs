//! The real binary as a child process: a guard that kills it, `nthbouncer serve` started from
//! a generated config and waited on, and the requests tests make of it.
//!
//! `env!("CARGO_BIN_EXE_nthbouncer")` exists only in the binary crate's own tests, so every
//! function here that starts the binary takes its path (`bin`) from the caller.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::wait::{poll, wait_until};
use crate::{ADMIN_TOKEN, API_HOST, KEY};

/// Kills (and reaps) the child when the test ends, whatever happens.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Spawns the binary `bin` with `args`, its output discarded. `rust_log` sets `RUST_LOG`; `None`
/// leaves the environment's.
pub fn spawn(bin: &str, args: &[&str], rust_log: Option<&str>) -> Proc {
    let mut cmd = Command::new(bin);
    cmd.args(args).stdout(Stdio::null()).stderr(Stdio::null());
    if let Some(level) = rust_log {
        cmd.env("RUST_LOG", level);
    }
    Proc(cmd.spawn().unwrap())
}

/// [`spawn`] with the child's stdout and stderr appended to `log` (kept across restarts), so a
/// failing test can say what the process printed ([`Server::log_tail`]).
pub fn spawn_logged(bin: &str, args: &[&str], rust_log: &str, log: &Path) -> Proc {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .env("RUST_LOG", rust_log);
    Proc(cmd.spawn().unwrap())
}

/// Writes `text` as `nthbouncer.toml` in `dir` and returns its path.
pub fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("nthbouncer.toml");
    std::fs::File::create(&path)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    path
}

/// The `[server]` table's first lines: listen on `127.0.0.1:port`, data in `dir/data`.
pub fn server_toml(port: u16, dir: &Path) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\ndata_dir = {:?}\n",
        dir.join("data").display().to_string()
    )
}

/// Waits (bounded, 10 s) until something accepts connections on `port`.
pub fn wait_listening(port: u16) {
    for _ in 0..400 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("nothing listened on port {port}");
}

/// How long any request a helper here makes may take: a server that accepts and never answers
/// fails the test with the request's URL, instead of hanging it (and CI) for good.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Waits (bounded, 10 s) until `/readyz` on `port` answers 200.
pub async fn wait_ready(client: &reqwest::Client, port: u16) {
    let ready = wait_until(400, Duration::from_millis(25), async || {
        client
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .header("host", API_HOST)
            // Whatever answers on the port must answer at once, or this is not our server.
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(ready, "the server on port {port} never became ready");
}

/// Where a [`Server`] writes what its process prints, in its tempdir.
const LOG: &str = "nthbouncer.log";

/// `nthbouncer serve` on a free loopback port, from a config written in its own tempdir, with
/// the test admin token; its pools take the test key.
pub struct Server {
    bin: &'static str,
    proc: Proc,
    pub port: u16,
    /// Used for every request the helpers make, readiness checks included.
    pub client: reqwest::Client,
    rust_log: &'static str,
    config: PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Writes a config of the `[server]` table (listen, data dir, `admin_token`) followed by
    /// `rest` (which may open with more `[server]` keys), starts `bin serve` with
    /// `RUST_LOG=rust_log`, and waits until it is ready.
    pub async fn start(
        bin: &'static str,
        rust_log: &'static str,
        client: reqwest::Client,
        rest: &str,
    ) -> Server {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let config = write_config(
            dir.path(),
            &format!(
                "{}admin_token = \"{ADMIN_TOKEN}\"\n{rest}",
                server_toml(port, dir.path())
            ),
        );
        let server = Server {
            bin,
            proc: spawn_logged(
                bin,
                &["serve", "--config", config.to_str().unwrap()],
                rust_log,
                &dir.path().join(LOG),
            ),
            port,
            client,
            rust_log,
            config,
            _dir: dir,
        };
        wait_ready(&server.client, port).await;
        server
    }

    /// `kill -9`: the process dies at once, with whatever it had in flight.
    pub fn kill_9(&mut self) {
        self.proc.0.kill().unwrap();
        self.proc.0.wait().unwrap();
    }

    /// `kill -TERM`: asks the process to shut down gracefully (see [`Server::exited`]).
    pub fn sigterm(&self) {
        let pid = self.proc.0.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(sent.success(), "kill -TERM {pid} failed");
    }

    /// Waits (bounded, 60 s) for the process to exit on its own, and returns how it exited.
    pub async fn exited(&mut self) -> std::process::ExitStatus {
        for _ in 0..2400 {
            if let Some(status) = self.proc.0.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("the server did not exit within 60 s");
    }

    /// Starts `serve` again on the same config (same port, same data dir) and waits until it
    /// is ready.
    pub async fn restart(&mut self) {
        let config = self.config.to_str().unwrap();
        self.proc = spawn_logged(
            self.bin,
            &["serve", "--config", config],
            self.rust_log,
            &self._dir.path().join(LOG),
        );
        wait_ready(&self.client, self.port).await;
    }

    /// Rewrites the config file as [`Server::start`] wrote it, with `rest` after the
    /// `[server]` head: what the next reload reads.
    pub fn rewrite_config(&self, rest: &str) {
        self.rewrite_config_listening(&format!("127.0.0.1:{}", self.port), rest);
    }

    /// [`Server::rewrite_config`] with `server.listen = listen` instead of the running port.
    pub fn rewrite_config_listening(&self, listen: &str, rest: &str) {
        self.rewrite_config_head(listen, ADMIN_TOKEN, rest);
    }

    /// [`Server::rewrite_config`] with `server.admin_token = token` instead of the test's.
    pub fn rewrite_config_with_token(&self, token: &str, rest: &str) {
        self.rewrite_config_head(&format!("127.0.0.1:{}", self.port), token, rest);
    }

    fn rewrite_config_head(&self, listen: &str, token: &str, rest: &str) {
        let data = self._dir.path().join("data").display().to_string();
        let text = format!(
            "[server]\nlisten = \"{listen}\"\ndata_dir = {data:?}\nadmin_token = \"{token}\"\n{rest}"
        );
        write_config(self._dir.path(), &text);
    }

    /// `kill -HUP`: asks the process to reload its config file.
    pub fn sighup(&self) {
        let pid = self.proc.0.id().to_string();
        let sent = Command::new("kill").args(["-HUP", &pid]).status().unwrap();
        assert!(sent.success(), "kill -HUP {pid} failed");
    }

    /// `POST /admin/reload`: the status and the JSON answer.
    pub async fn reload(&self) -> (u16, Value) {
        let r = self
            .client
            .post(self.url("/admin/reload"))
            .timeout(REQUEST_TIMEOUT)
            .header("host", API_HOST)
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// The last `bytes` of what the process printed (every run of it, restarts included), for
    /// an assertion's message.
    pub fn log_tail(&self, bytes: usize) -> String {
        let text = std::fs::read(self._dir.path().join(LOG)).unwrap_or_default();
        let from = text.len().saturating_sub(bytes);
        String::from_utf8_lossy(&text[from..]).into_owned()
    }

    /// The node's `data_dir` (its SQLite store, when it runs on one).
    pub fn data_dir(&self) -> PathBuf {
        self._dir.path().join("data")
    }

    /// `http://127.0.0.1:{port}{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// A request to `path` on `pool`'s host with the test key, bounded by [`REQUEST_TIMEOUT`].
    pub fn pool(&self, pool: &str, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, self.url(path))
            .timeout(REQUEST_TIMEOUT)
            .header("host", format!("{pool}.localhost"))
            .header("x-nthpool-key", KEY)
    }

    /// GET `path` on `pool`'s host with the test key.
    pub fn pool_get(&self, pool: &str, path: &str) -> reqwest::RequestBuilder {
        self.pool(pool, reqwest::Method::GET, path)
    }

    /// A request to `path` on the API host with the test key, bounded by [`REQUEST_TIMEOUT`].
    pub fn api(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, self.url(path))
            .timeout(REQUEST_TIMEOUT)
            .header("host", API_HOST)
            .header("x-nthpool-key", KEY)
    }

    /// The server's `/metrics` text.
    pub async fn metrics_text(&self) -> String {
        self.api(reqwest::Method::GET, "/metrics")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// GET `path` on the admin API, as JSON (whatever the status).
    pub async fn admin_json(&self, path: &str) -> Value {
        self.client
            .get(self.url(path))
            .timeout(REQUEST_TIMEOUT)
            .header("host", API_HOST)
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Waits (bounded, 20 s) for `pool` to be idle: nothing in flight, nothing queued.
    pub async fn wait_idle(&self, pool: &str) {
        let mut last = Value::Null;
        let idle = wait_until(1000, Duration::from_millis(20), async || {
            let s = self.admin_json(&format!("/admin/pools/{pool}/state")).await;
            let idle = s["inFlight"] == 0 && s["queued"] == 0;
            last = s;
            idle
        })
        .await;
        assert!(idle, "pool {pool} never went idle: {last}");
    }

    /// Submits `n` async jobs to `pool` (`POST /work/{i}`, 16 at a time, with `body(i)` as the
    /// body if any); every one must be accepted with 202. Their job ids, in submission order.
    pub async fn submit_async_jobs(
        &self,
        pool: &str,
        n: usize,
        body: impl Fn(usize) -> Option<String>,
    ) -> Vec<String> {
        let sem = Arc::new(tokio::sync::Semaphore::new(16));
        let mut tasks = Vec::with_capacity(n);
        for i in 0..n {
            let permit = sem.clone().acquire_owned().await.unwrap();
            let mut req = self
                .pool(pool, reqwest::Method::POST, &format!("/work/{i}"))
                .header("x-nthpool-async", "1");
            if let Some(body) = body(i) {
                req = req.body(body);
            }
            tasks.push(tokio::spawn(async move {
                let r = req.send().await.unwrap();
                drop(permit);
                assert_eq!(r.status(), 202);
                let v: Value = r.json().await.unwrap();
                v["jobId"].as_str().unwrap().to_string()
            }));
        }
        let mut ids = Vec::with_capacity(n);
        for t in tasks {
            ids.push(t.await.unwrap());
        }
        ids
    }

    /// The job as its submitter polls it (`GET /pools/{pool}/jobs/{id}` with the test key):
    /// the status and the JSON body.
    pub async fn job(&self, pool: &str, id: &str) -> (u16, Value) {
        let r = self
            .api(reqwest::Method::GET, &format!("/pools/{pool}/jobs/{id}"))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// Waits (bounded, 30 s a job) until every job in `ids` has completed with `body` as its
    /// result; a job that is lost (not 200), fails or expires fails the test.
    pub async fn wait_completed(&self, pool: &str, ids: &[String], body: &str) {
        for id in ids {
            let finished = poll(3000, Duration::from_millis(10), async || {
                let (status, v) = self.job(pool, id).await;
                assert_eq!(status, 200, "job {id} was lost");
                if v["status"] == "completed" {
                    assert_eq!(v["result"]["body"], body);
                    return Some(());
                }
                assert!(v["status"] != "failed" && v["status"] != "expired", "{v}");
                None
            })
            .await
            .is_some();
            assert!(finished, "job {id} never completed");
        }
    }
}
