//! Configuration reload (SPEC §12 Reload): on SIGHUP (the binary) or `POST /admin/reload`, the
//! config file is read and validated whole, as at start and by `check-config`; a file with
//! anything wrong, or one that changes what only a restart can (`server.listen`, a pool's own
//! `listen`, `data_dir`, `store`, `coordination`), changes nothing and is answered `400`
//! naming the key and the rule. Otherwise the config-owned pools become the file's
//! (`pools::reload`: in-flight calls, slots, leases, waiters and learned limits stay), the
//! live `[server]` settings are swapped with them (`core::live`: every `[server]` key but
//! those that own a socket or a store), and the shared upstream client is replaced if its
//! timeouts changed (`upstream::SharedClient`: calls in flight keep the one they started on).
//!
//! Five keys are accepted but apply only at the next restart, and are listed in the answer's
//! `restartPending`: `coordination_fail`, `expected_nodes`, `coordination_prefix` and
//! `coordination_timeout_ms` set up the Redis coordination when it is opened at start (a
//! prefix changed live would split every pool's slots, queue and RPM window across two key
//! spaces); with in-process coordination they mean nothing. `store_claim_lease_ms` is read when
//! the PostgreSQL store is opened.
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
use crate::tls::ListenerTls;
use crate::upstream::ClientTimeouts;

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
    /// `[server]` keys that changed in the file but are read only when the coordination or the
    /// store is opened at start (`coordination_fail`, `expected_nodes`, `coordination_prefix`,
    /// `coordination_timeout_ms`, `store_claim_lease_ms`): they apply at the next restart.
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
        // Masked: the URL may carry a password.
        return Some(needs_restart("store", format!("{:?}", old.store_shown())));
    }
    if old.coordination != new.coordination {
        // Masked: the URL may carry a password.
        let was = format!("{:?}", old.coordination_shown());
        return Some(needs_restart("coordination", was));
    }
    None
}

/// `[server]` keys whose change is accepted but applies at the next restart: the Redis
/// coordination's settings, read once when it is opened at start.
fn pending_restart(old: &ServerSpec, new: &ServerSpec) -> Vec<String> {
    let mut keys = Vec::new();
    if old.coordination_fail != new.coordination_fail {
        keys.push("server.coordination_fail");
    }
    if old.coordination_prefix != new.coordination_prefix {
        keys.push("server.coordination_prefix");
    }
    if old.coordination_timeout_ms != new.coordination_timeout_ms {
        keys.push("server.coordination_timeout_ms");
    }
    if old.expected_nodes != new.expected_nodes {
        keys.push("server.expected_nodes");
    }
    if old.store_claim_lease_ms != new.store_claim_lease_ms {
        keys.push("server.store_claim_lease_ms");
    }
    keys.into_iter().map(String::from).collect()
}

/// `new` with the keys pending a restart at their running value (`running`'s): what a later
/// reload compares with.
fn as_applied(running: &ServerSpec, new: ServerSpec) -> ServerSpec {
    ServerSpec {
        coordination_fail: running.coordination_fail,
        expected_nodes: running.expected_nodes,
        coordination_prefix: running.coordination_prefix.clone(),
        coordination_timeout_ms: running.coordination_timeout_ms,
        store_claim_lease_ms: running.store_claim_lease_ms,
        ..new
    }
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
    let settings = ServerSettings::of(&config.server, state.live.port())?;
    state.pools.check_reload(&config)?;
    // A new shared upstream client if its timeouts change, built before anything is published.
    let timeouts = ClientTimeouts::of(&settings);
    let client = state
        .upstream
        .prepare(timeouts)
        .map_err(|e| ConfigError::new("server.upstream_connect_timeout_ms", e.to_string()))?;
    // The certificate files are read again (rotated ones included) before anything changes:
    // a file that does not read refuses the whole reload. They are served once the rest
    // applied.
    let certs = match (&state.tls, &config.server.tls) {
        (Some(tls), Some(spec)) => Some((tls, ListenerTls::prepare(spec)?)),
        (None, None) => None,
        _ => {
            return Err(ConfigError::new(
                "server.tls",
                "turning TLS on or off needs a restart (the running server keeps its listeners as they are)",
            ))
        }
    };
    // The pools and the live settings, published together.
    let pools = state.pools.apply_config(&config, settings).await?;
    if let Some(client) = client {
        state.upstream.install(timeouts, client);
    }
    if let Some((tls, certs)) = certs {
        tls.install(certs);
    }
    let restart_pending = pending_restart(&source.applied.server, &config.server);
    let mut applied = config;
    applied.server = as_applied(&source.applied.server, applied.server);
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
        added, changed or removed without dropping a call, a slot or a waiter of a kept pool. \
        Every `[server]` key that owns no socket and no store applies live: admin_token, \
        trusted_proxies, max_body_bytes and allow_private_webhooks to the next request; \
        api_host, pool_domain and public_url to the next request's routing and `pollUrl`s; \
        upstream_connect_timeout_ms and upstream_idle_timeout_ms to the next upstream call (calls \
        in flight keep their client); header_read_timeout_ms, idle_timeout_ms and \
        max_connections to the next connection accepted; max_destinations_per_pool to the next \
        destination added; access_log_keep to the next trim; shutdown_grace_ms to the next \
        shutdown; the `[server.tls]` certificates to the next handshake. coordination_fail, \
        expected_nodes, coordination_prefix, coordination_timeout_ms and store_claim_lease_ms are \
        accepted but apply at the next restart (they set up the Redis coordination or the store \
        when it is opened): the answer lists them in `restartPending`. A file with anything wrong, or one that changes \
        `server.listen`, a pool's own `listen`, `data_dir`, `store`, `coordination` or turns \
        `[server.tls]` on or off (those need a restart), changes nothing: `400 invalid` naming \
        the key in `field` and the rule in `message`.",
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
        new.idle_timeout_ms = 5;
        new.api_host = "api.example".into();
        new.pool_domain = "pools.example".into();
        new.public_url = Some("https://gw.example".into());
        new.upstream_connect_timeout_ms = 7;
        new.upstream_idle_timeout_ms = 7;
        new.max_connections = 7;
        new.shutdown_grace_ms = 7;
        new.access_log_keep = 7;
        assert!(restart_only(&old, &new).is_none());
        assert!(
            pending_restart(&old, &new).is_empty(),
            "live keys are not pending"
        );
        new.coordination_prefix = "other".into();
        new.expected_nodes = Some(3);
        assert_eq!(
            pending_restart(&old, &new),
            ["server.coordination_prefix", "server.expected_nodes"]
        );
        // The pending keys keep their running value for the next comparison; the rest is new.
        let applied = as_applied(&old, new.clone());
        assert!(pending_restart(&old, &applied).is_empty());
        assert_eq!(applied.api_host, "api.example");
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
