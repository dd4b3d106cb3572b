//! The dashboard at `/dashboard` on the API host (SPEC §10), and the per-second history it
//! charts (`GET /admin/pools/{pool}/history`, SPEC §12).
//!
//! It owns the dashboard's routes, its sessions (the admin token exchanged for an HttpOnly,
//! SameSite=Strict cookie that opens `/dashboard` only, with a CSRF token per session required
//! on every POST) and its pages: server-rendered HTML with one small embedded script that polls
//! `/dashboard/api/pools`. Per pool: Overview, Concurrency (`settings`), Keys, Webhooks, Jobs,
//! Access log. It reads the pools registry, the gates' live state and the stores directly, as
//! the admin API does, and changes things only through the operations the admin API's
//! handlers call (`pools::ops`, `pools::actions`); it imports no other feature. The routes and
//! the markup browser tests may rely on are listed in `pages`.

mod access_log;
mod chart;
mod examples;
mod form;
pub mod history;
mod jobs;
mod keys;
mod pages;
mod session;
mod settings;
mod webhooks;

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use nthbouncer_coord::Clock;
use serde::{Deserialize, Serialize};

use crate::core::error::ApiError;
use crate::pools::registry::PoolRuntime;
use crate::pools::Pools;
use form::Form;

use session::{Open, Sessions, SESSION_TTL_MS};

/// The session cookie's name.
const COOKIE: &str = "nb_dashboard";
const LOGIN_PATH: &str = "/dashboard/login";

/// What the dashboard needs: the pools (and their operations, shared with the admin API), the
/// stores it reads (access log; jobs and delivery attempts), the live admin token, the clock,
/// its sessions.
pub struct Dashboard {
    pub pools: Arc<Pools>,
    pub store: Arc<dyn nthbouncer_store::Store>,
    pub jobs: Arc<dyn nthbouncer_store::JobStore>,
    pub live: Arc<crate::core::live::LiveServer>,
    pub clock: Arc<dyn Clock>,
    /// The API listener serves TLS: the cookie is marked `Secure`.
    pub secure: bool,
    pub sessions: Sessions,
}

type DashRef = State<Arc<Dashboard>>;

/// An answer given before a handler's own work: the login redirect, the 403 page or the "No
/// such pool" page. Boxed: it is the `Err` of every page's checks, and large.
pub struct Early(Box<Response>);

impl From<Response> for Early {
    fn from(answer: Response) -> Self {
        Early(Box::new(answer))
    }
}

impl IntoResponse for Early {
    fn into_response(self) -> Response {
        *self.0
    }
}

/// What a page handler answers: its page, or the [`Early`] answer of its checks.
type Answer = Result<Response, Early>;

/// `body` as tab `tab` of `pool`'s pages, for the session `open`.
fn pool_html(
    status: StatusCode,
    pool: &PoolRuntime,
    tab: &str,
    open: &Open,
    flash: pages::Flash,
    body: &str,
) -> Response {
    html(
        status,
        pages::pool_page(&pool.name, tab, &open.csrf, &flash, body),
    )
}

impl Dashboard {
    pub fn new(
        pools: Arc<Pools>,
        stores: (
            Arc<dyn nthbouncer_store::Store>,
            Arc<dyn nthbouncer_store::JobStore>,
        ),
        live: Arc<crate::core::live::LiveServer>,
        clock: Arc<dyn Clock>,
        secure: bool,
    ) -> Dashboard {
        Dashboard {
            pools,
            store: stores.0,
            jobs: stores.1,
            live,
            clock,
            secure,
            sessions: Sessions::default(),
        }
    }

    /// The session the request's cookie names, if it is live.
    fn session(&self, headers: &HeaderMap) -> Option<(String, Open)> {
        let id = cookie(headers, COOKIE)?;
        let live = self.live.load();
        let open = self
            .sessions
            .find(&id, self.clock.now_ms(), live.admin_token.as_deref())?;
        Some((id, open))
    }

    /// The request's live session, or the redirect to the login form.
    fn open(&self, headers: &HeaderMap) -> Result<Open, Early> {
        self.session(headers)
            .map(|(_, open)| open)
            .ok_or_else(|| Early::from(Redirect::to(LOGIN_PATH).into_response()))
    }

    /// A POST's session and form: refused unless the session is live and the form's `csrf`
    /// field is its token.
    fn post(&self, headers: &HeaderMap, body: &Bytes) -> Result<(Open, Form), Early> {
        let open = self.open(headers)?;
        let form = Form::parse(body);
        if !open.csrf_matches(form.text("csrf")) {
            return Err(html(StatusCode::FORBIDDEN, pages::forbidden()).into());
        }
        Ok((open, form))
    }

    /// The pool named `name`, or the "No such pool" page.
    fn pool(&self, name: &str) -> Result<Arc<PoolRuntime>, Early> {
        self.pools
            .get(name)
            .ok_or_else(|| html(StatusCode::NOT_FOUND, pages::no_such_pool()).into())
    }

    /// A page of the pool named `name`: the session (else the login form), then the pool (else
    /// the "No such pool" page), in that order, so a stranger learns nothing of pool names.
    fn open_pool(
        &self,
        headers: &HeaderMap,
        name: &str,
    ) -> Result<(Open, Arc<PoolRuntime>), Early> {
        let open = self.open(headers)?;
        Ok((open, self.pool(name)?))
    }

    /// A POST to the pool named `name`: [`Dashboard::post`]'s checks, then the pool.
    fn post_pool(
        &self,
        headers: &HeaderMap,
        body: &Bytes,
        name: &str,
    ) -> Result<(Open, Form, Arc<PoolRuntime>), Early> {
        let (open, form) = self.post(headers, body)?;
        Ok((open, form, self.pool(name)?))
    }

    fn cookie_header(&self, value: &str, max_age_s: u64) -> String {
        let secure = if self.secure { "; Secure" } else { "" };
        format!(
            "{COOKIE}={value}; Path=/dashboard; HttpOnly; SameSite=Strict; Max-Age={max_age_s}{secure}"
        )
    }
}

/// The value of cookie `name` in the request's `Cookie` headers.
fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

/// The dashboard's own routes (the history route is an admin route: `app::router` mounts it).
/// `pages` documents them for browser tests.
pub fn router(state: &Arc<Dashboard>) -> Router {
    Router::new()
        .route("/dashboard", get(overview))
        .route("/dashboard/login", get(login_form).post(login))
        .route("/dashboard/logout", post(logout))
        .route("/dashboard/pools", post(settings::create))
        .route("/dashboard/pools/{pool}", get(pool_overview))
        .route(
            "/dashboard/pools/{pool}/concurrency",
            get(settings::page).post(settings::save),
        )
        .route(
            "/dashboard/pools/{pool}/keys",
            get(keys::page).post(keys::create),
        )
        .route(
            "/dashboard/pools/{pool}/keys/{id}/revoke",
            post(keys::revoke),
        )
        .route(
            "/dashboard/pools/{pool}/webhooks",
            get(webhooks::page).post(webhooks::create),
        )
        .route(
            "/dashboard/pools/{pool}/webhooks/{id}/active",
            post(webhooks::set_active),
        )
        .route(
            "/dashboard/pools/{pool}/webhooks/{id}/rotate",
            post(webhooks::rotate),
        )
        .route("/dashboard/pools/{pool}/jobs", get(jobs::list))
        .route("/dashboard/pools/{pool}/jobs/{job}", get(jobs::one))
        .route(
            "/dashboard/pools/{pool}/jobs/{job}/redeliver",
            post(webhooks::redeliver),
        )
        .route("/dashboard/pools/{pool}/access-log", get(access_log::page))
        .route("/dashboard/api/pools", get(pools_json))
        .route("/dashboard/api/pools/{pool}/history", get(history_json))
        .route("/dashboard/assets/dashboard.js", get(script))
        .route("/dashboard/assets/dashboard.css", get(stylesheet))
        .with_state(state.clone())
}

fn html(status: StatusCode, body: String) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

async fn login_form(State(d): DashRef, headers: HeaderMap) -> Response {
    if d.session(&headers).is_some() {
        return Redirect::to("/dashboard").into_response();
    }
    html(StatusCode::OK, pages::login(None))
}

#[derive(Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
}

/// `POST /dashboard/login`: the admin token (form field `token`), compared in constant time,
/// opens a session. The token is never echoed or logged.
async fn login(State(d): DashRef, body: Bytes) -> Response {
    let given = serde_urlencoded::from_bytes::<LoginForm>(&body)
        .map(|f| f.token)
        .unwrap_or_default();
    let live = d.live.load();
    if !live.is_admin_token(&given) {
        let why = if live.admin_token.is_none() {
            "The dashboard is disabled: set server.admin_token."
        } else {
            "That is not the admin token."
        };
        return html(StatusCode::UNAUTHORIZED, pages::login(Some(why)));
    }
    let id = d.sessions.open(d.clock.now_ms(), &given);
    let mut answer = Redirect::to("/dashboard").into_response();
    if let Ok(v) = HeaderValue::from_str(&d.cookie_header(&id, SESSION_TTL_MS / 1000)) {
        answer.headers_mut().insert(header::SET_COOKIE, v);
    }
    answer
}

#[derive(Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

/// `POST /dashboard/logout`: ends the session (CSRF token required) and clears the cookie.
async fn logout(State(d): DashRef, headers: HeaderMap, body: Bytes) -> Response {
    let Some((id, open)) = d.session(&headers) else {
        return Redirect::to(LOGIN_PATH).into_response();
    };
    let given = serde_urlencoded::from_bytes::<CsrfForm>(&body)
        .map(|f| f.csrf)
        .unwrap_or_default();
    if !open.csrf_matches(&given) {
        return html(StatusCode::FORBIDDEN, pages::forbidden());
    }
    d.sessions.end(&id);
    let mut answer = Redirect::to(LOGIN_PATH).into_response();
    if let Ok(v) = HeaderValue::from_str(&d.cookie_header("", 0)) {
        answer.headers_mut().insert(header::SET_COOKIE, v);
    }
    answer
}

/// One pool's live state as the dashboard shows it (the admin API's `state`, trimmed).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct PoolRow {
    name: String,
    kind: &'static str,
    in_flight: u32,
    effective_limit: u32,
    queued: u32,
    learned_limit: Option<u32>,
    learned_rpm: Option<u32>,
    /// Epoch ms.
    last_throttle_at: Option<u64>,
    last_throttle_cause: Option<String>,
    /// Epoch ms.
    paused_until: Option<u64>,
    /// Epoch ms.
    paced_until: Option<u64>,
}

#[derive(Serialize)]
struct PoolRows {
    items: Vec<PoolRow>,
}

async fn rows(d: &Dashboard) -> Vec<PoolRow> {
    let mut pools: Vec<_> = d.pools.snapshot().pools.values().cloned().collect();
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = Vec::with_capacity(pools.len());
    for pool in pools {
        out.push(row_of(&pool).await);
    }
    out
}

/// One pool's live state.
async fn row_of(pool: &PoolRuntime) -> PoolRow {
    let s = pool.gate.snapshot().await;
    PoolRow {
        name: pool.name.clone(),
        kind: match pool.spec.kind {
            nthbouncer_config::PoolKind::Proxy => "proxy",
            nthbouncer_config::PoolKind::Database => "database",
        },
        in_flight: s.in_flight,
        effective_limit: s.effective_limit,
        queued: s.queued,
        learned_limit: s.learned_limit,
        learned_rpm: s.learned_rpm,
        last_throttle_at: s.last_throttle.as_ref().map(|t| t.at),
        last_throttle_cause: s.last_throttle.map(|t| t.cause),
        paused_until: s.paused_until,
        paced_until: s.paced_until,
    }
}

/// `GET /dashboard`: the pool list, or the login page for a browser with no session.
async fn overview(State(d): DashRef, headers: HeaderMap) -> Answer {
    let open = d.open(&headers)?;
    let new_pool = pages::NewPoolForm::default();
    let page = pages::overview(&rows(&d).await, &open.csrf, &new_pool);
    Ok(html(StatusCode::OK, page))
}

/// `GET /dashboard/pools/{pool}`: the pool's Overview with its Examples.
async fn pool_overview(
    State(d): DashRef,
    headers: HeaderMap,
    crate::core::extract::Path(name): crate::core::extract::Path<String>,
) -> Answer {
    let (open, pool) = d.open_pool(&headers, &name)?;
    let live = d.live.load();
    let examples = examples::for_pool(&pool, &live);
    let chart = chart::figure(&pool.history.last(d.clock.now_ms()));
    let note = (pool.spec.kind == nthbouncer_config::PoolKind::Proxy
        && !pool.spec.async_jobs.enabled)
        .then_some(
            "The async call needs [pools.async] enabled = true and an active webhook destination.",
        );
    let page = pages::pool(&pool.name, &chart, note, &examples, &open.csrf);
    Ok(html(StatusCode::OK, page))
}

/// `GET /dashboard/api/pools/{pool}/history`: the admin route's answer, for the session.
async fn history_json(
    state: DashRef,
    headers: HeaderMap,
    name: crate::core::extract::Path<String>,
) -> Response {
    if state.session(&headers).is_none() {
        return ApiError::unauthorized("no dashboard session: log in at /dashboard/login")
            .into_response();
    }
    match history::pool_history(state, name).await {
        Ok(body) => ([(header::CACHE_CONTROL, "no-store")], body).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /dashboard/api/pools`: the numbers the page's script refreshes every 2 s.
async fn pools_json(State(d): DashRef, headers: HeaderMap) -> Response {
    if d.session(&headers).is_none() {
        return ApiError::unauthorized("no dashboard session: log in at /dashboard/login")
            .into_response();
    }
    (
        [(header::CACHE_CONTROL, "no-store")],
        Json(PoolRows {
            items: rows(&d).await,
        }),
    )
        .into_response()
}

/// Embedded assets: not fingerprinted, so cached for an hour rather than for ever.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        body,
    )
        .into_response()
}

async fn script() -> Response {
    asset(
        "text/javascript; charset=utf-8",
        include_str!("assets/dashboard.js"),
    )
}

async fn stylesheet() -> Response {
    asset(
        "text/css; charset=utf-8",
        include_str!("assets/dashboard.css"),
    )
}
