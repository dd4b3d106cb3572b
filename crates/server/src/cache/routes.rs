//! The cache's admin route: purge by path prefix (SPEC §12). Behind the admin token like every
//! `/admin/` route (the router adds the guard).

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::Caches;
use crate::core::error::{ApiError, ErrorCode};
use crate::core::extract::{parse_json, BodyBytes, Path, MAX_ADMIN_BODY_BYTES};

/// Longest prefix accepted (a request target is cut at the server's header limits anyway).
const MAX_PREFIX_BYTES: usize = 8192;

/// What to purge: every entry whose request path starts with `prefix` (`/` for all).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Purge {
    pub prefix: String,
}

#[derive(Serialize, ToSchema)]
pub struct Purged {
    /// Entries dropped (on this node: each node keeps its own cache).
    pub purged: u64,
}

#[utoipa::path(post, path = "/admin/pools/{pool}/cache/purge", tag = "admin", request_body = Purge,
    responses((status = 200, body = Purged), (status = 400, description = "invalid (prefix)"),
              (status = 404, description = "pool_not_found"),
              (status = 409, description = "conflict: the pool has no cache")))]
pub async fn purge(
    State(caches): State<Arc<Caches>>,
    Path(name): Path<String>,
    BodyBytes(body): BodyBytes<MAX_ADMIN_BODY_BYTES>,
) -> Result<Json<Purged>, ApiError> {
    let pool = caches.pools.get_or_404(&name)?;
    let req: Purge = parse_json(&body)?;
    if !req.prefix.starts_with('/') || req.prefix.len() > MAX_PREFIX_BYTES {
        return Err(ApiError::invalid(
            "prefix",
            format!("prefix must be a path starting with / (at most {MAX_PREFIX_BYTES} bytes)"),
        ));
    }
    let Some(cache) = caches.of(&pool) else {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            "this pool has no cache (no [pools.cache] in its settings)",
        ));
    };
    Ok(Json(Purged {
        purged: cache.purge(&req.prefix),
    }))
}
