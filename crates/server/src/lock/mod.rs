//! The lock API on the API host (SPEC §5; the seed on concurrency locks is normative): leased
//! slots for callers that call the origin themselves, sharing the pool's limit, queue and RPM
//! gate with proxy traffic.
//!
//! Acquire attempts are written to the access log; renew and release are not. The slot id is
//! 128 random bits and lives in the pool's own gate, so another pool cannot name it.

mod holdback;
pub mod leases;

use nthbouncer_coord::Clock;

use crate::core::access_log::AccessLog;
use crate::pools::Pools;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::rejection::PathRejection;
use axum::extract::{ConnectInfo, Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use nthbouncer_config::ConcurrencySpec;
use nthbouncer_coord::{AcquireRequest, Outcome, Priority, RateInfo, RenewError, SlotId, SlotKind};
use nthbouncer_store::LeaseRecord;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::core::access_log::{LogLine, LogOutcome, UpstreamSeen};
use crate::core::admission::{self, Caller as AdmissionCaller};
use crate::core::error::{ApiError, ErrorCode};
use crate::core::extract::{is_blank, parse_json, BodyBytes};
use crate::core::request_id::RequestId;
use crate::pools::guard::PoolCaller;
use crate::pools::registry::PoolRuntime;

/// What the lock API needs: the access log (acquire attempts), the clock, the lease book.
pub struct LockApi {
    pub pools: Arc<Pools>,
    pub access_log: AccessLog,
    pub clock: Arc<dyn Clock>,
    /// Lock leases on record, for the restart (see `leases`).
    pub leases: leases::LeaseBook,
}

impl LockApi {
    fn now(&self) -> u64 {
        self.clock.now_ms()
    }
}

/// Largest acquire or release body.
pub const MAX_LOCK_BODY_BYTES: usize = crate::core::extract::MAX_API_BODY_BYTES;

/// Optional acquire body.
#[derive(Deserialize, Default, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AcquireBody {
    /// Opt-in queue wait in ms, clamped to the pool's queue timeout; beats the header.
    pub wait_ms: Option<u64>,
    /// `high`, `normal` (default) or `low`; beats `X-Nthpool-Priority`.
    pub priority: Option<String>,
    /// The call's estimated tokens (prompt plus output cap), for a pool with a token budget;
    /// absent, `tokens.default_cost`.
    pub tokens: Option<u64>,
}

/// The lock grant.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LockGrant {
    pub slot_id: String,
    /// Epoch ms: renew before this.
    pub lease_deadline: u64,
    /// Epoch ms: the lease never extends past this.
    pub request_deadline: u64,
    pub term_ms: u64,
    pub renew_interval_ms: u64,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Renewed {
    pub lease_deadline: u64,
}

/// Pre-parsed rate fields of an outcome report.
#[derive(Deserialize, Default, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RateBody {
    pub limit: Option<u64>,
    pub remaining: Option<u64>,
    pub reset_ms: Option<u64>,
    pub token_limit: Option<u64>,
    pub token_remaining: Option<u64>,
    pub token_reset_ms: Option<u64>,
}

/// A header value as reported: one string, or several.
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
pub enum HeaderValues {
    One(String),
    Many(Vec<String>),
}

/// Optional release body: the upstream outcome, feeding adaptive learning.
#[derive(Deserialize, Default, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseBody {
    /// Final upstream HTTP status (100-599).
    pub status: Option<u16>,
    /// Count of upstream 429s observed.
    pub throttled: Option<u32>,
    /// Upstream retry hint in ms.
    pub retry_after_ms: Option<u64>,
    /// Pre-parsed rate fields; win over `headers`.
    pub rate: Option<RateBody>,
    /// Raw upstream response headers to parse. Names are case-insensitive; a name sent in
    /// several spellings is read in the byte order of the spellings (the first value wins), so
    /// the same body always gives the same outcome.
    #[schema(value_type = Object)]
    pub headers: Option<BTreeMap<String, HeaderValues>>,
    /// The tokens the call used, which corrects its charge against the pool's token budget.
    pub usage: Option<UsageBody>,
}

/// Tokens a call used: `totalTokens`, or prompt plus completion.
#[derive(Deserialize, Default, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageBody {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub total_tokens: Option<u64>,
}

impl UsageBody {
    fn total(&self) -> Option<u64> {
        self.total_tokens.or_else(|| {
            (self.prompt_tokens.is_some() || self.completion_tokens.is_some()).then(|| {
                self.prompt_tokens
                    .unwrap_or(0)
                    .saturating_add(self.completion_tokens.unwrap_or(0))
            })
        })
    }
}

/// The estimate an acquire body carries (already validated by [`acquire_params`]).
fn tokens_asked(bytes: &Bytes) -> Option<u64> {
    if is_blank(bytes) {
        return None;
    }
    parse_json::<AcquireBody>(bytes).ok()?.tokens
}

/// A granted lock's charge against the pool's token budget, if one is in force (the slot id is
/// the charge's id): refused, the slot is given back and the refusal is the answer.
async fn admit_tokens(
    pool: &PoolRuntime,
    grant: &nthbouncer_coord::Grant,
    asked: Option<u64>,
    wait_ms: u64,
    priority: Priority,
) -> Result<(), ApiError> {
    if !pool.tokens.active() {
        return Ok(());
    }
    let cost = asked.unwrap_or_else(|| crate::tokens::defaults(pool.spec.tokens.as_ref()).cost);
    let refusal = match pool
        .tokens
        .acquire(grant.slot_id.0, cost.into(), priority, wait_ms)
        .await
    {
        Ok(_) => return Ok(()),
        Err(r) => r,
    };
    pool.gate.release(grant.slot_id, None).await;
    Err(match refusal {
        crate::tokens::TokenRefusal::Exceeds { estimate, budget } => ApiError::new(
            ErrorCode::ExceedsTokenBudget,
            format!("the lock's {estimate} tokens exceed the pool's whole token budget of {budget} tokens"),
        ),
        crate::tokens::TokenRefusal::NoRoom { retry_after_ms } => {
            let mut e = ApiError::new(
                ErrorCode::TooManyRequests,
                "the pool's token budget has no room for this call now",
            );
            e.retry_after_s = retry_after_ms.map(|ms| ms.div_ceil(1000).max(1));
            e
        }
        crate::tokens::TokenRefusal::Timeout => ApiError::new(
            ErrorCode::QueueTimeout,
            "the wait budget ran out before the pool's token budget had room",
        ),
        crate::tokens::TokenRefusal::Unavailable { retry_after_ms } => {
            crate::tokens::unavailable(retry_after_ms)
        }
    })
}

#[derive(Serialize, ToSchema)]
pub struct Released {
    pub released: bool,
}

/// `{slotId}` of a slot route. A segment that does not decode to UTF-8 names no slot: the
/// answer is the JSON 404 of any other unknown id, not axum's plain-text 400.
fn slot_param(path: Result<Path<(String, String)>, PathRejection>) -> String {
    path.map(|Path((_, slot))| slot).unwrap_or_default()
}

/// The wait budget and priority an acquire body asks for (an empty body: the headers'), as the
/// handler reads them. Public for the `lock_bodies` fuzz target.
pub fn acquire_params(
    bytes: &Bytes,
    headers: &HeaderMap,
    spec: &ConcurrencySpec,
) -> Result<(u64, Priority), ApiError> {
    let req: AcquireBody = if is_blank(bytes) {
        AcquireBody::default()
    } else {
        parse_json(bytes)?
    };
    let wait_ms = admission::wait_budget(headers, spec, AdmissionCaller::Lock, req.wait_ms)?;
    let priority = match &req.priority {
        Some(p) => Priority::parse(p)
            .ok_or_else(|| ApiError::invalid("priority", "priority must be high, normal or low"))?,
        None => admission::priority_from_headers(headers)?,
    };
    Ok((wait_ms, priority))
}

#[utoipa::path(post, path = "/pools/{pool}/lock/acquire", tag = "lock", request_body(content = AcquireBody, description = "optional"),
    params(("pool" = String, Path, description = "the pool's name")),
    responses((status = 200, body = LockGrant, description = "granted, with x-nthpool-* headers"),
              (status = 400, description = "invalid (the body)"),
              (status = 401, description = "unauthorized"), (status = 403, description = "unauthorized (IP allowlist)"),
              (status = 404, description = "pool_not_found"), (status = 413, description = "payload_too_large"),
              (status = 429, description = "too_many_requests, may carry Retry-After"), (status = 504, description = "queue_timeout")))]
pub async fn acquire(
    State(state): State<Arc<LockApi>>,
    Extension(PoolCaller { pool, caller }): Extension<PoolCaller>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    BodyBytes(bytes): BodyBytes<MAX_LOCK_BODY_BYTES>,
) -> Response {
    // The headers and the body are read here, in a block, and not kept: this future is what a
    // lock waiter parked in the queue holds (bench/run scale), and a local that was borrowed
    // stays in an `async fn`'s state until its scope ends.
    let (log, parsed, asked) = {
        let (headers, bytes) = (headers, bytes);
        let log = LogLine {
            log: &state.access_log,
            pool: &pool.name,
            at: state.now(),
            peer,
            peer_text: None,
            route: "lock acquire".into(),
            request_id: RequestId::in_header(&headers),
            // Refusals carry the client certificate (logged by the guard); admissions do not.
            client_cert: None,
        };
        let parsed = acquire_params(&bytes, &headers, &pool.concurrency);
        (log, parsed, tokens_asked(&bytes))
    };
    let (wait_ms, priority) = match parsed {
        Ok(v) => v,
        Err(e) => {
            return log.refuse(Some(&caller.key_id), e);
        }
    };
    let request = AcquireRequest {
        fairness_key: caller.fairness,
        priority,
        wait_ms,
        kind: SlotKind::Lease,
    };
    match pool.gate.acquire(request).await {
        Ok(grant) => {
            // Boxed, and only with a budget in force: its wait would otherwise size every
            // waiter's state, budget or not.
            let charged = if pool.tokens.active() {
                Box::pin(admit_tokens(&pool, &grant, asked, wait_ms, priority)).await
            } else {
                Ok(())
            };
            if let Err(e) = charged {
                let mut resp = log.refuse(Some(&caller.key_id), e);
                crate::tokens::mark(resp.headers_mut(), &pool.tokens);
                return resp;
            }
            // On record before its holder hears of it, so a restart holds its slot back.
            let lease = LeaseRecord {
                slot_id: grant.slot_id.to_string(),
                pool: pool.name.to_string(),
                request_deadline: grant.request_deadline,
            };
            // Boxed for the same reason (the store's batch submit): one allocation per grant,
            // none per waiter.
            if let Err(e) = Box::pin(state.leases.granted(lease)).await {
                pool.gate.release(grant.slot_id, None).await;
                tracing::error!(pool = %pool.name, error = %e, "cannot record a lock lease");
                let e = ApiError::new(
                    ErrorCode::StoreUnavailable,
                    "the lease could not be recorded; try again",
                );
                return log.refuse(Some(&caller.key_id), e);
            }
            pool.metrics.admitted_lock.increment(1);
            pool.metrics
                .queue_wait
                .record(grant.headers.queued_ms as f64 / 1000.0);
            log.write(
                Some(&caller.key_id),
                LogOutcome::Admitted,
                None,
                StatusCode::OK,
                grant.headers.queued_ms,
                UpstreamSeen::default(),
            );
            let mut resp = Json(LockGrant {
                slot_id: grant.slot_id.to_string(),
                lease_deadline: grant.lease_deadline,
                request_deadline: grant.request_deadline,
                term_ms: grant.term_ms,
                renew_interval_ms: grant.renew_interval_ms,
            })
            .into_response();
            admission::write_gate_headers(resp.headers_mut(), &grant.headers);
            crate::tokens::mark(resp.headers_mut(), &pool.tokens);
            resp
        }
        Err(refusal) => admission::refuse(&pool.metrics, log, &caller.key_id, &refusal),
    }
}

fn slot_not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "slot already released or reclaimed")
}

#[utoipa::path(post, path = "/pools/{pool}/lock/{slotId}/renew", tag = "lock",
    params(("pool" = String, Path, description = "the pool's name"),
           ("slotId" = String, Path, description = "the grant's slotId")),
    responses((status = 200, body = Renewed), (status = 400, description = "invalid (the slot id)"),
              (status = 401, description = "unauthorized"),
              (status = 404, description = "not_found: released or reclaimed; pool_not_found"),
              (status = 409, description = "capped: the lease reached requestDeadline; release it")))]
pub async fn renew(
    Extension(PoolCaller { pool, .. }): Extension<PoolCaller>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<Renewed>, ApiError> {
    let slot = slot_param(path);
    let slot = SlotId::parse(&slot).ok_or_else(slot_not_found)?;
    match pool.gate.renew(slot).await {
        Ok(lease_deadline) => Ok(Json(Renewed { lease_deadline })),
        Err(RenewError::NotFound) => Err(slot_not_found()),
        Err(RenewError::Capped) => Err(ApiError::new(
            ErrorCode::Capped,
            "the slot reached its request deadline and cannot be renewed; release it",
        )),
    }
}

/// The outcome a release body reports (an empty body: none), as the handler reads it. Public for
/// the `lock_bodies` fuzz target.
pub fn release_outcome(bytes: &Bytes, now_ms: u64) -> Result<Option<Outcome>, ApiError> {
    if is_blank(bytes) {
        return Ok(None);
    }
    let report: ReleaseBody = parse_json(bytes)?;
    outcome_of(&report, now_ms).map(Some)
}

/// Turns a release report into a governor outcome: `rate` wins over `headers`.
pub fn outcome_of(report: &ReleaseBody, now_ms: u64) -> Result<Outcome, ApiError> {
    if let Some(s) = report.status {
        if !(100..=599).contains(&s) {
            return Err(ApiError::invalid(
                "status",
                "status must be an HTTP status code (100-599)",
            ));
        }
    }
    let status = report.status.unwrap_or(0);
    let parsed = report
        .headers
        .as_ref()
        .map(|h| nthbouncer_ratelimit::parse(status, header_pairs(h, |_| true), now_ms));
    let rate = match &report.rate {
        Some(r) => Some(RateInfo {
            limit: r.limit,
            remaining: r.remaining,
            reset_ms: r.reset_ms,
            token_limit: r.token_limit,
            token_remaining: r.token_remaining,
            token_reset_ms: r.token_reset_ms,
            ..Default::default()
        }),
        None => parsed
            .as_ref()
            .and_then(crate::upstream::outcome::rate_info),
    };
    let header_throttled = parsed.as_ref().is_some_and(|p| p.throttled);
    // With `rate` sent, the header budgets lose, and so does the retry delay the parser derives
    // from them on a throttled answer; an explicit `Retry-After` / `retry-after-ms` still counts.
    let header_retry_ms = match (&report.rate, &report.headers) {
        (Some(_), Some(h)) => {
            let explicit = |name: &str| {
                name.trim().eq_ignore_ascii_case("retry-after")
                    || name.trim().eq_ignore_ascii_case("retry-after-ms")
            };
            nthbouncer_ratelimit::parse(status, header_pairs(h, explicit), now_ms).retry_after_ms
        }
        _ => parsed.as_ref().and_then(|p| p.retry_after_ms),
    };
    Ok(Outcome {
        status: report.status,
        throttled: report.throttled.unwrap_or(u32::from(header_throttled)),
        retry_after_ms: report.retry_after_ms.or(header_retry_ms),
        rate,
        via: Some(crate::upstream::outcome::VIA_LOCK),
        dialect: parsed.as_ref().and_then(crate::upstream::outcome::dialect),
    })
}

/// The reported headers as `(name, value)` pairs, one per value, keeping the names `keep` accepts.
fn header_pairs<'a>(
    headers: &'a BTreeMap<String, HeaderValues>,
    keep: impl Fn(&str) -> bool + 'a,
) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
    headers
        .iter()
        .filter(move |(k, _)| keep(k))
        .flat_map(|(k, v)| {
            let values: &[String] = match v {
                HeaderValues::One(s) => std::slice::from_ref(s),
                HeaderValues::Many(list) => list,
            };
            values.iter().map(move |s| (k.as_str(), s.as_str()))
        })
}

#[utoipa::path(post, path = "/pools/{pool}/lock/{slotId}/release", tag = "lock", request_body(content = ReleaseBody, description = "optional outcome report"),
    params(("pool" = String, Path, description = "the pool's name"),
           ("slotId" = String, Path, description = "the grant's slotId")),
    responses((status = 200, body = Released), (status = 400, description = "invalid"),
              (status = 401, description = "unauthorized"), (status = 404, description = "pool_not_found"), (status = 413, description = "payload_too_large")))]
pub async fn release(
    State(state): State<Arc<LockApi>>,
    Extension(PoolCaller { pool, .. }): Extension<PoolCaller>,
    path: Result<Path<(String, String)>, PathRejection>,
    BodyBytes(bytes): BodyBytes<MAX_LOCK_BODY_BYTES>,
) -> Result<Json<Released>, ApiError> {
    let slot = slot_param(path);
    let outcome = release_outcome(&bytes, state.now())?;
    let window = outcome.as_ref().and_then(crate::tokens::window_of);
    let parsed = SlotId::parse(&slot);
    let released = match parsed {
        Some(slot) => pool.gate.release(slot, outcome).await,
        None => false,
    };
    if let (true, Some(id)) = (released, parsed) {
        state.leases.released(&slot);
        // The call's charge (if the pool has a token budget): corrected by its usage, and what
        // the origin announced teaches the budget.
        let usage = if is_blank(&bytes) {
            None
        } else {
            parse_json::<ReleaseBody>(&bytes)
                .ok()
                .and_then(|r| r.usage.and_then(|u| u.total()))
        };
        pool.tokens
            .finish(id.0, usage.map(nthbouncer_governor::Usage::Total));
        if let Some(window) = window {
            pool.tokens.observe(Some(id.0), window);
        }
        // The freed slot may have gone to a waiter on this very thread, whose task is now
        // queued behind this one: let it answer first, so the slot's next holder hears of it
        // before this caller hears that it let go (the caller holds nothing any more).
        tokio::task::yield_now().await;
    }
    Ok(Json(Released { released }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::upstream::outcome::from_response;
    use crate::upstream::outcome::tests::{headers, SANDBOX_429, SANDBOX_OK};
    use nthbouncer_coord::{Coordination, PoolSettings};
    use serde_json::json;

    /// Lock-release reports act like proxy outcomes: the same answer, reported as raw headers
    /// by a lock holder, becomes the same outcome (only `via` differs) and teaches a pool the
    /// same limit, budget, pause and cause.
    #[tokio::test]
    async fn lock_release_reports_act_like_proxy_outcomes() {
        let cases: [(u16, &[(&str, &str)]); 2] = [(200, &SANDBOX_OK), (429, &SANDBOX_429)];
        let coord = nthbouncer_coord::in_process::InProcessCoordination::new(std::sync::Arc::new(
            nthbouncer_coord::ManualClock::new(1_000_000),
        ));
        let settings = PoolSettings {
            limit: 64,
            ..PoolSettings::default()
        };
        let proxied = coord.open("proxied", settings.clone());
        let locked = coord.open("locked", settings);
        for (status, pairs) in cases {
            let from_proxy = from_response(status, &headers(pairs), 1_000_000);
            let body: ReleaseBody = serde_json::from_value(json!({
                "status": status,
                "headers": pairs.iter().map(|(k, v)| (k.to_string(), json!(v)))
                    .collect::<serde_json::Map<_, _>>(),
            }))
            .unwrap();
            let from_lock = outcome_of(&body, 1_000_000).unwrap();
            assert_eq!(from_lock.via, Some("lock release"));
            assert_eq!(
                Outcome {
                    via: None,
                    ..from_lock.clone()
                },
                Outcome {
                    via: None,
                    ..from_proxy.clone()
                }
            );
            for (gate, outcome) in [(&proxied, from_proxy), (&locked, from_lock)] {
                let grant = gate
                    .acquire(nthbouncer_coord::AcquireRequest {
                        fairness_key: 0,
                        priority: nthbouncer_coord::Priority::Normal,
                        wait_ms: 0,
                        kind: nthbouncer_coord::SlotKind::Lease,
                    })
                    .await
                    .unwrap();
                assert!(gate.release(grant.slot_id, Some(outcome)).await);
            }
        }
        let (p, l) = (proxied.snapshot().await, locked.snapshot().await);
        // Halved by the concurrency 429, paused for its hint, and no pace: the last answer
        // announced 280 left, a budget with room, which is spent rather than spread.
        assert_eq!(
            (p.effective_limit, p.learned_rpm, p.paused_until),
            (32, None, Some(1_001_200))
        );
        assert_eq!(
            (l.effective_limit, l.learned_rpm, l.paused_until),
            (p.effective_limit, p.learned_rpm, p.paused_until)
        );
        let cause = |s: &nthbouncer_coord::Snapshot| s.last_throttle.clone().unwrap().cause;
        assert_eq!(
            cause(&p),
            "status 429, 1 throttled, retry-after 1200ms (proxy, openai)"
        );
        assert_eq!(
            cause(&l),
            "status 429, 1 throttled, retry-after 1200ms (lock release, openai)"
        );
    }

    #[test]
    fn a_header_sent_in_two_spellings_gives_the_same_outcome_every_time() {
        let body = Bytes::from_static(
            br#"{"status":429,"headers":{"retry-after":"2","Retry-After":"1"}}"#,
        );
        for _ in 0..20 {
            let outcome = release_outcome(&body, 0).unwrap().unwrap();
            assert_eq!(outcome.retry_after_ms, Some(1_000));
        }
    }
}
