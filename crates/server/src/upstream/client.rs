//! The one HTTP client every call to an origin goes through (proxy, job runner, JWKS fetches).

use std::time::Duration;

use axum::body::Body;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use nthbouncer_config::ServerSpec;

use super::connector::TrackedConnector;

pub type UpstreamClient = Client<hyper_rustls::HttpsConnector<TrackedConnector>, Body>;

/// The server's settings every upstream client is built with.
#[derive(Clone, Copy, Debug)]
pub struct ClientTimeouts {
    pub connect_ms: u64,
    pub idle_ms: u64,
}

impl ClientTimeouts {
    pub fn of(server: &ServerSpec) -> ClientTimeouts {
        ClientTimeouts {
            connect_ms: server.upstream_connect_timeout_ms,
            idle_ms: server.upstream_idle_timeout_ms,
        }
    }
}

/// Builds the shared upstream client: keep-alive pool whose idle connections are closed by a
/// timer below typical upstream keep-alive timeouts, so we never write into a connection the
/// upstream is about to close.
pub fn build_client(server: &ServerSpec) -> Result<UpstreamClient, String> {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
        .map_err(|e| e.to_string())?
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(tracked(ClientTimeouts::of(server)));
    Ok(pooled(ClientTimeouts::of(server), https))
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
    http.set_connect_timeout(Some(Duration::from_millis(timeouts.connect_ms)));
    TrackedConnector(http)
}

fn pooled(
    timeouts: ClientTimeouts,
    https: hyper_rustls::HttpsConnector<TrackedConnector>,
) -> UpstreamClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_millis(timeouts.idle_ms))
        .pool_timer(TokioTimer::new())
        .pool_max_idle_per_host(1024)
        .build(https)
}
