//! HTTP routes of async jobs and webhook destinations: the poll route (pool auth) and the admin
//! reads and destination CRUD (admin auth).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use nthbouncer_store::{JobEvent, StoredDestination};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admin::parse_json;
use crate::error::ApiError;
use crate::jobs::JobView;
use crate::registry::PoolRuntime;
use crate::state::AppState;

type AppStateRef = State<Arc<AppState>>;

fn job_not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "job_not_found",
        "no such job in this pool",
    )
}

fn pool_or_404(state: &AppState, name: &str) -> Result<Arc<PoolRuntime>, ApiError> {
    state.pool(name).ok_or_else(ApiError::pool_not_found)
}

#[utoipa::path(get, path = "/pools/{pool}/jobs/{jobId}", tag = "jobs",
    responses((status = 200, body = JobView, description = "the job, whatever its status (HEAD: headers only)"),
              (status = 401, description = "unauthorized"), (status = 404, description = "job_not_found")))]
pub async fn poll(
    State(state): AppStateRef,
    method: Method,
    Path((name, job_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let pool = pool_or_404(&state, &name)?;
    crate::auth::authenticate(&pool, &headers, state.now())
        .map_err(|_| ApiError::unauthorized("missing or invalid pool key"))?;
    if !valid_job_id(&job_id) {
        return Err(job_not_found());
    }
    let job = state
        .jobs
        .get_job(&pool.name, &job_id)
        .await?
        .ok_or_else(job_not_found)?;
    let mut resp = Json(JobView::of(&job, state.now())).into_response();
    if method == Method::HEAD {
        // Same headers as GET, no body.
        *resp.body_mut() = axum::body::Body::empty();
    }
    Ok(resp)
}

fn valid_job_id(id: &str) -> bool {
    id.strip_prefix("job_")
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[derive(Deserialize, Default)]
pub struct JobListQuery {
    pub status: Option<String>,
    pub limit: Option<u32>,
    pub cursor: Option<String>,
}

#[derive(Serialize, ToSchema)]
pub struct JobPage {
    pub items: Vec<JobView>,
    pub next: Option<String>,
}

const STATUSES: [&str; 6] = [
    "accepted",
    "queued",
    "running",
    "completed",
    "failed",
    "expired",
];

#[utoipa::path(get, path = "/admin/pools/{pool}/jobs", tag = "admin",
    params(("status" = Option<String>, Query, description = "accepted, queued, running, completed, failed or expired"),
           ("limit" = Option<u32>, Query, description = "1..=500, default 100"),
           ("cursor" = Option<String>, Query, description = "the previous page's next")),
    responses((status = 200, body = JobPage), (status = 404, description = "pool_not_found")))]
pub async fn list_jobs(
    State(state): AppStateRef,
    Path(name): Path<String>,
    Query(q): Query<JobListQuery>,
) -> Result<Json<JobPage>, ApiError> {
    let pool = pool_or_404(&state, &name)?;
    if let Some(s) = &q.status {
        if !STATUSES.contains(&s.as_str()) {
            return Err(ApiError::invalid(
                "status",
                format!("status must be one of {}", STATUSES.join(", ")),
            ));
        }
    }
    let limit = q.limit.unwrap_or(100).clamp(1, 500);
    let mut jobs = state
        .jobs
        .list_jobs(
            &pool.name,
            q.status.as_deref(),
            q.cursor.as_deref(),
            limit + 1,
        )
        .await?;
    let next = if jobs.len() > limit as usize {
        jobs.truncate(limit as usize);
        jobs.last().map(|j| j.id.clone())
    } else {
        None
    };
    let now = state.now();
    Ok(Json(JobPage {
        items: jobs.iter().map(|j| JobView::of(j, now)).collect(),
        next,
    }))
}

#[derive(Serialize, ToSchema)]
pub struct JobDetail {
    #[serde(flatten)]
    pub job: JobView,
    #[schema(value_type = Vec<Object>)]
    pub history: Vec<JobEvent>,
    pub attempt: u32,
}

#[utoipa::path(get, path = "/admin/pools/{pool}/jobs/{jobId}", tag = "admin",
    responses((status = 200, body = JobDetail), (status = 404, description = "job_not_found")))]
pub async fn get_job(
    State(state): AppStateRef,
    Path((name, job_id)): Path<(String, String)>,
) -> Result<Json<JobDetail>, ApiError> {
    let pool = pool_or_404(&state, &name)?;
    let job = state
        .jobs
        .get_job(&pool.name, &job_id)
        .await?
        .ok_or_else(job_not_found)?;
    let history = state.jobs.job_events(&job.id).await?;
    Ok(Json(JobDetail {
        job: JobView::of(&job, state.now()),
        history,
        attempt: job.attempt,
    }))
}

/// A destination as the admin API shows it (secret masked).
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DestinationView {
    pub id: String,
    pub url: String,
    pub secret: String,
    pub active: bool,
    pub deactivate_after: u32,
    pub consecutive_failures: u32,
    pub deactivated_at: Option<u64>,
    pub managed_by: String,
    pub created_at: u64,
}

impl DestinationView {
    fn of(d: &StoredDestination, show_secret: bool) -> DestinationView {
        DestinationView {
            id: d.id.clone(),
            url: d.url.clone(),
            secret: if show_secret {
                d.secret.clone()
            } else {
                nthbouncer_config::mask(&d.secret)
            },
            active: d.active,
            deactivate_after: d.deactivate_after,
            consecutive_failures: d.consecutive_failures,
            deactivated_at: d.deactivated_at,
            managed_by: d.managed_by.clone(),
            created_at: d.created_at,
        }
    }
}

#[derive(Serialize, ToSchema)]
pub struct DestinationList {
    pub items: Vec<DestinationView>,
    pub next: Option<String>,
}

#[utoipa::path(get, path = "/admin/pools/{pool}/webhooks", tag = "admin",
    responses((status = 200, body = DestinationList), (status = 404, description = "pool_not_found")))]
pub async fn list_destinations(
    State(state): AppStateRef,
    Path(name): Path<String>,
) -> Result<Json<DestinationList>, ApiError> {
    let pool = pool_or_404(&state, &name)?;
    let items = pool
        .destinations
        .load()
        .iter()
        .map(|d| DestinationView::of(d, false))
        .collect();
    Ok(Json(DestinationList { items, next: None }))
}

#[derive(Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NewDestination {
    pub url: String,
    /// `whsec_…`; generated when absent. Shown once in the answer.
    pub secret: Option<String>,
    pub deactivate_after: Option<u32>,
}

/// Refuses URLs that name a private address literally, unless private webhooks are allowed.
/// (Names are resolved and checked again at every delivery attempt.)
fn check_destination_url(state: &AppState, url: &str) -> Result<(), ApiError> {
    let uri = nthbouncer_config::parse_http_url("url", url)
        .map_err(|e| ApiError::invalid("url", e.rule))?;
    if state.server.allow_private_webhooks {
        return Ok(());
    }
    let host = uri
        .host()
        .unwrap_or("")
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    let private = host == "localhost"
        || host.ends_with(".localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| crate::netcheck::is_private(&ip));
    if private {
        return Err(ApiError::invalid(
            "url",
            "webhook destinations may not point at loopback, private, link-local or metadata addresses \
             (set server.allow_private_webhooks = true for local testing)",
        ));
    }
    Ok(())
}

#[utoipa::path(post, path = "/admin/pools/{pool}/webhooks", tag = "admin", request_body = NewDestination,
    responses((status = 201, body = DestinationView, description = "created; the secret is shown this once"),
              (status = 400, description = "invalid"), (status = 404, description = "pool_not_found"),
              (status = 409, description = "too many destinations")))]
pub async fn create_destination(
    State(state): AppStateRef,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<(StatusCode, Json<DestinationView>), ApiError> {
    let pool = pool_or_404(&state, &name)?;
    let req: NewDestination = parse_json(&body)?;
    check_destination_url(&state, &req.url)?;
    let secret = match req.secret {
        Some(s) => {
            nthbouncer_config::async_jobs::check_webhook_secret("secret", &s)
                .map_err(|e| ApiError::invalid("secret", e.rule))?;
            s
        }
        None => nthbouncer_config::keys::generate_webhook_secret(),
    };
    let deactivate_after = req.deactivate_after.unwrap_or(20);
    if deactivate_after == 0 {
        return Err(ApiError::invalid(
            "deactivateAfter",
            "deactivateAfter must be at least 1",
        ));
    }
    let _guard = state.admin_lock.lock().await;
    let count = pool.destinations.load().len();
    let cap = state.server.max_destinations_per_pool as usize;
    if count >= cap {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "too_many_destinations",
            format!("pool {name:?} already has {count} destinations (server.max_destinations_per_pool = {cap})"),
        ));
    }
    let d = StoredDestination {
        id: format!("wh_{:024x}", rand::random::<u128>() >> 32),
        pool: pool.name.clone(),
        url: req.url,
        secret,
        active: true,
        deactivate_after,
        consecutive_failures: 0,
        deactivated_at: None,
        managed_by: "api".into(),
        created_at: state.now(),
    };
    state.jobs.create_destination(&d).await?;
    state.refresh_destinations(&pool).await?;
    Ok((StatusCode::CREATED, Json(DestinationView::of(&d, true))))
}

#[derive(Deserialize, ToSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DestinationPatch {
    /// `true` re-enables a deactivated destination (and clears its failure streak).
    pub active: Option<bool>,
    pub url: Option<String>,
    pub deactivate_after: Option<u32>,
}

#[utoipa::path(patch, path = "/admin/pools/{pool}/webhooks/{id}", tag = "admin", request_body = DestinationPatch,
    responses((status = 200, body = DestinationView), (status = 400, description = "invalid"),
              (status = 404, description = "destination_not_found"), (status = 409, description = "managed_by_config")))]
pub async fn patch_destination(
    State(state): AppStateRef,
    Path((name, id)): Path<(String, String)>,
    body: Bytes,
) -> Result<Json<DestinationView>, ApiError> {
    let pool = pool_or_404(&state, &name)?;
    let patch: DestinationPatch = parse_json(&body)?;
    let _guard = state.admin_lock.lock().await;
    let mut d = pool
        .destinations
        .load()
        .iter()
        .find(|d| d.id == id)
        .cloned()
        .ok_or_else(destination_not_found)?;
    if d.managed_by == "config" && (patch.url.is_some() || patch.deactivate_after.is_some()) {
        return Err(crate::state::managed_by_config(&name));
    }
    if let Some(url) = patch.url {
        check_destination_url(&state, &url)?;
        d.url = url;
    }
    if let Some(n) = patch.deactivate_after {
        if n == 0 {
            return Err(ApiError::invalid(
                "deactivateAfter",
                "deactivateAfter must be at least 1",
            ));
        }
        d.deactivate_after = n;
    }
    if let Some(active) = patch.active {
        d.active = active;
        if active {
            d.consecutive_failures = 0;
            d.deactivated_at = None;
        } else if d.deactivated_at.is_none() {
            d.deactivated_at = Some(state.now());
        }
    }
    if !state.jobs.update_destination(&d).await? {
        return Err(destination_not_found());
    }
    state.refresh_destinations(&pool).await?;
    Ok(Json(DestinationView::of(&d, false)))
}

#[utoipa::path(delete, path = "/admin/pools/{pool}/webhooks/{id}", tag = "admin",
    responses((status = 204, description = "deleted"), (status = 404, description = "destination_not_found"),
              (status = 409, description = "managed_by_config")))]
pub async fn delete_destination(
    State(state): AppStateRef,
    Path((name, id)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let pool = pool_or_404(&state, &name)?;
    let _guard = state.admin_lock.lock().await;
    let d = pool
        .destinations
        .load()
        .iter()
        .find(|d| d.id == id)
        .cloned()
        .ok_or_else(destination_not_found)?;
    if d.managed_by == "config" {
        return Err(crate::state::managed_by_config(&name));
    }
    state.jobs.delete_destination(&pool.name, &id).await?;
    state.refresh_destinations(&pool).await?;
    Ok(StatusCode::NO_CONTENT)
}

fn destination_not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "destination_not_found",
        "no such webhook destination in this pool",
    )
}
