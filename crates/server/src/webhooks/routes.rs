//! The admin routes of webhook destinations (SPEC §7, §10): CRUD, re-enable, secret rotation,
//! the delivery attempt log and manual redelivery.

use std::sync::Arc;

use crate::core::extract::{Path, Query};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use nthbouncer_store::{AttemptQuery, DeliveryAttempt, StoredDestination};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::Webhooks;
use crate::core::error::ApiError;
use crate::core::extract::{parse_json, BodyBytes, MAX_ADMIN_BODY_BYTES};
use crate::core::pagination;
use crate::pools::actions::DestinationChange;

type WebhooksRef = State<Arc<Webhooks>>;

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
    /// After a rotation: until when the previous secret still signs (next to the new one).
    pub previous_secret_expires_at: Option<u64>,
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
            previous_secret_expires_at: d.previous_secret_expires_at,
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
    State(state): WebhooksRef,
    Path(name): Path<String>,
) -> Result<Json<DestinationList>, ApiError> {
    let pool = state.pools.get_or_404(&name)?;
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
    /// `http://` or `https://`, a host, an optional port and path.
    #[schema(pattern = "^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~%/-]*)?$")]
    pub url: String,
    /// `whsec_…` (at least 24 bytes in standard base64); generated when absent. Shown once in
    /// the answer.
    #[schema(pattern = "^whsec_([A-Za-z0-9+/]{4}){8,}([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$")]
    pub secret: Option<String>,
    #[schema(minimum = 1)]
    pub deactivate_after: Option<u32>,
}

#[utoipa::path(post, path = "/admin/pools/{pool}/webhooks", tag = "admin", request_body = NewDestination,
    responses((status = 201, body = DestinationView, description = "created; the secret is shown this once"),
              (status = 400, description = "invalid"), (status = 404, description = "pool_not_found"),
              (status = 409, description = "too_many_destinations")))]
pub async fn create_destination(
    State(state): WebhooksRef,
    Path(name): Path<String>,
    BodyBytes(body): BodyBytes<MAX_ADMIN_BODY_BYTES>,
) -> Result<(StatusCode, Json<DestinationView>), ApiError> {
    state.pools.get_or_404(&name)?;
    let req: NewDestination = parse_json(&body)?;
    let d = state
        .pools
        .create_destination(&name, req.url, req.secret, req.deactivate_after)
        .await?;
    Ok((StatusCode::CREATED, Json(DestinationView::of(&d, true))))
}

#[derive(Deserialize, ToSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DestinationPatch {
    /// `true` re-enables a deactivated destination (and clears its failure streak).
    pub active: Option<bool>,
    #[schema(pattern = "^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~%/-]*)?$")]
    pub url: Option<String>,
    #[schema(minimum = 1)]
    pub deactivate_after: Option<u32>,
}

#[utoipa::path(patch, path = "/admin/pools/{pool}/webhooks/{id}", tag = "admin", request_body = DestinationPatch,
    responses((status = 200, body = DestinationView), (status = 400, description = "invalid"),
              (status = 404, description = "destination_not_found"),
              (status = 409, description = "managed_by_config (declared in the config file), or conflict (declared in the pool's settings: change it with PUT /admin/pools/{pool})")))]
pub async fn patch_destination(
    State(state): WebhooksRef,
    Path((name, id)): Path<(String, String)>,
    BodyBytes(body): BodyBytes<MAX_ADMIN_BODY_BYTES>,
) -> Result<Json<DestinationView>, ApiError> {
    state.pools.get_or_404(&name)?;
    let patch: DestinationPatch = parse_json(&body)?;
    let change = DestinationChange {
        active: patch.active,
        url: patch.url,
        deactivate_after: patch.deactivate_after,
    };
    let d = state.pools.change_destination(&name, &id, change).await?;
    Ok(Json(DestinationView::of(&d, false)))
}

#[utoipa::path(delete, path = "/admin/pools/{pool}/webhooks/{id}", tag = "admin",
    responses((status = 204, description = "deleted"), (status = 404, description = "destination_not_found"),
              (status = 409, description = "managed_by_config (declared in the config file), or conflict (declared in the pool's settings: change it with PUT /admin/pools/{pool})")))]
pub async fn delete_destination(
    State(state): WebhooksRef,
    Path((name, id)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    state.pools.delete_destination(&name, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, ToSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RotateSecret {
    /// How long the previous secret keeps signing next to the new one (seconds, 0..=604800,
    /// default 86400). During the grace every delivery carries both signatures.
    pub grace_s: Option<u64>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RotatedSecret {
    pub id: String,
    /// The new `whsec_` secret, shown this once.
    pub secret: String,
    /// Until when the previous secret also signs (`null`: it was dropped at once).
    pub previous_secret_expires_at: Option<u64>,
}

#[utoipa::path(post, path = "/admin/pools/{pool}/webhooks/{id}/rotate", tag = "admin", request_body = RotateSecret,
    responses((status = 200, body = RotatedSecret, description = "rotated; the new secret is shown this once"),
              (status = 400, description = "invalid"), (status = 404, description = "destination_not_found"),
              (status = 409, description = "managed_by_config (the secret lives in the config file), or conflict (in the pool's settings)")))]
pub async fn rotate_secret(
    State(state): WebhooksRef,
    Path((name, id)): Path<(String, String)>,
    BodyBytes(body): BodyBytes<MAX_ADMIN_BODY_BYTES>,
) -> Result<Json<RotatedSecret>, ApiError> {
    state.pools.get_or_404(&name)?;
    let req: RotateSecret = if crate::core::extract::is_blank(&body) {
        RotateSecret::default()
    } else {
        parse_json(&body)?
    };
    let rotated = state
        .pools
        .rotate_destination_secret(&name, &id, req.grace_s)
        .await?;
    Ok(Json(RotatedSecret {
        id,
        secret: rotated.secret,
        previous_secret_expires_at: rotated.previous_secret_expires_at,
    }))
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct AttemptListQuery {
    pub job_id: Option<String>,
    pub destination_id: Option<String>,
    pub limit: Option<u32>,
    pub cursor: Option<String>,
}

/// One logged delivery attempt.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttemptView {
    pub id: u64,
    pub delivery_id: u64,
    pub job_id: String,
    pub destination_id: String,
    /// 1-based, across every round of the delivery.
    pub attempt: u32,
    /// When it was made (epoch ms).
    pub at: u64,
    /// The HTTP status answered; `null` when none arrived (refused, unreachable, timed out).
    pub status_code: Option<u16>,
    pub latency_ms: u64,
    /// The start of the response body (at most 1 KiB).
    pub response_body: Option<String>,
    pub error: Option<String>,
    /// Part of a manual redelivery (does not count towards the failure streak).
    pub manual: bool,
    /// What the attempt left the delivery in: `delivered`, `retrying` or `failed`.
    pub outcome: String,
}

impl From<DeliveryAttempt> for AttemptView {
    fn from(a: DeliveryAttempt) -> Self {
        AttemptView {
            id: a.id,
            delivery_id: a.delivery_id,
            job_id: a.job_id,
            destination_id: a.destination_id,
            attempt: a.attempt,
            at: a.at,
            status_code: a.status_code,
            latency_ms: a.latency_ms,
            response_body: a.response_body,
            error: a.error,
            manual: a.manual,
            outcome: a.outcome,
        }
    }
}

#[derive(Serialize, ToSchema)]
pub struct AttemptPage {
    pub items: Vec<AttemptView>,
    pub next: Option<String>,
}

#[utoipa::path(get, path = "/admin/pools/{pool}/deliveries", tag = "admin",
    params(("jobId" = Option<String>, Query, description = "only this job's attempts"),
           ("destinationId" = Option<String>, Query, description = "only this destination's attempts"),
           ("limit" = Option<u32>, Query, description = "1..=1000, default 100"),
           ("cursor" = Option<String>, Query, description = "the previous page's next")),
    responses((status = 200, body = AttemptPage, description = "delivery attempts, newest first"),
              (status = 400, description = "invalid (a query parameter)"), (status = 404, description = "pool_not_found")))]
pub async fn list_deliveries(
    State(state): WebhooksRef,
    Path(name): Path<String>,
    Query(q): Query<AttemptListQuery>,
) -> Result<Json<AttemptPage>, ApiError> {
    let pool = state.pools.get_or_404(&name)?;
    let limit = pagination::page_size(q.limit, 1000);
    let rows = state
        .jobs
        .store
        .list_attempts(&AttemptQuery {
            pool: pool.name.clone(),
            job_id: q.job_id,
            destination_id: q.destination_id,
            before: pagination::numeric_cursor(q.cursor.as_deref())?,
            limit: limit + 1,
        })
        .await?;
    let (items, next) = pagination::split(rows, limit, |a| a.id.to_string());
    Ok(Json(AttemptPage {
        items: items.into_iter().map(AttemptView::from).collect(),
        next,
    }))
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Redelivery {
    pub job_id: String,
    /// Deliveries queued: one per active destination of the pool.
    pub deliveries: u32,
}

#[utoipa::path(post, path = "/admin/pools/{pool}/jobs/{jobId}/redeliver", tag = "admin",
    responses((status = 202, body = Redelivery, description = "queued: the job is sent again to every active destination \
               (a new round of the retry schedule whose failures do not count towards the streak)"),
              (status = 404, description = "job_not_found"),
              (status = 409, description = "job_not_terminal, or no_active_destination")))]
pub async fn redeliver(
    State(state): WebhooksRef,
    Path((name, job_id)): Path<(String, String)>,
) -> Result<(StatusCode, Json<Redelivery>), ApiError> {
    let deliveries = state.pools.redeliver(&name, &job_id).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(Redelivery { job_id, deliveries }),
    ))
}
