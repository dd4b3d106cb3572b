//! Database pools (SPEC §8) end to end: the real router on loopback in front of the machine's
//! PostgreSQL (127.0.0.1:5432, trust auth, database `test`; `NTHBOUNCER_TEST_PG_URL`
//! overrides). Each test has its own schema and its own `application_name`, so tests run in
//! parallel and count only their own backends in `pg_stat_activity`.
//!
//! The upstream URL carries a password (trust auth ignores it): no answer may ever show it.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nthbouncer_sqlhttp::{Database, Limits, SqlRequest, WireOptions};
use nthbouncer_testkit::{gateway, Gateway, KEY};
use reqwest::Method;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::sync::OnceCell;

/// The password in every test pool's upstream URL.
const PASSWORD: &str = "pg-hunter2-never-shown";

static BASE_URL: OnceCell<String> = OnceCell::const_new();
static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// `postgres://user@127.0.0.1:5432/test` for whichever of `postgres` and `root` answers.
async fn base_url() -> String {
    BASE_URL
        .get_or_init(|| async {
            if let Ok(url) = std::env::var("NTHBOUNCER_TEST_PG_URL") {
                return url;
            }
            let mut failures = Vec::new();
            for user in ["postgres", "root"] {
                let url = format!("postgres://{user}@127.0.0.1:5432/test");
                match Database::new(&url, Limits::default())
                    .unwrap()
                    .check()
                    .await
                {
                    Ok(()) => return url,
                    Err(e) => failures.push(format!("{user}: {e}")),
                }
            }
            panic!(
                "PostgreSQL is not answering at 127.0.0.1:5432 (database `test`, trust auth): {}",
                failures.join("; ")
            )
        })
        .await
        .clone()
}

/// A name unique to this run: `nbdb_{tag}_{pid}_{n}`.
fn unique(tag: &str) -> String {
    format!(
        "nbdb_{tag}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// The base URL with the test password and an `application_name`.
async fn upstream_url(app: &str) -> String {
    let base = base_url().await;
    let with_password = base.replacen('@', &format!(":{PASSWORD}@"), 1);
    format!("{with_password}?application_name={app}")
}

/// `[[pools]]` of a database pool `name` whose sessions carry `app`.
async fn pool_toml(name: &str, app: &str, extra: &str) -> String {
    format!(
        "[[pools]]\nname = \"{name}\"\nkind = \"database\"\nupstream = \"{}\"\nkeys = [\"{KEY}\"]\n{extra}",
        upstream_url(app).await
    )
}

/// Runs SQL outside the gateway (setup, and watching `pg_stat_activity`).
struct Direct(Database);

impl Direct {
    async fn new() -> Direct {
        let url = format!("{}?application_name=nbdb_monitor", base_url().await);
        Direct(Database::new(&url, Limits::default()).unwrap())
    }

    async fn rows(&self, query: &str, params: Value) -> Vec<Value> {
        let body = json!({"query": query, "params": params}).to_string();
        let request = SqlRequest::from_slice(body.as_bytes()).unwrap();
        let answer = self
            .0
            .execute(&request, &WireOptions::default())
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"));
        let v: Value = serde_json::from_slice(answer.body()).unwrap();
        v["rows"].as_array().unwrap().clone()
    }

    /// Backends of `app` (only those running a statement like `like`, if given).
    async fn backends(&self, app: &str, like: Option<&str>) -> i64 {
        let rows = self
            .rows(
                "SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1 \
                 AND ($2::text IS NULL OR (state = 'active' AND query LIKE $2))",
                json!([app, like]),
            )
            .await;
        rows[0]["n"].as_i64().unwrap()
    }
}

/// Polls `check` every 25 ms for up to 20 s; true once it held.
async fn eventually(check: impl AsyncFnMut() -> bool) -> bool {
    nthbouncer_testkit::wait_until(800, Duration::from_millis(25), check).await
}

/// Polls a job until it is terminal (up to 20 s); its last poll body.
async fn until_done(seen: &Seen, poll: impl Fn() -> reqwest::RequestBuilder) -> Value {
    let mut last = Value::Null;
    for _ in 0..800 {
        last = answer(seen, poll()).await.1;
        if matches!(
            last["status"].as_str(),
            Some("completed" | "failed" | "expired")
        ) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the job never finished: {last}")
}

/// Every answer a test saw, to look for the password in.
#[derive(Default)]
struct Seen(std::sync::Mutex<Vec<String>>);

impl Seen {
    fn keep(&self, status: u16, headers: &reqwest::header::HeaderMap, body: &str) {
        let mut text = format!("{status}\n");
        for (k, v) in headers {
            text.push_str(&format!("{k}: {}\n", v.to_str().unwrap_or("?")));
        }
        text.push_str(body);
        self.0.lock().unwrap().push(text);
    }

    fn assert_no_password(&self) {
        let seen = self.0.lock().unwrap();
        assert!(!seen.is_empty());
        for answer in seen.iter() {
            assert!(
                !answer.contains(PASSWORD),
                "the password in an answer: {answer}"
            );
        }
    }
}

/// A `POST /sql` of `body` on pool `pool`'s host with the test key.
fn sql_post(gw: &Gateway, pool: &str, body: Value) -> reqwest::RequestBuilder {
    gw.pool(pool, Method::POST, "/sql")
        .header("x-nthpool-key", KEY)
        .json(&body)
}

/// The same, sent: the status and the JSON body.
async fn sql(gw: &Gateway, seen: &Seen, pool: &str, body: Value) -> (u16, Value) {
    answer(seen, sql_post(gw, pool, body)).await
}

async fn answer(seen: &Seen, req: reqwest::RequestBuilder) -> (u16, Value) {
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let text = r.text().await.unwrap();
    seen.keep(status, &headers, &text);
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}

#[tokio::test]
async fn queries_types_batches_and_errors_through_the_pool_host() {
    let app = unique("types");
    let schema = unique("s");
    let gw = gateway(&pool_toml("db", &app, "").await).await;
    let seen = Seen::default();

    let (status, v) = sql(
        &gw,
        &seen,
        "db",
        json!({"query": "SELECT $1::int2 AS i2, $2::int4 AS i4, $3::int8 AS i8, \
            $4::numeric AS n, 1.5::float8 AS f, true AS b, 'x'::text AS t, NULL::text AS z, \
            '\\x0102'::bytea AS by, '2024-01-02'::date AS d, '03:04:05'::time AS tm, \
            '2024-01-02 03:04:05+00'::timestamptz AS ts, '1 day'::interval AS iv, \
            'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid AS u, '{\"k\": [1]}'::jsonb AS j, \
            '{\"k\": 2}'::json AS js, ARRAY[1, NULL, 3]::int4[] AS arr",
            "params": [7, 70000, "9007199254740993", "12345678901234567890.5"]}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["command"].as_str(), v["rowCount"].as_i64()),
        (Some("SELECT"), Some(1))
    );
    let row = &v["rows"][0];
    assert_eq!(row["i2"], json!(7));
    assert_eq!(row["i4"], json!(70000));
    assert_eq!(
        row["i8"],
        json!("9007199254740993"),
        "int8 kept exact as text"
    );
    assert_eq!(row["n"], json!("12345678901234567890.5"));
    assert_eq!(row["f"], json!(1.5));
    assert_eq!(
        (&row["b"], &row["t"], &row["z"]),
        (&json!(true), &json!("x"), &Value::Null)
    );
    assert_eq!(row["by"], json!("\\x0102"));
    assert_eq!(row["d"], json!("2024-01-02"));
    assert_eq!(row["tm"], json!("03:04:05"));
    assert!(
        row["ts"].as_str().unwrap().starts_with("2024-01-0"),
        "{row}"
    );
    assert_eq!(row["iv"], json!("1 day"));
    assert_eq!(row["u"], json!("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"));
    assert_eq!(row["j"], json!({"k": [1]}));
    assert_eq!(row["js"], json!({"k": 2}));
    assert_eq!(row["arr"], json!([1, null, 3]));
    let types: Vec<i64> = v["fields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["dataTypeID"].as_i64().unwrap())
        .collect();
    assert_eq!(&types[..4], &[21, 23, 20, 1700]);

    // What the driver sends: arrays of text, parsed by type id; its authToken as a Bearer
    // token, and a connection string of its own, which is ignored.
    let r = gw
        .pool("db", Method::POST, "/sql")
        .bearer_auth(KEY)
        .header(
            "neon-connection-string",
            "postgresql://someone:else@elsewhere/db",
        )
        .header("neon-array-mode", "true")
        .header("neon-raw-text-output", "true")
        .json(&json!({"query": "SELECT 1::int4 AS one, true AS t", "params": []}));
    let (status, v) = answer(&seen, r).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["rows"], json!([["1", "t"]]));
    assert_eq!(v["rowAsArray"], json!(true));

    // Without a key: 401, like every pool route.
    let r = gw
        .pool("db", Method::POST, "/sql")
        .json(&json!({"query": "SELECT 1"}));
    assert_eq!(answer(&seen, r).await.0, 401);
    // Other routes of the pool host.
    let r = gw
        .pool("db", Method::GET, "/sql")
        .header("x-nthpool-key", KEY);
    assert_eq!(answer(&seen, r).await.0, 405);
    let r = gw
        .pool("db", Method::GET, "/elsewhere")
        .header("x-nthpool-key", KEY);
    let (status, v) = answer(&seen, r).await;
    assert_eq!((status, v["error"].as_str()), (404, Some("not_found")));

    // A batch commits as one transaction...
    let setup = json!({"queries": [
        {"query": format!("CREATE SCHEMA {schema}")},
        {"query": format!("CREATE TABLE {schema}.t (id int PRIMARY KEY, v text NOT NULL)")},
        {"query": format!("INSERT INTO {schema}.t VALUES ($1, $2), (2, 'b')"), "params": [1, "a"]},
    ]});
    let r = sql_post(&gw, "db", setup).header("neon-batch-isolation-level", "Serializable");
    let (status, v) = answer(&seen, r).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["results"][2]["command"], json!("INSERT"));
    assert_eq!(v["results"][2]["rowCount"], json!(2));

    // ...and rolls back whole on an error, answered with PostgreSQL's fields.
    let failing = json!({"queries": [
        {"query": format!("INSERT INTO {schema}.t VALUES (3, 'c')")},
        {"query": format!("INSERT INTO {schema}.t VALUES (1, 'again')")},
    ]});
    let (status, v) = sql(&gw, &seen, "db", failing).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"], json!("sql_error"));
    assert_eq!(v["code"], json!("23505"));
    assert_eq!(v["constraint"], json!("t_pkey"));
    assert_eq!(
        (v["schema"].as_str(), v["table"].as_str()),
        (Some(schema.as_str()), Some("t"))
    );
    assert!(v["detail"].as_str().unwrap().contains("(id)=(1)"), "{v}");
    assert!(v["requestId"].is_string(), "{v}");
    let (_, v) = sql(
        &gw,
        &seen,
        "db",
        json!({"query": format!("SELECT count(*)::int AS n FROM {schema}.t")}),
    )
    .await;
    assert_eq!(
        v["rows"][0]["n"],
        json!(2),
        "the failed batch left nothing behind"
    );

    // A syntax error names its position; bad input names its field and costs no slot.
    let (status, v) = sql(&gw, &seen, "db", json!({"query": "SELEC 1"})).await;
    assert_eq!(
        (status, v["code"].as_str(), v["position"].as_str()),
        (400, Some("42601"), Some("1"))
    );
    let (status, v) = sql(&gw, &seen, "db", json!({"queries": [{"params": []}]})).await;
    assert_eq!(
        (status, v["error"].as_str(), v["field"].as_str()),
        (400, Some("invalid"), Some("queries[0].query"))
    );
    let r = sql_post(&gw, "db", json!({"query": "SELECT 1"}))
        .header("neon-batch-isolation-level", "Snapshot");
    let (status, v) = answer(&seen, r).await;
    assert_eq!(
        (status, v["field"].as_str()),
        (400, Some("Neon-Batch-Isolation-Level"))
    );

    // Each request has its access-log row.
    gw.flush_access_log().await;
    let (_, log) = gw
        .admin(Method::GET, "/admin/pools/db/access-log?limit=100", None)
        .await;
    seen.keep(200, &Default::default(), &log.to_string());
    let rows: Vec<(String, u64)> = log["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["route"].as_str().unwrap().to_string(),
                r["status"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(
        rows.contains(&("sql POST /sql".to_string(), 200)),
        "{rows:?}"
    );
    assert!(
        rows.contains(&("sql POST /sql".to_string(), 400)),
        "{rows:?}"
    );
    assert!(
        rows.contains(&("sql POST /sql".to_string(), 401)),
        "{rows:?}"
    );

    let (_, pool) = gw.admin(Method::GET, "/admin/pools/db", None).await;
    seen.keep(200, &Default::default(), &pool.to_string());
    assert!(
        pool["upstream"].as_str().unwrap().contains(":****@"),
        "{pool}"
    );
    seen.assert_no_password();
    Direct::new()
        .await
        .rows(
            &format!("DROP SCHEMA IF EXISTS {schema} CASCADE"),
            json!([]),
        )
        .await;
}

#[tokio::test]
async fn past_max_response_bytes_the_answer_is_507_and_an_unreachable_database_502() {
    let app = unique("cap");
    let toml = pool_toml("db", &app, "[pools.database]\nmax_response_bytes = 2000\n").await
        + &format!(
            "[[pools]]\nname = \"down\"\nkind = \"database\"\nupstream = \"postgres://app:{PASSWORD}@127.0.0.1:1/db\"\nkeys = [\"{KEY}\"]\n[pools.database]\nconnect_timeout_ms = 2000\n"
        );
    let gw = gateway(&toml).await;
    let seen = Seen::default();
    let big = json!({"query": "SELECT repeat('x', 100) AS x FROM generate_series(1, 1000)"});
    let (status, v) = sql(&gw, &seen, "db", big).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (507, Some("response_too_large")),
        "{v}"
    );
    // Small answers still fit, and the pool goes on.
    let (status, _) = sql(&gw, &seen, "db", json!({"query": "SELECT 1 AS one"})).await;
    assert_eq!(status, 200);

    let (status, v) = sql(&gw, &seen, "down", json!({"query": "SELECT 1"})).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (502, Some("upstream_unreachable")),
        "{v}"
    );

    // Bad settings through the admin API name the field, and never echo the URL.
    for (extra, field) in [
        (
            json!({"database": {"ca_file": "/dev/zero"}}),
            "database.ca_file",
        ),
        (
            json!({"database": {"max_response_bytes": 0}}),
            "database.max_response_bytes",
        ),
        (
            json!({"upstream": format!("mysql://app:{PASSWORD}@h/db")}),
            "upstream",
        ),
        (json!({"upstream_headers": {"x": "y"}}), "upstream_headers"),
    ] {
        let mut body = json!({"name": "bad", "kind": "database", "keys": [KEY],
            "upstream": format!("postgres://app:{PASSWORD}@127.0.0.1:5432/test")});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = gw.post("/admin/pools", body).await;
        seen.keep(status, &Default::default(), &v.to_string());
        assert_eq!((status, v["field"].as_str()), (400, Some(field)), "{v}");
    }
    seen.assert_no_password();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_holds_under_a_flood() {
    let app = unique("flood");
    let gw =
        Arc::new(gateway(&pool_toml("db", &app, "[pools.concurrency]\nlimit = 3\n").await).await);
    let direct = Arc::new(Direct::new().await);
    let most = Arc::new(AtomicI64::new(0));
    let stop = Arc::new(tokio::sync::Notify::new());
    let watcher = {
        let (direct, most, stop, app) = (direct.clone(), most.clone(), stop.clone(), app.clone());
        tokio::spawn(async move {
            loop {
                let n = direct.backends(&app, None).await;
                most.fetch_max(n, Ordering::Relaxed);
                tokio::select! {
                    _ = stop.notified() => return,
                    _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                }
            }
        })
    };
    let seen = Arc::new(Seen::default());
    let mut flood = Vec::new();
    for _ in 0..30 {
        let (gw, seen) = (gw.clone(), seen.clone());
        flood.push(tokio::spawn(async move {
            sql(&gw, &seen, "db", json!({"query": "SELECT pg_sleep(0.05)"}))
                .await
                .0
        }));
    }
    for call in flood {
        assert_eq!(call.await.unwrap(), 200);
    }
    stop.notify_one();
    watcher.await.unwrap();
    let most = most.load(Ordering::Relaxed);
    assert!(
        (1..=3).contains(&most),
        "{most} sessions open at once; the cap is 3"
    );
    let (_, state) = gw.admin(Method::GET, "/admin/pools/db/state", None).await;
    assert_eq!(state["inFlight"], json!(0), "{state}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_goes_away_has_its_query_cancelled() {
    let app = unique("gone");
    let gw = gateway(&pool_toml("db", &app, "[pools.concurrency]\nlimit = 1\n").await).await;
    let direct = Direct::new().await;
    let body = r#"{"query":"SELECT pg_sleep(30)"}"#;
    let head = format!(
        "POST /sql HTTP/1.1\r\nhost: db.localhost\r\nx-nthpool-key: {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let addr = gw.base.trim_start_matches("http://").to_string();
    let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
    socket.write_all(head.as_bytes()).await.unwrap();
    assert!(
        eventually(async || direct.backends(&app, Some("%pg_sleep(30)%")).await == 1).await,
        "the query never showed up in pg_stat_activity"
    );
    drop(socket);
    assert!(
        eventually(async || direct.backends(&app, Some("%pg_sleep(30)%")).await == 0).await,
        "the query of a caller that went away is still running"
    );
    // Its slot is free again (limit 1): the next caller is served without waiting.
    let seen = Seen::default();
    let r =
        sql_post(&gw, "db", json!({"query": "SELECT 2 AS two"})).header("x-nthpool-no-queue", "1");
    let (status, v) = answer(&seen, r).await;
    assert_eq!((status, &v["rows"]), (200, &json!([{"two": 2}])), "{v}");
}

#[tokio::test]
async fn async_handles_are_polled_on_the_pool_host_as_reached() {
    let app = unique("async");
    let toml = pool_toml(
        "db",
        &app,
        "listen = \"127.0.0.1:0\"\n[pools.async]\nenabled = true\n",
    )
    .await
        + &pool_toml("sync", &unique("sync"), "").await;
    let gw = gateway(&toml).await;
    let seen = Seen::default();
    let listener = gw.running.state.pools.listeners.addr("db").unwrap();

    // Through the main listener: the handle is on the pool's host as the request named it
    // (the test's `Host` is `db.localhost`, without the port).
    let r = sql_post(
        &gw,
        "db",
        json!({"query": "SELECT $1::int AS n", "params": [5]}),
    )
    .header("x-nthpool-async", "1")
    .header("neon-array-mode", "true");
    let (status, v) = answer(&seen, r).await;
    assert_eq!(status, 202, "{v}");
    let job = v["jobId"].as_str().unwrap().to_string();
    assert_eq!(
        v["pollUrl"],
        json!(format!("http://db.localhost/jobs/{job}"))
    );
    let poll = || {
        gw.pool("db", Method::GET, &format!("/jobs/{job}"))
            .header("x-nthpool-key", KEY)
    };
    let done = until_done(&seen, poll).await;

    assert_eq!(done["status"], json!("completed"), "{done}");
    assert_eq!(done["result"]["status"], json!(200));
    let result: Value = serde_json::from_str(done["result"]["body"].as_str().unwrap()).unwrap();
    assert_eq!(result["rows"], json!([[5]]), "the job kept Neon-Array-Mode");
    // Polling needs the pool key; a job of another pool is not found here.
    let r = gw.pool("db", Method::GET, &format!("/jobs/{job}"));
    assert_eq!(answer(&seen, r).await.0, 401);
    let r = gw
        .pool(
            "db",
            Method::GET,
            "/jobs/job_00000000000000000000000000000000",
        )
        .header("x-nthpool-key", KEY);
    assert_eq!(answer(&seen, r).await.1["error"], json!("job_not_found"));

    // Through the pool's own listener: the handle is on that listener.
    let r = reqwest::Client::new()
        .post(format!("http://{listener}/sql"))
        .bearer_auth(KEY)
        .header("x-nthpool-async", "1")
        .json(&json!({"query": "SELECT nope"}));
    let (status, v) = answer(&seen, r).await;
    assert_eq!(status, 202, "{v}");
    let poll_url = v["pollUrl"].as_str().unwrap().to_string();
    assert!(
        poll_url.starts_with(&format!("http://{listener}/jobs/job_")),
        "{poll_url}"
    );
    let done = until_done(&seen, || {
        reqwest::Client::new().get(&poll_url).bearer_auth(KEY)
    })
    .await;

    // A SQL error is an answer: the job completed with it.
    assert_eq!(done["result"]["status"], json!(400), "{done}");
    assert!(
        done["result"]["body"].as_str().unwrap().contains("42703"),
        "{done}"
    );

    // A pool without async refuses the header.
    let r = sql_post(&gw, "sync", json!({"query": "SELECT 1"})).header("x-nthpool-async", "1");
    let (status, v) = answer(&seen, r).await;
    assert_eq!((status, v["error"].as_str()), (400, Some("async_disabled")));
    seen.assert_no_password();
}
