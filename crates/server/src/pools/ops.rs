//! The operations that change the set of pools: the start-up load (config file, then store),
//! admin create/update/delete, key and destination refreshes. Every change is serialised by
//! `Pools::changes` and published by swapping the registry.

use std::sync::Arc;

use arc_swap::ArcSwap;
use nthbouncer_config::{Config, ConfigError, PoolSpec, WebhookSpec};
use nthbouncer_store::{StoredDestination, StoredKey, StoredPool};

use super::counted::CountedGate;
use super::listeners::{Bound, Listeners};
use super::registry::{same_database, PoolRuntime, Provenance, Registry, Shared};
use super::Pools;
use crate::access::keys::KeyIndex;
use crate::core::error::{ApiError, ErrorCode};
use crate::core::history::History;
use crate::core::netcheck::check_webhook_url;
use crate::core::ManagedBy;
use crate::tokens::TokenGate;

/// Why the pools could not be loaded at start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("invalid configuration: {0}")]
    Config(ConfigError),
    #[error("cannot read the store: {0}")]
    Store(String),
    #[error("{at}: cannot listen on {addr}: {source}")]
    Listen {
        at: String,
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

impl Pools {
    /// Builds a runtime pool, reusing `previous`'s gate and key index when it is an update. The
    /// key index is rebuilt from `stored_keys`, read from the store under `Pools::changes` by
    /// the caller: never from an index in memory, which a key change may have replaced since.
    pub(super) fn build_pool(
        &self,
        at: &str,
        spec: PoolSpec,
        provenance: Provenance,
        stored_keys: &[StoredKey],
        previous: Option<&Arc<PoolRuntime>>,
    ) -> Result<Arc<PoolRuntime>, ConfigError> {
        let timeouts = self.upstream_timeouts();
        self.build_pool_with(at, spec, provenance, stored_keys, previous, timeouts)
    }

    /// [`Pools::build_pool`] with the upstream timeouts a reload is about to publish.
    pub(super) fn build_pool_with(
        &self,
        at: &str,
        spec: PoolSpec,
        provenance: Provenance,
        stored_keys: &[StoredKey],
        previous: Option<&Arc<PoolRuntime>>,
        timeouts: crate::upstream::ClientTimeouts,
    ) -> Result<Arc<PoolRuntime>, ConfigError> {
        let settings = PoolRuntime::gate_settings(&spec.concurrency);
        let (gate, tokens, history, keys, destinations) = match previous {
            Some(p) => (
                p.gate.clone(),
                p.tokens.clone(),
                p.history.clone(),
                p.access.keys().clone(),
                p.destinations.clone(),
            ),
            None => {
                let history = Arc::new(History::default());
                let gate = CountedGate::wrap(
                    self.coordination.open(&spec.name, settings.clone()),
                    history.clone(),
                    self.clock.clone(),
                );
                let ledger = self
                    .token_ledgers
                    .as_ref()
                    .map(|r| r.token_ledger(&spec.name));
                let tokens = TokenGate::open(
                    PoolRuntime::token_settings(&spec),
                    self.clock.clone(),
                    ledger,
                );
                (
                    gate,
                    tokens,
                    history,
                    Arc::new(ArcSwap::from_pointee(KeyIndex::default())),
                    Arc::new(ArcSwap::from_pointee(Vec::new())),
                )
            }
        };
        let database = previous
            .filter(|p| same_database(&p.spec, &spec))
            .and_then(|p| p.upstream.database().cloned());
        let shared = Shared {
            gate,
            tokens,
            history,
            keys,
            destinations,
            upstream_timeouts: timeouts,
        };
        let mut runtime = PoolRuntime::build(at, spec, provenance, shared, database)?;
        match previous {
            // Seen nonces and failure counts survive a settings change (a replay window must
            // not reopen because an admin edited the pool).
            Some(p) => runtime.access.carry_state_from(&p.access),
            // Durable nonces, with those recorded before a restart.
            None => runtime
                .access
                .use_nonces(self.nonces.for_pool(&runtime.name)),
        }
        runtime.access.keys().store(Arc::new(KeyIndex::build(
            &runtime.spec_key_digests,
            stored_keys,
        )));
        Ok(Arc::new(runtime))
    }

    /// Loads the config file's pools and then the store's (a store pool whose name the file
    /// also declares is shadowed by the file, with a warning).
    pub async fn load_pools(&self, config: &Config) -> Result<(), LoadError> {
        let _guard = self.changes.lock().await;
        let nonces = self
            .nonces
            .load()
            .await
            .map_err(|e| LoadError::Store(e.to_string()))?;
        if nonces > 0 {
            tracing::info!(nonces, "HMAC nonces seen before the restart loaded");
        }
        let all_keys = self
            .store
            .list_all_keys()
            .await
            .map_err(|e| LoadError::Store(e.to_string()))?;
        let keys_of = |pool: &str| -> Vec<StoredKey> {
            all_keys
                .iter()
                .filter(|k| k.pool == pool)
                .cloned()
                .collect()
        };
        let mut registry = Registry::default();
        let now = self.now();
        for (i, spec) in config.pools.iter().enumerate() {
            let keys = keys_of(&spec.name);
            let pool = self
                .build_pool(
                    &format!("pools[{i}]"),
                    spec.clone(),
                    Provenance {
                        managed_by: ManagedBy::Config,
                        created_at: now,
                        updated_at: now,
                    },
                    &keys,
                    None,
                )
                .map_err(LoadError::Config)?;
            self.listen_config(i, spec)?;
            registry = registry.with_pool(pool);
        }
        for stored in self
            .store
            .list_pools()
            .await
            .map_err(|e| LoadError::Store(e.to_string()))?
        {
            if registry.pools.contains_key(&stored.name) {
                tracing::warn!(pool = %stored.name, "pool is declared in the config file and in the store; the file wins");
                continue;
            }
            let at = format!("stored pool {:?}", stored.name);
            let spec: PoolSpec = match serde_json::from_value(stored.spec.clone()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(pool = %stored.name, error = %e, "stored pool unreadable; skipped");
                    continue;
                }
            };
            let mut spec = spec;
            self.restore_webhook_secrets(&mut spec)
                .await
                .map_err(|e| LoadError::Store(e.to_string()))?;
            let keys = keys_of(&stored.name);
            match spec.validate(&at).and_then(|_| {
                self.build_pool(
                    &at,
                    spec,
                    Provenance {
                        managed_by: ManagedBy::Api,
                        created_at: stored.created_at,
                        updated_at: stored.updated_at,
                    },
                    &keys,
                    None,
                )
            }) {
                Ok(pool) => {
                    self.listen_stored(&pool);
                    registry = registry.with_pool(pool);
                }
                Err(e) => {
                    tracing::error!(pool = %stored.name, error = %e, "stored pool invalid; skipped")
                }
            }
        }
        self.registry.store(Arc::new(registry));
        self.sync_config_destinations(config)
            .await
            .map_err(|e| LoadError::Store(e.to_string()))?;
        for pool in self.registry.load().pools.values() {
            self.refresh_destinations(pool)
                .await
                .map_err(|e| LoadError::Store(e.message.to_string()))?;
        }
        Ok(())
    }

    /// Writes the file's `[[pools.webhooks]]` into the store (keeping their runtime state:
    /// active, failure streak) and removes config destinations the file no longer lists.
    pub(super) async fn sync_config_destinations(
        &self,
        config: &Config,
    ) -> nthbouncer_store::Result<()> {
        let existing = self.jobs.list_destinations(None).await?;
        let mut wanted = std::collections::HashSet::new();
        for (i, pool) in config.pools.iter().enumerate() {
            for (j, w) in pool.webhooks.iter().enumerate() {
                let at = format!("pools[{i}].webhooks[{j}].secret");
                let secret = nthbouncer_config::resolve_secret(&at, &w.secret)
                    .map_err(|e| nthbouncer_store::StoreError::Backend(e.to_string()))?;
                let id = self
                    .upsert_destination(&existing, &pool.name, w, secret, CONFIG_OWNER)
                    .await?;
                wanted.insert(id);
            }
        }
        for d in existing
            .iter()
            .filter(|d| d.managed_by == CONFIG_OWNER && !wanted.contains(&d.id))
        {
            self.jobs.delete_destination(&d.pool, &d.id).await?;
        }
        Ok(())
    }

    /// Makes the destinations an API pool's body declares exactly `webhooks` (keeping each
    /// one's runtime state), removing those the body no longer lists.
    async fn sync_spec_destinations(
        &self,
        pool: &str,
        webhooks: &[WebhookSpec],
    ) -> nthbouncer_store::Result<()> {
        let existing = self.jobs.list_destinations(Some(pool)).await?;
        let mut wanted = std::collections::HashSet::new();
        for w in webhooks {
            let id = self
                .upsert_destination(&existing, pool, w, w.secret.clone(), SPEC_OWNER)
                .await?;
            wanted.insert(id);
        }
        for d in existing
            .iter()
            .filter(|d| d.managed_by == SPEC_OWNER && !wanted.contains(&d.id))
        {
            self.jobs.delete_destination(&d.pool, &d.id).await?;
        }
        Ok(())
    }

    /// Creates or updates the destination `w` of `pool` declared by `owner`; its id.
    async fn upsert_destination(
        &self,
        existing: &[StoredDestination],
        pool: &str,
        w: &WebhookSpec,
        secret: String,
        owner: &str,
    ) -> nthbouncer_store::Result<String> {
        let id = config_destination_id(pool, &w.url);
        match existing.iter().find(|d| d.id == id) {
            Some(d) => {
                let mut d = d.clone();
                d.url = w.url.clone();
                d.secret = secret;
                d.deactivate_after = w.deactivate_after;
                d.managed_by = owner.to_string();
                self.jobs.update_destination(&d).await?;
            }
            None => {
                self.jobs
                    .create_destination(&StoredDestination {
                        id: id.clone(),
                        pool: pool.to_string(),
                        url: w.url.clone(),
                        secret,
                        active: true,
                        deactivate_after: w.deactivate_after,
                        consecutive_failures: 0,
                        deactivated_at: None,
                        managed_by: owner.to_string(),
                        created_at: self.now(),
                        previous_secret: None,
                        previous_secret_expires_at: None,
                    })
                    .await?;
            }
        }
        Ok(id)
    }

    /// Checks an API pool body's webhooks before anything is written: URLs the address guard
    /// allows, and room for them beside the destinations added through the webhooks routes.
    async fn check_spec_webhooks(&self, spec: &PoolSpec) -> Result<(), ApiError> {
        for (i, w) in spec.webhooks.iter().enumerate() {
            let field = format!("webhooks[{i}].url");
            check_webhook_url(&field, &w.url, self.live.load().allow_private_webhooks).await?;
        }
        let added = self
            .jobs
            .list_destinations(Some(&spec.name))
            .await?
            .iter()
            .filter(|d| d.managed_by == "api")
            .count();
        let cap = self.live.load().max_destinations_per_pool as usize;
        if added + spec.webhooks.len() > cap {
            return Err(ApiError::new(
                ErrorCode::TooManyDestinations,
                format!(
                    "pool {:?} would have {} destinations (server.max_destinations_per_pool = {cap})",
                    spec.name,
                    added + spec.webhooks.len()
                ),
            ));
        }
        Ok(())
    }

    /// A stored API pool's webhooks get their secrets back from their destinations (the stored
    /// body holds none); one whose destination is gone is dropped.
    pub(super) async fn restore_webhook_secrets(
        &self,
        spec: &mut PoolSpec,
    ) -> nthbouncer_store::Result<()> {
        if spec.webhooks.is_empty() {
            return Ok(());
        }
        let destinations = self.jobs.list_destinations(Some(&spec.name)).await?;
        let pool = spec.name.clone();
        spec.webhooks.retain_mut(|w| {
            let id = config_destination_id(&pool, &w.url);
            match destinations.iter().find(|d| d.id == id) {
                Some(d) => {
                    w.secret = d.secret.clone();
                    true
                }
                None => {
                    tracing::warn!(pool = %pool, url = %w.url, "a webhook of the pool's settings has no destination any more; dropped");
                    false
                }
            }
        });
        Ok(())
    }

    /// Re-reads a pool's destinations into its runtime view (and wakes the webhook dispatcher,
    /// which fails deliveries to destinations that are no longer active).
    pub async fn refresh_destinations(&self, pool: &PoolRuntime) -> Result<(), ApiError> {
        let list = self.jobs.list_destinations(Some(&pool.name)).await?;
        pool.destinations.store(Arc::new(list));
        self.destinations_changed.notify_one();
        Ok(())
    }

    fn check_domains(&self, registry: &Registry, spec: &PoolSpec) -> Result<(), ApiError> {
        for (i, d) in spec.custom_domains.iter().enumerate() {
            let d = d.to_ascii_lowercase();
            if d == self.live.load().api_host {
                return Err(ApiError::invalid(
                    format!("custom_domains[{i}]"),
                    format!("{d:?} is the API host"),
                ));
            }
            if let Some(owner) = registry.domain_owner(&d, &spec.name) {
                return Err(ApiError::invalid(
                    format!("custom_domains[{i}]"),
                    format!("{d:?} already belongs to pool {owner:?}"),
                ));
            }
        }
        Ok(())
    }

    /// Admin API: creates a pool in the store and starts serving it.
    pub async fn create_pool(&self, spec: PoolSpec) -> Result<Arc<PoolRuntime>, ApiError> {
        spec.validate("pool").map_err(invalid_from_config)?;
        let _guard = self.changes.lock().await;
        let registry = self.registry.load_full();
        if registry.pools.contains_key(&spec.name) {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("pool {:?} already exists", spec.name),
            ));
        }
        self.check_domains(&registry, &spec)?;
        self.check_spec_webhooks(&spec).await?;
        let bound = bind_for(&spec, None)?;
        let spec = spec.with_hashed_keys();
        let now = self.now();
        let pool = self
            .build_pool(
                "pool",
                spec.clone(),
                Provenance {
                    managed_by: ManagedBy::Api,
                    created_at: now,
                    updated_at: now,
                },
                &[],
                None,
            )
            .map_err(invalid_from_config)?;
        let stored = StoredPool {
            name: spec.name.clone(),
            spec: stored_spec(&spec)?,
            created_at: now,
            updated_at: now,
        };
        if let Err(e) = self.store.create_pool(&stored).await {
            pool.gate.close().await;
            return Err(e.into());
        }
        self.sync_spec_destinations(&pool.name, &spec.webhooks)
            .await?;
        self.refresh_destinations(&pool).await?;
        if let Some(bound) = bound {
            self.listeners.serve(&pool.name, bound);
        }
        self.registry
            .store(Arc::new(registry.with_pool(pool.clone())));
        Ok(pool)
    }

    /// Admin API: replaces an API-managed pool's settings; the gate keeps its slots and queue.
    pub async fn update_pool(
        &self,
        name: &str,
        spec: PoolSpec,
    ) -> Result<Arc<PoolRuntime>, ApiError> {
        if spec.name != name {
            return Err(ApiError::invalid(
                "name",
                "a pool cannot be renamed; the body's name must match the path",
            ));
        }
        let _guard = self.changes.lock().await;
        let registry = self.registry.load_full();
        let previous = registry
            .pools
            .get(name)
            .cloned()
            .ok_or_else(ApiError::pool_not_found)?;
        if previous.managed_by == ManagedBy::Config {
            return Err(managed_by_config(name));
        }
        // What a GET showed masked, sent back, keeps the current value.
        let spec = spec.unmasked(&previous.spec).map_err(invalid_from_config)?;
        spec.validate("pool").map_err(invalid_from_config)?;
        self.check_domains(&registry, &spec)?;
        self.check_spec_webhooks(&spec).await?;
        let bound = bind_for(&spec, previous.spec.listen.as_deref())?;
        let spec = spec.with_hashed_keys();
        let now = self.now();
        // From the store, under the lock key changes take too: a key revoked a moment ago is
        // revoked here as well.
        let stored_keys = self.store.list_keys(name).await?;
        let pool = self
            .build_pool(
                "pool",
                spec.clone(),
                Provenance {
                    managed_by: ManagedBy::Api,
                    created_at: previous.created_at,
                    updated_at: now,
                },
                &stored_keys,
                Some(&previous),
            )
            .map_err(invalid_from_config)?;
        if !self
            .store
            .update_pool(name, &stored_spec(&spec)?, now)
            .await?
        {
            return Err(ApiError::pool_not_found());
        }
        self.sync_spec_destinations(name, &spec.webhooks).await?;
        self.refresh_destinations(&pool).await?;
        pool.gate
            .reconfigure(PoolRuntime::gate_settings(&pool.concurrency))
            .await;
        pool.tokens
            .reconfigure(PoolRuntime::token_settings(&pool.spec));
        match bound {
            Some(bound) => self.listeners.serve(name, bound),
            None if pool.spec.listen.is_none() => self.listeners.close(name),
            None => {} // the same address: the listener stays
        }
        self.registry
            .store(Arc::new(registry.with_pool(pool.clone())));
        if !same_database(&previous.spec, &pool.spec) {
            // Idle sessions close now, busy ones as their requests end.
            if let Some(db) = previous.upstream.database() {
                db.close();
            }
        }
        Ok(pool)
    }

    /// Admin API: deletes an API-managed pool, its keys and its access log; waiters are refused.
    pub async fn delete_pool(&self, name: &str) -> Result<(), ApiError> {
        let _guard = self.changes.lock().await;
        let registry = self.registry.load_full();
        let previous = registry
            .pools
            .get(name)
            .cloned()
            .ok_or_else(ApiError::pool_not_found)?;
        if previous.managed_by == ManagedBy::Config {
            return Err(managed_by_config(name));
        }
        self.store.delete_pool(name).await?;
        self.sync_spec_destinations(name, &[]).await?;
        self.listeners.close(name);
        self.registry.store(Arc::new(registry.without(name)));
        previous.gate.close().await;
        if let Some(db) = previous.upstream.database() {
            db.close();
        }
        Ok(())
    }

    /// Admin API: stores a new key of pool `name` and puts it in the pool's index. Serialised
    /// with every pool change, so a concurrent update cannot publish an index without it.
    pub async fn add_key(&self, name: &str, key: &StoredKey) -> Result<(), ApiError> {
        let _guard = self.changes.lock().await;
        let pool = self.get_or_404(name)?;
        self.store.create_key(key).await?;
        self.reload_keys(&pool).await
    }

    /// Admin API: revokes key `id` of pool `name` in the store and in the pool's index.
    /// Serialised with every pool change (an update rebuilding the index from an older view
    /// would bring the key back).
    pub async fn revoke_key(&self, name: &str, id: &str) -> Result<(), ApiError> {
        let _guard = self.changes.lock().await;
        let pool = self.get_or_404(name)?;
        let managed = pool
            .access
            .keys()
            .load()
            .by_digest
            .values()
            .find(|e| *e.id == *id)
            .map(|e| e.managed_by);
        if managed == Some(ManagedBy::Config) {
            return Err(managed_by_config(name));
        }
        if !self.store.revoke_key(&pool.name, id, self.now()).await? {
            return Err(ApiError::new(
                ErrorCode::KeyNotFound,
                format!("no active key {id:?} in pool {name:?}"),
            ));
        }
        self.reload_keys(&pool).await
    }

    /// Re-reads a pool's stored keys into its index. Callers hold `changes`: two reloads racing
    /// could publish the older read last.
    async fn reload_keys(&self, pool: &PoolRuntime) -> Result<(), ApiError> {
        let stored = self.store.list_keys(&pool.name).await?;
        pool.access
            .keys()
            .store(Arc::new(KeyIndex::build(&pool.spec_key_digests, &stored)));
        Ok(())
    }
}

/// A config destination's id: stable across restarts, derived from pool and URL.
/// Who owns a destination: the config file's `[[pools.webhooks]]`.
const CONFIG_OWNER: &str = "config";
/// Who owns a destination: the `webhooks` of an API pool's body (changed by the pool's PUT).
const SPEC_OWNER: &str = "pool";

/// An API pool's body as stored: its webhooks' secrets live only in their destinations.
fn stored_spec(spec: &PoolSpec) -> Result<serde_json::Value, ApiError> {
    let mut spec = spec.clone();
    for w in spec.webhooks.iter_mut() {
        w.secret.clear();
    }
    serde_json::to_value(&spec).map_err(|e| ApiError::internal(e.to_string()))
}

/// A destination the destination routes may not change: it is declared in the config file, or
/// in the pool's own settings.
pub fn owned_elsewhere(pool: &str, owner: &str) -> ApiError {
    if owner == CONFIG_OWNER {
        return managed_by_config(pool);
    }
    ApiError::new(
        ErrorCode::Conflict,
        format!(
            "this destination is declared in pool {pool:?}'s settings; change it with \
             PUT /admin/pools/{pool}"
        ),
    )
}

/// Binds the listener `spec` asks for, unless it is `current` (an update that keeps it): a
/// pool change that cannot listen where it asks fails before anything changes.
fn bind_for(spec: &PoolSpec, current: Option<&str>) -> Result<Option<Bound>, ApiError> {
    let Some(addr) = spec.listen_addr("listen").map_err(invalid_from_config)? else {
        return Ok(None);
    };
    if spec.listen.as_deref() == current {
        return Ok(None);
    }
    Listeners::bind(addr)
        .map(Some)
        .map_err(|e| ApiError::invalid("listen", format!("cannot listen on {addr}: {e}")))
}

impl Pools {
    /// The config file's pool `i` listens where it asks, or the start fails naming the key.
    fn listen_config(&self, i: usize, spec: &PoolSpec) -> Result<(), LoadError> {
        let at = format!("pools[{i}].listen");
        if let Some(addr) = spec.listen_addr(&at).map_err(LoadError::Config)? {
            let bound =
                Listeners::bind(addr).map_err(|source| LoadError::Listen { at, addr, source })?;
            self.listeners.serve(&spec.name, bound);
        }
        Ok(())
    }

    /// A stored pool's own listener, at start: one that cannot bind is logged, and the pool is
    /// served on its host names only.
    pub(super) fn listen_stored(&self, pool: &PoolRuntime) {
        let Some(addr) = pool.spec.listen.as_deref().and_then(|l| l.parse().ok()) else {
            return;
        };
        match Listeners::bind(addr) {
            Ok(bound) => self.listeners.serve(&pool.name, bound),
            Err(e) => tracing::error!(
                pool = %pool.name, %addr, error = %e,
                "cannot listen on the pool's own address; it is served on its host names only"
            ),
        }
    }
}

pub fn config_destination_id(pool: &str, url: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("{pool}\n{url}").as_bytes());
    format!("wh_{}", hex::encode(&digest[..12]))
}

pub fn managed_by_config(name: &str) -> ApiError {
    ApiError::new(
        ErrorCode::ManagedByConfig,
        format!("pool {name:?} is declared in the config file; edit the file instead"),
    )
}

/// A validation failure of an API body: `400 invalid` naming the field.
pub fn invalid_from_config(e: ConfigError) -> ApiError {
    let field = e.key.strip_prefix("pool.").unwrap_or(&e.key).to_string();
    ApiError::invalid(field, e.to_string())
}
