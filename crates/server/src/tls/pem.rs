//! Reading PEM files into rustls's types, with errors that name the key and the rule.

use std::path::Path;
use std::sync::Arc;

use nthbouncer_config::ConfigError;
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Most bytes a certificate, key or CA file may have: PEM bundles, not anything else.
pub const MAX_PEM_FILE_BYTES: u64 = 4 * 1024 * 1024;

fn read(key: &str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    let meta = std::fs::metadata(path)
        .map_err(|e| ConfigError::new(key, format!("cannot read {}: {e}", path.display())))?;
    if !meta.is_file() {
        return Err(ConfigError::new(
            key,
            format!("{} is not a file", path.display()),
        ));
    }
    if meta.len() > MAX_PEM_FILE_BYTES {
        return Err(ConfigError::new(
            key,
            format!(
                "{} is larger than {MAX_PEM_FILE_BYTES} bytes",
                path.display()
            ),
        ));
    }
    std::fs::read(path)
        .map_err(|e| ConfigError::new(key, format!("cannot read {}: {e}", path.display())))
}

/// Every certificate in a PEM file (at least one).
pub fn certs(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let bytes = read(key, path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ConfigError::new(key, format!("bad PEM in {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(ConfigError::new(
            key,
            format!("no CERTIFICATE block in {}", path.display()),
        ));
    }
    Ok(certs)
}

/// The private key of a PEM file: PKCS#8, PKCS#1 (RSA) or SEC1 (EC).
pub fn private_key(key: &str, path: &Path) -> Result<PrivateKeyDer<'static>, ConfigError> {
    let bytes = read(key, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
        let why = match e {
            rustls_pki_types::pem::Error::NoItemsFound => "no private key".to_string(),
            other => format!("bad PEM: {other}"),
        };
        ConfigError::new(key, format!("{why} in {}", path.display()))
    })
}

/// A certificate chain and its key, checked to belong together. `at` names the table that has
/// `cert_file` and `key_file`.
pub fn certified_key(
    at: &str,
    cert_file: &Path,
    key_file: &Path,
) -> Result<Arc<CertifiedKey>, ConfigError> {
    let chain = certs(&format!("{at}.cert_file"), cert_file)?;
    let key_key = format!("{at}.key_file");
    let der = private_key(&key_key, key_file)?;
    let signing = super::provider()
        .key_provider
        .load_private_key(der)
        .map_err(|e| ConfigError::new(&key_key, format!("unsupported private key: {e}")))?;
    let ck = CertifiedKey::new(chain, signing);
    match ck.keys_match() {
        Ok(()) => {}
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            return Err(ConfigError::new(
                &key_key,
                "is not the key of the certificate in cert_file",
            ))
        }
        // The key's public half cannot be told (never with ring's keys): the handshake shows.
        Err(rustls::Error::InconsistentKeys(_)) => {}
        Err(e) => {
            return Err(ConfigError::new(
                format!("{at}.cert_file"),
                format!("not a usable certificate: {e}"),
            ))
        }
    }
    Ok(Arc::new(ck))
}
