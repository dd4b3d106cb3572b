//! HTTP routes of async jobs: the poll route (pool auth, behind the pools guard) and the admin
//! reads of jobs (admin auth).

use std::sync::Arc;

use crate::core::extract::{Path, Query};
use axum::extract::{Extension, State};

use crate::pools::guard::PoolCaller;
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use axum::Json;
use nthbouncer_store::{DeliveryState, JobEvent};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::core::error::ApiError;
use crate::core::pagination;
use crate::jobs::{JobView, Jobs};
use crate::pools::registry::PoolRuntime;

type JobsRef = State<Arc<Jobs>>;

pub use crate::pools::actions::{job_not_found, valid_job_id};

#[utoipa::path(get, path = "/pools/{pool}/jobs/{jobId}", tag = "jobs",
    responses((status = 200, body = JobView, description = "the job, whatever its status (HEAD: headers only)"),
              (status = 401, description = "unauthorized"), (status = 404, description = "job_not_found")))]
pub async fn poll(
    State(state): JobsRef,
    Extension(PoolCaller { pool, .. }): Extension<PoolCaller>,
    method: Method,
    Path((_pool, job_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    poll_job(&state, &pool, &job_id, &method).await
}

/// The poll answer of `pool`'s job `job_id` (the caller is authenticated already): on the API
/// host, and on a database pool's host (`/jobs/{jobId}`, SPEC §8).
pub async fn poll_job(
    state: &Jobs,
    pool: &PoolRuntime,
    job_id: &str,
    method: &Method,
) -> Result<Response, ApiError> {
    if !valid_job_id(job_id) {
        return Err(job_not_found());
    }
    let job = state
        .store
        .get_job(&pool.name, job_id)
        .await?
        .ok_or_else(job_not_found)?;
    let mut resp = Json(JobView::of(&job, state.now())).into_response();
    if method == Method::HEAD {
        // Same headers as GET, no body.
        *resp.body_mut() = axum::body::Body::empty();
    }
    Ok(resp)
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

use nthbouncer_store::jobs::status::ALL as STATUSES;

#[utoipa::path(get, path = "/admin/pools/{pool}/jobs", tag = "admin",
    params(("status" = Option<String>, Query, description = "accepted, queued, running, completed, failed or expired"),
           ("limit" = Option<u32>, Query, description = "1..=500, default 100"),
           ("cursor" = Option<String>, Query, description = "the previous page's next")),
    responses((status = 200, body = JobPage), (status = 400, description = "invalid (a query parameter)"), (status = 404, description = "pool_not_found")))]
pub async fn list_jobs(
    State(state): JobsRef,
    Path(name): Path<String>,
    Query(q): Query<JobListQuery>,
) -> Result<Json<JobPage>, ApiError> {
    let pool = state.pools.get_or_404(&name)?;
    if let Some(s) = &q.status {
        if !STATUSES.contains(&s.as_str()) {
            return Err(ApiError::invalid(
                "status",
                format!("status must be one of {}", STATUSES.join(", ")),
            ));
        }
    }
    let limit = pagination::page_size(q.limit, 500);
    let rows = state
        .store
        .list_jobs(
            &pool.name,
            q.status.as_deref(),
            q.cursor.as_deref(),
            limit + 1,
        )
        .await?;
    let (jobs, next) = pagination::split(rows, limit, |j| j.id.clone());
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
    /// One per destination the job is (or was) delivered to.
    pub deliveries: Vec<DeliveryView>,
}

/// A job's delivery to one destination, as it stands.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryView {
    pub id: u64,
    pub destination_id: String,
    /// `pending`, `delivered` or `failed`.
    pub status: String,
    pub attempts: u32,
    /// When the next attempt is due (pending only).
    pub next_attempt_at: Option<u64>,
    /// The current round was a manual redelivery.
    pub manual: bool,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub delivered_at: Option<u64>,
    pub updated_at: u64,
    /// The job's request id (`x-request-id` of the request it was taken from).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

impl From<DeliveryState> for DeliveryView {
    fn from(d: DeliveryState) -> Self {
        DeliveryView {
            id: d.id,
            destination_id: d.destination_id,
            status: d.status,
            attempts: d.attempts,
            next_attempt_at: d.next_attempt_at,
            manual: d.manual,
            last_status: d.last_status,
            last_error: d.last_error,
            delivered_at: d.delivered_at,
            updated_at: d.updated_at,
            request_id: d.request_id,
        }
    }
}

#[utoipa::path(get, path = "/admin/pools/{pool}/jobs/{jobId}", tag = "admin",
    responses((status = 200, body = JobDetail), (status = 404, description = "job_not_found")))]
pub async fn get_job(
    State(state): JobsRef,
    Path((name, job_id)): Path<(String, String)>,
) -> Result<Json<JobDetail>, ApiError> {
    let pool = state.pools.get_or_404(&name)?;
    let job = state
        .store
        .get_job(&pool.name, &job_id)
        .await?
        .ok_or_else(job_not_found)?;
    let history = state.store.job_events(&job.id).await?;
    let deliveries = state.store.job_deliveries(&job.id).await?;
    Ok(Json(JobDetail {
        job: JobView::of(&job, state.now()),
        history,
        attempt: job.attempt,
        deliveries: deliveries.into_iter().map(DeliveryView::from).collect(),
    }))
}
