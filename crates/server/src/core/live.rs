//! The `[server]` settings a configuration reload changes live (SPEC §12 Reload): every one that
//! owns no socket and no store. Whatever reads them holds the one [`LiveServer`] and loads it
//! where the setting is used (per request, per new connection, per upstream call, per trim, at
//! shutdown), so a reload applies from the next of those on. What owns a socket or a store
//! (`listen`, `data_dir`, `store`, `coordination` and the Redis connection's settings, TLS on or
//! off) is read once at start from `ServerSpec` and is not here.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use nthbouncer_config::{ConfigError, ServerSpec};

/// The live `[server]` settings, resolved.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    /// `server.admin_token`, `env:` resolved; `None`: the admin API answers 401.
    pub admin_token: Option<String>,
    pub trusted_proxies: Vec<ipnet::IpNet>,
    pub max_body_bytes: u64,
    pub header_read_timeout: Duration,
    pub allow_private_webhooks: bool,
    pub max_destinations_per_pool: u32,
    /// `server.api_host`, lowercased.
    pub api_host: String,
    /// `.{server.pool_domain}`, lowercased: a pool's host is its name followed by this.
    pub pool_suffix: String,
    /// `server.public_url` (or `http://{api_host}:{port}`), without a trailing `/`: the base of
    /// every `pollUrl`.
    pub public_url: String,
    /// `server.upstream_connect_timeout_ms` (upstream clients and webhook deliveries).
    pub upstream_connect_timeout: Duration,
    /// `server.upstream_idle_timeout_ms`.
    pub upstream_idle_timeout: Duration,
    /// `server.idle_timeout_ms`, for connections accepted from now on.
    pub idle_timeout: Duration,
    /// `server.max_connections`, checked at each accept.
    pub max_connections: u64,
    /// `server.shutdown_grace_ms`, read when the shutdown starts.
    pub shutdown_grace: Duration,
    /// `server.access_log_keep`, read at each trim.
    pub access_log_keep: u64,
}

impl ServerSettings {
    /// `server`'s live settings; `port` is the main listener's (which a reload cannot change),
    /// for the default `public_url`.
    pub fn of(server: &ServerSpec, port: u16) -> Result<ServerSettings, ConfigError> {
        let ms = Duration::from_millis;
        Ok(ServerSettings {
            admin_token: server.admin_token()?,
            trusted_proxies: server.trusted_proxy_nets(),
            max_body_bytes: server.max_body_bytes,
            header_read_timeout: ms(server.header_read_timeout_ms),
            allow_private_webhooks: server.allow_private_webhooks,
            max_destinations_per_pool: server.max_destinations_per_pool,
            api_host: server.api_host.to_ascii_lowercase(),
            pool_suffix: format!(".{}", server.pool_domain.to_ascii_lowercase()),
            public_url: server.public_url(port),
            upstream_connect_timeout: ms(server.upstream_connect_timeout_ms),
            upstream_idle_timeout: ms(server.upstream_idle_timeout_ms),
            idle_timeout: ms(server.idle_timeout_ms),
            max_connections: server.max_connections,
            shutdown_grace: ms(server.shutdown_grace_ms),
            access_log_keep: server.access_log_keep,
        })
    }
}

impl ServerSettings {
    /// Whether `given` is the admin token, compared in constant time (no token set: nothing
    /// is). The admin API's Bearer check and the dashboard's login both ask here.
    pub fn is_admin_token(&self, given: &str) -> bool {
        use subtle::ConstantTimeEq;
        self.admin_token
            .as_ref()
            .is_some_and(|expected| bool::from(expected.as_bytes().ct_eq(given.as_bytes())))
    }

    /// The scheme of a database pool's `pollUrl`s: a deployment behind TLS says so in its
    /// public URL.
    pub fn poll_scheme(&self) -> &'static str {
        if self.public_url.starts_with("https://") {
            "https"
        } else {
            "http"
        }
    }
}

/// The current [`ServerSettings`]; a reload swaps them.
pub struct LiveServer {
    current: ArcSwap<ServerSettings>,
    /// The main listener's port, fixed for the life of the process.
    port: u16,
}

impl LiveServer {
    pub fn new(settings: ServerSettings, port: u16) -> LiveServer {
        LiveServer {
            current: ArcSwap::from_pointee(settings),
            port,
        }
    }

    /// The settings as they are now.
    pub fn load(&self) -> arc_swap::Guard<Arc<ServerSettings>> {
        self.current.load()
    }

    pub fn store(&self, settings: ServerSettings) {
        self.current.store(Arc::new(settings));
    }

    /// The main listener's port (for [`ServerSettings::of`]).
    pub fn port(&self) -> u16 {
        self.port
    }
}
