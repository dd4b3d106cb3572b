//! Configuration reload (SPEC §12 Reload): on SIGHUP (the binary) or `POST /admin/reload`, the
//! config file is read and validated whole, as at start and by `check-config`; a file with
//! anything wrong, or one that changes what only a restart can (`server.listen`, a pool's own
//! `listen`, `data_dir`, `store`, `coordination`), changes nothing and is answered `400`
//! naming the key and the rule. Otherwise the config-owned pools become the file's
//! (`pools::reload`: in-flight calls, slots, leases, waiters and learned limits stay) and the
//! live `[server]` settings are swapped (`core::live`).
//!
//! It owns the reload's sequence, its record (log, metrics) and the route; it must not change
//! pools itself (the registry does) nor serve anything.

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use nthbouncer_config::{Config, ConfigError, ServerSpec};
use serde::Serialize;
use tokio::sync::Mutex;
use utoipa::ToSchema;

use crate::app::state::AppState;
use crate::core::error::ApiError;
use crate::core::live::ServerSettings;
use crate::pools::reload::PoolChanges;

/// Where the configuration comes from and what was last applied. One reload at a time.
#[derive(Default)]
pub struct Reloader {
    source: Mutex<Option<Source>>,
}

struct Source {
    path: PathBuf,
    applied: Config,
}

/// A reload that was applied.
#[derive(Debug, Serialize, ToSchema)]
pub struct Reloaded {
    /// `"reloaded"`.
    pub status: &'static str,
    /// What happened to the config file's pools, by name.
    pub pools: PoolChanges,
    /// `[server]` keys that changed in the file but are read only at start (the upstream
    /// client's timeouts, the connection limits, the host names…): they apply at the next
    /// restart.
    #[serde(rename = "restartPending")]
    pub restart_pending: Vec<String>,
}

impl Reloader {
    /// Remembers the file the server was started from, and the configuration it applied.
    pub async fn set_source(&self, path: PathBuf, applied: Config) {
        *self.source.lock().await = Some(Source { path, applied });
    }
}

/// `[server]` keys a reload may not change: they own a socket or a store.
fn restart_only(old: &ServerSpec, new: &ServerSpec) -> Option<ConfigError> {
    let needs_restart = |key: &str, was: String| {
        ConfigError::new(
            format!("server.{key}"),
            format!("changing it needs a restart (the running server keeps {was})"),
        )
    };
    if old.listen != new.listen {
        return Some(needs_restart("listen", format!("{:?}", old.listen)));
    }
    if old.data_dir != new.data_dir {
        return Some(needs_restart("data_dir", format!("{:?}", old.data_dir)));
    }
    if old.store != new.store {
        return Some(needs_restart("store", format!("{:?}", old.store)));
    }
    if old.coordination != new.coordination {
        return Some(needs_restart(
            "coordination",
            format!("{:?}", old.coordination),
        ));
    }
    None
}

/// `[server]` keys whose change is accepted but applies at the next restart: read once at
/// start by parts a reload does not rebuild.
fn pending_restart(old: &ServerSpec, new: &ServerSpec) -> Vec<String> {
    let (Ok(old), Ok(new)) = (serde_json::to_value(old), serde_json::to_value(new)) else {
        return Vec::new();
    };
    const LIVE: &[&str] = &[
        "admin_token",
        "trusted_proxies",
        "max_body_bytes",
        "header_read_timeout_ms",
        "allow_private_webhooks",
        "max_destinations_per_pool",
        "tls",
    ];
    let (Some(old), Some(new)) = (old.as_object(), new.as_object()) else {
        return Vec::new();
    };
    let mut keys: Vec<String> = new
        .iter()
        .filter(|(k, v)| !LIVE.contains(&k.as_str()) && old.get(*k) != Some(*v))
        .map(|(k, _)| format!("server.{k}"))
        .collect();
    keys.sort();
    keys
}

/// Re-reads the config file and applies it; `trigger` says what asked (for the log).
pub async fn reload(state: &AppState, trigger: &str) -> Result<Reloaded, ConfigError> {
    let outcome = reload_inner(state).await;
    let now_s = state.clock.now_ms() as f64 / 1000.0;
    crate::core::metrics::handle();
    metrics::gauge!("nthbouncer_config_reload_last_timestamp_seconds").set(now_s);
    let ok = outcome.is_ok();
    metrics::gauge!("nthbouncer_config_reload_last_success").set(if ok { 1.0 } else { 0.0 });
    metrics::counter!("nthbouncer_config_reloads_total", "result" => if ok { "applied" } else { "refused" })
        .increment(1);
    match &outcome {
        Ok(r) => tracing::info!(
            trigger,
            added = ?r.pools.added,
            changed = ?r.pools.changed,
            removed = ?r.pools.removed,
            restart_pending = ?r.restart_pending,
            "configuration reloaded"
        ),
        Err(e) => tracing::error!(
            trigger, key = %e.key, rule = %e.rule,
            "configuration reload refused; nothing changed"
        ),
    }
    if let Some(r) = outcome
        .as_ref()
        .ok()
        .filter(|r| !r.restart_pending.is_empty())
    {
        tracing::warn!(
            keys = ?r.restart_pending,
            "these [server] keys changed in the file; they apply at the next restart"
        );
    }
    outcome
}

async fn reload_inner(state: &AppState) -> Result<Reloaded, ConfigError> {
    let mut source = state.reload.source.lock().await;
    let Some(source) = source.as_mut() else {
        return Err(ConfigError::new(
            "(file)",
            "the server was started without a config file (or with --demo): nothing to reload",
        ));
    };
    let path = source.path.clone();
    let config = tokio::task::spawn_blocking(move || Config::load(&path))
        .await
        .map_err(|e| ConfigError::new("(file)", e.to_string()))??;
    // The checks `check-config` and the start make, without binding or opening anything.
    crate::app::start::check_config(&config)?;
    if let Some(e) = restart_only(&source.applied.server, &config.server) {
        return Err(e);
    }
    let settings = ServerSettings::of(&config.server)?;
    state.pools.check_reload(&config)?;
    // The certificate files are read again (rotated ones included) before anything else
    // changes: a file that does not read refuses the whole reload.
    match (&state.tls, &config.server.tls) {
        (Some(tls), Some(spec)) => tls.use_spec(spec)?,
        (None, None) => {}
        _ => {
            return Err(ConfigError::new(
                "server.tls",
                "turning TLS on or off needs a restart (the running server keeps its listeners as they are)",
            ))
        }
    }
    let pools = state.pools.apply_config(&config).await?;
    state.live.store(settings);
    let restart_pending = pending_restart(&source.applied.server, &config.server);
    // What a later reload compares with: the keys pending a restart keep their running value.
    let mut applied = config;
    let running = &source.applied.server;
    applied.server = ServerSpec {
        admin_token: applied.server.admin_token.clone(),
        trusted_proxies: applied.server.trusted_proxies.clone(),
        max_body_bytes: applied.server.max_body_bytes,
        header_read_timeout_ms: applied.server.header_read_timeout_ms,
        allow_private_webhooks: applied.server.allow_private_webhooks,
        max_destinations_per_pool: applied.server.max_destinations_per_pool,
        tls: applied.server.tls.clone(),
        ..running.clone()
    };
    source.applied = applied;
    Ok(Reloaded {
        status: "reloaded",
        pools,
        restart_pending,
    })
}

/// `POST /admin/reload`: re-reads the config file and applies it.
#[utoipa::path(post, path = "/admin/reload", tag = "admin",
    description = "Re-reads the config file and applies it, as SIGHUP does: the file's pools are \
        added, changed or removed without dropping a call, a slot or a waiter of a kept pool; the \
        live `[server]` settings (admin_token, trusted_proxies, max_body_bytes, \
        header_read_timeout_ms, allow_private_webhooks, max_destinations_per_pool) apply to the \
        next request. A file with anything wrong, or one that changes `server.listen`, a pool's \
        own `listen`, `data_dir`, `store` or `coordination` (those need a restart), changes \
        nothing: `400 invalid` naming the key in `field` and the rule in `message`.",
    responses(
        (status = 200, description = "applied", body = Reloaded),
        (status = 400, description = "invalid: refused, nothing changed"),
    ))]
pub async fn reload_route(State(state): State<Arc<AppState>>) -> Result<Json<Reloaded>, ApiError> {
    reload(&state, "POST /admin/reload")
        .await
        .map(Json)
        .map_err(|e| ApiError::invalid(e.key.clone(), e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_owns_a_socket_or_a_store_is_refused_and_start_only_keys_are_pending() {
        let old = ServerSpec::default();
        let mut new = old.clone();
        new.admin_token = Some("another-admin-token-0123".into());
        new.max_body_bytes = 1;
        assert!(restart_only(&old, &new).is_none());
        assert!(
            pending_restart(&old, &new).is_empty(),
            "live keys are not pending"
        );
        new.idle_timeout_ms = 5;
        new.api_host = "api.example".into();
        assert_eq!(
            pending_restart(&old, &new),
            ["server.api_host", "server.idle_timeout_ms"]
        );
        for (key, change) in [
            (
                "server.listen",
                (|s: &mut ServerSpec| s.listen = "127.0.0.1:1".into()) as fn(&mut ServerSpec),
            ),
            ("server.data_dir", |s| s.data_dir = "elsewhere".into()),
            ("server.store", |s| s.store = "postgres://x".into()),
            ("server.coordination", |s| {
                s.coordination = "redis://x".into()
            }),
        ] {
            let mut changed = old.clone();
            change(&mut changed);
            let refused =
                restart_only(&old, &changed).map(|e| (e.key, e.rule.contains("needs a restart")));
            assert_eq!(refused, Some((key.to_string(), true)));
        }
    }
}
