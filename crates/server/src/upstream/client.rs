//! The one HTTP client every call to an origin goes through (proxy, job runner, JWKS fetches),
//! and its replacement when a reload changes its timeouts ([`SharedClient`]).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::body::Body;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::connector::TrackedConnector;
use crate::core::live::ServerSettings;

pub type UpstreamClient = Client<hyper_rustls::HttpsConnector<TrackedConnector>, Body>;

/// The server's settings every upstream client is built with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientTimeouts {
    pub connect: Duration,
    pub idle: Duration,
}

impl ClientTimeouts {
    pub fn of(server: &ServerSettings) -> ClientTimeouts {
        ClientTimeouts {
            connect: server.upstream_connect_timeout,
            idle: server.upstream_idle_timeout,
        }
    }
}

/// The shared upstream client, as the last reload left it. A call takes the current client
/// ([`SharedClient::get`]) and keeps it to its end: a reload that changes the timeouts builds
/// a new client for the calls after it, and the old one (with its pooled connections) goes
/// away once its last call is done.
pub struct SharedClient {
    current: ArcSwap<Built>,
}

struct Built {
    timeouts: ClientTimeouts,
    client: Arc<UpstreamClient>,
}

impl SharedClient {
    pub fn new(timeouts: ClientTimeouts) -> Result<SharedClient, rustls::Error> {
        let client = Arc::new(build_client(timeouts)?);
        Ok(SharedClient {
            current: ArcSwap::from_pointee(Built { timeouts, client }),
        })
    }

    /// The client for a call starting now.
    pub fn get(&self) -> Arc<UpstreamClient> {
        self.current.load().client.clone()
    }

    /// A client with `timeouts`, when they differ from the current one's: built before a
    /// reload publishes anything (so a failure changes nothing), put in place by
    /// [`SharedClient::install`].
    pub fn prepare(
        &self,
        timeouts: ClientTimeouts,
    ) -> Result<Option<Arc<UpstreamClient>>, rustls::Error> {
        if self.current.load().timeouts == timeouts {
            return Ok(None);
        }
        build_client(timeouts).map(|c| Some(Arc::new(c)))
    }

    /// Makes `client` (built by [`SharedClient::prepare`] with `timeouts`) the current one.
    pub fn install(&self, timeouts: ClientTimeouts, client: Arc<UpstreamClient>) {
        self.current.store(Arc::new(Built { timeouts, client }));
    }
}

/// Builds the shared upstream client: keep-alive pool whose idle connections are closed by a
/// timer below typical upstream keep-alive timeouts, so we never write into a connection the
/// upstream is about to close.
pub fn build_client(timeouts: ClientTimeouts) -> Result<UpstreamClient, rustls::Error> {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())?
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(tracked(timeouts));
    Ok(pooled(timeouts, https))
}

/// A client of its own for a pool with `[pools.upstream_tls]`: its CA, its client certificate,
/// its SNI name (so its connections are never shared with other pools' to the same origin).
pub fn build_tls_client(
    timeouts: ClientTimeouts,
    config: rustls::ClientConfig,
    server_name: Option<rustls_pki_types::ServerName<'static>>,
) -> UpstreamClient {
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http();
    let builder = match server_name {
        Some(name) => {
            builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
        }
        None => builder,
    };
    let https = builder
        .enable_http1()
        .enable_http2()
        .wrap_connector(tracked(timeouts));
    pooled(timeouts, https)
}

fn tracked(timeouts: ClientTimeouts) -> TrackedConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(timeouts.connect));
    TrackedConnector(http)
}

fn pooled(
    timeouts: ClientTimeouts,
    https: hyper_rustls::HttpsConnector<TrackedConnector>,
) -> UpstreamClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(timeouts.idle)
        .pool_timer(TokioTimer::new())
        .pool_max_idle_per_host(1024)
        .build(https)
}
