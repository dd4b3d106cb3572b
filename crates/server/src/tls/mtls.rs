//! `[pools.access.mtls]`: a pool's callers present a client certificate that chains to the
//! pool's CA (and, if listed, has an allowed subject or SAN). The chain arrives with the
//! connection ([`super::PeerTls`]); it is checked per request, because on a listener shared by
//! several pools one handshake cannot know which pool its requests are for.

use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Arc;

use nthbouncer_config::{ConfigError, MtlsSpec};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use rustls_pki_types::{CertificateDer, UnixTime};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::pem;

/// Why a caller's certificate was refused (for the access log).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MtlsFailure {
    /// No client certificate on the connection (or a plain-HTTP connection).
    Missing,
    /// The chain does not lead to the pool's CA, or the certificate is expired or not for
    /// client authentication.
    Untrusted,
    /// Neither its subject nor any SAN is on the pool's lists.
    NotAllowed,
}

impl MtlsFailure {
    pub fn as_str(&self) -> &'static str {
        match self {
            MtlsFailure::Missing => "mtls: no client certificate",
            MtlsFailure::Untrusted => "mtls: client certificate not signed by access.mtls.ca_file",
            MtlsFailure::NotAllowed => {
                "mtls: client certificate subject and SANs not in allowed_subjects / allowed_sans"
            }
        }
    }
}

/// Who a client certificate names: its subject and its SANs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CertIdentity {
    pub subject: String,
    pub sans: Vec<String>,
}

impl CertIdentity {
    /// Read from a certificate (DER); an unparsable one names nobody.
    pub fn of(der: &CertificateDer<'_>) -> CertIdentity {
        let Ok((_, cert)) = X509Certificate::from_der(der) else {
            return CertIdentity::default();
        };
        let mut sans = Vec::new();
        if let Ok(Some(ext)) = cert.subject_alternative_name() {
            for name in &ext.value.general_names {
                match name {
                    GeneralName::DNSName(s) | GeneralName::URI(s) | GeneralName::RFC822Name(s) => {
                        sans.push((*s).to_string())
                    }
                    GeneralName::IPAddress(b) => {
                        let ip = match b.len() {
                            4 => <[u8; 4]>::try_from(*b).ok().map(IpAddr::from),
                            16 => <[u8; 16]>::try_from(*b).ok().map(IpAddr::from),
                            _ => None,
                        };
                        sans.extend(ip.map(|ip| ip.to_string()));
                    }
                    _ => {}
                }
            }
        }
        CertIdentity {
            subject: cert.subject().to_string(),
            sans,
        }
    }

    /// For the access log: `subject="…" sans=a,b`.
    pub fn describe(&self) -> String {
        let mut out = format!("subject={:?}", self.subject);
        if !self.sans.is_empty() {
            let _ = write!(out, " sans={}", self.sans.join(","));
        }
        out
    }
}

/// A subject as compared: its attributes in order, without the spaces around the commas
/// (`CN=a, O=b` and `CN=a,O=b` are the same subject).
fn subject_key(subject: &str) -> String {
    subject
        .split(',')
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(",")
}

/// A pool's client-certificate policy, ready to check chains.
pub struct MtlsPolicy {
    verifier: Arc<dyn ClientCertVerifier>,
    allowed_subjects: Vec<String>,
    allowed_sans: Vec<String>,
}

impl MtlsPolicy {
    /// Reads the CA file; `at` names the table (`pools[0].access.mtls`).
    pub fn build(at: &str, spec: &MtlsSpec) -> Result<MtlsPolicy, ConfigError> {
        spec.validate(at)?;
        let key = format!("{at}.ca_file");
        let mut roots = RootCertStore::empty();
        for cert in pem::certs(&key, &spec.ca_file)? {
            roots
                .add(cert)
                .map_err(|e| ConfigError::new(&key, format!("not a usable CA certificate: {e}")))?;
        }
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), super::provider())
                .build()
                .map_err(|e| ConfigError::new(&key, e.to_string()))?;
        Ok(MtlsPolicy {
            verifier,
            allowed_subjects: spec
                .allowed_subjects
                .iter()
                .map(|s| subject_key(s))
                .collect(),
            allowed_sans: spec
                .allowed_sans
                .iter()
                .map(|s| s.to_ascii_lowercase())
                .collect(),
        })
    }

    /// Checks the connection's client chain (leaf first). The identity comes back either way
    /// when there is a certificate, for the access log.
    pub fn check(
        &self,
        chain: Option<&[CertificateDer<'static>]>,
    ) -> (Option<CertIdentity>, Result<(), MtlsFailure>) {
        let Some((leaf, intermediates)) = chain.and_then(|c| c.split_first()) else {
            return (None, Err(MtlsFailure::Missing));
        };
        let identity = CertIdentity::of(leaf);
        let verified = self
            .verifier
            .verify_client_cert(leaf, intermediates, UnixTime::now());
        if verified.is_err() {
            return (Some(identity), Err(MtlsFailure::Untrusted));
        }
        let lists = !self.allowed_subjects.is_empty() || !self.allowed_sans.is_empty();
        let allowed = !lists
            || self
                .allowed_subjects
                .contains(&subject_key(&identity.subject))
            || identity
                .sans
                .iter()
                .any(|san| self.allowed_sans.contains(&san.to_ascii_lowercase()));
        let result = if allowed {
            Ok(())
        } else {
            Err(MtlsFailure::NotAllowed)
        };
        (Some(identity), result)
    }
}
