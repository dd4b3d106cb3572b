//! The live set of pools: what each pool host routes to, each pool's key index and gate.
//!
//! Readers (every request) load an immutable [`Registry`] through `ArcSwap` — no lock shared
//! across pools on the hot path. Writers (admin API, start-up) build a new registry and swap it
//! in, serialised by [`super::Pools`].

use std::sync::Arc;

use arc_swap::ArcSwap;
use http::{HeaderName, HeaderValue};
use nthbouncer_config::{ConcurrencySpec, ConfigError, PoolKind, PoolSpec};
use nthbouncer_coord::{PoolGate, PoolSettings};
use nthbouncer_sqlhttp::{Database, Limits};
use nthbouncer_store::StoredDestination;

use crate::access::keys::{Accept, KeyIndex};
use crate::access::AccessPolicy;
use crate::core::history::History;
use crate::core::metrics::PoolMetrics;
use crate::core::ManagedBy;
use crate::tokens::TokenGate;
use crate::upstream::{
    build_tls_client, CallClient, ClientTimeouts, SharedClient, Target, UpstreamClient,
};

/// Who owns a pool and since when.
#[derive(Clone, Copy, Debug)]
pub struct Provenance {
    pub managed_by: ManagedBy,
    pub created_at: u64,
    pub updated_at: u64,
}

/// Where a pool's calls go: an HTTP origin (proxy pools) or PostgreSQL (database pools).
pub enum Upstream {
    Http(Target),
    /// The pool's PostgreSQL sessions, capped at the pool's limit. Shared by every settings
    /// version of the pool whose upstream and `[pools.database]` did not change.
    Database(Database),
}

impl Upstream {
    pub fn http(&self) -> Option<&Target> {
        match self {
            Upstream::Http(t) => Some(t),
            Upstream::Database(_) => None,
        }
    }

    pub fn database(&self) -> Option<&Database> {
        match self {
            Upstream::Database(d) => Some(d),
            Upstream::Http(_) => None,
        }
    }
}

/// A pool as the serving path sees it: immutable; a settings change builds a new one that
/// shares the same gate and key index.
pub struct PoolRuntime {
    pub name: String,
    pub spec: PoolSpec,
    pub managed_by: ManagedBy,
    pub created_at: u64,
    pub updated_at: u64,
    pub upstream: Upstream,
    pub upstream_headers: Vec<(HeaderName, HeaderValue)>,
    pub concurrency: ConcurrencySpec,
    /// Digests of the keys the spec itself lists (config file, or the API body).
    pub spec_key_digests: Vec<[u8; 32]>,
    pub gate: Arc<dyn PoolGate>,
    /// The pool key and the pool's access policies (SPEC §2, §9); it holds the key index.
    pub access: AccessPolicy,
    /// Webhook destinations (from the store; config ones are synced there at start-up).
    pub destinations: Arc<ArcSwap<Vec<StoredDestination>>>,
    pub metrics: PoolMetrics,
    /// The last 15 minutes, second by second, counted by the gate (shared by every version).
    pub history: Arc<History>,
    /// The pool's own upstream client (`[pools.upstream_tls]`); otherwise the shared one.
    pub client: Option<Arc<UpstreamClient>>,
    /// The pool's token budget (SPEC §12), shared by every version like the gate.
    pub tokens: Arc<TokenGate>,
}

impl PoolRuntime {
    /// The client this pool's upstream calls go through: its own (`[pools.upstream_tls]`),
    /// else `shared`.
    pub fn client(&self, shared: &SharedClient) -> CallClient {
        match &self.client {
            Some(own) => CallClient::pooled(own.clone()),
            None => shared.for_call(),
        }
    }

    /// Resolves a validated spec into runtime form. `at` names the spec's origin in errors.
    /// A database pool uses `database` (the previous version's sessions) when given.
    pub fn build(
        at: &str,
        spec: PoolSpec,
        provenance: Provenance,
        shared: Shared,
        database: Option<Database>,
    ) -> Result<PoolRuntime, ConfigError> {
        let Shared {
            gate,
            tokens,
            history,
            keys,
            destinations,
            upstream_timeouts,
        } = shared;
        let client = match &spec.upstream_tls {
            Some(t) => {
                let (config, name) =
                    crate::tls::upstream_client_config(&format!("{at}.upstream_tls"), t)?;
                Some(Arc::new(build_tls_client(upstream_timeouts, config, name)))
            }
            None => None,
        };
        let upstream = match (spec.kind, database) {
            (PoolKind::Proxy, _) => Upstream::Http(Target::parse(at, &spec.upstream)?),
            (PoolKind::Database, Some(db)) => {
                db.set_max_connections(spec.concurrency.limit as usize);
                Upstream::Database(db)
            }
            (PoolKind::Database, None) => Upstream::Database(open_database(at, &spec)?),
        };
        let mut upstream_headers = Vec::new();
        for (name, value) in spec.resolved_upstream_headers(at)? {
            let key = format!("{at}.upstream_headers.{name}");
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| ConfigError::new(&key, "is not a valid header name"))?;
            let mut value = HeaderValue::from_str(&value)
                .map_err(|_| ConfigError::new(&key, "is not a valid header value"))?;
            // Credentials must never show up in debug output or HPACK tables.
            value.set_sensitive(true);
            upstream_headers.push((name, value));
        }
        let spec_key_digests = spec.key_digests(at)?;
        let accept = Accept::of(&spec.auth_methods());
        let access = AccessPolicy::build(&format!("{at}.access"), &spec.access, accept, keys)?;
        Ok(PoolRuntime {
            name: spec.name.clone(),
            upstream,
            upstream_headers,
            concurrency: spec.concurrency.clone(),
            spec_key_digests,
            metrics: PoolMetrics::new(&spec.name),
            history,
            spec,
            managed_by: provenance.managed_by,
            created_at: provenance.created_at,
            updated_at: provenance.updated_at,
            gate,
            access,
            destinations,
            client,
            tokens,
        })
    }

    /// Ids of the destinations that receive this pool's webhooks now.
    pub fn active_destination_ids(&self) -> Vec<String> {
        self.destinations
            .load()
            .iter()
            .filter(|d| d.active)
            .map(|d| d.id.clone())
            .collect()
    }

    /// Async is live: enabled, and (on proxy pools) at least one active destination. Otherwise
    /// the pool behaves exactly as with async off (SPEC §6 fallback). Database pools take jobs
    /// with `async.enabled` alone (SPEC §8): their handles are polled on the pool host.
    pub fn async_live(&self) -> bool {
        self.spec.async_jobs.enabled
            && (self.spec.kind == PoolKind::Database
                || self.destinations.load().iter().any(|d| d.active))
    }

    /// The governor's view of the settings.
    pub fn gate_settings(spec: &ConcurrencySpec) -> PoolSettings {
        PoolSettings {
            limit: spec.limit,
            queue_size: spec.queue_size,
            rpm: spec.rpm,
            request_timeout_ms: spec.request_timeout_ms,
            lease_term_ms: spec.lease_term_ms,
            renew_interval_ms: spec.renew_interval_ms,
            adaptive: spec.adaptive,
            min_limit: spec.min_limit,
            fair_share: spec.fair_share,
            max_pause_ms: spec.max_pause_ms,
        }
    }

    /// The token budget's view of the settings.
    pub fn token_settings(spec: &PoolSpec) -> nthbouncer_governor::TokenSettings {
        crate::tokens::settings(&spec.concurrency, spec.tokens.as_ref())
    }

    /// Host names this pool answers to besides `{name}.{pool_domain}`.
    pub fn domains(&self) -> impl Iterator<Item = String> + '_ {
        self.spec
            .custom_domains
            .iter()
            .map(|d| d.to_ascii_lowercase())
    }
}

/// What every settings version of a pool shares: its gate, its key index, its destinations.
pub struct Shared {
    pub gate: Arc<dyn PoolGate>,
    pub tokens: Arc<TokenGate>,
    pub history: Arc<History>,
    pub keys: Arc<ArcSwap<KeyIndex>>,
    pub destinations: Arc<ArcSwap<Vec<StoredDestination>>>,
    pub upstream_timeouts: ClientTimeouts,
}

/// Whether a settings change keeps a database pool's sessions: same upstream, same
/// `[pools.database]` (a new limit only resizes them).
pub fn same_database(previous: &PoolSpec, next: &PoolSpec) -> bool {
    previous.kind == PoolKind::Database
        && next.kind == PoolKind::Database
        && previous.upstream == next.upstream
        && previous.database_settings() == next.database_settings()
}

/// A database pool's sessions, opened on demand, at most `concurrency.limit` at once (the gate
/// lowers the cap to the effective limit as it learns). Errors never quote the URL.
pub fn open_database(at: &str, spec: &PoolSpec) -> Result<Database, ConfigError> {
    let url = spec.database_url(at)?;
    let settings = spec.database_settings();
    let limits = Limits {
        max_connections: spec.concurrency.limit.max(1) as usize,
        statement_timeout: (settings.statement_timeout_ms > 0)
            .then(|| std::time::Duration::from_millis(settings.statement_timeout_ms)),
        max_response_bytes: settings.max_response_bytes as usize,
        connect_timeout: std::time::Duration::from_millis(settings.connect_timeout_ms),
    };
    let opened = match &settings.ca_file {
        Some(path) => Database::with_ca(&url, limits, &read_ca_file(at, path)?),
        None => Database::new(&url, limits),
    };
    opened.map_err(|e| ConfigError::new(format!("{at}.upstream"), e.to_string()))
}

/// Most bytes a `database.ca_file` may have: a bundle of CA certificates, not anything else.
const MAX_CA_FILE_BYTES: u64 = 1024 * 1024;

/// Reads `database.ca_file`: a regular file of at most [`MAX_CA_FILE_BYTES`] (an admin API body
/// names it too, so a device or a huge file is refused rather than read).
fn read_ca_file(at: &str, path: &std::path::Path) -> Result<Vec<u8>, ConfigError> {
    let key = format!("{at}.database.ca_file");
    let unreadable = |e: std::io::Error| ConfigError::new(&key, format!("cannot read it: {e}"));
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    if !meta.is_file() || meta.len() > MAX_CA_FILE_BYTES {
        return Err(ConfigError::new(
            &key,
            format!("must be a PEM file of at most {MAX_CA_FILE_BYTES} bytes"),
        ));
    }
    std::fs::read(path).map_err(unreadable)
}

/// An immutable snapshot of every pool.
#[derive(Default, Clone)]
pub struct Registry {
    // foldhash, not SipHash: every request looks its pool up by `Host`, and only the
    // configuration inserts names here (a lookup of an attacker's name cannot degrade the map).
    pub pools: foldhash::HashMap<String, Arc<PoolRuntime>>,
    pub domains: foldhash::HashMap<String, Arc<PoolRuntime>>,
}

impl Registry {
    /// A copy with `pool` added or replaced.
    pub fn with_pool(&self, pool: Arc<PoolRuntime>) -> Registry {
        let mut next = self.without(&pool.name);
        for d in pool.domains() {
            next.domains.insert(d, pool.clone());
        }
        next.pools.insert(pool.name.clone(), pool);
        next
    }

    /// A copy with the pool named `name` removed.
    pub fn without(&self, name: &str) -> Registry {
        let mut next = self.clone();
        next.pools.remove(name);
        next.domains.retain(|_, p| p.name != name);
        next
    }

    /// The pool a (lowercased, port-less) host names, if any.
    pub fn by_host(&self, host: &str, pool_suffix: &str) -> Option<&Arc<PoolRuntime>> {
        if let Some(name) = host.strip_suffix(pool_suffix) {
            if !name.contains('.') {
                if let Some(p) = self.pools.get(name) {
                    return Some(p);
                }
            }
        }
        self.domains.get(host)
    }

    /// Another pool (not `except`) already claiming `domain`.
    pub fn domain_owner(&self, domain: &str, except: &str) -> Option<&str> {
        self.domains
            .get(domain)
            .map(|p| p.name.as_str())
            .filter(|n| *n != except)
    }
}
