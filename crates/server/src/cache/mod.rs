//! The shared response cache of proxy pools (SPEC §4, §12 `[pools.cache]`).
//!
//! Owns each cache-enabled pool's entries ([`store::PoolCache`], in memory on each node), the
//! rules of what is kept and for how long ([`policy`]), storing an answer as it streams
//! ([`fill`]) and the admin API's purge ([`routes`]). The proxy asks [`Caches::lookup`] after
//! authentication and every access policy, before admission: a hit is answered here and never
//! reaches the gate (no slot, no RPM token); a miss goes through the gate as any request and
//! its answer is stored through the [`Fill`] it carries. Concurrent misses for one key wait
//! for the first one's call (request coalescing) and get its answer once it is complete.
//!
//! It must not admit (the gate does), authenticate (access does) nor talk to the origin (the
//! proxy does, through upstream): it sees requests and answers, never connections.

mod fill;
pub mod policy;
pub mod routes;
pub mod store;

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::body::Body;
use http::header::{HeaderName, HeaderValue};
use http::Response;
use nthbouncer_coord::Clock;
use parking_lot::Mutex;

pub use fill::Fill;
pub use policy::RequestHead;
use policy::RequestRule;
pub use store::Stats;
use store::{Found, PoolCache};

use crate::pools::registry::PoolRuntime;
use crate::pools::Pools;

/// The header every answer of a cache-enabled pool carries.
pub const CACHE_HEADER: HeaderName = HeaderName::from_static("x-nthpool-cache");

/// What the cache did for an answer: `x-nthpool-cache: hit|miss|bypass`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    Hit,
    Miss,
    Bypass,
}

impl Mark {
    pub fn value(self) -> HeaderValue {
        HeaderValue::from_static(match self {
            Mark::Hit => "hit",
            Mark::Miss => "miss",
            Mark::Bypass => "bypass",
        })
    }
}

/// Sets `x-nthpool-cache` on an answer.
pub fn mark(resp: &mut Response<Body>, mark: Mark) {
    resp.headers_mut().insert(CACHE_HEADER, mark.value());
}

/// Marks an answer `bypass` unless the cache already marked it (answers refused before the
/// lookup: authentication, a bad header).
pub fn mark_unmarked(resp: &mut Response<Body>) {
    if !resp.headers().contains_key(CACHE_HEADER) {
        mark(resp, Mark::Bypass);
    }
}

/// What the proxy does with a request after the lookup.
pub enum Lookup {
    /// Answer this (marked `hit`, with `Age`); nothing goes to the gate or the origin.
    Hit(Response<Body>),
    /// Go to the origin (mark the answer `miss`); store its answer through the fill, if any.
    Miss(Option<Fill>),
    /// Go to the origin; the cache takes no part (mark the answer `bypass`).
    Bypass,
}

/// Which settings a pool's cache was built for: a change of any of them starts an empty one
/// (a pool deleted and created again, another upstream, other cache settings).
#[derive(PartialEq)]
struct Identity {
    created_at: u64,
    upstream: String,
    spec: nthbouncer_config::CacheSpec,
}

impl Identity {
    fn of(pool: &PoolRuntime) -> Option<Identity> {
        Some(Identity {
            created_at: pool.created_at,
            upstream: pool.spec.upstream.clone(),
            spec: pool.spec.cache.clone()?,
        })
    }

    fn serves(&self, pool: &PoolRuntime) -> bool {
        self.created_at == pool.created_at
            && self.upstream == pool.spec.upstream
            && pool.spec.cache.as_ref() == Some(&self.spec)
    }
}

struct Built {
    identity: Identity,
    cache: Arc<PoolCache>,
}

/// Every pool's cache, found by pool name; read without a lock shared across pools.
pub struct Caches {
    by_pool: ArcSwap<HashMap<String, Arc<Built>>>,
    /// Serialises building a pool's cache (rare: the first request after a change).
    building: Mutex<()>,
    pub(crate) pools: Arc<Pools>,
    clock: Arc<dyn Clock>,
}

impl Caches {
    pub fn new(pools: Arc<Pools>, clock: Arc<dyn Clock>) -> Caches {
        Caches {
            by_pool: ArcSwap::from_pointee(HashMap::new()),
            building: Mutex::new(()),
            pools,
            clock,
        }
    }

    /// The pool's cache as its settings are now, built (empty) if they changed; `None` for a
    /// pool without `[pools.cache]`.
    pub(crate) fn of(&self, pool: &PoolRuntime) -> Option<Arc<PoolCache>> {
        pool.spec.cache.as_ref()?;
        if let Some(b) = self.by_pool.load().get(&pool.name) {
            if b.identity.serves(pool) {
                return Some(b.cache.clone());
            }
        }
        let _building = self.building.lock();
        let current = self.by_pool.load_full();
        if let Some(b) = current.get(&pool.name).filter(|b| b.identity.serves(pool)) {
            return Some(b.cache.clone());
        }
        let identity = Identity::of(pool)?;
        let cache = Arc::new(PoolCache::new(
            &pool.name,
            &identity.spec,
            self.clock.clone(),
        ));
        let mut next: HashMap<String, Arc<Built>> = (*current).clone();
        // Caches of pools deleted or changed since are dropped with their memory.
        next.retain(|name, b| self.pools.get(name).is_some_and(|p| b.identity.serves(&p)));
        next.insert(
            pool.name.clone(),
            Arc::new(Built {
                identity,
                cache: cache.clone(),
            }),
        );
        self.by_pool.store(Arc::new(next));
        Some(cache)
    }

    /// Looks a request up in its pool's cache (call only for a pool with `[pools.cache]`,
    /// after authentication and access policies).
    pub async fn lookup(&self, pool: &PoolRuntime, req: &RequestHead<'_>, key_id: &str) -> Lookup {
        let Some(cache) = self.of(pool) else {
            return Lookup::Bypass;
        };
        let read = match policy::request_rule(&cache.spec, req) {
            RequestRule::Bypass(_) => {
                cache.count(Mark::Bypass);
                return Lookup::Bypass;
            }
            RequestRule::Use { read } => read,
        };
        let key = policy::key(&cache.spec, key_id, req.method, req.uri, req.headers);
        match cache.find(key, read, req.headers).await {
            Found::Hit(entry) => Lookup::Hit(entry.response(cache.now())),
            Found::Alone => Lookup::Miss(None),
            Found::Lead(ticket) => Lookup::Miss(Some(Fill {
                ticket,
                request: req.headers.clone(),
                path: req.uri.path().to_string(),
            })),
        }
    }

    /// The pool's cache figures, if it has a cache.
    pub fn stats(&self, pool: &PoolRuntime) -> Option<Stats> {
        self.of(pool).map(|c| c.stats())
    }

    /// Sets the pool's cache gauges (called at scrape time).
    pub fn set_gauges(&self, pool: &PoolRuntime) {
        let Some(s) = self.stats(pool) else { return };
        let p = pool.name.clone();
        metrics::gauge!("nthbouncer_cache_bytes", "pool" => p.clone()).set(s.bytes as f64);
        metrics::gauge!("nthbouncer_cache_max_bytes", "pool" => p.clone()).set(s.max_bytes as f64);
        metrics::gauge!("nthbouncer_cache_entries", "pool" => p.clone()).set(s.entries as f64);
        metrics::gauge!("nthbouncer_cache_hit_ratio", "pool" => p).set(s.hit_ratio());
    }
}
