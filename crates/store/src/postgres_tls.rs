//! TLS to the PostgreSQL store: `sslmode` (`disable`, `prefer`, `require`, `verify-ca`,
//! `verify-full`) and `sslrootcert` from the URL, checked by rustls.
//!
//! tokio-postgres knows only `disable`, `prefer` and `require` and no `sslrootcert`, so
//! [`TlsOptions::take_from`] takes what it does not know out of the URL first. Every mode that
//! encrypts checks the server's chain against the trusted CAs (the web's roots, or
//! `sslrootcert`'s); all but `verify-ca` check the host name too (stricter than libpq's
//! `prefer` and `require`, which check nothing: the node hands the server a password).

use std::sync::Arc;

use crate::{Result, StoreError};

/// How the server's certificate is checked, from the URL's `sslmode` and `sslrootcert`
/// (tokio-postgres knows neither `verify-ca`/`verify-full` nor `sslrootcert`, so they are taken
/// out of the URL before it parses it; `verify-*` then connects as `require`). Only TLS
/// connections use it: with `sslmode=disable` (or none) nothing is checked because nothing is
/// encrypted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TlsOptions {
    /// `verify-ca`: the chain is checked, the host name is not (libpq's meaning: for a server
    /// reached by an address its certificate does not name). Every other mode checks both.
    pub(crate) skip_host_name: bool,
    /// `sslrootcert=FILE`: the CAs (PEM) trusted instead of the web's roots (`system`, as in
    /// libpq, means the web's roots).
    pub(crate) root_cert: Option<std::path::PathBuf>,
}

impl TlsOptions {
    /// Splits `url` into what tokio-postgres parses and these options. Refuses an `sslmode`
    /// tokio-postgres would not know either, so the message names the modes there are.
    pub(crate) fn take_from(url: &str) -> Result<(String, TlsOptions)> {
        let mut options = TlsOptions {
            skip_host_name: false,
            root_cert: None,
        };
        let Some((base, query)) = url.split_once('?') else {
            return Ok((url.to_owned(), options));
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match key {
                "sslmode" => match value {
                    "disable" | "prefer" | "require" => kept.push(pair.to_owned()),
                    "verify-full" => kept.push("sslmode=require".to_owned()),
                    "verify-ca" => {
                        options.skip_host_name = true;
                        kept.push("sslmode=require".to_owned());
                    }
                    _ => {
                        return Err(StoreError::Backend(
                            "reading the PostgreSQL URL: sslmode must be disable, prefer, \
                             require, verify-ca or verify-full"
                                .into(),
                        ))
                    }
                },
                "sslrootcert" => {
                    let path = percent_decoded(value).ok_or_else(|| {
                        StoreError::Backend(
                            "reading the PostgreSQL URL: sslrootcert is not a valid path".into(),
                        )
                    })?;
                    options.root_cert = (path != "system").then(|| path.into());
                }
                _ => kept.push(pair.to_owned()),
            }
        }
        let url = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        Ok((url, options))
    }

    /// The rustls client configuration for these options.
    pub(crate) fn client_config(&self) -> Result<rustls::ClientConfig> {
        let roots = match &self.root_cert {
            None => rustls::RootCertStore {
                roots: webpki_roots_list(),
            },
            Some(path) => read_roots(path)?,
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Backend(format!("setting up TLS: {e}")))?;
        if !self.skip_host_name {
            return Ok(builder.with_root_certificates(roots).with_no_client_auth());
        }
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| StoreError::Backend(format!("setting up TLS: {e}")))?;
        Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyHostName(verifier)))
            .with_no_client_auth())
    }

    pub(crate) fn connector(&self) -> Result<tokio_postgres_rustls::MakeRustlsConnect> {
        Ok(tokio_postgres_rustls::MakeRustlsConnect::new(
            self.client_config()?,
        ))
    }
}

/// `%XX` escapes decoded (the `percent-encoding` crate, as the URL's other values are); `None`
/// if the result is not UTF-8. A `%` not followed by two hex digits stays as it is.
fn percent_decoded(value: &str) -> Option<String> {
    percent_encoding::percent_decode_str(value)
        .decode_utf8()
        .ok()
        .map(std::borrow::Cow::into_owned)
}

/// The CA certificates of a PEM file; at least one, or an error naming the file.
fn read_roots(path: &std::path::Path) -> Result<rustls::RootCertStore> {
    use rustls::pki_types::pem::PemObject;
    let fail =
        |why: String| StoreError::Backend(format!("reading sslrootcert {}: {why}", path.display()));
    let pem = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| fail(e.to_string()))?;
        roots.add(cert).map_err(|e| fail(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(fail("no certificate in it".into()));
    }
    Ok(roots)
}

/// `sslmode=verify-ca`: the full check of the chain (a trusted CA, validity, usage), then a
/// name mismatch forgiven. rustls checks the name last, so a `NotValidForName` error means
/// everything before it passed.
#[derive(Debug)]
struct AnyHostName(Arc<rustls::client::WebPkiServerVerifier>);

impl rustls::client::danger::ServerCertVerifier for AnyHostName {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> std::result::Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        use rustls::CertificateError::{NotValidForName, NotValidForNameContext};
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                NotValidForName | NotValidForNameContext { .. },
            )) => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

fn webpki_roots_list() -> Vec<rustls::pki_types::TrustAnchor<'static>> {
    webpki_roots::TLS_SERVER_ROOTS.to_vec()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use nthbouncer_testkit::tls::Ca;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

    #[test]
    fn the_url_keeps_what_tokio_postgres_knows_and_gives_the_rest_here() {
        let (url, o) = TlsOptions::take_from("postgres://u:pw@db:5432/x").unwrap();
        assert_eq!(url, "postgres://u:pw@db:5432/x");
        assert_eq!((o.skip_host_name, o.root_cert), (false, None));

        let (url, o) = TlsOptions::take_from(
            "postgres://u@db/x?application_name=a&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem",
        )
        .unwrap();
        assert_eq!(url, "postgres://u@db/x?application_name=a&sslmode=require");
        assert!(!o.skip_host_name);
        assert_eq!(o.root_cert, Some("/etc/ca.pem".into()));

        let (url, o) =
            TlsOptions::take_from("postgres://u@db/x?sslrootcert=/ca.pem&sslmode=verify-ca")
                .unwrap();
        assert_eq!(url, "postgres://u@db/x?sslmode=require");
        assert!(o.skip_host_name);

        let (url, o) =
            TlsOptions::take_from("postgres://u@db/x?sslmode=require&sslrootcert=system").unwrap();
        assert_eq!(url, "postgres://u@db/x?sslmode=require");
        assert_eq!((o.skip_host_name, o.root_cert), (false, None));

        for bad in [
            "postgres://u:secret@db/x?sslmode=verify",
            "postgres://u:secret@db/x?sslmode=allow",
            "postgres://u:secret@db/x?sslrootcert=%ff",
        ] {
            let e = TlsOptions::take_from(bad).unwrap_err().to_string();
            assert!(!e.contains("secret"), "{e}");
        }
        let missing = TlsOptions {
            skip_host_name: false,
            root_cert: Some("/nonexistent/ca.pem".into()),
        };
        let e = missing.client_config().unwrap_err().to_string();
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
    }

    /// A TLS handshake in memory between a client of `options` and a server presenting
    /// `leaf` (PEM certificate and key), reaching it as `name`.
    fn handshake(
        options: &TlsOptions,
        leaf: (&str, &str),
        name: &str,
    ) -> std::result::Result<(), String> {
        let client = Arc::new(options.client_config().map_err(|e| e.to_string())?);
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(leaf.0.as_bytes())
            .map(|c| c.unwrap())
            .collect();
        let key = PrivateKeyDer::from_pem_slice(leaf.1.as_bytes()).unwrap();
        let server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
        let name = ServerName::try_from(name.to_owned()).unwrap();
        let mut c = rustls::ClientConnection::new(client, name).unwrap();
        let mut s = rustls::ServerConnection::new(Arc::new(server)).unwrap();
        for _ in 0..10 {
            let mut wire = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut wire).unwrap();
            }
            s.read_tls(&mut wire.as_slice()).unwrap();
            s.process_new_packets()
                .map_err(|e| format!("server: {e}"))?;
            let mut wire = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut wire).unwrap();
            }
            c.read_tls(&mut wire.as_slice()).unwrap();
            c.process_new_packets()
                .map_err(|e| format!("client: {e}"))?;
            if !c.is_handshaking() && !s.is_handshaking() {
                return Ok(());
            }
        }
        Err("the handshake did not finish".into())
    }

    #[test]
    fn the_chain_is_checked_against_sslrootcert_and_the_name_unless_verify_ca() {
        let dir = tempfile::tempdir().unwrap();
        let (ours, other) = (Ca::new("ours"), Ca::new("other"));
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, ours.pem()).unwrap();
        let leaf = ours.server(&["db.internal"]);
        let leaf = (leaf.cert.as_str(), leaf.key.as_str());
        let strangers = other.server(&["db.internal"]);
        let strangers = (strangers.cert.as_str(), strangers.key.as_str());
        let full = TlsOptions {
            skip_host_name: false,
            root_cert: Some(ca.clone()),
        };
        let ca_only = TlsOptions {
            skip_host_name: true,
            root_cert: Some(ca),
        };
        let web = TlsOptions {
            skip_host_name: false,
            root_cert: None,
        };

        assert_eq!(handshake(&full, leaf, "db.internal"), Ok(()));
        let wrong_name = handshake(&full, leaf, "db.elsewhere").unwrap_err();
        assert!(wrong_name.contains("not valid for name"), "{wrong_name}");
        let wrong_ca = handshake(&full, strangers, "db.internal").unwrap_err();
        assert!(wrong_ca.contains("UnknownIssuer"), "{wrong_ca}");
        assert!(
            handshake(&web, leaf, "db.internal").is_err(),
            "not a web root"
        );

        // verify-ca: any name, but only our CA.
        assert_eq!(handshake(&ca_only, leaf, "db.elsewhere"), Ok(()));
        assert_eq!(handshake(&ca_only, leaf, "127.0.0.1"), Ok(()));
        let wrong_ca = handshake(&ca_only, strangers, "db.internal").unwrap_err();
        assert!(wrong_ca.contains("UnknownIssuer"), "{wrong_ca}");
    }
}
