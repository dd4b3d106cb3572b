//! A configuration reload's share of the pools: make the config-owned pools exactly the file's
//! `[[pools]]` (add, update, remove), keeping what each kept pool has in flight.
//!
//! A kept pool is rebuilt on its gate, key index and destinations (the machinery of an admin
//! update): its holders, leases, waiters, learned limit and RPM window stay, and a changed
//! limit applies to the next admission. A removed pool leaves the registry (new calls answer
//! `404 pool_not_found`), its waiters are refused, and the calls it admitted run to their end
//! on the runtime they hold. Pools created through the admin API are never touched.
//!
//! The live `[server]` settings are published here too, with the pools: the API host and the
//! pool domain route the next request by the new pool set, and a pool with its own upstream
//! client (`[pools.upstream_tls]`) is rebuilt on its gate when the upstream timeouts change.
//!
//! Everything that can fail is checked and built before anything is published: a reload that
//! fails changes nothing. It must not read the file nor judge which `[server]` keys may change
//! (the app's reload does).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use nthbouncer_config::{Config, ConfigError};

use super::listeners::{Bound, Listeners};
use super::registry::{same_database, PoolRuntime, Provenance, Registry};
use super::Pools;
use crate::core::live::ServerSettings;
use crate::core::ManagedBy;
use crate::upstream::ClientTimeouts;

/// What a reload did to the pools, by name.
#[derive(Debug, Default, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct PoolChanges {
    pub added: Vec<String>,
    pub changed: Vec<String>,
    pub removed: Vec<String>,
    pub unchanged: Vec<String>,
}

/// A pool built for the reload, not yet published.
struct Next {
    pool: Arc<PoolRuntime>,
    previous: Option<Arc<PoolRuntime>>,
    bound: Option<Bound>,
}

impl Pools {
    /// Checks the file's pools against the running ones: a refusal names the key and why.
    /// `config` has passed the start-up validation.
    pub fn check_reload(&self, config: &Config) -> Result<(), ConfigError> {
        let registry = self.registry.load_full();
        for (i, spec) in config.pools.iter().enumerate() {
            // Resolved before anything changes: the store sync after publishing needs them.
            for (j, w) in spec.webhooks.iter().enumerate() {
                let at = format!("pools[{i}].webhooks[{j}].secret");
                nthbouncer_config::resolve_secret(&at, &w.secret)?;
            }
            let Some(current) = registry.pools.get(&spec.name) else {
                continue;
            };
            if current.managed_by != ManagedBy::Config {
                return Err(ConfigError::new(
                    format!("pools[{i}].name"),
                    format!(
                        "pool {:?} was created through the admin API; delete it there before \
                         declaring it in the file",
                        spec.name
                    ),
                ));
            }
            if current.spec.listen != spec.listen {
                return Err(ConfigError::new(
                    format!("pools[{i}].listen"),
                    "changing a pool's own listener needs a restart",
                ));
            }
        }
        Ok(())
    }

    /// Makes the config-owned pools exactly `config.pools` and `settings` the live `[server]`
    /// settings, published together. Nothing changes if it fails.
    pub async fn apply_config(
        &self,
        config: &Config,
        settings: ServerSettings,
    ) -> Result<PoolChanges, ConfigError> {
        let _guard = self.changes.lock().await;
        self.check_reload(config)?;
        let registry = self.registry.load_full();
        check_api_host(&registry, &settings.api_host)?;
        let hosts = Hosts {
            api_host: &settings.api_host,
            timeouts: ClientTimeouts::of(&settings),
            timeouts_changed: ClientTimeouts::of(&settings) != self.upstream_timeouts(),
        };
        let wanted: HashSet<&str> = config.pools.iter().map(|p| p.name.as_str()).collect();
        let removed: Vec<Arc<PoolRuntime>> = registry
            .pools
            .values()
            .filter(|p| p.managed_by == ManagedBy::Config && !wanted.contains(p.name.as_str()))
            .cloned()
            .collect();
        // The API pools, which the file's pools must not clash with (custom domains).
        let mut candidate = registry
            .pools
            .values()
            .filter(|p| p.managed_by == ManagedBy::Config)
            .fold((*registry).clone(), |r, p| r.without(&p.name));
        let built = self
            .build_all(config, &registry, &mut candidate, &hosts)
            .await;
        let next = match built {
            Ok(next) => next,
            Err((e, opened)) => {
                // Gates opened for pools that will not be served.
                for pool in opened {
                    pool.gate.close().await;
                }
                return Err(e);
            }
        };
        let mut changes = PoolChanges::default();
        let mut listeners = Vec::new();
        for n in &next {
            match &n.previous {
                None => changes.added.push(n.pool.name.clone()),
                Some(p) if p.spec != n.pool.spec => changes.changed.push(n.pool.name.clone()),
                Some(_) => changes.unchanged.push(n.pool.name.clone()),
            }
        }
        // Publish: destinations first (the store), then the registry, then the gates.
        if let Err(e) = self.sync_config_destinations(config).await {
            tracing::error!(error = %e, "reload: cannot write the webhook destinations; they are synced at the next reload or start");
        }
        for n in next {
            if let Err(e) = self.refresh_destinations(&n.pool).await {
                tracing::error!(pool = %n.pool.name, error = %e.message, "reload: cannot read the pool's destinations");
            }
            if let Some(previous) = &n.previous {
                settle(previous, &n.pool).await;
            }
            if let Some(bound) = n.bound {
                listeners.push((n.pool.name.clone(), bound));
            }
        }
        // The pools and the host names they are found by change together.
        self.registry.store(Arc::new(candidate));
        self.live.store(settings);
        for (name, bound) in listeners {
            self.listeners.serve(&name, bound);
        }
        for pool in removed {
            self.listeners.close(&pool.name);
            // Waiters are refused; holders release into a gate nobody admits through.
            pool.gate.close().await;
            if let Some(db) = pool.upstream.database() {
                db.close();
            }
            changes.removed.push(pool.name.clone());
        }
        for list in [
            &mut changes.added,
            &mut changes.changed,
            &mut changes.removed,
            &mut changes.unchanged,
        ] {
            list.sort();
        }
        Ok(changes)
    }

    /// Builds every file pool into `candidate` (the registry to publish). On failure, the
    /// error and the new pools whose gates were opened.
    async fn build_all(
        &self,
        config: &Config,
        registry: &Registry,
        candidate: &mut Registry,
        hosts: &Hosts<'_>,
    ) -> Result<Vec<Next>, (ConfigError, Vec<Arc<PoolRuntime>>)> {
        let mut next: Vec<Next> = Vec::new();
        let opened = |next: &[Next]| -> Vec<Arc<PoolRuntime>> {
            next.iter()
                .filter(|n| n.previous.is_none())
                .map(|n| n.pool.clone())
                .collect()
        };
        let all_keys = match self.store.list_all_keys().await {
            Ok(k) => k,
            Err(e) => {
                return Err((
                    ConfigError::new("pools", format!("cannot read the pools' keys: {e}")),
                    Vec::new(),
                ))
            }
        };
        let mut keys_of: HashMap<&str, Vec<_>> = HashMap::new();
        for k in &all_keys {
            keys_of.entry(k.pool.as_str()).or_default().push(k.clone());
        }
        let now = self.now();
        for (i, spec) in config.pools.iter().enumerate() {
            let at = format!("pools[{i}]");
            let previous = registry.pools.get(&spec.name).cloned();
            if let Err(e) = check_reload_domains(candidate, hosts.api_host, &at, spec) {
                return Err((e, opened(&next)));
            }
            // An unchanged pool stays as it is (its access policies' caches too), unless its
            // own upstream client must take new timeouts.
            let keep = |p: &&Arc<PoolRuntime>| {
                p.spec == *spec && !(hosts.timeouts_changed && p.client.is_some())
            };
            if let Some(p) = previous.as_ref().filter(keep) {
                *candidate = candidate.with_pool(p.clone());
                next.push(Next {
                    pool: p.clone(),
                    previous: Some(p.clone()),
                    bound: None,
                });
                continue;
            }
            let provenance = Provenance {
                managed_by: ManagedBy::Config,
                created_at: previous.as_ref().map_or(now, |p| p.created_at),
                updated_at: now,
            };
            let keys = keys_of.get(spec.name.as_str()).cloned().unwrap_or_default();
            let pool = match self.build_pool_with(
                &at,
                spec.clone(),
                provenance,
                &keys,
                previous.as_ref(),
                hosts.timeouts,
            ) {
                Ok(p) => p,
                Err(e) => return Err((e, opened(&next))),
            };
            // A new pool's own listener is bound now, so a reload that cannot listen fails
            // whole (a kept pool keeps its listener: `check_reload` refused any change).
            let bound = match (&previous, spec.listen_addr(&format!("{at}.listen"))) {
                (None, Ok(Some(addr))) => match Listeners::bind(addr) {
                    Ok(b) => Some(b),
                    Err(e) => {
                        let mut o = opened(&next);
                        o.push(pool);
                        return Err((
                            ConfigError::new(
                                format!("{at}.listen"),
                                format!("cannot listen on {addr}: {e}"),
                            ),
                            o,
                        ));
                    }
                },
                (_, Err(e)) => {
                    let mut o = opened(&next);
                    if previous.is_none() {
                        o.push(pool);
                    }
                    return Err((e, o));
                }
                _ => None,
            };
            *candidate = candidate.with_pool(pool.clone());
            next.push(Next {
                pool,
                previous,
                bound,
            });
        }
        Ok(next)
    }
}

/// What the reload's `[server]` settings mean for building the pools.
struct Hosts<'a> {
    /// The API host to be, lowercased.
    api_host: &'a str,
    /// The upstream timeouts to be, and whether they differ from the running ones.
    timeouts: ClientTimeouts,
    timeouts_changed: bool,
}

/// A file pool's custom domains: not the API host to be, not another pool's.
fn check_reload_domains(
    candidate: &Registry,
    api_host: &str,
    at: &str,
    spec: &nthbouncer_config::PoolSpec,
) -> Result<(), ConfigError> {
    for (j, d) in spec.custom_domains.iter().enumerate() {
        let d = d.to_ascii_lowercase();
        let key = format!("{at}.custom_domains[{j}]");
        if d == api_host {
            return Err(ConfigError::new(key, format!("{d:?} is the API host")));
        }
        if let Some(owner) = candidate.domain_owner(&d, &spec.name) {
            return Err(ConfigError::new(
                key,
                format!("{d:?} already belongs to pool {owner:?}"),
            ));
        }
    }
    Ok(())
}

/// A new API host must not be a custom domain of a pool created through the admin API (the
/// file's pools are checked against it one by one).
fn check_api_host(registry: &Registry, api_host: &str) -> Result<(), ConfigError> {
    match registry.domains.get(api_host) {
        Some(pool) if pool.managed_by != ManagedBy::Config => Err(ConfigError::new(
            "server.api_host",
            format!(
                "{api_host:?} is a custom domain of pool {:?} (created through the admin API)",
                pool.name
            ),
        )),
        _ => Ok(()),
    }
}

/// A kept pool's gates take its new settings, and its old database sessions close if the
/// database changed.
async fn settle(previous: &PoolRuntime, pool: &PoolRuntime) {
    pool.tokens
        .reconfigure(PoolRuntime::token_settings(&pool.spec));
    if previous.concurrency != pool.concurrency {
        pool.gate
            .reconfigure(PoolRuntime::gate_settings(&pool.concurrency))
            .await;
    }
    if !same_database(&previous.spec, &pool.spec) {
        if let Some(db) = previous.upstream.database() {
            // Idle sessions close now, busy ones as their requests end.
            db.close();
        }
    }
}
