//! `[pools.access]`: the optional policies a caller must pass besides the pool key (SPEC §9) —
//! an IP allowlist, HMAC request signing, a JWT, a Cloudflare Access assertion. Every configured
//! policy must pass.
//!
//! This module only describes and checks the settings; the server turns them into runtime
//! verifiers (and parses key material such as PEM and JWK, which is why the checks here on
//! `public_keys` are only about shape).

use serde::{Deserialize, Serialize};

use crate::ConfigError;

pub const DEFAULT_HMAC_WINDOW_S: u64 = 300;
pub const MAX_HMAC_WINDOW_S: u64 = 3_600;
pub const MIN_HMAC_SECRET_BYTES: usize = 16;
pub const MAX_HMAC_SECRETS: usize = 16;
/// `access.hmac.max_body_bytes`: a signed body is read whole before its signature is checked,
/// so this bounds the memory one unverified request may take.
pub const DEFAULT_HMAC_MAX_BODY_BYTES: u64 = 1024 * 1024;
pub const MAX_HMAC_MAX_BODY_BYTES: u64 = 64 * 1024 * 1024;
pub const DEFAULT_JWT_LEEWAY_S: u64 = 60;
pub const MAX_JWT_LEEWAY_S: u64 = 600;
pub const DEFAULT_JWT_HEADER: &str = "X-Nthpool-Jwt";
pub const MAX_PUBLIC_KEYS: usize = 32;
pub const MAX_IP_ALLOW: usize = 4_096;

/// JWT signature algorithms `access.jwt.algorithms` may name: public-key algorithms only.
pub const JWT_ALGORITHMS: [&str; 9] = [
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA",
];

/// `[pools.access]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AccessSpec {
    /// Client addresses allowed (IP or CIDR); empty = any. See `server.trusted_proxies`.
    pub ip_allow: Vec<String>,
    pub hmac: Option<HmacSpec>,
    pub jwt: Option<JwtSpec>,
    pub cloudflare_access: Option<CloudflareAccessSpec>,
    /// Client certificates (needs `[server.tls]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mtls: Option<crate::tls::MtlsSpec>,
}

/// `[pools.access.hmac]`: request signing with replay protection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HmacSpec {
    /// Shared secrets (`env:NAME` allowed); a signature made with any of them passes, so a new
    /// secret can be rolled out before the old one is removed.
    pub secrets: Vec<String>,
    /// How far `X-Nthpool-Timestamp` may be from our clock, either way, in seconds.
    #[serde(default = "default_window_s")]
    pub window_s: u64,
    /// Largest signed body: it is read whole and verified before anything of the request
    /// leaves the gateway (`413` beyond).
    #[serde(default = "default_hmac_max_body_bytes")]
    pub max_body_bytes: u64,
}

/// `[pools.access.jwt]`: a JWT from an issuer of the operator's choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JwtSpec {
    /// Required `iss`, compared exactly.
    pub issuer: String,
    /// Required member of `aud`.
    pub audience: String,
    /// Where the issuer publishes its keys (JWKS); cached, refreshed on an unknown `kid`.
    #[serde(default)]
    pub jwks_url: Option<String>,
    /// Static verification keys instead of `jwks_url`: PEM public keys or JWKs (JSON objects).
    #[serde(default)]
    pub public_keys: Vec<String>,
    /// Accepted `alg` values (public-key algorithms only; never `none`, never `HS*`).
    #[serde(default = "default_algorithms")]
    pub algorithms: Vec<String>,
    /// Clock skew tolerated on `exp` and `nbf`, in seconds.
    #[serde(default = "default_leeway_s")]
    pub leeway_s: u64,
    /// Header carrying the token (bare or as `Bearer <jwt>`); `Authorization: Bearer <jwt>` is
    /// accepted too when that header does not carry the pool key.
    #[serde(default = "default_jwt_header")]
    pub header: String,
}

/// `[pools.access.cloudflare_access]`: the `Cf-Access-Jwt-Assertion` Cloudflare Access adds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CloudflareAccessSpec {
    /// e.g. `myteam.cloudflareaccess.com`; the issuer is `https://{team_domain}`.
    pub team_domain: String,
    /// The application's AUD tag; the token's `aud` must contain it.
    pub audience: String,
    /// Where the signing certs are; default `https://{team_domain}/cdn-cgi/access/certs`.
    #[serde(default)]
    pub certs_url: Option<String>,
}

fn default_window_s() -> u64 {
    DEFAULT_HMAC_WINDOW_S
}

fn default_hmac_max_body_bytes() -> u64 {
    DEFAULT_HMAC_MAX_BODY_BYTES
}

fn default_algorithms() -> Vec<String> {
    vec!["RS256".to_string()]
}

fn default_leeway_s() -> u64 {
    DEFAULT_JWT_LEEWAY_S
}

fn default_jwt_header() -> String {
    DEFAULT_JWT_HEADER.to_string()
}

/// Headers that carry other credentials and so cannot carry the JWT.
const RESERVED_HEADERS: [&str; 5] = [
    "x-nthpool-key",
    "x-nthpool-signature",
    "x-nthpool-timestamp",
    "x-nthpool-nonce",
    "cf-access-jwt-assertion",
];

impl AccessSpec {
    /// Whether any policy besides the pool key is configured.
    pub fn is_empty(&self) -> bool {
        self.ip_allow.is_empty()
            && self.hmac.is_none()
            && self.jwt.is_none()
            && self.cloudflare_access.is_none()
            && self.mtls.is_none()
    }

    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        if self.ip_allow.len() > MAX_IP_ALLOW {
            return Err(ConfigError::new(
                format!("{at}.ip_allow"),
                format!("at most {MAX_IP_ALLOW} entries"),
            ));
        }
        for (i, entry) in self.ip_allow.iter().enumerate() {
            crate::parse_cidr(entry).ok_or_else(|| {
                ConfigError::new(
                    format!("{at}.ip_allow[{i}]"),
                    format!("{entry:?} is not an IP address or CIDR"),
                )
            })?;
        }
        if let Some(h) = &self.hmac {
            h.validate(&format!("{at}.hmac"))?;
        }
        if let Some(j) = &self.jwt {
            j.validate(&format!("{at}.jwt"))?;
        }
        if let Some(c) = &self.cloudflare_access {
            c.validate(&format!("{at}.cloudflare_access"))?;
        }
        if let Some(m) = &self.mtls {
            m.validate(&format!("{at}.mtls"))?;
        }
        Ok(())
    }

    /// The allowlist as networks (call after `validate`).
    pub fn ip_allow_nets(&self) -> Vec<ipnet::IpNet> {
        self.ip_allow
            .iter()
            .filter_map(|e| crate::parse_cidr(e))
            .collect()
    }

    /// The spec with HMAC secrets masked (unless an `env:` reference).
    pub fn masked(&self) -> AccessSpec {
        let mut out = self.clone();
        if let Some(h) = out.hmac.as_mut() {
            for s in h.secrets.iter_mut() {
                if !s.starts_with("env:") {
                    *s = crate::mask(s);
                }
            }
        }
        out
    }
}

impl HmacSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        if self.secrets.is_empty() || self.secrets.len() > MAX_HMAC_SECRETS {
            return Err(ConfigError::new(
                format!("{at}.secrets"),
                format!("must list between 1 and {MAX_HMAC_SECRETS} secrets"),
            ));
        }
        self.resolved_secrets(at)?;
        if self.window_s == 0 || self.window_s > MAX_HMAC_WINDOW_S {
            return Err(ConfigError::new(
                format!("{at}.window_s"),
                format!(
                    "must be between 1 and {MAX_HMAC_WINDOW_S} (got {})",
                    self.window_s
                ),
            ));
        }
        if self.max_body_bytes == 0 || self.max_body_bytes > MAX_HMAC_MAX_BODY_BYTES {
            return Err(ConfigError::new(
                format!("{at}.max_body_bytes"),
                format!(
                    "must be between 1 and {MAX_HMAC_MAX_BODY_BYTES} (got {})",
                    self.max_body_bytes
                ),
            ));
        }
        Ok(())
    }

    /// The secrets with `env:` resolved, each checked for length.
    pub fn resolved_secrets(&self, at: &str) -> Result<Vec<Vec<u8>>, ConfigError> {
        self.secrets
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let key = format!("{at}.secrets[{i}]");
                let value = crate::resolve_secret(&key, s)?;
                if value.len() < MIN_HMAC_SECRET_BYTES {
                    return Err(ConfigError::new(
                        key,
                        format!("must be at least {MIN_HMAC_SECRET_BYTES} bytes long"),
                    ));
                }
                Ok(value.into_bytes())
            })
            .collect()
    }
}

impl JwtSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        if self.issuer.trim().is_empty() {
            return Err(ConfigError::new(
                format!("{at}.issuer"),
                "must not be empty",
            ));
        }
        if self.audience.trim().is_empty() {
            return Err(ConfigError::new(
                format!("{at}.audience"),
                "must not be empty",
            ));
        }
        match (&self.jwks_url, self.public_keys.is_empty()) {
            (Some(_), false) => {
                return Err(ConfigError::new(
                    format!("{at}.public_keys"),
                    "give either jwks_url or public_keys, not both",
                ))
            }
            (None, true) => {
                return Err(ConfigError::new(
                    format!("{at}.jwks_url"),
                    "one of jwks_url or public_keys is required",
                ))
            }
            (Some(url), true) => check_fetch_url(&format!("{at}.jwks_url"), url)?,
            (None, false) => {}
        }
        if self.public_keys.len() > MAX_PUBLIC_KEYS {
            return Err(ConfigError::new(
                format!("{at}.public_keys"),
                format!("at most {MAX_PUBLIC_KEYS} keys"),
            ));
        }
        for (i, k) in self.public_keys.iter().enumerate() {
            let k = k.trim();
            let pem = k.starts_with("-----BEGIN ") && k.contains("PUBLIC KEY-----");
            let jwk = k.starts_with('{') && k.ends_with('}');
            if !pem && !jwk {
                return Err(ConfigError::new(
                    format!("{at}.public_keys[{i}]"),
                    "must be a PEM public key (-----BEGIN PUBLIC KEY-----) or a JWK (a JSON object)",
                ));
            }
        }
        if self.algorithms.is_empty() {
            return Err(ConfigError::new(
                format!("{at}.algorithms"),
                "must name at least one algorithm",
            ));
        }
        for (i, alg) in self.algorithms.iter().enumerate() {
            check_jwt_algorithm(&format!("{at}.algorithms[{i}]"), alg)?;
        }
        if self.leeway_s > MAX_JWT_LEEWAY_S {
            return Err(ConfigError::new(
                format!("{at}.leeway_s"),
                format!("must be at most {MAX_JWT_LEEWAY_S}"),
            ));
        }
        let header = http::HeaderName::from_bytes(self.header.as_bytes())
            .map_err(|_| ConfigError::new(format!("{at}.header"), "is not a valid header name"))?;
        if RESERVED_HEADERS.contains(&header.as_str()) {
            return Err(ConfigError::new(
                format!("{at}.header"),
                format!("{:?} carries another credential", self.header),
            ));
        }
        Ok(())
    }
}

/// Accepts only the public-key algorithms of [`JWT_ALGORITHMS`], with a reason for the rest.
pub fn check_jwt_algorithm(key: &str, alg: &str) -> Result<(), ConfigError> {
    if JWT_ALGORITHMS.contains(&alg) {
        return Ok(());
    }
    let rule = if alg.eq_ignore_ascii_case("none") {
        "\"none\" (unsigned tokens) is never accepted".to_string()
    } else if alg.to_ascii_uppercase().starts_with("HS") {
        format!(
            "{alg:?} is not accepted: tokens are verified with public keys, and an HMAC token \
             checked against a public key can be forged by anyone who has that key"
        )
    } else {
        format!("{alg:?} must be one of {}", JWT_ALGORITHMS.join(", "))
    };
    Err(ConfigError::new(key, rule))
}

impl CloudflareAccessSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        crate::check_hostname(&format!("{at}.team_domain"), &self.team_domain)?;
        if self.audience.trim().is_empty() {
            return Err(ConfigError::new(
                format!("{at}.audience"),
                "must not be empty",
            ));
        }
        if let Some(url) = &self.certs_url {
            check_fetch_url(&format!("{at}.certs_url"), url)?;
        }
        Ok(())
    }

    /// The issuer every token must name.
    pub fn issuer(&self) -> String {
        format!("https://{}", self.team_domain.to_ascii_lowercase())
    }

    /// Where the signing keys are fetched from.
    pub fn certs_url(&self) -> String {
        match &self.certs_url {
            Some(u) => u.clone(),
            None => format!(
                "https://{}/cdn-cgi/access/certs",
                self.team_domain.to_ascii_lowercase()
            ),
        }
    }
}

/// A URL we fetch keys from: `https://`, or `http://` on loopback only (keys fetched in the clear
/// across a network could be swapped by anyone on the path).
fn check_fetch_url(key: &str, url: &str) -> Result<(), ConfigError> {
    let uri = crate::parse_http_url(key, url)?;
    if uri.scheme_str() == Some("https") {
        return Ok(());
    }
    let host = uri.host().unwrap_or_default();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if loopback {
        Ok(())
    } else {
        Err(ConfigError::new(
            key,
            format!("{url:?} must use https:// (http:// is allowed on loopback only)"),
        ))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::{Config, ConfigError};

    const BASE: &str = "[[pools]]\nname = \"x\"\nupstream = \"http://a\"\n";

    fn err(extra: &str) -> ConfigError {
        Config::from_toml_str(&format!("{BASE}{extra}")).unwrap_err()
    }

    #[test]
    fn a_full_access_table_parses_with_defaults() {
        let c = Config::from_toml_str(&format!(
            "{BASE}[pools.access]\nip_allow = [\"10.0.0.0/8\", \"::1\"]\n\
             [pools.access.hmac]\nsecrets = [\"0123456789abcdef0123\"]\n\
             [pools.access.jwt]\nissuer = \"https://id.example\"\naudience = \"gw\"\njwks_url = \"https://id.example/jwks\"\n\
             [pools.access.cloudflare_access]\nteam_domain = \"t.cloudflareaccess.com\"\naudience = \"aud-tag\"\n"
        ))
        .unwrap();
        let a = &c.pools[0].access;
        assert_eq!(a.ip_allow_nets().len(), 2);
        let h = a.hmac.as_ref().unwrap();
        assert_eq!(h.window_s, 300);
        let j = a.jwt.as_ref().unwrap();
        assert_eq!(j.algorithms, vec!["RS256"]);
        assert_eq!(j.leeway_s, 60);
        assert_eq!(j.header, "X-Nthpool-Jwt");
        let cf = a.cloudflare_access.as_ref().unwrap();
        assert_eq!(cf.issuer(), "https://t.cloudflareaccess.com");
        assert_eq!(
            cf.certs_url(),
            "https://t.cloudflareaccess.com/cdn-cgi/access/certs"
        );
        assert!(!a.is_empty());
        assert!(Config::from_toml_str(BASE).unwrap().pools[0]
            .access
            .is_empty());
    }

    #[test]
    fn errors_name_the_access_key() {
        let e = err("[pools.access]\nip_allow = [\"10.0.0.0/33\"]\n");
        assert_eq!(e.key, "pools[0].access.ip_allow[0]");

        let e = err("[pools.access.hmac]\nsecrets = []\n");
        assert_eq!(e.key, "pools[0].access.hmac.secrets");
        let e = err("[pools.access.hmac]\nsecrets = [\"0123456789abcdef\", \"short\"]\n");
        assert_eq!(e.key, "pools[0].access.hmac.secrets[1]");
        assert!(
            !e.rule.contains("short"),
            "a secret must not be echoed: {e}"
        );
        let e = err("[pools.access.hmac]\nsecrets = [\"env:NTHBOUNCER_TEST_SURELY_UNSET\"]\n");
        assert_eq!(e.key, "pools[0].access.hmac.secrets[0]");
        let e = err("[pools.access.hmac]\nsecrets = [\"0123456789abcdef\"]\nwindow_s = 0\n");
        assert_eq!(e.key, "pools[0].access.hmac.window_s");
        for bad in [0, super::MAX_HMAC_MAX_BODY_BYTES + 1] {
            let e = err(&format!(
                "[pools.access.hmac]\nsecrets = [\"0123456789abcdef\"]\nmax_body_bytes = {bad}\n"
            ));
            assert_eq!(e.key, "pools[0].access.hmac.max_body_bytes");
            assert!(e.rule.contains("between 1 and 67108864"), "{e}");
        }
        let e = err("[pools.access.hmac]\nsecrets = [\"0123456789abcdef\"]\nwindw_s = 3\n");
        assert!(e.key.starts_with("pools[0].access.hmac"), "{e}");

        let jwt = "[pools.access.jwt]\nissuer = \"i\"\naudience = \"a\"\n";
        let e = err(jwt);
        assert_eq!(e.key, "pools[0].access.jwt.jwks_url");
        let e = err(&format!("{jwt}jwks_url = \"http://id.example/jwks\"\n"));
        assert_eq!(e.key, "pools[0].access.jwt.jwks_url");
        assert!(e.rule.contains("https"), "{e}");
        assert!(Config::from_toml_str(&format!(
            "{BASE}{jwt}jwks_url = \"http://127.0.0.1:9/jwks\"\n"
        ))
        .is_ok());
        let e = err(&format!(
            "{jwt}jwks_url = \"https://i/jwks\"\npublic_keys = [\"{{}}\"]\n"
        ));
        assert_eq!(e.key, "pools[0].access.jwt.public_keys");
        let e = err(&format!("{jwt}public_keys = [\"not a key\"]\n"));
        assert_eq!(e.key, "pools[0].access.jwt.public_keys[0]");
        for (alg, word) in [("none", "never"), ("HS256", "forged"), ("XY1", "one of")] {
            let e = err(&format!(
                "{jwt}jwks_url = \"https://i/jwks\"\nalgorithms = [\"ES256\", \"{alg}\"]\n"
            ));
            assert_eq!(e.key, "pools[0].access.jwt.algorithms[1]");
            assert!(e.rule.contains(word), "{e}");
        }
        let e = err(&format!(
            "{jwt}jwks_url = \"https://i/jwks\"\nheader = \"X-Nthpool-Key\"\n"
        ));
        assert_eq!(e.key, "pools[0].access.jwt.header");

        let e = err(
            "[pools.access.cloudflare_access]\nteam_domain = \"bad domain\"\naudience = \"a\"\n",
        );
        assert_eq!(e.key, "pools[0].access.cloudflare_access.team_domain");
        let e = err("[pools.access.cloudflare_access]\nteam_domain = \"t.example\"\naudience = \"a\"\ncerts_url = \"ftp://x\"\n");
        assert_eq!(e.key, "pools[0].access.cloudflare_access.certs_url");
    }

    #[test]
    fn hmac_secrets_are_masked_on_read() {
        let c = Config::from_toml_str(&format!(
            "{BASE}[pools.access.hmac]\nsecrets = [\"super-secret-signing-key\", \"env:NTHBOUNCER_TEST_HMAC\"]\n"
        ));
        // The env secret is unset: validation fails, which is right; mask a parsed spec instead.
        assert!(c.is_err());
        let spec = super::AccessSpec {
            hmac: Some(super::HmacSpec {
                secrets: vec![
                    "super-secret-signing-key".into(),
                    "env:NTHBOUNCER_TEST_HMAC".into(),
                ],
                window_s: 300,
                max_body_bytes: super::DEFAULT_HMAC_MAX_BODY_BYTES,
            }),
            ..Default::default()
        };
        let shown = serde_json::to_string(&spec.masked()).unwrap();
        assert!(!shown.contains("super-secret-signing-key"), "{shown}");
        assert!(shown.contains("env:NTHBOUNCER_TEST_HMAC"), "{shown}");
    }
}
