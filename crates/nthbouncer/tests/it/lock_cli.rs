//! `nthbouncer lock` as a real process against a real gateway started in-process on loopback:
//! CMD's status passes through, the slot is held while CMD runs and released after, refusals
//! exit with their own codes and a message, lease trouble warns, signals behave.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use nthbouncer_client::LockError;
use nthbouncer_testkit::{gateway, lock_pool_toml, wait_until, Gateway, API_HOST, KEY};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::BIN;

/// A gateway on a loopback port with lock pool `p` configured by `concurrency` (TOML lines).
async fn gateway_p(concurrency: &str) -> Gateway {
    gateway(&lock_pool_toml("p", concurrency)).await
}

/// `nthbouncer lock` against a gateway's pool `p`.
trait LockCli {
    fn lock(&self, extra: &[&str], cmd: &[&str]) -> Command;
    async fn run(&self, extra: &[&str], cmd: &[&str]) -> Output;
    fn path(&self, name: &str) -> String;
}

impl LockCli for Gateway {
    /// `nthbouncer lock` against this gateway's pool `p`; the key comes from the environment.
    fn lock(&self, extra: &[&str], cmd: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("lock")
            .args(["--api", &self.base, "--host", API_HOST, "--pool", "p"])
            .args(extra)
            .arg("--")
            .args(cmd)
            .env("NTHBOUNCER_KEY", KEY)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        c
    }

    async fn run(&self, extra: &[&str], cmd: &[&str]) -> Output {
        let out = self.lock(extra, cmd).output();
        tokio::time::timeout(Duration::from_secs(20), out)
            .await
            .expect("nthbouncer lock finished")
            .unwrap()
    }

    fn path(&self, name: &str) -> String {
        self.dir().join(name).to_string_lossy().into_owned()
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Polls (bounded, 10 s) until `path` exists.
async fn wait_for_file(path: &str) {
    let exists = wait_until(1000, Duration::from_millis(10), async || {
        Path::new(path).exists()
    })
    .await;
    assert!(exists, "timed out waiting for {path}");
}

/// A command that creates `started`, then waits until `go` exists, then exits 0.
fn wait_for_go<'a>(started: &'a str, go: &'a str) -> Vec<&'a str> {
    vec![
        "sh",
        "-c",
        "touch \"$1\"; while [ ! -e \"$2\" ]; do sleep 0.02; done",
        "sh",
        started,
        go,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_status_and_output_pass_through_and_the_slot_is_released() {
    // The default 30 s term: only a release frees the slot this soon.
    let gw = gateway_p("limit = 1").await;
    let out = gw.run(&[], &["sh", "-c", "echo out; exit 3"]).await;
    assert_eq!(out.status.code(), Some(3), "stderr: {}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert_eq!(gw.in_flight("p").await, 0, "released before exiting");

    let out = gw.run(&[], &["true"]).await;
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert!(out.stderr.is_empty(), "quiet on success: {}", stderr(&out));
    assert_eq!(gw.in_flight("p").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_is_held_while_the_command_runs() {
    let gw = gateway_p("limit = 1\nlease_term_ms = 300\nrenew_interval_ms = 100").await;
    let (started, go) = (gw.path("started"), gw.path("go"));
    let child = gw.lock(&[], &wait_for_go(&started, &go)).spawn().unwrap();
    wait_for_file(&started).await;
    assert_eq!(gw.in_flight("p").await, 1);
    // Long enough for the 300 ms lease to need renewals; the pool stays full throughout.
    for _ in 0..5 {
        let refused = gw.lock_client("p").acquire(None).await;
        assert!(
            matches!(refused, Err(LockError::NoSlot { .. })),
            "{refused:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(gw.in_flight("p").await, 1);
    std::fs::write(&go, b"").unwrap();
    let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
    assert_eq!(gw.in_flight("p").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_exits_75_with_a_message_and_the_command_does_not_run() {
    let gw = gateway_p("limit = 1").await;
    let holder = gw.lock_client("p").acquire(None).await.unwrap();
    let ran = gw.path("ran");

    let out = gw.run(&[], &["touch", &ran]).await;
    assert_eq!(out.status.code(), Some(75));
    let msg = stderr(&out);
    assert!(
        msg.starts_with("nthbouncer lock: no free slot in pool \"p\""),
        "{msg}"
    );
    assert_eq!(msg.lines().count(), 1, "one line: {msg}");

    let out = gw.run(&["--wait-ms", "50"], &["touch", &ran]).await;
    assert_eq!(out.status.code(), Some(75));
    let msg = stderr(&out);
    assert!(msg.starts_with("nthbouncer lock: waited"), "{msg}");
    assert!(msg.contains("no slot opened"), "{msg}");

    assert!(!Path::new(&ran).exists(), "the command never ran");
    assert!(holder.release(None).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_refusals_have_their_own_exit_codes() {
    let gw = gateway_p("limit = 1").await;

    let mut bad_key = gw.lock(&[], &["true"]);
    bad_key.env("NTHBOUNCER_KEY", "not-the-key-0123456789");
    let out = bad_key.output().await.unwrap();
    assert_eq!(out.status.code(), Some(77), "{}", stderr(&out));
    assert!(stderr(&out).contains("refused the key"), "{}", stderr(&out));

    let out = Command::new(BIN)
        .args([
            "lock",
            "--api",
            &gw.base,
            "--host",
            "api.localhost",
            "--pool",
            "nope",
        ])
        .args(["--key", KEY, "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(68), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no pool \"nope\""),
        "{}",
        stderr(&out)
    );

    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let out = Command::new(BIN)
        .args(["lock", "--api", &format!("http://{closed}"), "--pool", "p"])
        .args(["--key", KEY, "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot reach the gateway"),
        "{}",
        stderr(&out)
    );

    let out = Command::new(BIN)
        .args([
            "lock", "--api", "ftp://x", "--pool", "p", "--key", KEY, "--", "true",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));

    assert_eq!(gw.in_flight("p").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_lease_warns_and_the_command_keeps_running() {
    let gw = gateway_p(
        "limit = 1\nrequest_timeout_ms = 300\nlease_term_ms = 200\nrenew_interval_ms = 100",
    )
    .await;
    let (started, go) = (gw.path("started"), gw.path("go"));
    let mut child = gw.lock(&[], &wait_for_go(&started, &go)).spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let warning = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("a warning")
        .unwrap()
        .unwrap_or_default();
    assert!(
        warning.contains("warning") && warning.contains("capped"),
        "{warning}"
    );
    assert!(warning.contains("keeps running"), "{warning}");
    // The command is still running; let it finish.
    wait_for_file(&started).await;
    std::fs::write(&go, b"").unwrap();
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert_eq!(gw.in_flight("p").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_killed_by_a_signal_exits_128_plus_the_signal() {
    let gw = gateway_p("limit = 1").await;
    let out = gw.run(&[], &["sh", "-c", "kill -TERM $$"]).await;
    assert_eq!(out.status.code(), Some(128 + 15), "{}", stderr(&out));
    assert_eq!(gw.in_flight("p").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_is_forwarded_to_the_command() {
    let gw = gateway_p("limit = 1").await;
    let started = gw.path("started");
    let script = "trap 'exit 7' TERM; touch \"$1\"; while :; do sleep 0.02; done";
    let child = gw
        .lock(&[], &["sh", "-c", script, "sh", &started])
        .spawn()
        .unwrap();
    wait_for_file(&started).await;
    let pid = child.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    assert_eq!(gw.in_flight("p").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_command_exits_127_and_releases_the_slot() {
    let gw = gateway_p("limit = 1").await;
    let out = gw.run(&[], &["/nonexistent/nthbouncer-test-command"]).await;
    assert_eq!(out.status.code(), Some(127), "{}", stderr(&out));
    assert!(stderr(&out).contains("cannot run"), "{}", stderr(&out));
    assert_eq!(gw.in_flight("p").await, 0);
}
