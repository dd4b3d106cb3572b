//! TLS (SPEC §12), everything the gateway does with certificates: the listener's server side
//! ([`ListenerTls`]: certificates by SNI, re-read on SIGHUP), what a connection's handshake
//! told us ([`PeerTls`]: the SNI name, the client's certificate chain), the per-pool client
//! certificate policy ([`MtlsPolicy`], checked per request by `access`), and the client side
//! towards private origins ([`upstream_client_config`]). One crypto provider: rustls on ring.
//!
//! It must not know pools, requests or features: callers hand it settings and chains. Files are
//! read here, and every problem is a [`ConfigError`] naming the key.

mod listener;
mod mtls;
mod pem;

use std::sync::Arc;

use nthbouncer_config::{ConfigError, UpstreamTlsSpec};
use rustls::crypto::CryptoProvider;
use rustls_pki_types::{CertificateDer, ServerName};

pub use listener::{ListenerTls, PreparedCerts};
pub use mtls::{CertIdentity, MtlsFailure, MtlsPolicy};

/// The one crypto provider.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What a TLS connection's handshake settled, put on each of its requests' extensions.
#[derive(Debug, Clone, Default)]
pub struct PeerTls {
    /// The name the client opened the connection for (SNI), lower-cased.
    pub sni: Option<Box<str>>,
    /// The client's certificate chain, leaf first, if it sent one (its possession of the key
    /// was proven in the handshake; the chain is checked per request by the pool's policy).
    pub chain: Option<Arc<[CertificateDer<'static>]>>,
    /// Who that certificate names (`subject="…" sans=…`), for the access log.
    pub client: Option<Box<str>>,
}

impl PeerTls {
    /// The TLS facts of the connection a request came on (none over plain HTTP).
    pub fn of_request(extensions: &http::Extensions) -> Option<&PeerTls> {
        extensions.get::<Arc<PeerTls>>().map(|t| &**t)
    }

    pub fn of(conn: &rustls::ServerConnection) -> PeerTls {
        let chain: Option<Arc<[CertificateDer<'static>]>> = conn
            .peer_certificates()
            .filter(|c| !c.is_empty())
            .map(|c| c.iter().map(|c| c.clone().into_owned()).collect());
        PeerTls {
            sni: conn.server_name().map(|s| s.to_ascii_lowercase().into()),
            client: chain
                .as_ref()
                .and_then(|c| c.first())
                .map(|leaf| CertIdentity::of(leaf).describe().into()),
            chain,
        }
    }

    /// The client certificate a request's connection presented, described for the access log.
    pub fn client_of(extensions: &http::Extensions) -> Option<String> {
        Self::of_request(extensions)?
            .client
            .as_deref()
            .map(str::to_string)
    }
}

/// The client TLS settings of a pool's `[pools.upstream_tls]` (`at` names the table), and the
/// SNI name to use instead of the upstream's host, if set.
pub fn upstream_client_config(
    at: &str,
    spec: &UpstreamTlsSpec,
) -> Result<(rustls::ClientConfig, Option<ServerName<'static>>), ConfigError> {
    let mut roots = rustls::RootCertStore::empty();
    match &spec.ca_file {
        Some(path) => {
            let key = format!("{at}.ca_file");
            for cert in pem::certs(&key, path)? {
                roots.add(cert).map_err(|e| {
                    ConfigError::new(&key, format!("not a usable CA certificate: {e}"))
                })?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError::new(at, e.to_string()))?
        .with_root_certificates(roots);
    let config = match (&spec.cert_file, &spec.key_file) {
        (Some(cert), Some(key)) => {
            let ck = pem::certified_key(at, cert, key)?;
            builder
                .with_client_auth_cert(
                    ck.cert.clone(),
                    pem::private_key(&format!("{at}.key_file"), key)?,
                )
                .map_err(|e| ConfigError::new(format!("{at}.key_file"), e.to_string()))?
        }
        _ => builder.with_no_client_auth(),
    };
    let name = match &spec.server_name {
        Some(n) => Some(ServerName::try_from(n.clone()).map_err(|_| {
            ConfigError::new(format!("{at}.server_name"), "is not a valid server name")
        })?),
        None => None,
    };
    Ok((config, name))
}
