//! The `[server]` settings a configuration reload changes live (SPEC §12 Reload): the ones that
//! own no socket and no store. Features that read them hold the one [`LiveServer`] and load it
//! per request (one atomic load), so a reload applies to the next request. Settings read once at
//! start (the listener's, the store's, the upstream client's) are not here.

use std::sync::atomic::{AtomicBool, Ordering};
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
}

impl ServerSettings {
    pub fn of(server: &ServerSpec) -> Result<ServerSettings, ConfigError> {
        Ok(ServerSettings {
            admin_token: server.admin_token()?,
            trusted_proxies: server.trusted_proxy_nets(),
            max_body_bytes: server.max_body_bytes,
            header_read_timeout: Duration::from_millis(server.header_read_timeout_ms),
            allow_private_webhooks: server.allow_private_webhooks,
            max_destinations_per_pool: server.max_destinations_per_pool,
        })
    }
}

/// The current [`ServerSettings`]; a reload swaps them.
pub struct LiveServer {
    current: ArcSwap<ServerSettings>,
    /// `allow_private_webhooks` again, for the webhook connector (which knows no more).
    allow_private_webhooks: Arc<AtomicBool>,
}

impl LiveServer {
    pub fn new(settings: ServerSettings) -> LiveServer {
        LiveServer {
            allow_private_webhooks: Arc::new(AtomicBool::new(settings.allow_private_webhooks)),
            current: ArcSwap::from_pointee(settings),
        }
    }

    /// The settings as they are now.
    pub fn load(&self) -> arc_swap::Guard<Arc<ServerSettings>> {
        self.current.load()
    }

    pub fn store(&self, settings: ServerSettings) {
        self.allow_private_webhooks
            .store(settings.allow_private_webhooks, Ordering::Relaxed);
        self.current.store(Arc::new(settings));
    }

    /// `allow_private_webhooks` as a flag that follows reloads.
    pub fn allow_private_webhooks(&self) -> Arc<AtomicBool> {
        self.allow_private_webhooks.clone()
    }
}
