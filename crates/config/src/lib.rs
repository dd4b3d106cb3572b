//! The configuration: the TOML file's shape, its defaults, and the rules it must obey.
//!
//! This crate owns the *contract* of `nthbouncer serve --config FILE` (SPEC §10): every key,
//! its default, and a validation that names the key and the rule broken. The admin API accepts
//! the same [`PoolSpec`] as JSON, so a pool reads the same whether it came from the file or the
//! API. It must not know about HTTP serving, storage, or the governor's internals: it hands out
//! plain values, and the server turns them into runtime state.

#![forbid(unsafe_code)]

pub mod access;
pub mod async_jobs;
pub mod cache;
pub mod coordination;
pub mod database;
pub mod keys;
pub mod store;
pub mod tls;
pub mod tokens;

pub use access::{AccessSpec, CloudflareAccessSpec, HmacSpec, JwtSpec};
pub use async_jobs::{AsyncSpec, WebhookSpec};
pub use cache::CacheSpec;
pub use coordination::{Coordination, CoordinationFail, RedisCoordination};
pub use database::DatabaseSpec;
pub use store::StoreSpec;
pub use tls::{MtlsSpec, ServerTlsSpec, SniCertSpec, UpstreamTlsSpec};
pub use tokens::TokensSpec;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A configuration problem, naming the key and the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {rule}")]
pub struct ConfigError {
    /// Dotted path of the offending key, e.g. `pools[0].concurrency.limit`.
    pub key: String,
    /// What is wrong, for a human.
    pub rule: String,
}

impl ConfigError {
    pub fn new(key: impl Into<String>, rule: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            rule: rule.into(),
        }
    }
}

/// The whole file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerSpec,
    #[serde(default)]
    pub pools: Vec<PoolSpec>,
}

/// `[server]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSpec {
    pub listen: String,
    pub api_host: String,
    pub pool_domain: String,
    /// Base of every `pollUrl`; default `http://{api_host}:{port}`.
    pub public_url: Option<String>,
    pub data_dir: PathBuf,
    /// `"sqlite"` (embedded default) or `"postgres://…"` (`env:NAME` allowed): durable state in
    /// one PostgreSQL database that several nodes share.
    pub store: String,
    /// On a PostgreSQL store, how long a node's claim on a job or a webhook delivery holds off
    /// the other nodes: a node renews its jobs' claims while it runs them, so this is how long
    /// the work of a node that died waits before another node takes it over.
    pub store_claim_lease_ms: u64,
    /// `"in-process"` (default) or `"redis://host:port/db"` (`env:NAME` allowed): several nodes
    /// then share each pool's limit, queue, RPM and learned state.
    pub coordination: String,
    /// While Redis is away: `"closed"` (refuse, default) or `"open"` (admit
    /// `limit / expected_nodes` per node).
    pub coordination_fail: CoordinationFail,
    /// How many nodes share the pools; needed for `coordination_fail = "open"`.
    pub expected_nodes: Option<u32>,
    /// First part of every Redis key and channel, so several deployments can share one Redis.
    pub coordination_prefix: String,
    /// Longest wait for one Redis call (and for connecting).
    pub coordination_timeout_ms: u64,
    /// Bearer token of the admin API (`env:NAME` allowed). Unset: the admin API answers 401.
    pub admin_token: Option<String>,
    pub trusted_proxies: Vec<String>,
    pub allow_private_webhooks: bool,
    pub max_destinations_per_pool: u32,
    /// Largest caller body the proxy forwards.
    pub max_body_bytes: u64,
    /// How long a client may take to send its request head (slowloris guard).
    pub header_read_timeout_ms: u64,
    /// How long a pooled upstream connection may sit idle; keep it below typical upstream
    /// keep-alive timeouts (Node's default is 5 s) so we never write to a connection the
    /// upstream is closing.
    pub upstream_idle_timeout_ms: u64,
    /// How long to wait for upstream TCP+TLS connect.
    pub upstream_connect_timeout_ms: u64,
    /// On SIGTERM, how long in-flight requests may take to finish.
    pub shutdown_grace_ms: u64,
    /// An idle keep-alive (HTTP/1) or HTTP/2 connection is closed after this long without a
    /// request in flight.
    pub idle_timeout_ms: u64,
    /// Most client connections open at once; past it a new connection is answered
    /// `503 overloaded` and closed, so descriptors (and `/healthz`) stay available.
    pub max_connections: u64,
    /// Newest access-log entries kept per pool.
    pub access_log_keep: u64,
    /// `[server.tls]`: HTTPS (and HTTP/2 by ALPN) on the main listener and pools' listeners.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<ServerTlsSpec>,
}

impl Default for ServerSpec {
    fn default() -> Self {
        ServerSpec {
            listen: "127.0.0.1:8080".into(),
            api_host: "api.localhost".into(),
            pool_domain: "localhost".into(),
            public_url: None,
            data_dir: PathBuf::from("nthbouncer-data"),
            store: "sqlite".into(),
            store_claim_lease_ms: store::DEFAULT_CLAIM_LEASE_MS,
            coordination: "in-process".into(),
            coordination_fail: CoordinationFail::Closed,
            expected_nodes: None,
            coordination_prefix: "nb".into(),
            coordination_timeout_ms: 1_000,
            admin_token: None,
            trusted_proxies: Vec::new(),
            allow_private_webhooks: false,
            max_destinations_per_pool: 10,
            max_body_bytes: 10 * 1024 * 1024,
            header_read_timeout_ms: 10_000,
            upstream_idle_timeout_ms: 4_000,
            upstream_connect_timeout_ms: 5_000,
            shutdown_grace_ms: 30_000,
            idle_timeout_ms: 60_000,
            max_connections: 10_000,
            access_log_keep: 10_000,
            tls: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// Every request on the pool host is proxied to an HTTP upstream (SPEC §4).
    #[default]
    Proxy,
    /// SQL over HTTP (Neon's wire format) in front of PostgreSQL (SPEC §8).
    Database,
}

/// One `[[pools]]` table (and the admin API's pool body).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    #[schema(pattern = "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")]
    pub name: String,
    #[serde(default)]
    pub kind: PoolKind,
    /// `http(s)://…` for a proxy pool; `postgres://user:password@host/db` (or `env:NAME`) for a
    /// database pool, whose password is a managed credential shown masked on read.
    #[schema(
        pattern = "^(https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~%/-]*)?|postgres(ql)?://.+|env:[A-Za-z_][A-Za-z0-9_]*)$"
    )]
    pub upstream: String,
    #[serde(default)]
    pub custom_domains: Vec<String>,
    /// Managed credentials set on every upstream request (values may be `env:NAME`).
    #[serde(default)]
    pub upstream_headers: BTreeMap<String, String>,
    /// Plaintext keys or `sha256:<hex>` hashes.
    #[serde(default)]
    pub keys: Vec<String>,
    /// Unset: `["header"]`, and `["header", "bearer"]` on database pools (the Neon driver's
    /// `authToken` arrives as `Authorization: Bearer`). See [`PoolSpec::auth_methods`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthSpec>,
    #[serde(default)]
    pub concurrency: ConcurrencySpec,
    #[serde(default, rename = "async")]
    pub async_jobs: AsyncSpec,
    /// Webhook destinations declared with the pool (more can be added through the admin API).
    #[serde(default)]
    pub webhooks: Vec<WebhookSpec>,
    /// Policies callers must pass besides the pool key (SPEC §9).
    #[serde(default)]
    pub access: AccessSpec,
    /// The pool's own listener (`"127.0.0.1:8081"`): everything arriving there is this pool's
    /// host whatever its `Host` header, for clients that cannot set `Host`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// `[pools.database]`, for `kind = "database"` only (defaults when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database: Option<DatabaseSpec>,
    /// The shared response cache (SPEC §4); absent, the pool has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheSpec>,
    /// `[pools.tokens]`: how a pool with a token budget estimates a request's cost (defaults
    /// when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokensSpec>,
    /// `[pools.upstream_tls]`: a private CA, a client certificate and an SNI override towards
    /// the origin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_tls: Option<UpstreamTlsSpec>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AuthMethod {
    /// `X-Nthpool-Key: <key>`
    Header,
    /// `Authorization: Bearer <key>`
    Bearer,
    /// `Authorization: Nthbouncer <key>`
    Nthbouncer,
}

/// `[pools.auth]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSpec {
    pub accept: Vec<AuthMethod>,
}

impl Default for AuthSpec {
    fn default() -> Self {
        AuthSpec {
            accept: vec![AuthMethod::Header],
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProxyWait {
    /// Proxy requests wait up to `queue_timeout_ms` by default.
    #[default]
    Open,
    /// Proxy requests fail fast unless they ask for a wait budget.
    FailFast,
}

/// `[pools.concurrency]`: the governor's settings (SPEC §3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ConcurrencySpec {
    pub limit: u32,
    pub queue_size: u32,
    pub queue_timeout_ms: u64,
    pub proxy_wait: ProxyWait,
    pub rpm: u32,
    pub request_timeout_ms: u64,
    pub lease_term_ms: u64,
    pub renew_interval_ms: u64,
    pub adaptive: bool,
    pub min_limit: u32,
    pub fair_share: bool,
    /// Longest pause any one outcome report or upstream answer may impose (`Retry-After`,
    /// reset hints, a learned pace), whatever it asks for.
    pub max_pause_ms: u64,
    /// Tokens admitted per rolling minute (`tokens.window_ms`); 0 = no configured token budget
    /// (one announced by the origin is still learned when `adaptive`).
    pub tpm: u64,
}

impl Default for ConcurrencySpec {
    fn default() -> Self {
        ConcurrencySpec {
            limit: 10,
            queue_size: 1000,
            queue_timeout_ms: 30_000,
            proxy_wait: ProxyWait::Open,
            rpm: 0,
            request_timeout_ms: 120_000,
            lease_term_ms: 30_000,
            renew_interval_ms: 10_000,
            adaptive: true,
            min_limit: 1,
            fair_share: true,
            max_pause_ms: 300_000,
            tpm: 0,
        }
    }
}

/// Limits on settings, documented in the README's configuration reference.
pub mod limits {
    pub const MAX_LIMIT: u32 = 100_000;
    pub const MAX_QUEUE_SIZE: u32 = 1_000_000;
    pub const MAX_QUEUE_TIMEOUT_MS: u64 = 3_600_000;
    pub const MAX_REQUEST_TIMEOUT_MS: u64 = 86_400_000;
    pub const MIN_LEASE_TERM_MS: u64 = 100;
    /// `concurrency.max_pause_ms`: at least a second (the pause after a throttle without a
    /// hint), at most a day.
    pub const MIN_MAX_PAUSE_MS: u64 = 1_000;
    pub const MAX_MAX_PAUSE_MS: u64 = 86_400_000;
    pub const MAX_KEYS_PER_POOL: usize = 10_000;
    pub const MAX_IDLE_TIMEOUT_MS: u64 = 86_400_000;
    pub const MAX_CONNECTIONS: u64 = 1_000_000;
}

impl Config {
    /// Parses and validates a TOML document. Errors name the key and the rule.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let de = toml::Deserializer::new(text);
        let config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let key = if path == "." || path.is_empty() {
                "(file)".to_string()
            } else {
                path
            };
            ConfigError::new(
                key,
                inner.message().to_string() + &location(text, inner.span()),
            )
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::new("(file)", format!("cannot read {}: {e}", path.display()))
        })?;
        Config::from_toml_str(&text)
    }

    /// Checks every rule; the first broken one is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.server.validate()?;
        let mut names = HashSet::new();
        let mut domains = HashSet::new();
        let mut listeners = HashSet::from([self.server.listen_addr()?]);
        for (i, pool) in self.pools.iter().enumerate() {
            let at = format!("pools[{i}]");
            pool.validate(&at)?;
            if pool.access.mtls.is_some() && self.server.tls.is_none() {
                return Err(ConfigError::new(
                    format!("{at}.access.mtls"),
                    "needs [server.tls]: client certificates are asked for in the TLS handshake",
                ));
            }
            // Port 0 asks the system for a free port: never a clash.
            if let Some(addr) = pool.listen_addr(&at)?.filter(|a| a.port() != 0) {
                if !listeners.insert(addr) {
                    return Err(ConfigError::new(
                        format!("{at}.listen"),
                        format!("{addr} is already the server's or another pool's listener"),
                    ));
                }
            }
            if !names.insert(pool.name.as_str()) {
                return Err(ConfigError::new(
                    format!("{at}.name"),
                    format!("duplicate pool name {:?}", pool.name),
                ));
            }
            for d in &pool.custom_domains {
                let d = d.to_ascii_lowercase();
                if d == self.server.api_host.to_ascii_lowercase() {
                    return Err(ConfigError::new(
                        format!("{at}.custom_domains"),
                        format!("{d:?} is the API host"),
                    ));
                }
                if !domains.insert(d.clone()) {
                    return Err(ConfigError::new(
                        format!("{at}.custom_domains"),
                        format!("{d:?} is claimed by two pools"),
                    ));
                }
            }
        }
        Ok(())
    }
}

fn location(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    match span {
        Some(span) if span.start <= text.len() => {
            let line = text[..span.start].matches('\n').count() + 1;
            format!(" (line {line})")
        }
        _ => String::new(),
    }
}

impl ServerSpec {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen_addr()?;
        check_hostname("server.api_host", &self.api_host)?;
        check_hostname("server.pool_domain", &self.pool_domain)?;
        if let Some(url) = &self.public_url {
            parse_http_url("server.public_url", url)?;
        }
        self.store()?;
        self.coordination()?;
        if self.admin_token.is_some() {
            let token = self.admin_token()?.unwrap_or_default();
            if token.len() < 16 {
                return Err(ConfigError::new(
                    "server.admin_token",
                    "must be at least 16 characters",
                ));
            }
        }
        for (i, p) in self.trusted_proxies.iter().enumerate() {
            parse_cidr(p).ok_or_else(|| {
                ConfigError::new(
                    format!("server.trusted_proxies[{i}]"),
                    format!("{p:?} is not an IP address or CIDR"),
                )
            })?;
        }
        positive("server.max_body_bytes", self.max_body_bytes)?;
        positive("server.header_read_timeout_ms", self.header_read_timeout_ms)?;
        positive(
            "server.upstream_idle_timeout_ms",
            self.upstream_idle_timeout_ms,
        )?;
        positive(
            "server.upstream_connect_timeout_ms",
            self.upstream_connect_timeout_ms,
        )?;
        positive("server.access_log_keep", self.access_log_keep)?;
        if self.idle_timeout_ms == 0 || self.idle_timeout_ms > limits::MAX_IDLE_TIMEOUT_MS {
            return Err(ConfigError::new(
                "server.idle_timeout_ms",
                format!(
                    "must be between 1 and {} (got {})",
                    limits::MAX_IDLE_TIMEOUT_MS,
                    self.idle_timeout_ms
                ),
            ));
        }
        if self.max_connections == 0 || self.max_connections > limits::MAX_CONNECTIONS {
            return Err(ConfigError::new(
                "server.max_connections",
                format!(
                    "must be between 1 and {} (got {})",
                    limits::MAX_CONNECTIONS,
                    self.max_connections
                ),
            ));
        }
        if self.max_destinations_per_pool == 0 {
            return Err(ConfigError::new(
                "server.max_destinations_per_pool",
                "must be at least 1",
            ));
        }
        if let Some(tls) = &self.tls {
            tls.validate("server.tls")?;
        }
        Ok(())
    }

    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.listen.parse().map_err(|_| {
            ConfigError::new(
                "server.listen",
                format!("{:?} is not an address like 127.0.0.1:8080", self.listen),
            )
        })
    }

    /// The admin token with `env:` resolved.
    pub fn admin_token(&self) -> Result<Option<String>, ConfigError> {
        self.admin_token
            .as_deref()
            .map(|t| resolve_secret("server.admin_token", t))
            .transpose()
    }

    pub fn trusted_proxy_nets(&self) -> Vec<ipnet::IpNet> {
        self.trusted_proxies
            .iter()
            .filter_map(|p| parse_cidr(p))
            .collect()
    }

    /// `public_url`, or `http://{api_host}:{port}`.
    pub fn public_url(&self, port: u16) -> String {
        match &self.public_url {
            Some(u) => u.trim_end_matches('/').to_string(),
            None => format!("http://{}:{port}", self.api_host),
        }
    }
}

fn positive(key: &str, v: u64) -> Result<(), ConfigError> {
    if v == 0 {
        Err(ConfigError::new(key, "must be greater than 0"))
    } else {
        Ok(())
    }
}

fn parse_cidr(s: &str) -> Option<ipnet::IpNet> {
    s.parse::<ipnet::IpNet>()
        .ok()
        .or_else(|| s.parse::<std::net::IpAddr>().ok().map(ipnet::IpNet::from))
}

/// Resolves `env:NAME` to the variable's value; other strings are returned as they are.
pub fn resolve_secret(key: &str, value: &str) -> Result<String, ConfigError> {
    match value.strip_prefix("env:") {
        Some(name) => std::env::var(name)
            .map_err(|_| ConfigError::new(key, format!("environment variable {name} is not set"))),
        None => Ok(value.to_string()),
    }
}

/// Pool names: `^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`.
pub fn valid_pool_name(name: &str) -> bool {
    let b = name.as_bytes();
    let ok = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= 63
        && b.first().is_some_and(ok)
        && b.last().is_some_and(ok)
        && b.iter().all(|c| ok(c) || *c == b'-')
}

pub(crate) fn check_hostname(key: &str, host: &str) -> Result<(), ConfigError> {
    let valid = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if valid {
        Ok(())
    } else {
        Err(ConfigError::new(
            key,
            format!("{host:?} is not a valid host name"),
        ))
    }
}

/// An absolute `http`/`https` URL with a host.
pub fn parse_http_url(key: &str, url: &str) -> Result<http::Uri, ConfigError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|_| ConfigError::new(key, format!("{url:?} is not a URL")))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => {
            return Err(ConfigError::new(
                key,
                format!("{url:?} must start with http:// or https://"),
            ))
        }
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(ConfigError::new(key, format!("{url:?} has no host")));
    }
    Ok(uri)
}

impl PoolSpec {
    /// Checks the pool's own rules; `at` prefixes key paths (e.g. `pools[0]`).
    /// The pool's own listener address, if it has one.
    pub fn listen_addr(&self, at: &str) -> Result<Option<SocketAddr>, ConfigError> {
        let Some(listen) = &self.listen else {
            return Ok(None);
        };
        listen.parse().map(Some).map_err(|_| {
            ConfigError::new(
                format!("{at}.listen"),
                format!("{listen:?} is not an address like 127.0.0.1:8081"),
            )
        })
    }

    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        self.listen_addr(at)?;
        if !valid_pool_name(&self.name) {
            return Err(ConfigError::new(
                format!("{at}.name"),
                format!(
                    "{:?} must match ^[a-z0-9]([a-z0-9-]{{0,61}}[a-z0-9])?$",
                    self.name
                ),
            ));
        }
        self.validate_kind(at)?;
        for (i, d) in self.custom_domains.iter().enumerate() {
            check_hostname(&format!("{at}.custom_domains[{i}]"), d)?;
        }
        for (name, value) in &self.upstream_headers {
            let key = format!("{at}.upstream_headers.{name}");
            http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| ConfigError::new(&key, "is not a valid header name"))?;
            let resolved = resolve_secret(&key, value)?;
            http::HeaderValue::from_str(&resolved)
                .map_err(|_| ConfigError::new(&key, "is not a valid header value"))?;
        }
        if self.keys.len() > limits::MAX_KEYS_PER_POOL {
            return Err(ConfigError::new(
                format!("{at}.keys"),
                format!("at most {} keys per pool", limits::MAX_KEYS_PER_POOL),
            ));
        }
        for i in 0..self.keys.len() {
            self.key_digest(at, i)?;
        }
        if self.auth.as_ref().is_some_and(|a| a.accept.is_empty()) {
            return Err(ConfigError::new(
                format!("{at}.auth.accept"),
                "must name at least one of header, bearer, nthbouncer",
            ));
        }
        self.concurrency.validate(&format!("{at}.concurrency"))?;
        self.async_jobs.validate(&format!("{at}.async"))?;
        for (i, w) in self.webhooks.iter().enumerate() {
            w.validate(&format!("{at}.webhooks[{i}]"))?;
        }
        self.access.validate(&format!("{at}.access"))?;
        if let Some(cache) = &self.cache {
            cache.validate(&format!("{at}.cache"))?;
        }
        if let Some(tokens) = &self.tokens {
            tokens.validate(&format!("{at}.tokens"))?;
        }
        if let Some(t) = &self.upstream_tls {
            t.validate(&format!("{at}.upstream_tls"))?;
            if self.kind == PoolKind::Database {
                return Err(ConfigError::new(
                    format!("{at}.upstream_tls"),
                    "is only for proxy pools (a database pool has database.ca_file)",
                ));
            }
        }
        Ok(())
    }

    /// The upstream and the tables that belong to the pool's kind.
    fn validate_kind(&self, at: &str) -> Result<(), ConfigError> {
        let upstream = format!("{at}.upstream");
        match self.kind {
            PoolKind::Proxy => {
                parse_http_url(&upstream, &self.upstream)?;
                if self.database.is_some() {
                    return Err(ConfigError::new(
                        format!("{at}.database"),
                        "is only for kind = \"database\"",
                    ));
                }
            }
            PoolKind::Database => {
                database::check_database_url(&upstream, &self.upstream)?;
                if !self.upstream_headers.is_empty() {
                    return Err(ConfigError::new(
                        format!("{at}.upstream_headers"),
                        "is only for proxy pools (a database pool's credential is in upstream)",
                    ));
                }
                self.database_settings()
                    .validate(&format!("{at}.database"))?;
            }
        }
        Ok(())
    }

    /// The forms of the pool key the pool accepts (`auth.accept`, or the kind's default).
    pub fn auth_methods(&self) -> Vec<AuthMethod> {
        match (&self.auth, self.kind) {
            (Some(auth), _) => auth.accept.clone(),
            (None, PoolKind::Proxy) => vec![AuthMethod::Header],
            (None, PoolKind::Database) => vec![AuthMethod::Header, AuthMethod::Bearer],
        }
    }

    /// `[pools.database]`, or its defaults.
    pub fn database_settings(&self) -> DatabaseSpec {
        self.database.clone().unwrap_or_default()
    }

    /// A database pool's upstream URL with `env:` resolved.
    pub fn database_url(&self, at: &str) -> Result<String, ConfigError> {
        database::check_database_url(&format!("{at}.upstream"), &self.upstream)
    }

    /// The digest of key `i` (plaintext hashed, `sha256:` parsed, `env:` resolved).
    pub fn key_digest(&self, at: &str, i: usize) -> Result<[u8; 32], ConfigError> {
        let key = format!("{at}.keys[{i}]");
        let raw = self
            .keys
            .get(i)
            .ok_or_else(|| ConfigError::new(&key, "no such key"))?;
        let value = resolve_secret(&key, raw)?;
        if value.starts_with("sha256:") {
            return keys::parse_hash(&value).ok_or_else(|| {
                ConfigError::new(&key, "sha256: must be followed by 64 hex characters")
            });
        }
        keys::check_format(&value).map_err(|e| {
            ConfigError::new(
                &key,
                match e {
                    keys::KeyFormatError::Malformed => {
                        "an nb_live_ key must have 38 base62 characters after the prefix"
                    }
                    keys::KeyFormatError::Checksum => {
                        "the nb_live_ key's checksum does not match (mistyped?)"
                    }
                    keys::KeyFormatError::Legacy => {
                        "a key must be 16-256 printable characters, or sha256:<hex>"
                    }
                },
            )
        })?;
        Ok(keys::digest(&value))
    }

    /// Every key digest; call after `validate`.
    pub fn key_digests(&self, at: &str) -> Result<Vec<[u8; 32]>, ConfigError> {
        (0..self.keys.len())
            .map(|i| self.key_digest(at, i))
            .collect()
    }

    /// Managed upstream headers with secrets resolved.
    pub fn resolved_upstream_headers(
        &self,
        at: &str,
    ) -> Result<Vec<(String, String)>, ConfigError> {
        self.upstream_headers
            .iter()
            .map(|(k, v)| {
                Ok((
                    k.clone(),
                    resolve_secret(&format!("{at}.upstream_headers.{k}"), v)?,
                ))
            })
            .collect()
    }

    /// The spec as shown on read: header values masked (unless an `env:` reference), plaintext
    /// keys replaced by a shortened hash.
    pub fn masked(&self) -> PoolSpec {
        let mut out = self.clone();
        if self.kind == PoolKind::Database && !self.upstream.starts_with("env:") {
            out.upstream = database::mask_database_url(&self.upstream);
        }
        for v in out.upstream_headers.values_mut() {
            if !v.starts_with("env:") {
                *v = mask(v);
            }
        }
        for w in out.webhooks.iter_mut() {
            if !w.secret.starts_with("env:") {
                w.secret = mask(&w.secret);
            }
        }
        out.access = self.access.masked();
        out.keys = self.keys.iter().map(|k| mask_key(k)).collect();
        out
    }

    /// A spec sent back as it was read ([`PoolSpec::masked`]): every value still masked as it
    /// was shown means "keep the current one" — a key shown as its shortened hash, an upstream
    /// header's value, a webhook's secret (matched by URL), an HMAC secret. So a GET's body,
    /// PUT back unchanged, changes nothing. A shortened hash that is none of the current keys
    /// is refused: it cannot be turned back into a key.
    pub fn unmasked(mut self, current: &PoolSpec) -> Result<PoolSpec, ConfigError> {
        for (i, k) in self.keys.iter_mut().enumerate() {
            if !k.ends_with('…') {
                continue;
            }
            match current.keys.iter().find(|c| mask_key(c) == *k) {
                Some(c) => *k = c.clone(),
                None => {
                    return Err(ConfigError::new(
                        format!("keys[{i}]"),
                        "a shortened key hash that matches none of the pool's keys; send the \
                         key itself or its full sha256: hash",
                    ))
                }
            }
        }
        let kept =
            |shown: &str, current: &str| !current.starts_with("env:") && mask(current) == shown;
        if self.kind == PoolKind::Database
            && current.kind == PoolKind::Database
            && !current.upstream.starts_with("env:")
            && database::mask_database_url(&current.upstream) == self.upstream
        {
            self.upstream = current.upstream.clone();
        }
        for (name, v) in self.upstream_headers.iter_mut() {
            if let Some(c) = current.upstream_headers.get(name).filter(|c| kept(v, c)) {
                *v = c.clone();
            }
        }
        for w in self.webhooks.iter_mut() {
            if let Some(c) = current
                .webhooks
                .iter()
                .find(|c| c.url == w.url && kept(&w.secret, &c.secret))
            {
                w.secret = c.secret.clone();
            }
        }
        if let (Some(h), Some(c)) = (self.access.hmac.as_mut(), current.access.hmac.as_ref()) {
            for s in h.secrets.iter_mut() {
                if let Some(c) = c.secrets.iter().find(|c| kept(s, c)) {
                    *s = c.clone();
                }
            }
        }
        Ok(self)
    }

    /// The spec as stored: plaintext keys replaced by their `sha256:` hash.
    pub fn with_hashed_keys(&self) -> PoolSpec {
        let mut out = self.clone();
        out.keys = self
            .keys
            .iter()
            .map(|k| {
                if k.starts_with("sha256:") || k.starts_with("env:") {
                    k.clone()
                } else {
                    format!("sha256:{}", keys::hash_hex(k))
                }
            })
            .collect();
        out
    }
}

/// Shows a secret's first 4 characters at most, never the whole.
/// A key as shown on read: its `sha256:` hash, shortened, with `…`.
fn mask_key(key: &str) -> String {
    let hash = if key.starts_with("sha256:") {
        key.to_string()
    } else {
        format!("sha256:{}", keys::hash_hex(key))
    };
    format!("{}…", &hash[..hash.len().min(19)])
}

pub fn mask(secret: &str) -> String {
    let shown: String = secret.chars().take(4).collect();
    if secret.chars().count() <= 8 {
        "****".to_string()
    } else {
        format!("{shown}****")
    }
}

impl ConcurrencySpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        let k = |name: &str| format!("{at}.{name}");
        if self.limit == 0 || self.limit > limits::MAX_LIMIT {
            return Err(ConfigError::new(
                k("limit"),
                format!(
                    "must be between 1 and {} (got {})",
                    limits::MAX_LIMIT,
                    self.limit
                ),
            ));
        }
        if self.queue_size > limits::MAX_QUEUE_SIZE {
            return Err(ConfigError::new(
                k("queue_size"),
                format!("must be at most {}", limits::MAX_QUEUE_SIZE),
            ));
        }
        if self.queue_timeout_ms > limits::MAX_QUEUE_TIMEOUT_MS {
            return Err(ConfigError::new(
                k("queue_timeout_ms"),
                format!("must be at most {}", limits::MAX_QUEUE_TIMEOUT_MS),
            ));
        }
        if self.request_timeout_ms == 0 || self.request_timeout_ms > limits::MAX_REQUEST_TIMEOUT_MS
        {
            return Err(ConfigError::new(
                k("request_timeout_ms"),
                format!("must be between 1 and {}", limits::MAX_REQUEST_TIMEOUT_MS),
            ));
        }
        if self.lease_term_ms < limits::MIN_LEASE_TERM_MS {
            return Err(ConfigError::new(
                k("lease_term_ms"),
                format!("must be at least {}", limits::MIN_LEASE_TERM_MS),
            ));
        }
        if self.renew_interval_ms == 0 || self.renew_interval_ms >= self.lease_term_ms {
            return Err(ConfigError::new(
                k("renew_interval_ms"),
                format!(
                    "must be greater than 0 and less than lease_term_ms ({})",
                    self.lease_term_ms
                ),
            ));
        }
        if self.min_limit == 0 || self.min_limit > self.limit {
            return Err(ConfigError::new(
                k("min_limit"),
                format!("must be between 1 and limit ({})", self.limit),
            ));
        }
        if !(limits::MIN_MAX_PAUSE_MS..=limits::MAX_MAX_PAUSE_MS).contains(&self.max_pause_ms) {
            return Err(ConfigError::new(
                k("max_pause_ms"),
                format!(
                    "must be between {} and {} (got {})",
                    limits::MIN_MAX_PAUSE_MS,
                    limits::MAX_MAX_PAUSE_MS,
                    self.max_pause_ms
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn err(text: &str) -> ConfigError {
        Config::from_toml_str(text).unwrap_err()
    }

    #[test]
    fn a_pool_listener_is_an_address_of_its_own() {
        let pool = |name: &str, listen: &str| {
            format!("[[pools]]\nname = \"{name}\"\nupstream = \"http://127.0.0.1:9\"\nlisten = \"{listen}\"\n")
        };
        let c = Config::from_toml_str(&pool("a", "127.0.0.1:8081")).unwrap();
        assert_eq!(c.pools[0].listen.as_deref(), Some("127.0.0.1:8081"));
        let e = err(&pool("a", "nowhere"));
        assert_eq!(e.key, "pools[0].listen");
        let e = err(&(pool("a", "127.0.0.1:8081") + &pool("b", "127.0.0.1:8081")));
        assert_eq!(e.key, "pools[1].listen");
        let e = err(&pool("a", "127.0.0.1:8080"));
        assert_eq!(e.key, "pools[0].listen", "the server's own listener");
        // Port 0 (any free port) never clashes.
        Config::from_toml_str(&(pool("a", "127.0.0.1:0") + &pool("b", "127.0.0.1:0"))).unwrap();
    }

    #[test]
    fn empty_file_gives_defaults() {
        let c = Config::from_toml_str("").unwrap();
        assert_eq!(c.server.listen, "127.0.0.1:8080");
        assert_eq!(c.server.api_host, "api.localhost");
        assert!(c.pools.is_empty());
    }

    #[test]
    fn a_full_pool_parses_with_defaults_filled_in() {
        let c = Config::from_toml_str(
            r#"
            [[pools]]
            name = "demo"
            upstream = "http://127.0.0.1:9000"
            keys = ["legacy-key-0123456789"]
            [pools.upstream_headers]
            authorization = "Bearer sk-123"
            [pools.concurrency]
            limit = 3
            "#,
        )
        .unwrap();
        let p = &c.pools[0];
        assert_eq!(p.concurrency.limit, 3);
        assert_eq!(p.concurrency.queue_size, 1000);
        assert_eq!(p.auth_methods(), vec![AuthMethod::Header]);
        assert_eq!(p.key_digests("pools[0]").unwrap().len(), 1);
    }

    #[test]
    fn errors_name_the_key_and_rule() {
        let e = err(
            "[[pools]]\nname = \"x\"\nupstream = \"http://a\"\n[pools.concurrency]\nlimit = 0\n",
        );
        assert_eq!(e.key, "pools[0].concurrency.limit");
        assert!(e.rule.contains("between 1"), "{e}");

        let e = err("[[pools]]\nname = \"Bad_Name\"\nupstream = \"http://a\"\n");
        assert_eq!(e.key, "pools[0].name");

        let e = err("[[pools]]\nname = \"x\"\nupstream = \"ftp://a\"\n");
        assert_eq!(e.key, "pools[0].upstream");

        let e = err("[server]\nlisten = \"nowhere\"\n");
        assert_eq!(e.key, "server.listen");

        let e = err(
            "[[pools]]\nname = \"x\"\nupstream = \"http://a\"\n[pools.concurrency]\nlimt = 3\n",
        );
        assert!(e.key.starts_with("pools[0].concurrency"), "{e}");
        assert!(e.rule.contains("unknown field"), "{e}");

        let e = err("[[pools]]\nname = \"x\"\nupstream = \"http://a\"\nkeys = [\"env:NTHBOUNCER_TEST_SURELY_UNSET\"]\n");
        assert_eq!(e.key, "pools[0].keys[0]");
        assert!(e.rule.contains("NTHBOUNCER_TEST_SURELY_UNSET"));

        let e = err("[[pools]]\nname = \"x\"\nupstream = \"http://a\"\n[[pools]]\nname = \"x\"\nupstream = \"http://b\"\n");
        assert_eq!(e.key, "pools[1].name");

        let e = err("[[pools]]\nname = \"x\"\nupstream = \"http://a\"\n[pools.concurrency]\nlimit = \"many\"\n");
        assert_eq!(e.key, "pools[0].concurrency.limit");
    }

    #[test]
    fn hardening_keys_have_defaults_and_ranges() {
        let base = "[[pools]]\nname = \"x\"\nupstream = \"http://a\"\n";
        let c = Config::from_toml_str(&format!(
            "{base}[pools.access.hmac]\nsecrets = [\"0123456789abcdef\"]\n"
        ))
        .unwrap();
        assert_eq!(c.server.idle_timeout_ms, 60_000);
        assert_eq!(c.server.max_connections, 10_000);
        let p = &c.pools[0];
        assert_eq!(p.async_jobs.max_pending, 10_000);
        assert_eq!(p.access.hmac.as_ref().unwrap().max_body_bytes, 1_048_576);

        let c = Config::from_toml_str(&format!(
            "[server]\nidle_timeout_ms = 5000\nmax_connections = 2\n{base}[pools.async]\nmax_pending = 3\n"
        ))
        .unwrap();
        assert_eq!(
            (c.server.idle_timeout_ms, c.server.max_connections),
            (5_000, 2)
        );
        assert_eq!(c.pools[0].async_jobs.max_pending, 3);

        for (toml, key) in [
            ("[server]\nidle_timeout_ms = 0\n", "server.idle_timeout_ms"),
            (
                "[server]\nidle_timeout_ms = 86400001\n",
                "server.idle_timeout_ms",
            ),
            ("[server]\nmax_connections = 0\n", "server.max_connections"),
            (
                "[server]\nmax_connections = 1000001\n",
                "server.max_connections",
            ),
            (
                &format!("{base}[pools.async]\nmax_pending = 0\n"),
                "pools[0].async.max_pending",
            ),
            (
                &format!("{base}[pools.async]\nmax_pending = 10000001\n"),
                "pools[0].async.max_pending",
            ),
        ] {
            let e = err(toml);
            assert_eq!(e.key, key, "{toml}");
            assert!(e.rule.contains("must be between 1 and"), "{e}");
        }
        // Unknown keys are still refused.
        let e = err("[server]\nidle_timeout = 5\n");
        assert!(e.rule.contains("unknown field"), "{e}");
        // Pools stored before these keys existed still read, with the defaults.
        let spec: AsyncSpec = serde_json::from_str(r#"{"enabled": true}"#).unwrap();
        assert_eq!(spec.max_pending, 10_000);
        let spec: HmacSpec =
            serde_json::from_str(r#"{"secrets": ["0123456789abcdef"], "window_s": 60}"#).unwrap();
        assert_eq!(spec.max_body_bytes, 1_048_576);
    }

    #[test]
    fn max_pause_has_a_default_and_a_range() {
        let base = "[[pools]]\nname = \"x\"\nupstream = \"http://a\"\n";
        let c = Config::from_toml_str(base).unwrap();
        assert_eq!(c.pools[0].concurrency.max_pause_ms, 300_000);
        let c = Config::from_toml_str(&format!("{base}[pools.concurrency]\nmax_pause_ms = 1000\n"))
            .unwrap();
        assert_eq!(c.pools[0].concurrency.max_pause_ms, 1_000);
        for bad in [0, 999, 86_400_001] {
            let e = err(&format!(
                "{base}[pools.concurrency]\nmax_pause_ms = {bad}\n"
            ));
            assert_eq!(e.key, "pools[0].concurrency.max_pause_ms");
            assert!(e.rule.contains("between 1000 and 86400000"), "{e}");
        }
        // A pool stored before the key existed still reads, with the default.
        let spec: ConcurrencySpec = serde_json::from_str(r#"{"limit": 3}"#).unwrap();
        assert_eq!(spec.max_pause_ms, 300_000);
    }

    #[test]
    fn masking_never_shows_a_secret_whole() {
        let spec = PoolSpec {
            name: "p".into(),
            kind: PoolKind::Proxy,
            upstream: "http://a".into(),
            custom_domains: vec![],
            upstream_headers: [(
                "authorization".to_string(),
                "Bearer sk-very-secret".to_string(),
            )]
            .into(),
            keys: vec!["legacy-key-0123456789".into()],
            auth: None,
            concurrency: ConcurrencySpec::default(),
            async_jobs: AsyncSpec::default(),
            webhooks: vec![WebhookSpec {
                url: "https://example.com/hook".into(),
                secret: "whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldA==".into(),
                deactivate_after: 20,
            }],
            access: Default::default(),
            listen: None,
            database: None,
            cache: None,
            upstream_tls: None,
            tokens: None,
        };
        let m = spec.masked();
        let shown = serde_json::to_string(&m).unwrap();
        assert!(!shown.contains("sk-very-secret"));
        assert!(!shown.contains("legacy-key-0123456789"));
        assert!(!shown.contains("c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldA"));
        assert!(spec.with_hashed_keys().keys[0].starts_with("sha256:"));
    }

    #[test]
    fn async_settings_are_checked() {
        let base = "[[pools]]\nname = \"x\"\nupstream = \"http://a\"\n";
        let e = err(&format!(
            "{base}[pools.async]\nenabled = true\nretention_s = 59\n"
        ));
        assert_eq!(e.key, "pools[0].async.retention_s");
        let e = err(&format!("{base}[pools.async]\non_open_wait = true\n"));
        assert_eq!(e.key, "pools[0].async.enabled");
        let e = err(&format!(
            "{base}[[pools.webhooks]]\nurl = \"http://h\"\nsecret = \"nope\"\n"
        ));
        assert_eq!(e.key, "pools[0].webhooks[0].secret");
        let ok = format!(
            "{base}[pools.async]\nenabled = true\n[[pools.webhooks]]\nurl = \"http://h\"\nsecret = \"{}\"\n",
            keys::generate_webhook_secret()
        );
        let c = Config::from_toml_str(&ok).unwrap();
        assert!(c.pools[0].async_jobs.enabled);
        assert_eq!(c.pools[0].webhooks[0].deactivate_after, 20);
    }

    #[test]
    fn database_pools_parse_check_and_mask() {
        let db = |extra: &str| {
            format!(
                "[[pools]]\nname = \"db\"\nkind = \"database\"\nupstream = \"postgres://app:hunter2@127.0.0.1:5432/shop\"\n{extra}"
            )
        };
        let c = Config::from_toml_str(&db("")).unwrap();
        let p = &c.pools[0];
        assert_eq!(p.kind, PoolKind::Database);
        assert_eq!(
            p.auth_methods(),
            vec![AuthMethod::Header, AuthMethod::Bearer]
        );
        assert_eq!(p.database_settings().max_response_bytes, 10 * 1024 * 1024);
        let shown = serde_json::to_string(&p.masked()).unwrap();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("postgres://app:****@127.0.0.1:5432/shop"));
        // The masked body sent back keeps the password.
        let back: PoolSpec = serde_json::from_str(&shown).unwrap();
        assert_eq!(back.unmasked(p).unwrap().upstream, p.upstream);

        let c = Config::from_toml_str(&db(
            "[pools.auth]\naccept = [\"bearer\"]\n[pools.database]\nmax_response_bytes = 100\nstatement_timeout_ms = 5000\n",
        ))
        .unwrap();
        assert_eq!(c.pools[0].auth_methods(), vec![AuthMethod::Bearer]);
        assert_eq!(c.pools[0].database_settings().statement_timeout_ms, 5000);

        for (extra, key) in [
            (
                "[pools.database]\nmax_response_bytes = 0\n",
                "pools[0].database.max_response_bytes",
            ),
            (
                "[pools.database]\nconnect_timeout_ms = 0\n",
                "pools[0].database.connect_timeout_ms",
            ),
            ("[pools.database]\nbogus = 1\n", "pools[0].database.bogus"),
            (
                "[pools.upstream_headers]\nx = \"y\"\n",
                "pools[0].upstream_headers",
            ),
        ] {
            let e = err(&db(extra));
            assert_eq!(e.key, key, "{extra}: {e}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
        let e = err(
            "[[pools]]\nname = \"db\"\nkind = \"database\"\nupstream = \"http://app:hunter2@h\"\n",
        );
        assert_eq!(e.key, "pools[0].upstream");
        assert!(!e.to_string().contains("hunter2"), "{e}");
        let e = err("[[pools]]\nname = \"p\"\nupstream = \"http://h\"\n[pools.database]\n");
        assert_eq!(e.key, "pools[0].database");
    }

    #[test]
    fn pool_names() {
        assert!(valid_pool_name("demo"));
        assert!(valid_pool_name("prod-acme-1"));
        assert!(!valid_pool_name("-x"));
        assert!(!valid_pool_name("x-"));
        assert!(!valid_pool_name("UPPER"));
        assert!(!valid_pool_name(""));
        assert!(!valid_pool_name(&"a".repeat(64)));
    }
}
