//! The one HTTP client every call to an origin goes through (proxy, job runner, JWKS fetches).

use std::time::Duration;

use axum::body::Body;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use nthbouncer_config::ServerSpec;

use super::connector::TrackedConnector;

pub type UpstreamClient = Client<hyper_rustls::HttpsConnector<TrackedConnector>, Body>;

/// Builds the shared upstream client: keep-alive pool whose idle connections are closed by a
/// timer below typical upstream keep-alive timeouts, so we never write into a connection the
/// upstream is about to close.
pub fn build_client(server: &ServerSpec) -> Result<UpstreamClient, String> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_millis(
        server.upstream_connect_timeout_ms,
    )));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
        .map_err(|e| e.to_string())?
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(TrackedConnector(http));
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_millis(server.upstream_idle_timeout_ms))
        .pool_timer(TokioTimer::new())
        .pool_max_idle_per_host(1024)
        .build(https))
}
