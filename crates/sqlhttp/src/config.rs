//! The upstream: a `postgres://` URL parsed into a connection target, and the pool's limits.
//!
//! Owns the managed credential. The password lives only in `Target::password` and is read only
//! by the authentication exchange; `Debug` and `Target::redacted` never show it, and no parse
//! error quotes the URL. Must not open connections (that is `conn`).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

use crate::error::SqlHttpError;

/// Limits of one database pool.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most connections open at once: the pool's effective limit. At least 1.
    pub max_connections: usize,
    /// PostgreSQL's `statement_timeout` for every session of the pool (`None`: the server's).
    pub statement_timeout: Option<Duration>,
    /// Most bytes one answer may encode to; past it the query is cancelled (`507`).
    pub max_response_bytes: usize,
    /// Longest a new connection may take (TCP, TLS, authentication) before it counts as
    /// unreachable.
    pub connect_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 10,
            statement_timeout: None,
            max_response_bytes: 10 * 1024 * 1024,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Whether and how the connection is encrypted, from the URL's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SslMode {
    /// `disable`, `allow`, or no `sslmode`: plain TCP.
    Disable,
    /// `prefer`: TLS when the server offers it, plain otherwise.
    Prefer,
    /// `require`, `verify-ca`, `verify-full`: TLS or no connection.
    Require,
}

/// Where and as whom to connect. Shared by every connection of a pool and by cancel requests.
pub(crate) struct Target {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) user: String,
    pub(crate) password: Option<String>,
    pub(crate) database: String,
    pub(crate) application_name: String,
    pub(crate) ssl_mode: SslMode,
    pub(crate) tls: Option<Arc<rustls::ClientConfig>>,
    pub(crate) statement_timeout: Option<Duration>,
    pub(crate) connect_timeout: Duration,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl Target {
    /// Parses a `postgres://user:password@host:port/database?sslmode=…&application_name=…`
    /// URL. Error messages name the problem, never the URL.
    pub(crate) fn parse(
        url: &str,
        limits: &Limits,
        extra_roots_pem: Option<&[u8]>,
    ) -> Result<Target, SqlHttpError> {
        let bad = |message: &str| SqlHttpError::Config {
            message: format!("database url: {message}"),
        };
        // The url crate's errors describe the syntax without quoting the input.
        let parsed = url::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
        if !matches!(parsed.scheme(), "postgres" | "postgresql") {
            return Err(bad("scheme must be postgres:// or postgresql://"));
        }
        let host = match parsed.host() {
            Some(url::Host::Domain(d)) if !d.is_empty() => d.to_owned(),
            Some(url::Host::Ipv4(ip)) => ip.to_string(),
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            _ => return Err(bad("a host is required")),
        };
        let decode = |s: &str, what: &str| {
            percent_decode(s)
                .ok_or_else(|| bad(&format!("{what} is not valid percent-encoded UTF-8")))
        };
        let user = decode(parsed.username(), "user")?;
        if user.is_empty() {
            return Err(bad("a user is required"));
        }
        let password = match parsed.password() {
            Some(p) => Some(decode(p, "password")?),
            None => None,
        };
        let database = decode(parsed.path().trim_start_matches('/'), "database")?;
        let database = if database.is_empty() {
            user.clone()
        } else {
            database
        };

        let mut ssl_mode = SslMode::Disable;
        let mut application_name = "nthbouncer".to_owned();
        for (key, value) in parsed.query_pairs() {
            match &*key {
                "sslmode" => ssl_mode = match &*value {
                    "disable" | "allow" => SslMode::Disable,
                    "prefer" => SslMode::Prefer,
                    "require" | "verify-ca" | "verify-full" => SslMode::Require,
                    _ => return Err(bad(
                        "sslmode must be disable, allow, prefer, require, verify-ca or verify-full",
                    )),
                },
                "application_name" => application_name = value.into_owned(),
                // Others (Neon's `channel_binding`, libpq's `connect_timeout`, …) are libpq
                // client settings this client replaces with its own (`Limits`).
                _ => {}
            }
        }

        if limits.max_connections == 0 {
            return Err(SqlHttpError::Config {
                message: "max_connections must be at least 1".into(),
            });
        }

        let tls = match ssl_mode {
            SslMode::Disable => None,
            SslMode::Prefer | SslMode::Require => Some(tls_config(extra_roots_pem)?),
        };

        Ok(Target {
            host,
            port: parsed.port().unwrap_or(5432),
            user,
            password,
            database,
            application_name,
            ssl_mode,
            tls,
            statement_timeout: limits.statement_timeout,
            connect_timeout: limits.connect_timeout,
        })
    }

    /// `postgres://user@host:port/database`: what logs and error messages may show.
    pub(crate) fn redacted(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!(
            "postgres://{}@{}:{}/{}",
            self.user, host, self.port, self.database
        )
    }
}

/// Certificates are verified against the public web roots plus any CA the operator gives: a
/// gateway that holds the password must not hand it to whoever answers on the address, so
/// `sslmode=require` verifies here (stricter than libpq's `require`).
fn tls_config(extra_roots_pem: Option<&[u8]>) -> Result<Arc<rustls::ClientConfig>, SqlHttpError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(pem) = extra_roots_pem {
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| SqlHttpError::Config {
                message: format!("database CA certificates: {e}"),
            })?;
            roots.add(cert).map_err(|e| SqlHttpError::Config {
                message: format!("database CA certificate: {e}"),
            })?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| SqlHttpError::Config {
            message: format!("TLS: {e}"),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// `%XX` escapes decoded (the `percent-encoding` crate, as the URL's other values are); `None`
/// if the result is not UTF-8. A `%` not followed by two hex digits stays as it is.
fn percent_decode(value: &str) -> Option<String> {
    percent_encoding::percent_decode_str(value)
        .decode_utf8()
        .ok()
        .map(std::borrow::Cow::into_owned)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn parses_and_redacts() {
        let t = Target::parse(
            "postgres://app%40x:p%40ss@db.example:6543/shop?sslmode=disable&application_name=a1",
            &Limits::default(),
            None,
        )
        .unwrap();
        assert_eq!(t.user, "app@x");
        assert_eq!(t.password.as_deref(), Some("p@ss"));
        assert_eq!(t.database, "shop");
        assert_eq!(t.port, 6543);
        assert_eq!(t.application_name, "a1");
        assert_eq!(t.redacted(), "postgres://app@x@db.example:6543/shop");
        assert!(!format!("{t:?}").contains("p@ss"));
    }

    #[test]
    fn database_defaults_to_user_and_require_builds_tls() {
        let t = Target::parse(
            "postgresql://u:pw@h?sslmode=require",
            &Limits::default(),
            None,
        )
        .unwrap();
        assert_eq!(t.database, "u");
        assert_eq!(t.ssl_mode, SslMode::Require);
        assert!(t.tls.is_some());
    }

    #[test]
    fn errors_never_quote_the_url() {
        for url in [
            "mysql://u:hunter2@h/db",
            "postgres://:hunter2@h/db",
            "postgres://u:hunter2@h/db?sslmode=bogus",
            "postgres://u:hunter2@[::1/db",
        ] {
            let e = Target::parse(url, &Limits::default(), None).unwrap_err();
            assert!(!e.to_string().contains("hunter2"), "{e}");
            assert!(!format!("{e:?}").contains("hunter2"), "{e:?}");
        }
    }
}
