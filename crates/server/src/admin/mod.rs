//! The admin API on the API host (SPEC §10): pools CRUD, pool keys, live governor state, the
//! access log. Behind `Authorization: Bearer {admin_token}`, compared in constant time.
//! Changes apply at once (the registry is swapped), without restart.

use std::sync::Arc;

use crate::core::extract::{epoch_ms, Path, Query};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use nthbouncer_config::PoolSpec;
use nthbouncer_coord::Clock;
use nthbouncer_store::{AccessLogEntry, AccessLogQuery, Store};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::core::error::ApiError;
use crate::core::extract::{self, parse_json, BodyBytes, MAX_ADMIN_BODY_BYTES};
use crate::core::pagination;
use crate::pools::registry::PoolRuntime;
use crate::pools::Pools;

type AdminRef = State<Arc<Admin>>;

/// What the admin API needs: the pools and their operations, the store (keys, access log).
pub struct Admin {
    pub pools: Arc<Pools>,
    pub store: Arc<dyn Store>,
    pub clock: Arc<dyn Clock>,
    /// The live `[server]` settings (the admin token).
    pub live: Arc<crate::core::live::LiveServer>,
    /// The proxy's response caches, for the pool state.
    pub cache: Arc<crate::cache::Caches>,
}

/// Rejects requests without the admin bearer token.
pub async fn require_admin(State(state): AdminRef, req: Request, next: Next) -> Response {
    let presented = extract::authorization(req.headers()).and_then(extract::bearer);
    let live = state.live.load();
    if !presented.is_some_and(|given| live.is_admin_token(given)) {
        let msg = if live.admin_token.is_none() {
            "the admin API is disabled: set server.admin_token"
        } else {
            "missing or invalid admin token"
        };
        return ApiError::unauthorized(msg).into_response();
    }
    next.run(req).await
}

/// A pool as the admin API shows it: its settings (secrets masked) and who owns them.
#[derive(Serialize)]
pub struct PoolView {
    #[serde(flatten)]
    pub spec: PoolSpec,
    #[serde(rename = "managedBy")]
    pub managed_by: &'static str,
    #[serde(rename = "createdAt")]
    pub created_at: u64,
    #[serde(rename = "updatedAt")]
    pub updated_at: u64,
}

impl utoipa::PartialSchema for PoolView {
    /// The settings as written (`PoolSpec`'s properties) beside the read-only fields, in one
    /// object: an `allOf` with `PoolSpec` would inherit its `additionalProperties: false`,
    /// which every answer (with `managedBy`, `createdAt`, `updatedAt`) would then violate.
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
        use utoipa::openapi::RefOr;
        let mut view = match <PoolSpec as utoipa::PartialSchema>::schema() {
            RefOr::T(Schema::Object(o)) => o,
            _ => ObjectBuilder::new().build(),
        };
        view.additional_properties = None;
        view.description = Some(
            "A pool as read: its settings (header values, webhook and HMAC secrets masked, keys \
             shown as shortened sha256: hashes; sent back unchanged they mean keep) and the \
             read-only fields."
                .into(),
        );
        let read_only = |t: Type, what: &str| {
            RefOr::T(Schema::Object(
                ObjectBuilder::new()
                    .schema_type(t)
                    .read_only(Some(true))
                    .description(Some(what))
                    .build(),
            ))
        };
        for (name, t, what) in [
            (
                "managedBy",
                Type::String,
                "config (the file owns it) or api",
            ),
            ("createdAt", Type::Integer, "epoch ms"),
            ("updatedAt", Type::Integer, "epoch ms"),
        ] {
            view.properties.insert(name.into(), read_only(t, what));
            view.required.push(name.into());
        }
        RefOr::T(Schema::Object(view))
    }
}

impl ToSchema for PoolView {}

impl PoolView {
    fn of(p: &PoolRuntime) -> PoolView {
        PoolView {
            spec: p.spec.masked(),
            managed_by: p.managed_by.as_str(),
            created_at: p.created_at,
            updated_at: p.updated_at,
        }
    }
}

#[derive(Serialize, ToSchema)]
pub struct PoolList {
    pub items: Vec<PoolView>,
    pub next: Option<String>,
}

#[derive(Deserialize, Default)]
pub struct PageQuery {
    pub limit: Option<u32>,
    pub cursor: Option<String>,
}

#[utoipa::path(get, path = "/admin/pools", tag = "admin",
    params(("limit" = Option<u32>, Query, description = "page size, 1..=500 (default 100)"),
           ("cursor" = Option<String>, Query, description = "the previous page's `next`")),
    responses((status = 200, body = PoolList), (status = 400, description = "invalid (a query parameter)"), (status = 401, description = "unauthorized")))]
pub async fn list_pools(State(state): AdminRef, Query(q): Query<PageQuery>) -> Json<PoolList> {
    let limit = q.limit.unwrap_or(100).clamp(1, 500) as usize;
    let registry = state.pools.snapshot();
    let mut names: Vec<&String> = registry
        .pools
        .keys()
        .filter(|n| q.cursor.as_ref().is_none_or(|c| *n > c))
        .collect();
    names.sort();
    let next = if names.len() > limit {
        names.get(limit - 1).map(|n| n.to_string())
    } else {
        None
    };
    let items = names
        .into_iter()
        .take(limit)
        .filter_map(|n| registry.pools.get(n))
        .map(|p| PoolView::of(p))
        .collect();
    Json(PoolList { items, next })
}

#[utoipa::path(post, path = "/admin/pools", tag = "admin", request_body = PoolSpec,
    responses((status = 201, body = PoolView), (status = 400, description = "invalid"),
              (status = 409, description = "conflict (the name or a custom domain is taken), or too_many_destinations")))]
pub async fn create_pool(
    State(state): AdminRef,
    BodyBytes(body): BodyBytes<MAX_ADMIN_BODY_BYTES>,
) -> Result<(StatusCode, Json<PoolView>), ApiError> {
    let spec: PoolSpec = parse_json(&body)?;
    let pool = state.pools.create_pool(spec).await?;
    Ok((StatusCode::CREATED, Json(PoolView::of(&pool))))
}

#[utoipa::path(get, path = "/admin/pools/{pool}", tag = "admin",
    responses((status = 200, body = PoolView), (status = 404, description = "pool_not_found")))]
pub async fn get_pool(
    State(state): AdminRef,
    Path(name): Path<String>,
) -> Result<Json<PoolView>, ApiError> {
    Ok(Json(PoolView::of(&*state.pools.get_or_404(&name)?)))
}

#[utoipa::path(put, path = "/admin/pools/{pool}", tag = "admin", request_body = PoolSpec,
    responses((status = 200, body = PoolView), (status = 400, description = "invalid"),
              (status = 404, description = "pool_not_found"),
              (status = 409, description = "managed_by_config, conflict (a custom domain is taken), or too_many_destinations")))]
pub async fn put_pool(
    State(state): AdminRef,
    Path(name): Path<String>,
    BodyBytes(body): BodyBytes<MAX_ADMIN_BODY_BYTES>,
) -> Result<Json<PoolView>, ApiError> {
    // The name may be omitted from the body: the path names the pool. What a GET shows beside
    // the settings (read-only) may be sent back and is ignored, so a GET's body round-trips.
    let mut value: serde_json::Value = parse_json(&body)?;
    if let Some(obj) = value.as_object_mut() {
        obj.entry("name")
            .or_insert_with(|| serde_json::Value::String(name.clone()));
        for read_only in ["managedBy", "createdAt", "updatedAt"] {
            obj.remove(read_only);
        }
    }
    let spec: PoolSpec = parse_json(&Bytes::from(value.to_string()))?;
    Ok(Json(PoolView::of(
        &*state.pools.update_pool(&name, spec).await?,
    )))
}

#[utoipa::path(delete, path = "/admin/pools/{pool}", tag = "admin",
    responses((status = 204, description = "deleted"), (status = 404, description = "pool_not_found"),
              (status = 409, description = "managed_by_config")))]
pub async fn delete_pool(
    State(state): AdminRef,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.pools.delete_pool(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    pub label: Option<String>,
    /// Epoch ms after which the key stops working.
    #[serde(rename = "expiresAt")]
    pub expires_at: Option<u64>,
}

/// A new key: the plaintext `key` is shown this once.
#[derive(Serialize, ToSchema)]
pub struct CreatedKey {
    pub id: String,
    pub key: String,
    pub label: Option<String>,
    #[serde(rename = "createdAt")]
    pub created_at: u64,
    #[serde(rename = "expiresAt")]
    pub expires_at: Option<u64>,
}

#[derive(Serialize, ToSchema)]
pub struct KeyView {
    pub id: String,
    pub label: Option<String>,
    #[serde(rename = "createdAt")]
    pub created_at: u64,
    #[serde(rename = "expiresAt")]
    pub expires_at: Option<u64>,
    #[serde(rename = "revokedAt")]
    pub revoked_at: Option<u64>,
    #[serde(rename = "managedBy")]
    pub managed_by: &'static str,
}

#[derive(Serialize, ToSchema)]
pub struct KeyList {
    pub items: Vec<KeyView>,
    pub next: Option<String>,
}

#[utoipa::path(post, path = "/admin/pools/{pool}/keys", tag = "admin", request_body = NewKey,
    responses((status = 201, body = CreatedKey), (status = 400, description = "invalid"), (status = 404, description = "pool_not_found")))]
pub async fn create_key(
    State(state): AdminRef,
    Path(name): Path<String>,
    BodyBytes(body): BodyBytes<MAX_ADMIN_BODY_BYTES>,
) -> Result<(StatusCode, Json<CreatedKey>), ApiError> {
    state.pools.get_or_404(&name)?;
    let req: NewKey = if crate::core::extract::is_blank(&body) {
        NewKey::default()
    } else {
        parse_json(&body)?
    };
    let made = state
        .pools
        .create_key(&name, req.label, req.expires_at)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedKey {
            id: made.stored.id,
            key: made.key,
            label: made.stored.label,
            created_at: made.stored.created_at,
            expires_at: made.stored.expires_at,
        }),
    ))
}

#[utoipa::path(get, path = "/admin/pools/{pool}/keys", tag = "admin",
    responses((status = 200, body = KeyList), (status = 404, description = "pool_not_found")))]
pub async fn list_keys(
    State(state): AdminRef,
    Path(name): Path<String>,
) -> Result<Json<KeyList>, ApiError> {
    let pool = state.pools.get_or_404(&name)?;
    let index = pool.access.keys().load();
    let mut items: Vec<KeyView> = index
        .by_digest
        .values()
        .map(|e| KeyView {
            id: e.id.to_string(),
            label: e.label.clone(),
            created_at: e.created_at,
            expires_at: e.expires_at,
            revoked_at: e.revoked_at,
            managed_by: e.managed_by.as_str(),
        })
        .collect();
    items.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    Ok(Json(KeyList { items, next: None }))
}

#[derive(Serialize, ToSchema)]
pub struct Revoked {
    pub id: String,
    pub revoked: bool,
}

#[utoipa::path(delete, path = "/admin/pools/{pool}/keys/{id}", tag = "admin",
    responses((status = 200, body = Revoked), (status = 404, description = "key_not_found"),
              (status = 409, description = "managed_by_config")))]
pub async fn revoke_key(
    State(state): AdminRef,
    Path((name, id)): Path<(String, String)>,
) -> Result<Json<Revoked>, ApiError> {
    state.pools.revoke_key(&name, &id).await?;
    Ok(Json(Revoked { id, revoked: true }))
}

#[derive(Serialize, ToSchema)]
pub struct QueuedByClass {
    pub high: u32,
    pub normal: u32,
    pub low: u32,
}

#[derive(Serialize, ToSchema)]
pub struct LastThrottle {
    pub at: u64,
    pub cause: String,
}

/// Live governor state of a pool.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolState {
    pub in_flight: u32,
    pub queued: u32,
    pub queued_by_class: QueuedByClass,
    pub effective_limit: u32,
    pub configured_limit: u32,
    pub learned_limit: Option<u32>,
    pub learned_rpm: Option<u32>,
    pub rpm_remaining: Option<u32>,
    pub paused_until: Option<u64>,
    /// Epoch ms; present only while the learned pace holds the next admission back.
    pub paced_until: Option<u64>,
    pub last_throttle: Option<LastThrottle>,
    pub admitted_total: u64,
    pub refused_total: u64,
    /// The shared response cache on this node; absent for a pool without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheState>,
    /// The token budget (SPEC §12); absent while none is in force.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenState>,
}

/// A pool's token budget (with coordination on Redis, the one every node shares).
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TokenState {
    /// The whole budget per window (the smaller of `concurrency.tpm` and the origin's).
    pub budget: Option<u64>,
    pub remaining: Option<u64>,
    /// `configured`, `announced` or `configured+announced`.
    pub source: String,
    /// Requests waiting for room in the budget.
    pub waiting: u32,
    /// The budget is held for a request that has waited `tokens.hold_ms`.
    pub held: bool,
    /// Tokens charged since the pool started (estimates corrected by reported usage).
    pub admitted_tokens: u64,
    /// What the origin's input-token budget has left, when it announces input and output
    /// tokens apart (Anthropic).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_remaining: Option<u64>,
    /// What its output-token budget has left, likewise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_remaining: Option<u64>,
}

impl TokenState {
    fn of(s: nthbouncer_governor::TokenSnapshot) -> Option<TokenState> {
        Some(TokenState {
            budget: s.budget,
            remaining: s.remaining,
            source: s.source?.as_str().to_string(),
            waiting: s.waiting,
            held: s.held,
            admitted_tokens: s.admitted_tokens,
            input_remaining: s.input_remaining,
            output_remaining: s.output_remaining,
        })
    }
}

/// A pool's response cache on this node (counts since its settings last changed).
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CacheState {
    pub entries: u64,
    /// What the entries weigh (bodies, headers, keys), against `maxBytes`.
    pub bytes: u64,
    pub max_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub bypasses: u64,
    /// Requests waiting now for an identical request's call to the origin (coalesced).
    pub waiting: u64,
    /// hits / (hits + misses); 0 before any lookup.
    pub hit_ratio: f64,
}

impl CacheState {
    fn of(s: crate::cache::Stats) -> CacheState {
        CacheState {
            entries: s.entries,
            bytes: s.bytes,
            max_bytes: s.max_bytes,
            hits: s.hits,
            misses: s.misses,
            bypasses: s.bypasses,
            waiting: s.waiting,
            hit_ratio: s.hit_ratio(),
        }
    }
}

#[utoipa::path(get, path = "/admin/pools/{pool}/state", tag = "admin",
    responses((status = 200, body = PoolState), (status = 404, description = "pool_not_found")))]
pub async fn pool_state(
    State(state): AdminRef,
    Path(name): Path<String>,
) -> Result<Json<PoolState>, ApiError> {
    let pool = state.pools.get_or_404(&name)?;
    let s = pool.gate.snapshot().await;
    Ok(Json(PoolState {
        in_flight: s.in_flight,
        queued: s.queued,
        queued_by_class: QueuedByClass {
            high: s.queued_high,
            normal: s.queued_normal,
            low: s.queued_low,
        },
        effective_limit: s.effective_limit,
        configured_limit: s.configured_limit,
        learned_limit: s.learned_limit,
        learned_rpm: s.learned_rpm,
        rpm_remaining: s.rpm_remaining,
        paused_until: s.paused_until,
        paced_until: s.paced_until,
        last_throttle: s.last_throttle.map(|t| LastThrottle {
            at: t.at,
            cause: t.cause,
        }),
        admitted_total: s.admitted_total,
        refused_total: s.refused_total,
        cache: state.cache.stats(&pool).map(CacheState::of),
        tokens: TokenState::of(pool.tokens.snapshot().await),
    }))
}

#[derive(Deserialize, Default)]
pub struct AccessLogParams {
    pub limit: Option<u32>,
    pub cursor: Option<String>,
    pub since: Option<u64>,
    pub until: Option<u64>,
    pub outcome: Option<String>,
    #[serde(rename = "keyId")]
    pub key_id: Option<String>,
}

/// One access-log line as the admin API shows it.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AccessLogView {
    pub id: u64,
    pub at: u64,
    pub key_id: Option<String>,
    pub client_addr: String,
    pub route: String,
    pub outcome: String,
    pub reason: Option<String>,
    pub status: u16,
    pub queued_ms: u64,
    pub upstream_status: Option<u16>,
    pub upstream_latency_ms: Option<u64>,
    /// Requests this row stands for: 1, or more for authentication refusals of one client
    /// address folded into one row (the first one's route and time).
    pub count: u64,
    /// The request's `x-request-id` (a folded row: its first request's); absent on rows
    /// written before request ids were recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

impl From<AccessLogEntry> for AccessLogView {
    fn from(e: AccessLogEntry) -> Self {
        AccessLogView {
            id: e.id,
            at: e.at,
            key_id: e.key_id,
            client_addr: e.client_addr,
            route: e.route,
            outcome: e.outcome,
            reason: e.reason,
            status: e.status,
            queued_ms: e.queued_ms,
            upstream_status: e.upstream_status,
            upstream_latency_ms: e.upstream_latency_ms,
            count: e.count,
            request_id: e.request_id,
        }
    }
}

#[derive(Serialize, ToSchema)]
pub struct AccessLogPage {
    pub items: Vec<AccessLogView>,
    pub next: Option<String>,
}

#[utoipa::path(get, path = "/admin/pools/{pool}/access-log", tag = "admin",
    params(("limit" = Option<u32>, Query, description = "page size, 1..=1000 (default 100)"),
           ("cursor" = Option<String>, Query, description = "the previous page's `next`"),
           ("since" = Option<u64>, Query, description = "epoch ms, inclusive"),
           ("until" = Option<u64>, Query, description = "epoch ms, exclusive"),
           ("outcome" = Option<String>, Query, description = "admitted, 401, 429, 504, …"),
           ("keyId" = Option<String>, Query, description = "a key id")),
    responses((status = 200, body = AccessLogPage), (status = 400, description = "invalid (a query parameter)"), (status = 404, description = "pool_not_found")))]
pub async fn access_log(
    State(state): AdminRef,
    Path(name): Path<String>,
    Query(q): Query<AccessLogParams>,
) -> Result<Json<AccessLogPage>, ApiError> {
    let pool = state.pools.get_or_404(&name)?;
    let limit = pagination::page_size(q.limit, 1000);
    let query = AccessLogQuery {
        before: pagination::numeric_cursor(q.cursor.as_deref())?,
        since: epoch_ms("since", q.since)?,
        until: epoch_ms("until", q.until)?,
        outcome: q.outcome,
        key_id: q.key_id,
        limit: limit + 1,
    };
    let rows = state.store.query_access_log(&pool.name, &query).await?;
    let (entries, next) = pagination::split(rows, limit, |e| e.id.to_string());
    Ok(Json(AccessLogPage {
        items: entries.into_iter().map(AccessLogView::from).collect(),
        next,
    }))
}
