//! On a store several nodes share (PostgreSQL), changes made through another node's admin API
//! reach this node without a restart: pools created, changed or deleted there, keys added or
//! revoked, webhook destinations added, changed, deactivated or deleted.
//!
//! Every [`POLL`] the node reads the store's settings version (one row, moved in the same
//! transaction as any such change, see [`nthbouncer_store::Store::settings_version`]); when it
//! moved, the node re-reads the pools, keys and destinations and publishes what differs, under
//! the lock the admin API's changes take. So a change made on one node serves on every other
//! within about [`POLL`] (plus the reads). Pools from the config file are the file's: a stored
//! pool of the same name stays shadowed, as at start.
//!
//! On SQLite (one node) the version is `None` and the poll ends at once.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use nthbouncer_config::PoolSpec;
use nthbouncer_store::{StoredDestination, StoredKey};

use super::registry::{same_database, PoolRuntime, Provenance};
use super::Pools;
use crate::access::keys::KeyIndex;
use crate::core::ManagedBy;

/// How often the settings version is read.
pub const POLL: Duration = Duration::from_millis(500);

/// Follows the store's settings version until the process ends (or at once, on a store of one
/// node).
pub async fn run(pools: Arc<Pools>) {
    let mut seen: Option<u64> = None;
    let mut failing = false;
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let version = match pools.store.settings_version().await {
            Ok(Some(v)) => v,
            Ok(None) => return,
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "cannot read the store's settings version; retrying");
                }
                failing = true;
                continue;
            }
        };
        failing = false;
        if seen == Some(version) {
            continue;
        }
        match pools.sync_with_store().await {
            Ok(changes) => {
                if changes > 0 {
                    tracing::info!(
                        changes,
                        version,
                        "pools, keys or destinations changed in the store"
                    );
                }
                seen = Some(version);
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the changed pools; retrying"),
        }
    }
}

impl Pools {
    /// Makes the pools created through the admin API, every pool's stored keys and every
    /// pool's destinations what the store holds now; returns how many pools were added,
    /// changed or removed and whose keys or destinations changed.
    pub async fn sync_with_store(&self) -> nthbouncer_store::Result<usize> {
        let _guard = self.changes.lock().await;
        let stored = self.store.list_pools().await?;
        let all_keys = self.store.list_all_keys().await?;
        let all_destinations = self.jobs.list_destinations(None).await?;
        let registry = self.registry.load_full();
        let mut next = (*registry).clone();
        let mut changes = 0;

        let in_store: HashSet<&str> = stored.iter().map(|p| p.name.as_str()).collect();
        let mut retired: Vec<Arc<PoolRuntime>> = registry
            .pools
            .values()
            .filter(|p| p.managed_by != ManagedBy::Config && !in_store.contains(p.name.as_str()))
            .cloned()
            .collect();
        for p in &retired {
            next = next.without(&p.name);
            self.listeners.close(&p.name);
        }
        changes += retired.len();

        let mut keys_of: HashMap<&str, Vec<StoredKey>> = HashMap::new();
        for k in &all_keys {
            keys_of.entry(k.pool.as_str()).or_default().push(k.clone());
        }
        let mut settled: Vec<(Arc<PoolRuntime>, Arc<PoolRuntime>)> = Vec::new();
        for s in &stored {
            let current = registry.pools.get(&s.name);
            if let Some(p) = current {
                if p.managed_by == ManagedBy::Config
                    || (p.created_at == s.created_at && p.updated_at == s.updated_at)
                {
                    continue;
                }
            }
            // Deleted and created again elsewhere: a new pool, not an update.
            let previous = current.filter(|p| p.created_at == s.created_at).cloned();
            let at = format!("stored pool {:?}", s.name);
            let mut spec: PoolSpec = match serde_json::from_value(s.spec.clone()) {
                Ok(spec) => spec,
                Err(e) => {
                    tracing::error!(pool = %s.name, error = %e, "stored pool unreadable; skipped");
                    continue;
                }
            };
            self.restore_webhook_secrets(&mut spec).await?;
            let keys = keys_of.get(s.name.as_str()).cloned().unwrap_or_default();
            let provenance = Provenance {
                managed_by: ManagedBy::Api,
                created_at: s.created_at,
                updated_at: s.updated_at,
            };
            let built = spec
                .validate(&at)
                .and_then(|_| self.build_pool(&at, spec, provenance, &keys, previous.as_ref()));
            let pool = match built {
                Ok(pool) => pool,
                Err(e) => {
                    tracing::error!(pool = %s.name, error = %e, "stored pool invalid; skipped");
                    continue;
                }
            };
            match &previous {
                Some(p) => {
                    if p.spec.listen != pool.spec.listen {
                        self.listeners.close(&pool.name);
                        self.listen_stored(&pool);
                    }
                    settled.push((p.clone(), pool.clone()));
                }
                None => {
                    if let Some(old) = current {
                        self.listeners.close(&old.name);
                        retired.push(old.clone());
                    }
                    self.listen_stored(&pool);
                }
            }
            next = next.with_pool(pool);
            changes += 1;
        }
        self.registry.store(Arc::new(next));
        settle(settled, retired).await;
        changes += self.sync_keys_and_destinations(&keys_of, &all_destinations);
        Ok(changes)
    }

    /// Publishes every pool's stored keys and destinations as the store holds them now;
    /// returns how many pools' destinations changed.
    fn sync_keys_and_destinations(
        &self,
        keys_of: &HashMap<&str, Vec<StoredKey>>,
        all_destinations: &[StoredDestination],
    ) -> usize {
        let mut changes = 0;
        let mut destinations_of: HashMap<&str, Vec<StoredDestination>> = HashMap::new();
        for d in all_destinations {
            destinations_of
                .entry(d.pool.as_str())
                .or_default()
                .push(d.clone());
        }
        let mut destinations_moved = false;
        for pool in self.registry.load().pools.values() {
            let keys = keys_of.get(pool.name.as_str()).cloned().unwrap_or_default();
            let index = KeyIndex::build(&pool.spec_key_digests, &keys);
            pool.access.keys().store(Arc::new(index));
            let list = destinations_of
                .remove(pool.name.as_str())
                .unwrap_or_default();
            if **pool.destinations.load() != list {
                pool.destinations.store(Arc::new(list));
                destinations_moved = true;
                changes += 1;
            }
        }
        if destinations_moved {
            self.destinations_changed.notify_one();
        }
        changes
    }
}

/// Applies updated pools' gate and token settings (closing a database pool's old connections
/// when its database changed) and closes the retired pools' gates, once the new registry is
/// published.
async fn settle(
    settled: Vec<(Arc<PoolRuntime>, Arc<PoolRuntime>)>,
    retired: Vec<Arc<PoolRuntime>>,
) {
    for (previous, pool) in settled {
        pool.gate
            .reconfigure(PoolRuntime::gate_settings(&pool.concurrency))
            .await;
        pool.tokens
            .reconfigure(PoolRuntime::token_settings(&pool.spec));
        if !same_database(&previous.spec, &pool.spec) {
            if let Some(db) = previous.upstream.database() {
                db.close();
            }
        }
    }
    for pool in retired {
        pool.gate.close().await;
        if let Some(db) = pool.upstream.database() {
            db.close();
        }
    }
}
