//! The pool registry: the live set of pools the hot path reads ([`registry`]), the operations
//! that change it ([`ops`]), and the guard of the API host's pool routes ([`guard`]).
//!
//! [`Pools`] is the one handle every feature gets to find a pool; only the admin API, the
//! start-up and a configuration reload ([`reload`]) change the set, one change at a time.

pub mod guard;
pub mod listeners;
pub mod ops;
pub mod registry;
pub mod reload;

use std::sync::Arc;

use arc_swap::ArcSwap;
use nthbouncer_coord::{Clock, Coordination};
use nthbouncer_store::{JobStore, Store};
use tokio::sync::{Mutex, Notify};

use crate::access::NonceSource;
use crate::core::error::ApiError;
pub use listeners::Listeners;
pub use ops::{
    config_destination_id, invalid_from_config, managed_by_config, owned_elsewhere, LoadError,
};
use registry::{PoolRuntime, Registry};

/// The live pools and what changing them needs.
pub struct Pools {
    registry: ArcSwap<Registry>,
    /// Serialises changes to the pool set, to pool keys and to destinations (the admin API
    /// edits them): each reads the store and publishes what it read, so two at once could
    /// publish an older read last.
    changes: Mutex<()>,
    store: Arc<dyn Store>,
    /// Webhook destinations live with the jobs.
    jobs: Arc<dyn JobStore>,
    coordination: Arc<dyn Coordination>,
    clock: Arc<dyn Clock>,
    /// Lowercased `server.api_host`.
    api_host: String,
    /// `.{pool_domain}`, lowercased, for host matching.
    pool_suffix: String,
    /// Notified when a pool's destinations change (the webhook dispatcher listens).
    destinations_changed: Arc<Notify>,
    /// Where every pool's HMAC nonces are recorded (and loaded from at start).
    nonces: NonceSource,
    /// Pools' own listeners.
    pub listeners: Listeners,
    /// The live `[server]` settings: `allow_private_webhooks` (for the webhooks an API pool's
    /// body declares) and `max_destinations_per_pool`.
    live: Arc<crate::core::live::LiveServer>,
    /// For the clients of pools with `[pools.upstream_tls]`.
    upstream_timeouts: crate::upstream::ClientTimeouts,
}

/// What [`Pools::new`] is made of.
pub struct PoolsParts {
    pub store: Arc<dyn Store>,
    pub jobs: Arc<dyn JobStore>,
    pub coordination: Arc<dyn Coordination>,
    pub clock: Arc<dyn Clock>,
    pub api_host: String,
    pub pool_domain: String,
    pub destinations_changed: Arc<Notify>,
    pub nonces: NonceSource,
    pub live: Arc<crate::core::live::LiveServer>,
    pub upstream_timeouts: crate::upstream::ClientTimeouts,
}

impl Pools {
    /// An empty registry; [`Pools::load_pools`] fills it at start.
    pub fn new(parts: PoolsParts) -> Pools {
        Pools {
            registry: ArcSwap::from_pointee(Registry::default()),
            changes: Mutex::new(()),
            store: parts.store,
            jobs: parts.jobs,
            coordination: parts.coordination,
            clock: parts.clock,
            api_host: parts.api_host.to_ascii_lowercase(),
            pool_suffix: format!(".{}", parts.pool_domain.to_ascii_lowercase()),
            destinations_changed: parts.destinations_changed,
            nonces: parts.nonces,
            listeners: Listeners::default(),
            live: parts.live,
            upstream_timeouts: parts.upstream_timeouts,
        }
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The pool named `name`.
    pub fn get(&self, name: &str) -> Option<Arc<PoolRuntime>> {
        self.registry.load().pools.get(name).cloned()
    }

    /// The pool named `name`, or the `404 pool_not_found` answer.
    pub fn get_or_404(&self, name: &str) -> Result<Arc<PoolRuntime>, ApiError> {
        self.get(name).ok_or_else(ApiError::pool_not_found)
    }

    /// The pool a (lowercased, port-less) host names, if any.
    pub fn by_host(&self, host: &str) -> Option<Arc<PoolRuntime>> {
        self.registry
            .load()
            .by_host(host, &self.pool_suffix)
            .cloned()
    }

    /// The whole registry as it is now.
    pub fn snapshot(&self) -> Arc<Registry> {
        self.registry.load_full()
    }

    /// The lowercased API host name.
    pub fn api_host(&self) -> &str {
        &self.api_host
    }

    /// Waits for the right to change destinations (held across the store write and refresh).
    pub async fn lock_changes(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.changes.lock().await
    }
}
