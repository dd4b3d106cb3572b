//! The listener's TLS: one `rustls::ServerConfig` for the life of the process (so session
//! tickets and the session cache survive a reload), whose certificates sit behind an
//! [`ArcSwap`]: [`ListenerTls::reload`] swaps in freshly read files, and only handshakes after
//! it see them; connections already open keep going.
//!
//! Client certificates: when any pool asks for them (`access.mtls`), every handshake requests
//! one, optionally. The handshake only proves the client holds the certificate's key; whether
//! the chain is one a pool trusts is decided per request by that pool's [`super::MtlsPolicy`],
//! since on a shared listener the handshake cannot know which pool the requests are for.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;
use nthbouncer_config::{ConfigError, ServerTlsSpec};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, ServerSessionMemoryCache};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme};
use rustls_pki_types::{CertificateDer, UnixTime};
use tokio_rustls::TlsAcceptor;

use super::pem;

/// TLS sessions remembered for resumption by session id (TLS 1.2); tickets need no memory.
const SESSION_CACHE: usize = 10_000;

/// Whether any pool wants client certificates now (read at every handshake).
pub type WantsClientCerts = Arc<dyn Fn() -> bool + Send + Sync>;

/// The listener's TLS: the settings it was started with and the certificates now served.
pub struct ListenerTls {
    /// The files to read: `[server.tls]` as last loaded (a config reload may name others).
    spec: parking_lot::Mutex<ServerTlsSpec>,
    certs: Arc<ArcSwap<CertSet>>,
    acceptor: TlsAcceptor,
}

impl fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ListenerTls")
            .field("spec", &*self.spec.lock())
            .finish()
    }
}

impl ListenerTls {
    /// Reads every certificate of `[server.tls]`; errors name the key.
    pub fn load(spec: &ServerTlsSpec, wants: WantsClientCerts) -> Result<ListenerTls, ConfigError> {
        let certs = Arc::new(ArcSwap::from_pointee(CertSet::load(spec)?));
        let provider = super::provider();
        let algorithms = provider.signature_verification_algorithms;
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| ConfigError::new("server.tls", e.to_string()))?
            .with_client_cert_verifier(Arc::new(AnyClientCert { wants, algorithms }))
            .with_cert_resolver(Arc::new(Resolver(certs.clone())));
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config.session_storage = ServerSessionMemoryCache::new(SESSION_CACHE);
        config.ticketer = rustls::crypto::ring::Ticketer::new()
            .map_err(|e| ConfigError::new("server.tls", format!("no session tickets: {e}")))?;
        Ok(ListenerTls {
            spec: parking_lot::Mutex::new(spec.clone()),
            certs,
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// Checks `[server.tls]` the way [`ListenerTls::load`] would, reading every file.
    pub fn check(spec: &ServerTlsSpec) -> Result<(), ConfigError> {
        CertSet::load(spec).map(drop)
    }

    /// Re-reads the certificate and key files (on SIGHUP): new handshakes get the new ones,
    /// open connections are untouched. A file that does not read changes nothing; the error
    /// names the key and is logged here.
    pub fn reload(&self) -> Result<(), ConfigError> {
        let spec = self.spec.lock().clone();
        self.use_spec(&spec)
    }

    /// Like [`ListenerTls::reload`], from a re-read config's `[server.tls]` (other files or
    /// names); kept for later reloads only if every file reads. Turning TLS on or off needs a
    /// restart.
    pub fn use_spec(&self, spec: &ServerTlsSpec) -> Result<(), ConfigError> {
        match ListenerTls::prepare(spec) {
            Ok(prepared) => {
                self.install(prepared);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "TLS certificates not reloaded; the previous ones stay");
                Err(e)
            }
        }
    }

    /// Reads `spec`'s certificate and key files without serving them yet: a configuration
    /// reload reads them before anything changes and installs them only once the rest of the
    /// file applied ([`ListenerTls::install`]).
    pub fn prepare(spec: &ServerTlsSpec) -> Result<PreparedCerts, ConfigError> {
        Ok(PreparedCerts {
            set: CertSet::load(spec)?,
            spec: spec.clone(),
        })
    }

    /// Serves `prepared` to the handshakes from now on, and keeps its spec for later reloads.
    pub fn install(&self, prepared: PreparedCerts) {
        self.certs.store(Arc::new(prepared.set));
        *self.spec.lock() = prepared.spec;
        tracing::info!("TLS certificates reloaded");
    }

    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }
}

/// Certificates read by [`ListenerTls::prepare`], not served yet.
pub struct PreparedCerts {
    set: CertSet,
    spec: ServerTlsSpec,
}

/// The certificates served: by exact name, by wildcard (`*.example.com` → `example.com`), and
/// the default for any other name or none.
struct CertSet {
    default: Arc<CertifiedKey>,
    exact: HashMap<String, Arc<CertifiedKey>>,
    wildcard: HashMap<String, Arc<CertifiedKey>>,
}

impl CertSet {
    fn load(spec: &ServerTlsSpec) -> Result<CertSet, ConfigError> {
        let default = pem::certified_key("server.tls", &spec.cert_file, &spec.key_file)?;
        let mut set = CertSet {
            default,
            exact: HashMap::new(),
            wildcard: HashMap::new(),
        };
        for (i, c) in spec.certs.iter().enumerate() {
            let at = format!("server.tls.certs[{i}]");
            let ck = pem::certified_key(&at, &c.cert_file, &c.key_file)?;
            for name in &c.names {
                let name = name.to_ascii_lowercase();
                match name.strip_prefix("*.") {
                    Some(parent) => set.wildcard.insert(parent.to_string(), ck.clone()),
                    None => set.exact.insert(name, ck.clone()),
                };
            }
        }
        Ok(set)
    }

    fn pick(&self, sni: Option<&str>) -> Arc<CertifiedKey> {
        let Some(name) = sni.map(str::to_ascii_lowercase) else {
            return self.default.clone();
        };
        if let Some(ck) = self.exact.get(&name) {
            return ck.clone();
        }
        name.split_once('.')
            .and_then(|(_, parent)| self.wildcard.get(parent))
            .unwrap_or(&self.default)
            .clone()
    }
}

struct Resolver(Arc<ArcSwap<CertSet>>);

impl fmt::Debug for Resolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Resolver")
    }
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load().pick(hello.server_name()))
    }
}

/// Asks for a client certificate (optionally) while any pool wants one, and checks only that
/// the client holds its key; the chain is each pool's to judge, per request.
struct AnyClientCert {
    wants: WantsClientCerts,
    algorithms: WebPkiSupportedAlgorithms,
}

impl fmt::Debug for AnyClientCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AnyClientCert")
    }
}

impl ClientCertVerifier for AnyClientCert {
    fn offer_client_auth(&self) -> bool {
        (self.wants)()
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
