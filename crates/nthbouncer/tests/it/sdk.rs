//! Real clients against the real binary: the official Neon serverless driver (npm, pinned)
//! against a database pool in front of the machine's PostgreSQL; and, in front of a real
//! `sandbox` process, the OpenAI Python SDK (a plain `base_url` on the pool's own listener; sync
//! and streaming), Node's `fetch` (which cannot set `Host`) and the lock API from Python `httpx`
//! — the README's examples, run.
//!
//! The Python packages (`tests/sdk/requirements.txt`, pinned) go into a virtualenv under the
//! target directory, made once; the Neon driver (`tests/sdk/neon/package-lock.json`) is
//! installed with `npm ci`. Node and npm must be on the machine (`.ci/run` installs them).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use nthbouncer_testkit::binary::{free_port, server_toml, spawn, wait_listening, write_config};
use nthbouncer_testkit::KEY;

use crate::BIN;

const SDK_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk");

/// The virtualenv's python, made once per target directory (tests in this binary share it).
fn python() -> PathBuf {
    static MADE: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = made.as_ref() {
        return p.clone();
    }
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sdk-venv");
    let python = venv.join("bin/python");
    let requirements = Path::new(SDK_DIR).join("requirements.txt");
    let stamp = venv.join("requirements.txt");
    let wanted = std::fs::read_to_string(&requirements).unwrap();
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(wanted.as_str()) {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv));
        run(Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-r",
            ])
            .arg(&requirements));
        std::fs::write(&stamp, wanted).unwrap();
    }
    *made = Some(python.clone());
    python
}

/// Runs `cmd` to success; its stdout.
fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A sandbox origin and the server in front of it: pool `demo` with its own listener. Returns
/// the processes (kept alive by the caller), the server's port and the pool listener's port.
fn start() -> (
    Vec<nthbouncer_testkit::binary::Proc>,
    tempfile::TempDir,
    u16,
    u16,
) {
    let (sandbox_port, port, pool_port) = (free_port(), free_port(), free_port());
    let sandbox = spawn(
        BIN,
        &[
            "sandbox",
            "--listen",
            &format!("127.0.0.1:{sandbox_port}"),
            "--latency-ms",
            "5",
        ],
        None,
    );
    wait_listening(sandbox_port);
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "{}[[pools]]\nname = \"demo\"\nupstream = \"http://127.0.0.1:{sandbox_port}\"\n\
         keys = [\"{KEY}\"]\nlisten = \"127.0.0.1:{pool_port}\"\n\
         [pools.upstream_headers]\nauthorization = \"Bearer sandbox-managed-credential\"\n",
        server_toml(port, dir.path())
    );
    let path = write_config(dir.path(), &toml);
    let server = spawn(BIN, &["serve", "--config", path.to_str().unwrap()], None);
    wait_listening(port);
    wait_listening(pool_port);
    (vec![sandbox, server], dir, port, pool_port)
}

#[test]
fn the_openai_python_sdk_works_with_a_plain_base_url() {
    let python = python();
    let (_procs, _dir, _port, pool_port) = start();
    let out = run(Command::new(python)
        .arg(Path::new(SDK_DIR).join("openai_chat.py"))
        .arg(format!("http://127.0.0.1:{pool_port}/v1"))
        .arg(KEY));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"sync assistant True"), "{out}");
    let stream: Vec<&str> = lines.get(1).map_or(vec![], |l| l.split(' ').collect());
    assert_eq!(stream.first(), Some(&"stream"), "{out}");
    assert!(
        stream.get(1).and_then(|n| n.parse::<u32>().ok()) > Some(1),
        "the answer streamed in several chunks: {out}"
    );
    assert_eq!(stream.get(2), Some(&"True"), "{out}");
}

#[test]
fn nodes_fetch_works_on_the_pools_own_listener() {
    let (_procs, _dir, _port, pool_port) = start();
    let out = run(Command::new("node")
        .arg(Path::new(SDK_DIR).join("fetch.mjs"))
        .arg(format!("http://127.0.0.1:{pool_port}"))
        .arg(KEY));
    assert_eq!(out.trim(), "fetch 200 chat.completion true", "{out}");
}

#[test]
fn the_lock_api_works_from_python_httpx() {
    let python = python();
    let (_procs, _dir, port, _pool_port) = start();
    let out = run(Command::new(python)
        .arg(Path::new(SDK_DIR).join("lock_httpx.py"))
        .arg(format!("http://127.0.0.1:{port}"))
        .arg("demo")
        .arg(KEY));
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines
            .first()
            .is_some_and(|l| l.starts_with("acquired 200 ")),
        "{out}"
    );
    assert_eq!(
        lines.get(1..),
        Some(&["renewed 200", "released 200 True"][..]),
        "{out}"
    );
}

/// The Neon driver's packages (`tests/sdk/neon/package-lock.json`), installed with `npm ci` once
/// per checkout when `.ci/run` has not done it already.
fn neon_driver() -> PathBuf {
    static READY: Mutex<bool> = Mutex::new(false);
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Path::new(SDK_DIR).join("neon");
    let installed = dir.join("node_modules/@neondatabase/serverless/package.json");
    if !*ready && !installed.exists() {
        run(Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--silent"])
            .current_dir(&dir));
    }
    *ready = true;
    dir.join("neon.mjs")
}

/// The machine's PostgreSQL (trust auth), with a password it ignores: the pool's managed
/// credential, which the driver never sees.
fn database_url() -> String {
    let base = std::env::var("NTHBOUNCER_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    base.replacen('@', ":driver-test-password@", 1)
}

#[test]
fn the_neon_serverless_driver_works_on_a_database_pools_own_listener() {
    let script = neon_driver();
    let (port, pool_port) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "{}[[pools]]\nname = \"db\"\nkind = \"database\"\nupstream = \"{}\"\n\
         keys = [\"{KEY}\"]\nlisten = \"127.0.0.1:{pool_port}\"\n[pools.concurrency]\nlimit = 2\n",
        server_toml(port, dir.path()),
        database_url()
    );
    let path = write_config(dir.path(), &toml);
    let _server = spawn(BIN, &["serve", "--config", path.to_str().unwrap()], None);
    wait_listening(port);
    wait_listening(pool_port);
    let out = run(Command::new("node")
        .arg(script)
        .arg(format!("http://127.0.0.1:{pool_port}/sql"))
        .arg(KEY));
    let checks: serde_json::Value = serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("the driver script printed {out:?}: {e}"));
    assert_eq!(
        checks,
        serde_json::json!({
            "query": true, "params": true, "transaction": true, "rollback": true, "error": true
        }),
        "{out}"
    );
}
