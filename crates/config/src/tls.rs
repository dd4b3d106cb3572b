//! TLS settings (SPEC §12): `[server.tls]` (the listener's certificates, one default and
//! `[[server.tls.certs]]` per SNI name), `[pools.access.mtls]` (client certificates a pool's
//! callers must present) and `[pools.upstream_tls]` (a private CA, a client certificate and an
//! SNI override towards the origin).
//!
//! Only the shape is checked here (paths given, names valid, pairs complete); the server reads
//! the files and parses the PEM, with errors naming the same keys.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::ConfigError;

/// Most `[[server.tls.certs]]` entries, and most names in one entry or one allow list.
pub const MAX_TLS_CERTS: usize = 1_000;
pub const MAX_ALLOWED: usize = 1_000;

/// `[server.tls]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTlsSpec {
    /// PEM: the certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM: the private key (PKCS#8, or PKCS#1 RSA / SEC1 EC).
    pub key_file: PathBuf,
    /// Certificates chosen by the name the client asks for (SNI), e.g. for `custom_domains`.
    #[serde(default)]
    pub certs: Vec<SniCertSpec>,
}

/// `[[server.tls.certs]]`: a certificate served to clients that ask for one of `names`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SniCertSpec {
    /// Host names (exact, case-insensitive; `*.example.com` matches one label).
    pub names: Vec<String>,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// `[pools.access.mtls]`: callers must present a client certificate chaining to `ca_file`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MtlsSpec {
    /// PEM: the CA certificate(s) client certificates must chain to.
    #[schema(value_type = String)]
    pub ca_file: PathBuf,
    /// Accepted subjects (as shown in the access log, e.g. `CN=worker-1,O=Acme`); empty = any.
    #[serde(default)]
    pub allowed_subjects: Vec<String>,
    /// Accepted subject alternative names (DNS names, `spiffe://…` URIs, e-mail addresses, IP
    /// addresses); empty = any. With both lists set, a certificate matching either passes.
    #[serde(default)]
    pub allowed_sans: Vec<String>,
}

/// `[pools.upstream_tls]`: how the gateway's TLS connections to the origin are made.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamTlsSpec {
    /// PEM: CA certificate(s) trusted for the origin instead of the public roots.
    #[schema(value_type = Option<String>)]
    pub ca_file: Option<PathBuf>,
    /// PEM: a client certificate chain presented to the origin (mTLS); needs `key_file`.
    #[schema(value_type = Option<String>)]
    pub cert_file: Option<PathBuf>,
    #[schema(value_type = Option<String>)]
    pub key_file: Option<PathBuf>,
    /// The name sent as SNI and checked against the origin's certificate, instead of the
    /// upstream URL's host (an origin reached by IP address or an internal alias).
    pub server_name: Option<String>,
}

fn path_given(key: String, p: &std::path::Path) -> Result<(), ConfigError> {
    if p.as_os_str().is_empty() {
        return Err(ConfigError::new(key, "must be a file path"));
    }
    Ok(())
}

impl ServerTlsSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        path_given(format!("{at}.cert_file"), &self.cert_file)?;
        path_given(format!("{at}.key_file"), &self.key_file)?;
        if self.certs.len() > MAX_TLS_CERTS {
            return Err(ConfigError::new(
                format!("{at}.certs"),
                format!("at most {MAX_TLS_CERTS} entries"),
            ));
        }
        for (i, c) in self.certs.iter().enumerate() {
            let at = format!("{at}.certs[{i}]");
            path_given(format!("{at}.cert_file"), &c.cert_file)?;
            path_given(format!("{at}.key_file"), &c.key_file)?;
            if c.names.is_empty() || c.names.len() > MAX_ALLOWED {
                return Err(ConfigError::new(
                    format!("{at}.names"),
                    format!("must list between 1 and {MAX_ALLOWED} host names"),
                ));
            }
            for (j, n) in c.names.iter().enumerate() {
                let bare = n.strip_prefix("*.").unwrap_or(n);
                crate::check_hostname(&format!("{at}.names[{j}]"), bare)?;
            }
        }
        Ok(())
    }
}

impl MtlsSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        path_given(format!("{at}.ca_file"), &self.ca_file)?;
        for (name, list) in [
            ("allowed_subjects", &self.allowed_subjects),
            ("allowed_sans", &self.allowed_sans),
        ] {
            if list.len() > MAX_ALLOWED {
                return Err(ConfigError::new(
                    format!("{at}.{name}"),
                    format!("at most {MAX_ALLOWED} entries"),
                ));
            }
            if let Some(i) = list.iter().position(|s| s.trim().is_empty()) {
                return Err(ConfigError::new(
                    format!("{at}.{name}[{i}]"),
                    "must not be empty",
                ));
            }
        }
        Ok(())
    }
}

impl UpstreamTlsSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        for (name, p) in [
            ("ca_file", &self.ca_file),
            ("cert_file", &self.cert_file),
            ("key_file", &self.key_file),
        ] {
            if let Some(p) = p {
                path_given(format!("{at}.{name}"), p)?;
            }
        }
        match (&self.cert_file, &self.key_file) {
            (Some(_), None) => {
                return Err(ConfigError::new(
                    format!("{at}.key_file"),
                    "is required with cert_file (the client certificate's private key)",
                ))
            }
            (None, Some(_)) => {
                return Err(ConfigError::new(
                    format!("{at}.cert_file"),
                    "is required with key_file",
                ))
            }
            _ => {}
        }
        if let Some(n) = &self.server_name {
            if n.parse::<std::net::IpAddr>().is_err() {
                crate::check_hostname(&format!("{at}.server_name"), n)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::Config;

    const POOL: &str = "[[pools]]\nname = \"p\"\nupstream = \"https://10.0.0.5\"\n";
    const TLS: &str = "[server.tls]\ncert_file = \"a.pem\"\nkey_file = \"a.key\"\n";

    fn key_of(text: &str) -> String {
        Config::from_toml_str(text).unwrap_err().key
    }

    #[test]
    fn tls_tables_parse_and_name_what_is_wrong() {
        let full = format!(
            "{TLS}[[server.tls.certs]]\nnames = [\"a.example\", \"*.b.example\"]\ncert_file = \"b.pem\"\nkey_file = \"b.key\"\n\
             {POOL}[pools.upstream_tls]\nca_file = \"corp.pem\"\nserver_name = \"origin.corp\"\n\
             [pools.access.mtls]\nca_file = \"clients.pem\"\nallowed_sans = [\"w.internal\"]\n"
        );
        let c = Config::from_toml_str(&full).unwrap();
        assert_eq!(c.server.tls.as_ref().unwrap().certs[0].names.len(), 2);
        assert_eq!(
            c.pools[0]
                .upstream_tls
                .as_ref()
                .unwrap()
                .server_name
                .as_deref(),
            Some("origin.corp")
        );
        assert!(c.pools[0].access.mtls.is_some());

        assert_eq!(
            key_of("[server.tls]\ncert_file = \"a.pem\"\n"),
            "server.tls"
        );
        assert_eq!(
            key_of("[server.tls]\ncert_file = \"\"\nkey_file = \"a.key\"\n"),
            "server.tls.cert_file"
        );
        assert_eq!(
            key_of(&format!(
                "{TLS}[[server.tls.certs]]\nnames = []\ncert_file = \"b\"\nkey_file = \"c\"\n"
            )),
            "server.tls.certs[0].names"
        );
        assert_eq!(
            key_of(&format!("{TLS}[[server.tls.certs]]\nnames = [\"bad name\"]\ncert_file = \"b\"\nkey_file = \"c\"\n")),
            "server.tls.certs[0].names[0]"
        );
        assert_eq!(
            key_of(&format!("{POOL}[pools.upstream_tls]\nkey_file = \"k\"\n")),
            "pools[0].upstream_tls.cert_file"
        );
        assert_eq!(
            key_of(&format!(
                "{POOL}[pools.upstream_tls]\nserver_name = \"-x\"\n"
            )),
            "pools[0].upstream_tls.server_name"
        );
        assert_eq!(
            key_of(&format!(
                "{TLS}{POOL}[pools.access.mtls]\nca_file = \"c\"\nallowed_subjects = [\"\"]\n"
            )),
            "pools[0].access.mtls.allowed_subjects[0]"
        );
        let db =
            "[[pools]]\nname = \"d\"\nkind = \"database\"\nupstream = \"postgres://u:p@h/db\"\n";
        assert_eq!(
            key_of(&format!("{db}[pools.upstream_tls]\nca_file = \"c\"\n")),
            "pools[0].upstream_tls"
        );
    }
}
