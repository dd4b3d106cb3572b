//! The dashboard over loopback: the per-second history behind the admin token, the login that
//! exchanges the admin token for a session cookie, the pages it opens, CSRF on its POSTs,
//! logout, and a cookie that opens nothing of the admin API.

use nthbouncer_testkit::*;
use reqwest::header as h;
use reqwest::{Method, StatusCode};
use serde_json::Value;

/// The sums of a history's counters over its 900 seconds.
fn totals(history: &Value) -> [u64; 4] {
    let seconds = history["seconds"].as_array().unwrap();
    assert_eq!(seconds.len(), 900, "fifteen minutes, second by second");
    let sum = |field: &str| seconds.iter().map(|s| s[field].as_u64().unwrap()).sum();
    [
        sum("admitted"),
        sum("refused"),
        sum("queued"),
        sum("origin429"),
    ]
}

#[tokio::test]
async fn history_counts_admissions_refusals_and_origin_429s() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "limit = 1")).await;
    let (status, empty) = gw.admin(Method::GET, "/admin/pools/p/history", None).await;
    assert_eq!(status, 200);
    assert_eq!(empty["pool"], "p");
    assert_eq!(totals(&empty), [0, 0, 0, 0]);

    for _ in 0..3 {
        assert_eq!(send(gw.get("p", "/echo")).await.status(), 200);
    }
    // Waits: a proxied call's slot is freed once its body was handed over.
    let wait = Some(std::time::Duration::from_secs(10));
    let held = gw.lock_client("p").acquire(wait).await.unwrap();
    for _ in 0..2 {
        assert_eq!(send(gw.no_queue("p", "/echo")).await.status(), 429);
    }
    held.release(None).await.unwrap();
    let history = gw.admin_json("/admin/pools/p/history").await;
    let [admitted, refused, _, origin429] = totals(&history);
    assert_eq!((admitted, refused, origin429), (4, 2, 0), "{history}");

    // An origin 429 the proxy saw is counted once its slot is released.
    assert_eq!(send(gw.get("p", "/status/429")).await.status(), 429);
    eventually("the origin 429 in the history", async || {
        let history = gw.admin_json("/admin/pools/p/history").await;
        (totals(&history)[3] == 1).then_some(())
    })
    .await;

    expect_error(
        send(gw.api(Method::GET, "/admin/pools/nope/history")).await,
        404,
        "pool_not_found",
    )
    .await;
    expect_error(
        send(gw.api_anon(Method::GET, "/admin/pools/p/history")).await,
        401,
        "unauthorized",
    )
    .await;
}

/// A browser that does not follow redirects, so each answer is seen as sent.
fn browser() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

struct Dash<'a> {
    gw: &'a Gateway,
    http: reqwest::Client,
    /// The signed-in session's `name=value` cookie pair and CSRF token (empty before).
    cookie: String,
    csrf: String,
}

impl<'a> Dash<'a> {
    /// A browser that has not signed in.
    fn new(gw: &'a Gateway) -> Self {
        let (cookie, csrf) = (String::new(), String::new());
        let http = browser();
        Dash {
            gw,
            http,
            cookie,
            csrf,
        }
    }

    /// A browser that logged in and read its session's CSRF token.
    async fn signed_in(gw: &'a Gateway) -> Self {
        let mut d = Dash::new(gw);
        d.cookie = d.login().await.0;
        let (_, page) = d.page("/dashboard").await;
        d.csrf = csrf_of(&page);
        d
    }

    fn req(&self, method: Method, path: &str, cookie: Option<&str>) -> reqwest::RequestBuilder {
        let rb = self
            .http
            .request(method, format!("{}{}", self.gw.base, path))
            .header("host", API_HOST);
        match cookie {
            Some(c) => rb.header(h::COOKIE, c),
            None => rb,
        }
    }

    /// A GET with the session's cookie.
    fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.req(Method::GET, path, Some(&self.cookie))
    }

    async fn post_form(&self, path: &str, cookie: Option<&str>, form: &str) -> reqwest::Response {
        send(
            self.req(Method::POST, path, cookie)
                .header(h::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(form.to_string()),
        )
        .await
    }

    /// Logs in; the `name=value` pair to send back and the whole `Set-Cookie`.
    async fn login(&self) -> (String, String) {
        let r = self
            .post_form("/dashboard/login", None, &format!("token={ADMIN_TOKEN}"))
            .await;
        assert_eq!(r.status(), StatusCode::SEE_OTHER);
        assert_eq!(r.headers()[h::LOCATION], "/dashboard");
        let set = r.headers()[h::SET_COOKIE].to_str().unwrap().to_string();
        let pair = set.split(';').next().unwrap().trim().to_string();
        (pair, set)
    }
}

fn location(r: &reqwest::Response) -> &str {
    r.headers()[h::LOCATION].to_str().unwrap()
}

#[tokio::test]
async fn login_session_csrf_and_logout() {
    let up = Upstream::start().await;
    let gw =
        gateway(&(pool_toml("alpha", &up.url(), "") + &pool_toml("beta", &up.url(), ""))).await;
    let d = Dash::new(&gw);

    // No session: the dashboard sends the browser to the login form.
    let r = send(d.req(Method::GET, "/dashboard", None)).await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(location(&r), "/dashboard/login");
    let form = send(d.req(Method::GET, "/dashboard/login", None)).await;
    assert_eq!(form.status(), 200);
    let form = form.text().await.unwrap();
    assert!(form.contains("<html lang=\"en\">"), "{form}");
    assert!(form.contains("<label for=\"token\">") && form.contains("id=\"token\""));

    // A wrong token: the form again, with an error, and no cookie.
    let r = d
        .post_form("/dashboard/login", None, "token=not-the-admin-token")
        .await;
    assert_eq!(r.status(), 401);
    assert!(r.headers().get(h::SET_COOKIE).is_none());
    let page = r.text().await.unwrap();
    assert!(page.contains("role=\"alert\"") && page.contains("name=\"token\""));
    assert!(!page.contains("not-the-admin-token"), "the token is echoed");

    // The right token: a cookie only scripts cannot read and other sites cannot send.
    let (cookie, set) = d.login().await;
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/dashboard", "Max-Age="] {
        assert!(set.contains(attribute), "{attribute} missing: {set}");
    }
    assert!(!set.contains("Secure"), "plain HTTP listener: {set}");

    let page = send(d.req(Method::GET, "/dashboard", Some(&cookie))).await;
    assert_eq!(page.status(), 200);
    let page = page.text().await.unwrap();
    for pool in ["alpha", "beta"] {
        assert!(page.contains(&format!("data-pool=\"{pool}\"")), "{page}");
    }
    assert!(page.contains("<th scope=\"col\">"));
    let (status, live) = call(d.req(Method::GET, "/dashboard/api/pools", Some(&cookie))).await;
    assert_eq!(status, 200);
    let names: Vec<_> = live["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].clone())
        .collect();
    assert_eq!(names, ["alpha", "beta"]);
    assert_eq!(live["items"][0]["effectiveLimit"], 10, "{live}");

    // The cookie opens the dashboard only: the admin API takes the Bearer token alone.
    let r = send(d.req(Method::GET, "/admin/pools", Some(&cookie))).await;
    expect_error(r, 401, "unauthorized").await;

    // Logout needs the session's CSRF token.
    let csrf = csrf_of(&page);
    assert_eq!(csrf.len(), 64);
    let r = d.post_form("/dashboard/logout", Some(&cookie), "").await;
    assert_eq!(r.status(), 403);
    let r = d
        .post_form("/dashboard/logout", Some(&cookie), "csrf=0000")
        .await;
    assert_eq!(r.status(), 403);
    assert_eq!(
        send(d.req(Method::GET, "/dashboard", Some(&cookie)))
            .await
            .status(),
        200
    );
    let r = d
        .post_form("/dashboard/logout", Some(&cookie), &format!("csrf={csrf}"))
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert!(r.headers()[h::SET_COOKIE]
        .to_str()
        .unwrap()
        .contains("Max-Age=0"));

    // The ended session's cookie opens nothing.
    let r = send(d.req(Method::GET, "/dashboard", Some(&cookie))).await;
    assert_eq!(
        (r.status(), location(&r)),
        (StatusCode::SEE_OTHER, "/dashboard/login")
    );
    let r = send(d.req(Method::GET, "/dashboard/api/pools", Some(&cookie))).await;
    expect_error(r, 401, "unauthorized").await;
}

#[tokio::test]
async fn assets_are_embedded_and_cacheable() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "")).await;
    let d = Dash::new(&gw);
    for (path, kind) in [
        ("/dashboard/assets/dashboard.js", "text/javascript"),
        ("/dashboard/assets/dashboard.css", "text/css"),
    ] {
        let r = send(d.req(Method::GET, path, None)).await;
        assert_eq!(r.status(), 200, "{path}");
        assert!(r.headers()[h::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with(kind));
        assert!(r.headers()[h::CACHE_CONTROL]
            .to_str()
            .unwrap()
            .contains("max-age="));
        assert!(!r.text().await.unwrap().is_empty());
    }
}

#[tokio::test]
async fn a_pools_overview_has_examples_for_its_own_host() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("alpha", &up.url(), "")).await;
    let d = Dash::new(&gw);
    let r = send(d.req(Method::GET, "/dashboard/pools/alpha", None)).await;
    assert_eq!(
        (r.status(), location(&r)),
        (StatusCode::SEE_OTHER, "/dashboard/login")
    );
    let d = Dash::signed_in(&gw).await;
    let (status, page) = d.page("/dashboard/pools/alpha").await;
    assert_eq!(status, 200);
    let port = gw.running.addr.port();
    for expected in [
        format!("http://api.localhost:{port}/pools/alpha/lock/acquire"),
        format!("http://api.localhost:{port}/pools/alpha/lock/$SLOT/renew"),
        format!("http://api.localhost:{port}/pools/alpha/lock/$SLOT/release"),
        format!("curl -s http://alpha.localhost:{port}/v1/models"),
        "X-Nthpool-Async: 1".to_string(),
        format!("http://api.localhost:{port}/pools/alpha/jobs/$JOB_ID"),
        "YOUR_POOL_KEY".to_string(),
    ] {
        assert!(page.contains(&expected), "{expected} missing: {page}");
    }
    assert!(!page.contains(KEY), "a pool key is shown");
    assert!(page.contains("id=\"history-chart\""), "{page}");
    assert!(page.contains("data-total=\"admitted\">0<"), "{page}");

    // The chart's data, for the session (the admin route takes the Bearer token only).
    assert_eq!(send(gw.get("alpha", "/echo")).await.status(), 200);
    let (status, history) = call(d.get("/dashboard/api/pools/alpha/history")).await;
    assert_eq!(status, 200);
    assert_eq!(totals(&history)[0], 1, "{history}");
    let r = send(d.req(Method::GET, "/dashboard/api/pools/alpha/history", None)).await;
    expect_error(r, 401, "unauthorized").await;
    let r = send(d.get("/dashboard/api/pools/nope/history")).await;
    expect_error(r, 404, "pool_not_found").await;
    let r = send(d.get("/admin/pools/alpha/history")).await;
    expect_error(r, 401, "unauthorized").await;
    let r = send(d.get("/dashboard/pools/nope")).await;
    assert_eq!(r.status(), 404);
}

/// HTML text back to what it escapes.
fn unescape(html: &str) -> String {
    html.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

/// The shell lines of the Overview's example titled `title`.
fn example(page: &str, title: &str) -> String {
    let section = page
        .split(&format!("<h3>{title}</h3>"))
        .nth(1)
        .unwrap_or_else(|| panic!("no example {title:?}: {page}"));
    let code = section
        .split("<pre tabindex=\"0\"><code>")
        .nth(1)
        .and_then(|c| c.split("</code></pre>").next())
        .unwrap();
    unescape(code)
}

/// Runs an example's shell lines with bash, `curl` sent to the gateway whatever the host name;
/// what it printed.
async fn run_example(shell: &str, gw: &Gateway, host: &str, env: &[(&str, &str)]) -> String {
    let port = gw.running.addr.port();
    let shell = shell.replace(
        "curl -s ",
        &format!("curl -s -o /dev/null -w '%{{http_code}}' --resolve {host}:{port}:127.0.0.1 "),
    );
    let mut cmd = std::process::Command::new("bash");
    cmd.arg("-c").arg(&shell);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{shell}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn the_signed_example_is_accepted_as_written() {
    const SECRET: &str = "0123456789abcdef0123";
    let up = Upstream::start().await;
    let toml = pool_toml("signed", &up.url(), "")
        + &format!("[pools.access.hmac]\nsecrets = [\"{SECRET}\"]\n");
    let gw = gateway(&toml).await;
    let d = Dash::signed_in(&gw).await;
    let (_, page) = d.page("/dashboard/pools/signed").await;
    let shell = example(&page, "A signed call (access.hmac)").replace("YOUR_POOL_KEY", KEY);
    let host = format!("signed.localhost:{}", gw.running.addr.port());
    assert!(shell.contains(&format!("'{host}'")), "{shell}");
    let status = run_example(&shell, &gw, "signed.localhost", &[("HMAC_SECRET", SECRET)]).await;
    assert_eq!(status, "200", "{shell}");
    assert_eq!(up.total(), 1);
    let status = run_example(&shell, &gw, "signed.localhost", &[("HMAC_SECRET", "wrong")]).await;
    assert_eq!(status, "401");
    assert_eq!(up.total(), 1, "a wrong signature reached the origin");
}

#[tokio::test]
async fn a_database_pools_overview_has_a_query_example() {
    let toml = "[[pools]]\nname = \"db\"\nkind = \"database\"\n\
                upstream = \"postgres://app:s3cret-pw@127.0.0.1:5432/app\"\n"
        .to_string();
    let gw = gateway(&toml).await;
    let d = Dash::signed_in(&gw).await;
    let (_, page) = d.page("/dashboard/pools/db").await;
    let port = gw.running.addr.port();
    let sql = example(&page, "A SQL query");
    assert!(
        sql.contains(&format!("http://db.localhost:{port}/sql")) && sql.contains("\"query\""),
        "{sql}"
    );
    let signed = example(&page, "A signed call (access.hmac)");
    assert!(signed.contains("/sql"), "{signed}");
    assert!(
        !page.contains("s3cret-pw"),
        "the database password is shown"
    );
}

/// The text of `page` from just after `start` up to the next `end`.
fn between(page: &str, start: &str, end: char) -> String {
    let rest = page.split(start).nth(1);
    let found = rest.and_then(|rest| rest.split(end).next());
    found
        .unwrap_or_else(|| panic!("no {start}: {page}"))
        .to_string()
}

/// The session's CSRF token, from any signed-in page.
fn csrf_of(page: &str) -> String {
    between(page, "name=\"csrf\" value=\"", '"')
}

/// The `id` of the item of a list answer whose `field` is `value`.
fn id_where(list: &Value, field: &str, value: &str) -> String {
    let item = item_where(list, field, value);
    item["id"].as_str().unwrap().to_string()
}

/// A form body of `pairs`, encoded.
fn form(pairs: &[(&str, &str)]) -> String {
    serde_urlencoded::to_string(pairs).unwrap()
}

impl Dash<'_> {
    /// A signed-in page's status and text.
    async fn page(&self, path: &str) -> (u16, String) {
        let r = send(self.get(path)).await;
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// A signed-in POST of `pairs` (the CSRF token added): the status, `Location` and text.
    async fn submit(&self, path: &str, pairs: &[(&str, &str)]) -> (u16, String, String) {
        let mut all = vec![("csrf", self.csrf.as_str())];
        all.extend_from_slice(pairs);
        let r = self.post_form(path, Some(&self.cookie), &form(&all)).await;
        let location = r
            .headers()
            .get(h::LOCATION)
            .map(|l| l.to_str().unwrap().to_string())
            .unwrap_or_default();
        (r.status().as_u16(), location, r.text().await.unwrap())
    }
}

/// The Concurrency form as it comes, with `limit` changed.
fn concurrency_fields(limit: &str) -> Vec<(&str, &str)> {
    vec![
        ("limit", limit),
        ("min_limit", "1"),
        ("queue_size", "1000"),
        ("queue_timeout_ms", "30000"),
        ("rpm", "0"),
        ("request_timeout_ms", "120000"),
        ("lease_term_ms", "30000"),
        ("renew_interval_ms", "10000"),
        ("max_pause_ms", "300000"),
        ("adaptive", "true"),
        ("fair_share", "true"),
        ("proxy_wait", "open"),
    ]
}

#[tokio::test]
async fn a_pool_is_created_and_its_limit_changed_live_from_the_dashboard() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("owned", &up.url(), "")).await;
    let d = Dash::signed_in(&gw).await;
    let (_, list) = d.page("/dashboard").await;
    for markup in [
        "<h1 id=\"pools-title\">Pools</h1>",
        "data-testid=\"create-pool\"",
        "<label for=\"f-name\">",
        "<label for=\"f-upstream\">",
        "data-testid=\"logout\"",
    ] {
        assert!(list.contains(markup), "{markup} missing: {list}");
    }

    // Without the CSRF token nothing is created.
    let r = d
        .post_form(
            "/dashboard/pools",
            Some(&d.cookie),
            &form(&[("name", "fresh")]),
        )
        .await;
    assert_eq!(r.status(), 403);

    // Refused input: the message next to its field, the values kept.
    let upstream = up.url();
    let (status, _, page) = d
        .submit(
            "/dashboard/pools",
            &[
                ("name", "Bad Name!"),
                ("kind", "proxy"),
                ("upstream", &upstream),
                ("limit", "2"),
            ],
        )
        .await;
    assert_eq!(status, 400);
    assert!(page.contains("data-testid=\"error-name\""), "{page}");
    assert!(page.contains("value=\"Bad Name!\""), "{page}");

    let (status, location, _) = d
        .submit(
            "/dashboard/pools",
            &[
                ("name", "fresh"),
                ("kind", "proxy"),
                ("upstream", &upstream),
                ("limit", "2"),
            ],
        )
        .await;
    assert_eq!((status, location.as_str()), (303, "/dashboard/pools/fresh"));
    let pool = gw.admin_json("/admin/pools/fresh").await;
    assert_eq!(pool["managedBy"], "api");
    assert_eq!(pool["concurrency"]["limit"], 2);
    let (status, _, page) = d
        .submit(
            "/dashboard/pools",
            &[
                ("name", "fresh"),
                ("kind", "proxy"),
                ("upstream", &upstream),
                ("limit", "2"),
            ],
        )
        .await;
    assert_eq!(status, 409);
    assert!(page.contains("data-testid=\"form-error\""), "{page}");

    // The Concurrency page: the settings and the live state.
    let (status, page) = d.page("/dashboard/pools/fresh/concurrency").await;
    assert_eq!(status, 200);
    assert!(page.contains("<h1>fresh · Concurrency</h1>"), "{page}");
    assert!(page.contains("data-testid=\"field-limit\" ") && page.contains("value=\"2\""));
    assert!(page.contains("data-testid=\"limit\">2<"), "{page}");

    // Refused as the admin API refuses it, with the API's message next to the field.
    let mut spec = gw.admin_json("/admin/pools/fresh").await;
    spec["concurrency"]["limit"] = 0.into();
    let (status, api) = gw.put("/admin/pools/fresh", spec).await;
    assert_eq!(status, 400);
    let (status, _, page) = d
        .submit(
            "/dashboard/pools/fresh/concurrency",
            &concurrency_fields("0"),
        )
        .await;
    assert_eq!(status, 400);
    assert!(page.contains("id=\"f-limit-error\""), "{page}");
    let message = api["message"].as_str().unwrap();
    assert!(
        unescape(&page).contains(message),
        "{message} missing: {page}"
    );
    let (status, _, page) = d
        .submit(
            "/dashboard/pools/fresh/concurrency",
            &concurrency_fields("lots"),
        )
        .await;
    assert_eq!(status, 400);
    assert!(page.contains("id=\"f-limit-error\"") && page.contains("value=\"lots\""));
    assert_eq!(
        gw.admin_json("/admin/pools/fresh").await["concurrency"]["limit"],
        2
    );

    // Saved: applied at once.
    let (status, location, _) = d
        .submit(
            "/dashboard/pools/fresh/concurrency",
            &concurrency_fields("5"),
        )
        .await;
    assert_eq!(
        (status, location.as_str()),
        (303, "/dashboard/pools/fresh/concurrency?saved=1")
    );
    assert_eq!(
        gw.admin_json("/admin/pools/fresh/state").await["effectiveLimit"],
        5
    );
    assert_eq!(live_row(&d, "fresh").await["effectiveLimit"], 5);
    let (_, page) = d.page(&location).await;
    assert!(page.contains("role=\"status\""), "{page}");

    // A pool of the config file: read-only here, refused as by the API.
    let (_, page) = d.page("/dashboard/pools/owned/concurrency").await;
    assert!(page.contains("data-testid=\"read-only\"") && !page.contains("Save settings"));
    let (status, _, page) = d
        .submit(
            "/dashboard/pools/owned/concurrency",
            &concurrency_fields("3"),
        )
        .await;
    assert_eq!(status, 409);
    assert!(page.contains("data-testid=\"form-error\""), "{page}");
    assert_eq!(
        gw.admin_json("/admin/pools/owned/state").await["effectiveLimit"],
        10
    );
}

#[tokio::test]
async fn a_key_is_shown_once_and_revoked_from_the_dashboard() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "")).await;
    let d = Dash::signed_in(&gw).await;
    let (status, page) = d.page("/dashboard/pools/p/keys").await;
    assert_eq!(status, 200);
    assert_eq!(page.matches("data-testid=\"key-row\"").count(), 2, "{page}");
    assert!(
        !page.contains("data-testid=\"revoke-key\""),
        "config keys: {page}"
    );
    assert!(!page.contains(KEY), "a key is shown");

    let r = d
        .post_form("/dashboard/pools/p/keys", Some(&d.cookie), "label=ci")
        .await;
    assert_eq!(r.status(), 403);
    let (status, _, page) = d
        .submit("/dashboard/pools/p/keys", &[("label", "ci")])
        .await;
    assert_eq!(status, 201);
    let key = between(&page, "data-testid=\"new-key\">", '<');
    assert!(key.starts_with("nb_live_"), "{key}");
    let with_key = |key: &str| {
        gw.pool("p", Method::GET, "/echo")
            .header("x-nthpool-key", key.to_string())
    };
    assert_eq!(send(with_key(&key)).await.status(), 200);

    // Never shown again.
    let (_, page) = d.page("/dashboard/pools/p/keys").await;
    assert!(!page.contains(&key), "the key is shown twice");
    assert_eq!(page.matches("data-testid=\"key-row\"").count(), 3);
    let keys = gw.admin_json("/admin/pools/p/keys").await;
    let id = id_where(&keys, "label", "ci");
    assert!(page.contains(&format!("/dashboard/pools/p/keys/{id}/revoke")));

    // Refused as the API refuses it.
    let long = "x".repeat(201);
    let (status, api) = gw
        .post("/admin/pools/p/keys", serde_json::json!({ "label": long }))
        .await;
    assert_eq!(status, 400);
    let (status, _, page) = d
        .submit("/dashboard/pools/p/keys", &[("label", &long)])
        .await;
    assert_eq!(status, 400);
    assert!(page.contains("id=\"f-label-error\""), "{page}");
    assert!(page.contains(api["message"].as_str().unwrap()));

    let revoke = format!("/dashboard/pools/p/keys/{id}/revoke");
    let r = d.post_form(&revoke, Some(&d.cookie), "").await;
    assert_eq!(r.status(), 403);
    let (status, location, _) = d.submit(&revoke, &[]).await;
    assert_eq!(
        (status, location.as_str()),
        (303, &*format!("/dashboard/pools/p/keys?revoked={id}"))
    );
    expect_error(send(with_key(&key)).await, 401, "unauthorized").await;
    let (_, page) = d.page(&location).await;
    assert!(
        page.contains("role=\"status\"") && page.contains(">revoked<"),
        "{page}"
    );

    // A config key cannot be revoked here either.
    let config_id = id_where(&keys, "managedBy", "config");
    let (status, _, page) = d
        .submit(&format!("/dashboard/pools/p/keys/{config_id}/revoke"), &[])
        .await;
    assert_eq!(status, 409);
    assert!(page.contains("role=\"alert\""), "{page}");
    assert_eq!(send(gw.get("p", "/echo")).await.status(), 200);
}

/// The `data-destination-id` of the first destination row of a Webhooks page.
fn first_destination(page: &str) -> String {
    between(
        page,
        "data-testid=\"destination-row\" data-destination-id=\"",
        '"',
    )
}

#[tokio::test]
async fn webhooks_and_jobs_pages_show_deliveries_results_and_act_on_them() {
    let up = Upstream::start().await;
    let hook = nthbouncer_testkit::access::Recorder::start().await;
    let pool = pool_toml("p", &up.url(), "");
    let gw = gateway(&async_pool_toml(&pool, "", &format!("{}/hook", hook.url()))).await;
    let d = Dash::signed_in(&gw).await;

    let r = gw.post_async("p", "/echo").body("{\"prompt\":\"hi\"}");
    let job = accepted_id(send(r).await).await;
    eventually("the job's delivery attempt", async || {
        let page = gw.admin_json("/admin/pools/p/deliveries").await;
        (!page["items"].as_array()?.is_empty()).then_some(())
    })
    .await;

    // Jobs: filtered by status, one job's result.
    let (status, page) = d.page("/dashboard/pools/p/jobs").await;
    assert_eq!(status, 200);
    assert!(page.contains(&format!("data-job-id=\"{job}\"")), "{page}");
    let (_, page) = d.page("/dashboard/pools/p/jobs?status=completed").await;
    assert!(page.contains(&format!("data-job-id=\"{job}\"")), "{page}");
    let (_, page) = d.page("/dashboard/pools/p/jobs?status=failed").await;
    assert!(!page.contains("data-testid=\"job-row\""), "{page}");
    let (status, page) = d.page("/dashboard/pools/p/jobs?status=bogus").await;
    assert_eq!(status, 400);
    assert!(page.contains("data-testid=\"error-status\""), "{page}");
    let (status, page) = d.page(&format!("/dashboard/pools/p/jobs/{job}")).await;
    assert_eq!(status, 200);
    assert!(
        page.contains("data-testid=\"job-status\">completed<"),
        "{page}"
    );
    assert!(
        page.contains("data-testid=\"job-result-status\">200<"),
        "{page}"
    );
    // The upstream echoes the job's body inside its JSON answer.
    assert!(unescape(&page).contains(r#"{\"prompt\":\"hi\"}"#), "{page}");
    assert!(page.contains("data-testid=\"job-event\""));
    let (status, _) = d
        .page("/dashboard/pools/p/jobs/job_00000000000000000000000000000000")
        .await;
    assert_eq!(status, 404);

    // Webhooks: the destination (secret masked) and the attempt with its status and latency.
    let (status, page) = d.page("/dashboard/pools/p/webhooks").await;
    assert_eq!(status, 200);
    assert!(!page.contains(WEBHOOK_SECRET), "the secret is shown");
    assert!(
        page.contains("data-testid=\"destination-state\">active<"),
        "{page}"
    );
    assert!(
        page.contains("data-testid=\"attempt-status\">200<"),
        "{page}"
    );
    assert!(page.contains("data-testid=\"attempt-latency\">"));
    let id = first_destination(&page);

    // Deactivate and re-enable (a config destination: its state stays actionable).
    let toggle = format!("/dashboard/pools/p/webhooks/{id}/active");
    let r = d.post_form(&toggle, Some(&d.cookie), "active=false").await;
    assert_eq!(r.status(), 403);
    let (status, location, _) = d.submit(&toggle, &[("active", "false")]).await;
    assert_eq!(
        (status, location.as_str()),
        (303, "/dashboard/pools/p/webhooks?done=disabled")
    );
    let listed = gw.admin_json("/admin/pools/p/webhooks").await;
    assert_eq!(listed["items"][0]["active"], false);
    let (_, page) = d.page(&location).await;
    assert!(
        page.contains("data-testid=\"destination-state\">inactive<")
            && page.contains(">Re-enable<")
    );
    let (status, _, page) = d
        .submit(&format!("/dashboard/pools/p/jobs/{job}/redeliver"), &[])
        .await;
    assert_eq!(status, 409, "no active destination");
    assert!(page.contains("role=\"alert\""));
    let (status, _, _) = d.submit(&toggle, &[("active", "true")]).await;
    assert_eq!(status, 303);
    assert_eq!(
        gw.admin_json("/admin/pools/p/webhooks").await["items"][0]["active"],
        true
    );

    // Redeliver: a second delivery reaches the receiver.
    let (status, location, _) = d
        .submit(
            &format!("/dashboard/pools/p/jobs/{job}/redeliver"),
            &[("back", "webhooks")],
        )
        .await;
    assert_eq!(
        (status, location.as_str()),
        (303, "/dashboard/pools/p/webhooks?done=redelivered")
    );
    eventually("the redelivery", async || {
        (hook.completed() >= 2).then_some(())
    })
    .await;

    // A config destination's secret is the file's: no rotate button; rotating is refused.
    let rotate = format!("/dashboard/pools/p/webhooks/{id}/rotate");
    let (status, _, _) = d.submit(&rotate, &[]).await;
    assert_eq!(status, 409);

    // Add one: refused as the API refuses it, then its secret shown once; rotate it.
    let (status, _, page) = d
        .submit(
            "/dashboard/pools/p/webhooks",
            &[("url", "ftp://example.com/x")],
        )
        .await;
    assert_eq!(status, 400);
    assert!(page.contains("id=\"f-url-error\""), "{page}");
    let url = format!("{}/two", hook.url());
    let (status, _, page) = d
        .submit(
            "/dashboard/pools/p/webhooks",
            &[("url", &url), ("deactivate_after", "3")],
        )
        .await;
    assert_eq!(status, 201, "{page}");
    let secret = between(&page, "data-testid=\"new-secret\">", '<');
    assert!(secret.starts_with("whsec_"), "{secret}");
    let (_, page) = d.page("/dashboard/pools/p/webhooks").await;
    assert!(!page.contains(&secret), "the secret is shown twice");
    let hooks = gw.admin_json("/admin/pools/p/webhooks").await;
    let added = id_where(&hooks, "managedBy", "api");
    assert_eq!(page.matches("data-testid=\"rotate-secret\"").count(), 1);
    let (status, _, page) = d
        .submit(&format!("/dashboard/pools/p/webhooks/{added}/rotate"), &[])
        .await;
    assert_eq!(status, 200);
    let rotated = between(&page, "data-testid=\"new-secret\">", '<');
    assert!(rotated.starts_with("whsec_") && rotated != secret);
    let (_, page) = d.page("/dashboard/pools/p/webhooks").await;
    assert!(!page.contains(&rotated));
}

#[tokio::test]
async fn the_access_log_page_filters_and_pages() {
    let up = Upstream::start().await;
    let gw = gateway(&pool_toml("p", &up.url(), "")).await;
    let d = Dash::signed_in(&gw).await;
    for _ in 0..50 {
        assert_eq!(send(gw.get("p", "/echo")).await.status(), 200);
    }
    let anon = gw.pool("p", Method::GET, "/echo");
    assert_eq!(send(anon).await.status(), 401);
    gw.flush_access_log().await;

    let (status, page) = d.page("/dashboard/pools/p/access-log").await;
    assert_eq!(status, 200);
    assert!(page.contains("<label for=\"f-outcome\">"), "{page}");
    assert_eq!(page.matches("data-testid=\"log-row\"").count(), 50);
    let next = page
        .split("href=\"")
        .find(|s| s.contains("data-testid=\"next-page\""))
        .and_then(|s| s.split('"').next())
        .unwrap_or_else(|| panic!("no next page: {page}"))
        .replace("&amp;", "&");
    let (_, older) = d.page(&next).await;
    assert_eq!(
        older.matches("data-testid=\"log-row\"").count(),
        1,
        "{older}"
    );

    let (_, page) = d
        .page("/dashboard/pools/p/access-log?outcome=admitted")
        .await;
    assert_eq!(
        page.matches("data-testid=\"log-outcome\">admitted<")
            .count(),
        50
    );
    let (_, page) = d.page("/dashboard/pools/p/access-log?outcome=401").await;
    assert_eq!(page.matches("data-testid=\"log-row\"").count(), 1, "{page}");
    let (status, page) = d
        .page("/dashboard/pools/p/access-log?since=yesterday")
        .await;
    assert_eq!(status, 400);
    assert!(page.contains("id=\"f-since-error\"") && page.contains("value=\"yesterday\""));
    let (status, page) = d.page("/dashboard/pools/p/access-log?cursor=nope").await;
    assert_eq!(status, 400);
    assert!(page.contains("data-testid=\"form-error\""), "{page}");
}

/// The live row of pool `name` as the dashboard's script reads it.
async fn live_row(d: &Dash<'_>, name: &str) -> Value {
    let (status, live) = call(d.get("/dashboard/api/pools")).await;
    assert_eq!(status, 200);
    item_where(&live, "name", name)
}

#[tokio::test]
async fn the_live_state_follows_a_limit_changed_on_the_concurrency_page() {
    let gw = gateway("").await;
    let (status, _) = gw
        .post(
            "/admin/pools",
            serde_json::json!({"name": "x", "upstream": NO_UPSTREAM, "keys": [KEY],
                               "concurrency": {"limit": 1}}),
        )
        .await;
    assert_eq!(status, 201);
    let d = Dash::signed_in(&gw).await;
    let wait = Some(std::time::Duration::from_secs(30));
    let held = gw.lock_client("x").acquire(wait).await.unwrap();
    let lock = gw.lock_client("x");
    let waiter = tokio::spawn(async move { lock.acquire(wait).await });
    eventually("the waiter queued", async || {
        (live_row(&d, "x").await["queued"] == 1).then_some(())
    })
    .await;
    let row = live_row(&d, "x").await;
    assert_eq!(
        (row["inFlight"].clone(), row["effectiveLimit"].clone()),
        (1.into(), 1.into())
    );

    // Raised on the page: the waiter is admitted at once, and the row says so.
    let (status, _, _) = d
        .submit("/dashboard/pools/x/concurrency", &concurrency_fields("2"))
        .await;
    assert_eq!(status, 303);
    let second = waiter.await.unwrap().unwrap();
    let row = live_row(&d, "x").await;
    assert_eq!(
        (
            row["inFlight"].clone(),
            row["effectiveLimit"].clone(),
            row["queued"].clone()
        ),
        (2.into(), 2.into(), 0.into())
    );
    let (_, page) = d.page("/dashboard/pools/x/concurrency").await;
    assert!(
        page.contains("data-testid=\"in-flight\">2<") && page.contains("data-testid=\"limit\">2<")
    );
    held.release(None).await.unwrap();
    second.release(None).await.unwrap();
}
