//! The API host's router: health, readiness, metrics, the OpenAPI document, the admin API (and,
//! as they land, the lock and job routes). Unknown routes answer `404 not_found` in JSON.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use utoipa::OpenApi;

use crate::admin;
use crate::app::state::AppState;
use crate::core::error::{ApiError, ErrorCode};
use crate::jobs::routes as jobs_api;
use crate::webhooks::routes as webhooks_api;

pub fn router(state: &Arc<AppState>) -> Router {
    let admin = Router::new()
        .route(
            "/admin/pools",
            get(admin::list_pools).post(admin::create_pool),
        )
        .route(
            "/admin/pools/{pool}",
            get(admin::get_pool)
                .put(admin::put_pool)
                .delete(admin::delete_pool),
        )
        .route(
            "/admin/pools/{pool}/keys",
            get(admin::list_keys).post(admin::create_key),
        )
        .route("/admin/pools/{pool}/keys/{id}", delete(admin::revoke_key))
        .route("/admin/pools/{pool}/state", get(admin::pool_state))
        .route("/admin/pools/{pool}/access-log", get(admin::access_log))
        .with_state(state.admin.clone());
    let admin_jobs = Router::new()
        .route("/admin/pools/{pool}/jobs", get(jobs_api::list_jobs))
        .route("/admin/pools/{pool}/jobs/{job}", get(jobs_api::get_job))
        .with_state(state.jobs.clone());
    let admin_webhooks = Router::new()
        .route(
            "/admin/pools/{pool}/jobs/{job}/redeliver",
            post(webhooks_api::redeliver),
        )
        .route(
            "/admin/pools/{pool}/deliveries",
            get(webhooks_api::list_deliveries),
        )
        .route(
            "/admin/pools/{pool}/webhooks",
            get(webhooks_api::list_destinations).post(webhooks_api::create_destination),
        )
        .route(
            "/admin/pools/{pool}/webhooks/{id}",
            axum::routing::patch(webhooks_api::patch_destination)
                .delete(webhooks_api::delete_destination),
        )
        .route(
            "/admin/pools/{pool}/webhooks/{id}/rotate",
            post(webhooks_api::rotate_secret),
        )
        .with_state(state.webhooks.clone());
    let admin_cache = Router::new()
        .route(
            "/admin/pools/{pool}/cache/purge",
            post(crate::cache::routes::purge),
        )
        .with_state(state.cache.clone());
    let admin = admin
        .merge(admin_jobs)
        .merge(admin_webhooks)
        .merge(admin_cache)
        .route_layer(axum::middleware::from_fn_with_state(
            state.admin.clone(),
            admin::require_admin,
        ));
    // A pool's routes on the API host pass its access policies like the proxy (SPEC §2, §9),
    // once per request: the guard hands the caller to the handlers.
    let lock = Router::new()
        .route("/pools/{pool}/lock/acquire", post(crate::lock::acquire))
        .route("/pools/{pool}/lock/{slot}/renew", post(crate::lock::renew))
        .route(
            "/pools/{pool}/lock/{slot}/release",
            post(crate::lock::release),
        )
        .with_state(state.lock.clone());
    let pool_routes = Router::new()
        .route(
            "/pools/{pool}/jobs/{job}",
            get(jobs_api::poll).head(jobs_api::poll),
        )
        .with_state(state.jobs.clone())
        .merge(lock)
        .route_layer(axum::middleware::from_fn_with_state(
            state.guard.clone(),
            crate::pools::guard::require,
        ));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .with_state(state.clone())
        .merge(pool_routes)
        .merge(admin)
        .fallback(|| async { ApiError::not_found() })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                ErrorCode::MethodNotAllowed,
                "this route does not take that method",
            )
        })
}

#[utoipa::path(get, path = "/healthz", tag = "ops", responses((status = 200, description = "the process is alive")))]
async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

#[utoipa::path(get, path = "/readyz", tag = "ops",
    responses((status = 200, description = "ready to serve"), (status = 503, description = "draining or storage down")))]
async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if state.draining.load(Ordering::Relaxed) {
        return ApiError::new(ErrorCode::Draining, "shutting down").into_response();
    }
    match state.store.ping().await {
        Ok(()) => Json(serde_json::json!({ "status": "ready" })).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

#[utoipa::path(get, path = "/metrics", tag = "ops", responses((status = 200, description = "Prometheus text format")))]
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let pools: Vec<_> = state.pools.snapshot().pools.values().cloned().collect();
    for pool in pools {
        let snap = pool.gate.snapshot().await;
        crate::core::metrics::set_pool_gauges(&pool.name, &snap);
        state.cache.set_gauges(&pool);
    }
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::core::metrics::handle().render(),
    )
        .into_response()
}

async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "nthbouncer",
        description = "A self-hosted concurrency governor for upstream APIs. These are the API host's routes. \
            On a pool host (`{pool}.{pool_domain}` or a custom domain) every request is proxied to the \
            pool's upstream after pool-key authentication and admission (SPEC §4)."
    ),
    paths(
        healthz,
        readyz,
        metrics,
        crate::lock::acquire,
        crate::lock::renew,
        crate::lock::release,
        admin::list_pools,
        admin::create_pool,
        admin::get_pool,
        admin::put_pool,
        admin::delete_pool,
        jobs_api::poll,
        jobs_api::list_jobs,
        jobs_api::get_job,
        webhooks_api::list_destinations,
        webhooks_api::create_destination,
        webhooks_api::patch_destination,
        webhooks_api::delete_destination,
        webhooks_api::rotate_secret,
        webhooks_api::list_deliveries,
        webhooks_api::redeliver,
        admin::create_key,
        admin::list_keys,
        admin::revoke_key,
        admin::pool_state,
        admin::access_log,
        crate::cache::routes::purge,
    ),
    components(schemas(
        nthbouncer_config::PoolSpec,
        admin::PoolView,
        admin::PoolList,
        admin::NewKey,
        admin::CreatedKey,
        crate::lock::AcquireBody,
        crate::lock::LockGrant,
        crate::lock::Renewed,
        crate::lock::ReleaseBody,
        crate::lock::Released,
        crate::jobs::Accepted,
        crate::jobs::JobView,
        crate::core::error::ErrorBody,
        crate::core::error::ErrorCode,
        jobs_api::JobPage,
        jobs_api::JobDetail,
        webhooks_api::DestinationView,
        webhooks_api::DestinationList,
        webhooks_api::NewDestination,
        webhooks_api::DestinationPatch,
        jobs_api::DeliveryView,
        webhooks_api::RotateSecret,
        webhooks_api::RotatedSecret,
        webhooks_api::AttemptView,
        webhooks_api::AttemptPage,
        webhooks_api::Redelivery,
        admin::KeyView,
        admin::KeyList,
        admin::Revoked,
        admin::PoolState,
        admin::AccessLogPage,
        admin::CacheState,
        crate::cache::routes::Purge,
        crate::cache::routes::Purged,
        nthbouncer_config::CacheSpec,
    ))
)]
pub struct ApiDoc;
