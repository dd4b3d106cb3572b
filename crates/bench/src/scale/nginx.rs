//! The peer row of the scale benchmark (issue #14): nginx, one worker, holding the same number of
//! idle HTTP/1.1 keep-alive connections (each after one request) as nthbouncer's `h1-idle` row,
//! so the per-connection memory of the two is printed side by side.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::Method;

use super::{mem, open_idle_connections, Mem, Req, Row};
use crate::BoxError;

/// Starts nginx (`nginx` is its binary) in a directory of its own under `dir`, opens `n` idle
/// keep-alive connections to it and measures master + worker, as `run_waiters` measures the
/// server for its idle-connection row.
pub(super) async fn idle_row(
    nginx: &Path,
    dir: &Path,
    n: usize,
    connect_concurrency: usize,
    settle: Duration,
) -> Result<Row, BoxError> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let home = dir.join("nginx");
    std::fs::create_dir_all(&home)?;
    let h = home.display();
    let conf = home.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "worker_processes 1;\ndaemon off;\npid {h}/nginx.pid;\nerror_log {h}/error.log warn;\n\
             worker_rlimit_nofile {};\nevents {{ worker_connections {}; }}\n\
             http {{\n  access_log off;\n  keepalive_timeout 600s;\n  keepalive_requests 1000000;\n  \
             client_body_temp_path {h}/body;\n  proxy_temp_path {h}/proxy;\n  \
             fastcgi_temp_path {h}/fastcgi;\n  uwsgi_temp_path {h}/uwsgi;\n  scgi_temp_path {h}/scgi;\n  \
             server {{ listen {addr}; location / {{ return 200 \"ok\\n\"; }} }}\n}}\n",
            n + 1024,
            n + 512
        ),
    )?;
    let mut child = tokio::process::Command::new(nginx)
        .arg("-p")
        .arg(&home)
        .arg("-c")
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(home.join("stderr.log"))?)
        .kill_on_drop(true)
        .spawn()?;
    let master = child.id().ok_or("nginx exited at once")?;
    let result = measure(addr, master, n, connect_concurrency, settle).await;
    let _ = child.kill().await;
    result
}

async fn measure(
    addr: std::net::SocketAddr,
    master: u32,
    n: usize,
    connect_concurrency: usize,
    settle: Duration,
) -> Result<Row, BoxError> {
    let started = Instant::now();
    loop {
        if open_idle_connections(addr, 1, 1, request()).await.is_ok() {
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            return Err(format!("nginx did not answer on {addr} within 30 s").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(settle).await;
    let idle = tree_mem(master)?;
    let kept = open_idle_connections(addr, n, connect_concurrency, request()).await?;
    tokio::time::sleep(settle).await;
    let parked = tree_mem(master)?;
    drop(kept);
    tokio::time::sleep(settle).await;
    let released = tree_mem(master)?;
    Ok(Row {
        what: "nginx (1 worker): idle keep-alive connections".to_string(),
        transport: format!("HTTP/1.1, {} conns", super::count(n as f64)),
        waiters: n,
        idle,
        parked,
        released: Some(released),
        ready_after: None,
        goal: false,
        note: Some(
            "VmRSS of master + worker; nginx allocates its worker_connections' structures at \
             start, so they are in its idle figure"
                .to_string(),
        ),
    })
}

fn request() -> Req<'static> {
    Req {
        method: Method::GET,
        host: "localhost",
        path: "/",
        key: None,
        bearer: None,
        body: Bytes::new(),
    }
}

/// `pid` and its children (nginx's workers), summed.
fn tree_mem(pid: u32) -> Result<Mem, BoxError> {
    let mut total = mem(pid)?;
    for child in children(pid) {
        if let Ok(m) = mem(child) {
            total.rss += m.rss;
            total.hwm += m.hwm;
            total.anon += m.anon;
            total.threads += m.threads;
        }
    }
    Ok(total)
}

fn children(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                // After the command name (which may hold spaces and parentheses): state, ppid.
                stat.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(parent)
            })
        })
        .collect()
}
