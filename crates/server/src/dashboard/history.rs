//! `GET /admin/pools/{pool}/history` (SPEC §12): the pool's last 15 minutes, second by second,
//! from the ring its gate counts into (`core::history`). Behind the admin token like every
//! admin route; the dashboard charts it.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use super::Dashboard;
use crate::core::error::ApiError;
use crate::core::extract::Path;

/// One second of a pool's history.
#[derive(Serialize, ToSchema)]
pub struct HistorySecond {
    /// Epoch seconds (the server's clock).
    pub at: u64,
    /// Callers given a slot.
    pub admitted: u32,
    /// Callers refused a slot (`429 too_many_requests` or `504 queue_timeout` from the gate;
    /// async jobs that try again later count each try).
    pub refused: u32,
    /// Callers that waited in the queue, counted the second they left it.
    pub queued: u32,
    /// Origin `429`s reported to the gate (proxy answers, jobs, lock releases).
    pub origin429: u32,
}

/// A pool's last 900 seconds, oldest first, ending with the current second.
#[derive(Serialize, ToSchema)]
pub struct PoolHistory {
    pub pool: String,
    pub seconds: Vec<HistorySecond>,
}

#[utoipa::path(get, path = "/admin/pools/{pool}/history", tag = "admin",
    responses((status = 200, body = PoolHistory), (status = 404, description = "pool_not_found")))]
pub async fn pool_history(
    State(d): State<Arc<Dashboard>>,
    Path(name): Path<String>,
) -> Result<Json<PoolHistory>, ApiError> {
    let pool = d.pools.get_or_404(&name)?;
    let seconds = pool
        .history
        .last(d.clock.now_ms())
        .into_iter()
        .map(|s| HistorySecond {
            at: s.at,
            admitted: s.admitted,
            refused: s.refused,
            queued: s.queued,
            origin429: s.origin429,
        })
        .collect();
    Ok(Json(PoolHistory {
        pool: pool.name.clone(),
        seconds,
    }))
}
