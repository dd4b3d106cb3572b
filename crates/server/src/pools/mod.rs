//! The pool registry: the live set of pools the hot path reads ([`registry`]), the operations
//! that change it ([`ops`]), and the guard of the API host's pool routes ([`guard`]).
//!
//! [`Pools`] is the one handle every feature gets to find a pool; only the admin API, the
//! start-up, a configuration reload ([`reload`]) and, on a store several nodes share, another
//! node's admin changes ([`sync`]) change the set, one change at a time.

pub mod actions;
pub mod counted;
pub mod guard;
pub mod listeners;
pub mod ops;
pub mod registry;
pub mod reload;
pub mod sync;

use std::sync::Arc;

use arc_swap::ArcSwap;
use nthbouncer_coord::redis::RedisCoordination;
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

/// What a request's host names (SPEC §1).
pub enum HostRole {
    /// `server.api_host`.
    Api,
    /// A pool's host: `{pool}.{pool_domain}` or one of its custom domains.
    Pool(Arc<PoolRuntime>),
    Unknown,
}

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
    /// With coordination on Redis, where pools' token budgets are shared.
    token_ledgers: Option<Arc<RedisCoordination>>,
    clock: Arc<dyn Clock>,
    /// Notified when a pool's destinations change (the webhook dispatcher listens).
    destinations_changed: Arc<Notify>,
    /// Where every pool's HMAC nonces are recorded (and loaded from at start).
    nonces: NonceSource,
    /// Pools' own listeners.
    pub listeners: Listeners,
    /// The live `[server]` settings: the API host and the pool domain (host matching),
    /// `allow_private_webhooks` (for the webhooks an API pool's body declares),
    /// `max_destinations_per_pool`, and the timeouts of the clients of pools with
    /// `[pools.upstream_tls]`. A reload publishes new ones with the pools ([`reload`]).
    live: Arc<crate::core::live::LiveServer>,
}

/// What [`Pools::new`] is made of.
pub struct PoolsParts {
    pub store: Arc<dyn Store>,
    pub jobs: Arc<dyn JobStore>,
    pub coordination: Arc<dyn Coordination>,
    /// With coordination on Redis: every pool's token budget is shared there.
    pub token_ledgers: Option<Arc<RedisCoordination>>,
    pub clock: Arc<dyn Clock>,
    pub destinations_changed: Arc<Notify>,
    pub nonces: NonceSource,
    pub live: Arc<crate::core::live::LiveServer>,
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
            token_ledgers: parts.token_ledgers,
            clock: parts.clock,
            destinations_changed: parts.destinations_changed,
            nonces: parts.nonces,
            listeners: Listeners::default(),
            live: parts.live,
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

    /// What a (lowercased, port-less) host names, by the API host and pool domain of now.
    pub fn host_role(&self, host: &str) -> HostRole {
        let live = self.live.load();
        if host == live.api_host {
            return HostRole::Api;
        }
        match self.registry.load().by_host(host, &live.pool_suffix) {
            Some(pool) => HostRole::Pool(pool.clone()),
            None => HostRole::Unknown,
        }
    }

    /// The whole registry as it is now.
    pub fn snapshot(&self) -> Arc<Registry> {
        self.registry.load_full()
    }

    /// The lowercased API host name, as it is now.
    pub fn api_host(&self) -> String {
        self.live.load().api_host.clone()
    }

    /// The timeouts a pool's own upstream client is built with, as they are now.
    fn upstream_timeouts(&self) -> crate::upstream::ClientTimeouts {
        crate::upstream::ClientTimeouts::of(&self.live.load())
    }

    /// Waits for the right to change destinations (held across the store write and refresh).
    pub async fn lock_changes(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.changes.lock().await
    }
}
