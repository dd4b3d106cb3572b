//! `[pools.async]` and `[[pools.webhooks]]`: whether a pool takes work asynchronously, and
//! where finished jobs are reported (SPEC §6, §7).

use serde::{Deserialize, Serialize};

use crate::ConfigError;

pub const MIN_RETENTION_S: u64 = 60;
pub const MAX_RETENTION_S: u64 = 604_800;
pub const MAX_ASYNC_BODY_BYTES: u64 = 64 * 1024 * 1024;
pub const DEFAULT_MAX_PENDING: u64 = 10_000;
pub const MAX_MAX_PENDING: u64 = 10_000_000;

/// `[pools.async]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AsyncSpec {
    /// Accept `X-Nthpool-Async: 1` (needs an active webhook destination on proxy pools).
    pub enabled: bool,
    /// A request that would wait for a slot is accepted as a job instead (`reason: busy`).
    pub on_open_wait: bool,
    /// A wait that hits the queue timeout becomes a job instead of `504` (`reason: wait_timeout`).
    pub on_queue_timeout: bool,
    /// How long a job is kept: its `expiresAt` is `createdAt + retention_s`, and a finished job
    /// stays readable for `retention_s` after it finished.
    pub retention_s: u64,
    /// Largest request body a job keeps, and largest result body stored (`truncated` beyond).
    pub max_body_bytes: u64,
    /// Most jobs of the pool accepted and not yet terminal; past it, a request that would
    /// become a job gets `429 too_many_requests` with `Retry-After`. Bounds the backlog a
    /// restart must resume.
    pub max_pending: u64,
}

impl Default for AsyncSpec {
    fn default() -> Self {
        AsyncSpec {
            enabled: false,
            on_open_wait: false,
            on_queue_timeout: false,
            retention_s: 86_400,
            max_body_bytes: 1024 * 1024,
            max_pending: DEFAULT_MAX_PENDING,
        }
    }
}

impl AsyncSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        if !(MIN_RETENTION_S..=MAX_RETENTION_S).contains(&self.retention_s) {
            return Err(ConfigError::new(
                format!("{at}.retention_s"),
                format!(
                    "must be between {MIN_RETENTION_S} and {MAX_RETENTION_S} (got {})",
                    self.retention_s
                ),
            ));
        }
        if self.max_body_bytes == 0 || self.max_body_bytes > MAX_ASYNC_BODY_BYTES {
            return Err(ConfigError::new(
                format!("{at}.max_body_bytes"),
                format!("must be between 1 and {MAX_ASYNC_BODY_BYTES}"),
            ));
        }
        if self.max_pending == 0 || self.max_pending > MAX_MAX_PENDING {
            return Err(ConfigError::new(
                format!("{at}.max_pending"),
                format!(
                    "must be between 1 and {MAX_MAX_PENDING} (got {})",
                    self.max_pending
                ),
            ));
        }
        if (self.on_open_wait || self.on_queue_timeout) && !self.enabled {
            return Err(ConfigError::new(
                format!("{at}.enabled"),
                "on_open_wait and on_queue_timeout need enabled = true",
            ));
        }
        Ok(())
    }
}

/// One `[[pools.webhooks]]` destination.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookSpec {
    pub url: String,
    /// `whsec_` + base64 of at least 24 bytes (`env:NAME` allowed).
    pub secret: String,
    /// Consecutive failed attempts after which the destination is deactivated.
    #[serde(default = "default_deactivate_after")]
    pub deactivate_after: u32,
}

fn default_deactivate_after() -> u32 {
    20
}

/// Checks a `whsec_` secret: base64 of at least 24 bytes.
pub fn check_webhook_secret(key: &str, secret: &str) -> Result<(), ConfigError> {
    use base64::prelude::*;
    let Some(b64) = secret.strip_prefix("whsec_") else {
        return Err(ConfigError::new(
            key,
            "must start with whsec_ (generate one with `nthbouncer keygen --webhook-secret`)",
        ));
    };
    match BASE64_STANDARD.decode(b64) {
        Ok(bytes) if bytes.len() >= 24 => Ok(()),
        Ok(_) => Err(ConfigError::new(
            key,
            "must encode at least 24 random bytes",
        )),
        Err(_) => Err(ConfigError::new(
            key,
            "the part after whsec_ must be standard base64",
        )),
    }
}

impl WebhookSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        crate::parse_http_url(&format!("{at}.url"), &self.url)?;
        let secret = crate::resolve_secret(&format!("{at}.secret"), &self.secret)?;
        check_webhook_secret(&format!("{at}.secret"), &secret)?;
        if self.deactivate_after == 0 {
            return Err(ConfigError::new(
                format!("{at}.deactivate_after"),
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
