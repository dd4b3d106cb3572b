//! The real binary: config validation, keygen, serve with a real sandbox process, the demo, and
//! graceful shutdown on SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use nthbouncer_testkit::binary::{
    free_port, server_toml, spawn, wait_listening, write_config, Proc,
};

use crate::BIN;

#[test]
fn invalid_configs_exit_non_zero_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[[pools]]\nname = \"p\"\nupstream = \"http://127.0.0.1:1\"\n[pools.concurrency]\nlimit = 0\n", "pools[0].concurrency.limit"),
        ("[[pools]]\nname = \"Not Valid\"\nupstream = \"http://127.0.0.1:1\"\n", "pools[0].name"),
        ("[server]\nlisten = \"where?\"\n", "server.listen"),
        ("[[pools]]\nname = \"p\"\nupstream = \"http://127.0.0.1:1\"\nlisten = \"here\"\n", "pools[0].listen"),
        ("[server]\nbogus = 1\n", "bogus"),
        ("[[pools]]\nname = \"p\"\nupstream = \"http://127.0.0.1:1\"\n[pools.cache]\nttl_s = 0\n", "pools[0].cache.ttl_s"),
        ("[[pools]]\nname = \"p\"\nupstream = \"http://127.0.0.1:1\"\n[pools.cache]\nttl = 5\n", "pools[0].cache.ttl"),
        ("this is not toml", "(file)"),
        ("[server]\ncoordination = \"memcached://h\"\n", "server.coordination"),
        ("[server]\ncoordination = \"redis://h\"\ncoordination_fail = \"open\"\n", "server.expected_nodes"),
    ];
    for (text, key) in cases {
        let path = write_config(dir.path(), text);
        for args in [
            vec!["check-config", path.to_str().unwrap()],
            vec!["serve", "--config", path.to_str().unwrap()],
        ] {
            let out = Command::new(BIN).args(&args).output().unwrap();
            assert!(!out.status.success(), "{args:?} accepted {text:?}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains(key),
                "{args:?}: message {err:?} does not name {key}"
            );
        }
    }
    let missing = Command::new(BIN)
        .args(["check-config", "/nonexistent/nthbouncer.toml"])
        .output()
        .unwrap();
    assert!(!missing.status.success());
}

/// A pool listener whose address is taken stops the start, naming the key.
#[test]
fn serve_exits_naming_a_pool_listener_it_cannot_bind() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free_port();
    let text = format!(
        "{}[[pools]]\nname = \"p\"\nupstream = \"http://127.0.0.1:1\"\nlisten = \"{}\"\n",
        server_toml(port, dir.path()),
        taken.local_addr().unwrap()
    );
    let path = write_config(dir.path(), &text);
    let out = Command::new(BIN)
        .args(["serve", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success(), "served with a taken pool listener");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pools[0].listen"), "{err}");
}

/// Failing closed, a node whose Redis does not answer does not start; the message names the
/// setting and never quotes the URL (it may hold a password).
#[test]
fn serve_exits_naming_coordination_when_redis_does_not_answer() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "{}coordination = \"redis://:hunter2@127.0.0.1:1/0\"\ncoordination_timeout_ms = 300\n",
        server_toml(free_port(), dir.path())
    );
    let path = write_config(dir.path(), &text);
    let out = Command::new(BIN)
        .args(["serve", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success(), "served without its Redis");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("server.coordination"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

#[test]
fn check_config_prints_resolved_pools_with_secrets_masked() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(
        dir.path(),
        "[[pools]]\nname = \"p\"\nupstream = \"http://127.0.0.1:1\"\nkeys = [\"legacy-key-0123456789\"]\n[pools.upstream_headers]\nauthorization = \"Bearer sk-do-not-print\"\n[pools.cache]\nttl_s = 30\n",
    );
    let out = Command::new(BIN)
        .args(["check-config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("\"name\":\"p\""), "{text}");
    assert!(text.contains("\"limit\":10"), "defaults resolved: {text}");
    assert!(
        text.contains("\"max_entry_bytes\":1048576"),
        "cache defaults resolved: {text}"
    );
    assert!(!text.contains("sk-do-not-print"));
    assert!(!text.contains("legacy-key-0123456789"));
}

#[test]
fn keygen_prints_a_key_and_its_hash() {
    let out = Command::new(BIN).arg("keygen").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(nthbouncer_config::keys::check_format(lines[0]), Ok(()));
    assert_eq!(
        lines[1],
        format!("sha256:{}", nthbouncer_config::keys::hash_hex(lines[0]))
    );
    let out = Command::new(BIN)
        .args(["keygen", "--webhook-secret"])
        .output()
        .unwrap();
    assert!(String::from_utf8(out.stdout).unwrap().starts_with("whsec_"));
}

fn http(port: u16, host: &str, path: &str, key: Option<&str>) -> (u16, String) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut req = ::reqwest::Client::new()
            .get(format!("http://127.0.0.1:{port}{path}"))
            .header("host", host);
        if let Some(k) = key {
            req = req.header("x-nthpool-key", k);
        }
        let r = req.send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    })
}

/// `serve` in front of a real `sandbox` process; a request in flight at SIGTERM completes and
/// the process exits 0.
#[test]
fn serve_proxies_to_a_sandbox_and_drains_on_sigterm() {
    let sandbox_port = free_port();
    let sandbox_listen = format!("127.0.0.1:{sandbox_port}");
    let _sandbox = spawn(
        BIN,
        &[
            "sandbox",
            "--listen",
            &sandbox_listen,
            "--latency-ms",
            "600",
        ],
        None,
    );
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let key = "cli-test-key-0123456789";
    let path = write_config(
        dir.path(),
        &format!(
            "{}[[pools]]\nname = \"demo\"\nupstream = \"http://127.0.0.1:{sandbox_port}\"\nkeys = [\"{key}\"]\n",
            server_toml(port, dir.path())
        ),
    );
    let mut server = spawn(BIN, &["serve", "--config", path.to_str().unwrap()], None);
    wait_listening(sandbox_port);
    wait_listening(port);
    let (status, body) = http(port, "demo.localhost", "/echo", Some(key));
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains(key), "the pool key reached the sandbox");

    // A slow request in flight, then SIGTERM: it still completes.
    let in_flight =
        std::thread::spawn(move || http(port, "demo.localhost", "/v1/chat/completions", Some(key)));
    std::thread::sleep(Duration::from_millis(200));
    let pid = server.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let (status, _) = in_flight.join().unwrap();
    // The sandbox's chat route wants POST; what matters is that an answer came back.
    assert!(
        status == 200 || status == 405,
        "in-flight request got {status}"
    );
    let mut exited = None;
    for _ in 0..200 {
        if let Some(s) = server.0.try_wait().unwrap() {
            exited = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let exited = exited.expect("serve did not exit after SIGTERM");
    assert!(exited.success(), "exit status {exited:?}");
}

/// `serve --demo` prints a key and commands that work.
#[test]
fn demo_mode_serves_with_no_network() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &server_toml(port, dir.path()));
    let mut child = Command::new(BIN)
        .args(["serve", "--demo", "--config", path.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _guard = Proc(child);
    wait_listening(port);
    let (mut key, mut own_port) = (None, None);
    let mut own_listener_next = false;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.trim().strip_prefix("export KEY='") {
            key = Some(rest.trim_end_matches('\'').to_string());
        }
        own_listener_next |= line.contains("on its own listener");
        if let Some(rest) = line.trim().strip_prefix("curl -s http://127.0.0.1:") {
            if own_listener_next {
                own_port = rest.split('/').next().and_then(|p| p.parse::<u16>().ok());
                break;
            }
        }
    }
    let key = key.expect("the demo printed no key");
    let (status, body) = http(port, "demo.localhost", "/echo", Some(&key));
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("sandbox-managed-credential"),
        "the managed credential was not injected: {body}"
    );
    // The demo pool's own listener: any Host, the same pool.
    let own_port = own_port.expect("the demo printed no listener of the pool's own");
    let (status, body) = http(own_port, "127.0.0.1", "/echo", Some(&key));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("sandbox-managed-credential"), "{body}");
}
