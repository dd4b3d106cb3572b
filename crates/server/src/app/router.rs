//! The API host's router: health, readiness, metrics, the OpenAPI document, the admin API, the
//! lock and job routes, and the dashboard (its HTML routes are its own: `dashboard::router`). Unknown routes answer `404 not_found` in JSON.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};

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
        .merge(admin_reload(state).merge(admin_history(state)))
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
        .route("/openapi.json", get(crate::app::openapi::openapi_json))
        .with_state(state.clone())
        .merge(pool_routes)
        .merge(admin)
        .merge(crate::dashboard::router(&state.dashboard))
        .fallback(|| async { ApiError::not_found() })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                ErrorCode::MethodNotAllowed,
                "this route does not take that method",
            )
        })
}

/// `POST /admin/reload` (behind the admin token like every admin route): it needs the whole
/// state, which only this module hands out.
fn admin_reload(state: &Arc<AppState>) -> Router {
    Router::new()
        .route("/admin/reload", post(crate::app::reload::reload_route))
        .with_state(state.clone())
}

/// `GET /admin/pools/{pool}/history`: the dashboard's data, behind the admin token.
fn admin_history(state: &Arc<AppState>) -> Router {
    Router::new()
        .route(
            "/admin/pools/{pool}/history",
            get(crate::dashboard::history::pool_history),
        )
        .with_state(state.dashboard.clone())
}

#[utoipa::path(get, path = "/healthz", tag = "ops", responses((status = 200, description = "the process is alive")))]
pub async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

#[utoipa::path(get, path = "/readyz", tag = "ops",
    responses((status = 200, description = "ready to serve (`store` is `unavailable` while the durable store does not answer: proxied calls and the lock API go on, async intake answers `503 store_unavailable`; with Redis coordination `coordination` is `ok`, or `unavailable` while a node failing open admits its share on its own)"),
        (status = 503, description = "draining, or Redis unreachable while failing closed")))]
pub async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if state.draining.load(Ordering::Relaxed) {
        return ApiError::new(ErrorCode::Draining, "shutting down").into_response();
    }
    let mut ready = serde_json::json!({ "status": "ready" });
    // The store holds jobs and records, not what admission needs (pools and keys are in
    // memory): a node without it still proxies and leases, so it stays in the rotation. With
    // PostgreSQL every node loses it at once, and taking them all out would stop everything.
    if let Err(e) = state.store.ping().await {
        tracing::warn!(error = %e, "the store does not answer: /readyz says store unavailable");
        ready["store"] = "unavailable".into();
    }
    let Some(redis) = &state.shared else {
        return Json(ready).into_response();
    };
    match redis.ping().await {
        Ok(()) => ready["coordination"] = "ok".into(),
        // Failing open the node still admits (its share): keep it in the balancer's rotation.
        Err(_) if redis.fails_open() => ready["coordination"] = "unavailable".into(),
        // Failing closed it admits nothing that needs a slot, like every other node then.
        Err(_) => {
            let mut e = ApiError::new(
                ErrorCode::CoordinationUnavailable,
                "the coordination store (Redis) is unreachable; nothing that needs a slot is admitted",
            );
            let ms = u64::try_from(redis.retry_after().as_millis()).unwrap_or(u64::MAX);
            e.retry_after_s = Some(ms.div_ceil(1000).max(1));
            return e.into_response();
        }
    }
    Json(ready).into_response()
}

#[utoipa::path(get, path = "/metrics", tag = "ops", responses((status = 200, description = "Prometheus text format")))]
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeSet;

    /// `(METHOD, path)` with path parameters unnamed (`/pools/{}/lock/{}/renew`): the router
    /// and the document name them differently (`{slot}`, `{slotId}`).
    fn normalised(method: &str, path: &str) -> (String, String) {
        let mut out = String::new();
        let mut in_param = false;
        for c in path.chars() {
            match c {
                '{' => {
                    in_param = true;
                    out.push_str("{}");
                }
                '}' => in_param = false,
                _ if in_param => {}
                _ => out.push(c),
            }
        }
        (method.to_uppercase(), out)
    }

    /// Every `.route("path", method(handler)...)` of this file's router, read from its source:
    /// axum's `Router` cannot list its routes, and this keeps the check free of a second table
    /// that could drift like the document did.
    fn served_routes() -> BTreeSet<(String, String)> {
        let source = include_str!("router.rs");
        let source = source.split("#[cfg(test)]").next().unwrap();
        let mut routes = BTreeSet::new();
        for (at, _) in source.match_indices(".route(") {
            let rest = &source[at + ".route(".len()..];
            let rest = rest.trim_start().strip_prefix('"').unwrap();
            let (path, rest) = rest.split_once('"').unwrap();
            // The route's arguments: up to the parenthesis that closes `.route(`.
            let mut depth = 1;
            let end = rest
                .char_indices()
                .find(|&(_, c)| {
                    match c {
                        '(' => depth += 1,
                        ')' => depth -= 1,
                        _ => {}
                    }
                    depth == 0
                })
                .unwrap()
                .0;
            let args = &rest[..end];
            for method in ["get", "post", "put", "delete", "patch", "head"] {
                let call = format!("{method}(");
                let called = args.match_indices(&call).any(|(i, _)| {
                    !args[..i]
                        .chars()
                        .next_back()
                        .is_some_and(|c| c.is_alphanumeric() || c == '_')
                });
                if called {
                    routes.insert(normalised(method, path));
                }
            }
        }
        routes
    }

    /// Every route the router serves, with every method it takes, is an operation of
    /// `/openapi.json`, and the document lists nothing that is not served.
    #[test]
    fn every_served_route_is_documented_and_nothing_else() {
        let served = served_routes();
        assert!(
            served.contains(&normalised("post", "/pools/{pool}/lock/acquire")),
            "{served:?}"
        );
        assert!(served.len() >= 27, "{served:?}");
        let doc = crate::app::openapi::document();
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                documented.insert(normalised(method, path));
            }
        }
        let undocumented: Vec<_> = served.difference(&documented).collect();
        assert!(
            undocumented.is_empty(),
            "served, not documented: {undocumented:?}"
        );
        let unserved: Vec<_> = documented.difference(&served).collect();
        assert!(unserved.is_empty(), "documented, not served: {unserved:?}");
    }
}
