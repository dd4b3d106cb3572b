//! One pool's cache: the entries (moka, bounded by their weight in bytes), the calls in flight
//! that later identical requests wait for (request coalescing), the counters.
//!
//! Freshness is ours, not moka's: an entry records when it was stored on the injected clock's
//! monotonic reading and until when it is fresh, and a lookup checks it, so expiry is tested
//! by advancing a `ManualClock`. Moka only bounds the memory (and drops entries past `ttl_s`
//! of real time, which no fresh entry can outlive).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, AGE};
use http::{HeaderMap, Response, StatusCode};
use metrics::Counter;
use nthbouncer_config::CacheSpec;
use nthbouncer_coord::Clock;
use parking_lot::Mutex;
use tokio::sync::watch;

use super::policy::{self, Prepared};
use super::{Mark, CACHE_HEADER};

/// Bytes an entry is counted for beyond its body, headers and key (the maps' own overhead).
const ENTRY_OVERHEAD: usize = 256;

/// A stored answer.
pub struct Entry {
    pub status: StatusCode,
    /// The origin's headers, less ours (`x-nthpool-*`, `x-request-id`) and hop-by-hop ones.
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The request's path, for purges by prefix.
    pub path: String,
    /// Monotonic ms on the injected clock.
    pub stored_at: u64,
    pub fresh_until: u64,
    pub initial_age_s: u64,
    /// The origin's `Vary` with the values the stored request had.
    pub vary: Vec<(HeaderName, Vec<u8>)>,
    /// What the entry counts for against `max_bytes`.
    pub weight: u32,
}

impl Entry {
    /// The bytes an entry of this body, these headers and this key is counted for.
    pub fn weigh(key: &[u8], headers: &HeaderMap, body: &Bytes, path: &str) -> u32 {
        let headers: usize = headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 16)
            .sum();
        let total = ENTRY_OVERHEAD + key.len() + headers + body.len() + path.len();
        u32::try_from(total).unwrap_or(u32::MAX)
    }

    fn fresh_at(&self, now: u64) -> bool {
        now < self.fresh_until
    }

    /// The answer to a hit: the stored one, `Age` (its age at storage plus the time since,
    /// in whole seconds) and `x-nthpool-cache: hit`.
    pub fn response(&self, now: u64) -> Response<Body> {
        let age = self.initial_age_s + now.saturating_sub(self.stored_at) / 1000;
        let mut resp = Response::new(Body::from(self.body.clone()));
        *resp.status_mut() = self.status;
        let headers = resp.headers_mut();
        headers.clone_from(&self.headers);
        headers.insert(AGE, HeaderValue::from(age));
        headers.insert(CACHE_HEADER, Mark::Hit.value());
        resp
    }
}

/// What a flight's waiters get: the entry, or `None` when the answer was not kept (not
/// cacheable, too large, cut short): then each goes to the origin itself.
pub type Landed = Option<Arc<Entry>>;

/// A call in flight for one key; later requests for the key wait for it.
struct Flight {
    id: u64,
    landed: watch::Receiver<Option<Landed>>,
}

/// How a lookup went.
pub enum Found {
    /// A fresh entry (stored, or just landed from the flight the request waited for).
    Hit(Arc<Entry>),
    /// Go to the origin, and store the answer through this ticket (the flight's leader).
    Lead(Ticket),
    /// Go to the origin without storing: the flight this request waited for landed nothing.
    Alone,
}

/// The leader's right to store the answer for a key and land its flight. Dropped without
/// landing (the call failed, was refused, or became a job), it lands nothing: the waiters go
/// to the origin themselves.
pub struct Ticket {
    cache: Arc<PoolCache>,
    key: Arc<[u8]>,
    flight: u64,
    /// `PoolCache::purges` when the call started: a purge since then keeps its answer out.
    purges: u64,
    sender: Option<watch::Sender<Option<Landed>>>,
}

impl Ticket {
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    pub fn spec(&self) -> &Prepared {
        &self.cache.spec
    }

    pub fn now(&self) -> u64 {
        self.cache.clock.monotonic_ms()
    }

    /// Stores the entry (unless a purge came since the call started) and hands it to the
    /// waiters.
    pub fn land(mut self, entry: Entry) {
        let entry = Arc::new(entry);
        if self.cache.purges.load(Ordering::Acquire) == self.purges {
            self.cache.entries.insert(self.key.clone(), entry.clone());
        }
        self.finish(Some(entry));
    }

    fn finish(&mut self, landed: Landed) {
        let Some(sender) = self.sender.take() else {
            return;
        };
        {
            let mut flights = self.cache.flights.lock();
            if flights.get(&self.key).is_some_and(|f| f.id == self.flight) {
                flights.remove(&self.key);
            }
        }
        sender.send_replace(Some(landed));
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.finish(None);
    }
}

/// Counters since the cache was built.
#[derive(Default)]
struct Counts {
    hits: AtomicU64,
    misses: AtomicU64,
    bypasses: AtomicU64,
    /// Requests waiting for another's call to the origin now.
    waiting: AtomicU64,
}

/// A request counted in `Counts::waiting` while it waits (a cancelled wait included).
struct Waiting<'a>(&'a AtomicU64);

impl<'a> Waiting<'a> {
    fn on(count: &'a AtomicU64) -> Waiting<'a> {
        count.fetch_add(1, Ordering::Relaxed);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

struct Counters {
    hits: Counter,
    misses: Counter,
    bypasses: Counter,
}

impl Counters {
    fn new(pool: &str) -> Counters {
        let counter = |result: &'static str| metrics::counter!("nthbouncer_cache_requests_total", "pool" => pool.to_string(), "result" => result);
        Counters {
            hits: counter("hit"),
            misses: counter("miss"),
            bypasses: counter("bypass"),
        }
    }
}

/// A pool's cache, as it stands (SPEC §12 `cache.*`).
pub struct PoolCache {
    pub pool: String,
    pub spec: Prepared,
    pub max_bytes: u64,
    entries: moka::sync::Cache<Arc<[u8]>, Arc<Entry>>,
    flights: Mutex<HashMap<Arc<[u8]>, Flight>>,
    next_flight: AtomicU64,
    purges: AtomicU64,
    counts: Counts,
    counters: Counters,
    clock: Arc<dyn Clock>,
}

/// What the pool state and `/metrics` show of a cache.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub entries: u64,
    pub bytes: u64,
    pub max_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub bypasses: u64,
    /// Requests waiting now for an identical request's call to the origin (coalesced).
    pub waiting: u64,
}

impl Stats {
    /// Hits over lookups that could hit (hits and misses); 0 before any.
    pub fn hit_ratio(&self) -> f64 {
        let looked_up = self.hits + self.misses;
        if looked_up == 0 {
            0.0
        } else {
            self.hits as f64 / looked_up as f64
        }
    }
}

impl PoolCache {
    pub fn new(pool: &str, spec: &CacheSpec, clock: Arc<dyn Clock>) -> PoolCache {
        let entries = moka::sync::Cache::builder()
            .max_capacity(spec.max_bytes)
            .weigher(|_: &Arc<[u8]>, e: &Arc<Entry>| e.weight)
            // Memory hygiene only: no entry is fresh for longer than ttl_s (checked by us).
            .time_to_live(std::time::Duration::from_secs(spec.ttl_s.saturating_add(1)))
            .build();
        PoolCache {
            pool: pool.to_string(),
            spec: Prepared::of(spec),
            max_bytes: spec.max_bytes,
            entries,
            flights: Mutex::new(HashMap::new()),
            next_flight: AtomicU64::new(0),
            purges: AtomicU64::new(0),
            counts: Counts::default(),
            counters: Counters::new(pool),
            clock,
        }
    }

    pub fn now(&self) -> u64 {
        self.clock.monotonic_ms()
    }

    /// A fresh entry for `key` matching the request's headers (the origin's `Vary`), else
    /// the flight in progress for it (waited for), else the lead of a new flight. `read`
    /// false (the request's `no-cache`): no stored entry and no flight is used, but the
    /// answer is stored.
    pub async fn find(self: &Arc<Self>, key: Vec<u8>, read: bool, request: &HeaderMap) -> Found {
        let key: Arc<[u8]> = key.into();
        if let Some(entry) = self.fresh(&key, read, request) {
            return Found::Hit(entry);
        }
        let waiting = {
            let mut flights = self.flights.lock();
            match flights.get(&key) {
                Some(f) if read => Some(f.landed.clone()),
                _ => {
                    // A leader stores its entry before it ends its flight: one that landed
                    // since the look above is seen here.
                    if let Some(entry) = self.fresh(&key, read, request) {
                        return Found::Hit(entry);
                    }
                    let id = self.next_flight.fetch_add(1, Ordering::Relaxed);
                    let (sender, landed) = watch::channel(None);
                    flights.insert(key.clone(), Flight { id, landed });
                    drop(flights);
                    self.count(Mark::Miss);
                    return Found::Lead(Ticket {
                        cache: self.clone(),
                        key,
                        flight: id,
                        purges: self.purges.load(Ordering::Acquire),
                        sender: Some(sender),
                    });
                }
            }
        };
        let landed = match waiting {
            Some(mut rx) => {
                let _waiting = Waiting::on(&self.counts.waiting);
                match rx.wait_for(Option::is_some).await {
                    Ok(v) => v.clone().flatten(),
                    // The leader's side went away without a word: nothing landed.
                    Err(_) => None,
                }
            }
            None => None,
        };
        match landed {
            Some(entry) if policy::vary_matches(&entry.vary, request) => {
                self.count(Mark::Hit);
                Found::Hit(entry)
            }
            _ => {
                self.count(Mark::Miss);
                Found::Alone
            }
        }
    }

    /// A fresh stored entry for the key that the request matches (counted as a hit).
    fn fresh(&self, key: &Arc<[u8]>, read: bool, request: &HeaderMap) -> Option<Arc<Entry>> {
        if !read {
            return None;
        }
        let entry = self.entries.get(key)?;
        if entry.fresh_at(self.now()) && policy::vary_matches(&entry.vary, request) {
            self.count(Mark::Hit);
            Some(entry)
        } else {
            None
        }
    }

    pub fn count(&self, mark: Mark) {
        let (count, counter) = match mark {
            Mark::Hit => (&self.counts.hits, &self.counters.hits),
            Mark::Miss => (&self.counts.misses, &self.counters.misses),
            Mark::Bypass => (&self.counts.bypasses, &self.counters.bypasses),
        };
        count.fetch_add(1, Ordering::Relaxed);
        counter.increment(1);
    }

    /// Drops every entry whose path starts with `prefix`; answers in flight are not stored.
    /// Returns how many entries were dropped.
    pub fn purge(&self, prefix: &str) -> u64 {
        self.purges.fetch_add(1, Ordering::AcqRel);
        let mut purged = 0;
        for (key, entry) in self.entries.iter() {
            if entry.path.starts_with(prefix) && self.entries.remove(&*key).is_some() {
                purged += 1;
            }
        }
        self.entries.run_pending_tasks();
        purged
    }

    pub fn stats(&self) -> Stats {
        // Moka settles its bookkeeping lazily; a reading should be current.
        self.entries.run_pending_tasks();
        Stats {
            entries: self.entries.entry_count(),
            bytes: self.entries.weighted_size(),
            max_bytes: self.max_bytes,
            hits: self.counts.hits.load(Ordering::Relaxed),
            misses: self.counts.misses.load(Ordering::Relaxed),
            bypasses: self.counts.bypasses.load(Ordering::Relaxed),
            waiting: self.counts.waiting.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use nthbouncer_coord::ManualClock;

    fn cache(clock: &Arc<ManualClock>, spec: CacheSpec) -> Arc<PoolCache> {
        Arc::new(PoolCache::new("p", &spec, clock.clone()))
    }

    fn entry(t: &Ticket, path: &str, body: &'static [u8], fresh_ms: u64) -> Entry {
        let (headers, body) = (HeaderMap::new(), Bytes::from_static(body));
        let now = t.now();
        Entry {
            status: StatusCode::OK,
            weight: Entry::weigh(t.key(), &headers, &body, path),
            headers,
            body,
            path: path.into(),
            stored_at: now,
            fresh_until: now + fresh_ms,
            initial_age_s: 0,
            vary: vec![],
        }
    }

    async fn lead(c: &Arc<PoolCache>, key: &str) -> Ticket {
        match c.find(key.into(), true, &HeaderMap::new()).await {
            Found::Lead(t) => t,
            _ => panic!("expected a lead for {key}"),
        }
    }

    #[tokio::test]
    async fn an_entry_is_fresh_until_its_time_on_the_injected_clock() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let c = cache(&clock, CacheSpec::default());
        let t = lead(&c, "k").await;
        let e = entry(&t, "/a", b"hello", 5_000);
        t.land(e);
        clock.advance(4_999);
        let Found::Hit(e) = c.find("k".into(), true, &HeaderMap::new()).await else {
            panic!("expected a hit");
        };
        assert_eq!(e.response(c.now()).headers()["age"], "4");
        clock.advance(1);
        assert!(matches!(
            c.find("k".into(), true, &HeaderMap::new()).await,
            Found::Lead(_)
        ));
        let s = c.stats();
        assert_eq!((s.hits, s.misses), (1, 2));
    }

    #[tokio::test]
    async fn waiters_get_the_leaders_entry_or_go_alone() {
        let clock = Arc::new(ManualClock::new(0));
        let c = cache(&clock, CacheSpec::default());
        let t = lead(&c, "k").await;
        let waiters: Vec<_> = (0..5)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move { c.find("k".into(), true, &HeaderMap::new()).await })
            })
            .collect();
        tokio::task::yield_now().await;
        let e = entry(&t, "/a", b"x", 1_000);
        t.land(e);
        for w in waiters {
            assert!(matches!(w.await.unwrap(), Found::Hit(_)));
        }
        // A leader that lands nothing sends its waiters alone, and a new request leads.
        let t = lead(&c, "k2").await;
        let waiter = {
            let c = c.clone();
            tokio::spawn(async move { c.find("k2".into(), true, &HeaderMap::new()).await })
        };
        tokio::task::yield_now().await;
        drop(t);
        assert!(matches!(waiter.await.unwrap(), Found::Alone));
        assert!(matches!(
            c.find("k2".into(), true, &HeaderMap::new()).await,
            Found::Lead(_)
        ));
    }

    #[tokio::test]
    async fn purge_drops_a_prefix_and_keeps_answers_in_flight_out() {
        let clock = Arc::new(ManualClock::new(0));
        let c = cache(&clock, CacheSpec::default());
        for (k, path) in [("a", "/v1/models"), ("b", "/v1/models/x"), ("c", "/v2")] {
            let t = lead(&c, k).await;
            let e = entry(&t, path, b"x", 60_000);
            t.land(e);
        }
        let in_flight = lead(&c, "d").await;
        assert_eq!(c.purge("/v1/models"), 2);
        let e = entry(&in_flight, "/v1/models/d", b"x", 60_000);
        in_flight.land(e);
        assert_eq!(c.stats().entries, 1);
        assert!(matches!(
            c.find("c".into(), true, &HeaderMap::new()).await,
            Found::Hit(_)
        ));
        assert_eq!(c.purge("/"), 1);
    }

    #[tokio::test]
    async fn the_byte_bound_holds_under_a_flood_of_distinct_keys() {
        let clock = Arc::new(ManualClock::new(0));
        let spec = CacheSpec {
            max_bytes: 64 * 1024,
            ..CacheSpec::default()
        };
        let c = cache(&clock, spec);
        static BODY: [u8; 1000] = [b'x'; 1000];
        for i in 0..2_000 {
            let t = lead(&c, &format!("key-{i}")).await;
            let e = entry(&t, "/flood", &BODY, 60_000);
            t.land(e);
        }
        let s = c.stats();
        assert!(s.bytes <= 64 * 1024, "{} bytes held", s.bytes);
        assert!(s.entries > 0 && s.entries < 2_000);
    }
}
