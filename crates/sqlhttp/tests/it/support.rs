//! Shared helpers: finding the server, a `Database` per test, a scratch schema, polling.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use nthbouncer_sqlhttp::{Database, Limits, SqlHttpError, SqlRequest, WireOptions};
use serde_json::{json, Value};
use tokio::sync::OnceCell;

static BASE_URL: OnceCell<String> = OnceCell::const_new();

/// The server's URL without query string. Tries `postgres` then `root` (the machine has both);
/// fails the test loudly when nothing answers.
pub async fn base_url() -> String {
    BASE_URL
        .get_or_init(|| async {
            if let Ok(url) = std::env::var("NTHBOUNCER_TEST_PG_URL") {
                return url;
            }
            let mut failures = Vec::new();
            for user in ["postgres", "root"] {
                let url = format!("postgres://{user}@127.0.0.1:5432/test");
                let db = Database::new(&url, quick_limits(1)).unwrap();
                match db.check().await {
                    Ok(()) => return url,
                    Err(e) => failures.push(format!("{user}: {e}")),
                }
            }
            panic!(
                "PostgreSQL is not answering at 127.0.0.1:5432 (database `test`, trust auth): {}. \
                 Start it (pg_ctlcluster 15 main start) or set NTHBOUNCER_TEST_PG_URL.",
                failures.join("; ")
            )
        })
        .await
        .clone()
}

pub fn quick_limits(max_connections: usize) -> Limits {
    Limits {
        max_connections,
        connect_timeout: Duration::from_secs(5),
        ..Limits::default()
    }
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A name unique to this test run: `{tag}_{pid}_{n}`.
pub fn unique(tag: &str) -> String {
    format!(
        "sqlhttp_{tag}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A pool whose sessions carry `application_name`.
pub async fn database(app: &str, limits: Limits) -> Database {
    let url = format!("{}?application_name={app}", base_url().await);
    Database::new(&url, limits).unwrap()
}

/// Runs one statement; the answer parsed, or the error.
pub async fn run(
    db: &Database,
    query: &str,
    params: Value,
    options: WireOptions,
) -> Result<Value, SqlHttpError> {
    let body = json!({ "query": query, "params": params }).to_string();
    let request = SqlRequest::from_slice(body.as_bytes())?;
    let answer = db.execute(&request, &options).await?;
    Ok(serde_json::from_slice(answer.body()).unwrap())
}

/// Runs a batch body (`{"queries": …}`).
pub async fn run_batch(
    db: &Database,
    queries: Value,
    options: WireOptions,
) -> Result<Value, SqlHttpError> {
    let body = json!({ "queries": queries }).to_string();
    let request = SqlRequest::from_slice(body.as_bytes())?;
    let answer = db.execute(&request, &options).await?;
    Ok(serde_json::from_slice(answer.body()).unwrap())
}

/// `run` in object mode without parameters, expecting success: the rows.
pub async fn rows(db: &Database, query: &str) -> Vec<Value> {
    let answer = run(db, query, json!([]), WireOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"));
    answer["rows"].as_array().unwrap().clone()
}

/// A scratch schema, dropped by `drop_now` (and created fresh, in case a failed run left one).
pub struct Schema {
    pub name: String,
    admin: Database,
}

impl Schema {
    pub async fn new(tag: &str) -> Schema {
        let name = unique(tag);
        let admin = database("sqlhttp_admin", quick_limits(1)).await;
        rows(&admin, &format!("DROP SCHEMA IF EXISTS {name} CASCADE")).await;
        rows(&admin, &format!("CREATE SCHEMA {name}")).await;
        Schema { name, admin }
    }

    pub async fn drop_now(self) {
        rows(
            &self.admin,
            &format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name),
        )
        .await;
    }
}

/// A monitoring pool, outside the pools under test.
pub async fn monitor() -> Database {
    database("sqlhttp_monitor", quick_limits(2)).await
}

/// Backends whose `application_name` is `app` (optionally only those running `like`).
pub async fn backends(monitor: &Database, app: &str, like: Option<&str>) -> i64 {
    let answer = run(
        monitor,
        "SELECT count(*)::int AS n FROM pg_stat_activity \
         WHERE application_name = $1 AND ($2::text IS NULL OR (state = 'active' AND query LIKE $2))",
        json!([app, like]),
        WireOptions::default(),
    )
    .await
    .unwrap();
    answer["rows"][0]["n"].as_i64().unwrap()
}

/// Polls `check` every 25 ms for up to 20 s; true once it held.
pub async fn eventually<F, Fut>(mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..800 {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}

pub fn array_mode() -> WireOptions {
    WireOptions {
        array_mode: true,
        ..WireOptions::default()
    }
}

pub fn raw_text() -> WireOptions {
    WireOptions {
        array_mode: true,
        raw_text_output: true,
        ..WireOptions::default()
    }
}
