//! JWT verification for `access.jwt` and `access.cloudflare_access` (SPEC §9).
//!
//! Signatures, issuer and audience are checked by the `jsonwebtoken` crate against an allow-list
//! of public-key algorithms (`none` and `HS*` can never be on it, so neither an unsigned token
//! nor an HMAC token "signed" with our public key passes). Expiry and not-before are checked
//! here, against the server's clock, with claims parsed strictly: an `exp` that is not a number
//! is a malformed token, never a missing check.
//!
//! Keys are static (PEM or JWK) or fetched from a JWKS URL. Fetched keys are cached, refreshed
//! when older than [`JWKS_MAX_AGE_MS`] or when a token names an unknown `kid` — but never more
//! often than once per [`JWKS_MIN_REFRESH_MS`], so forged `kid`s cannot make us flood the issuer.
//! Header parameters that point elsewhere (`jku`, `jwk`, `x5u`) are ignored: keys come only from
//! the configuration.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use base64::prelude::*;
use http_body_util::{BodyExt, Limited};
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::{AlgorithmParameters, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use nthbouncer_config::ConfigError;
use serde::Deserialize;

use crate::upstream::SharedClient;

/// Cached JWKS keys older than this are refreshed on the next verification.
pub const JWKS_MAX_AGE_MS: u64 = 10 * 60 * 1000;
/// At most one JWKS fetch per this interval per pool policy, whatever tokens arrive.
pub const JWKS_MIN_REFRESH_MS: u64 = 30_000;
pub const JWKS_FETCH_TIMEOUT: Duration = Duration::from_secs(5);
pub const MAX_JWKS_BYTES: usize = 512 * 1024;
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;
/// Most keys a token without `kid` is tried against.
const MAX_KEYS_TRIED: usize = 8;

/// Why a token failed (for the access log only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JwtFailure {
    Missing,
    Malformed,
    Algorithm,
    UnknownKey,
    KeysUnavailable,
    Signature,
    Issuer,
    Audience,
    Expired,
    NotYetValid,
}

impl JwtFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            JwtFailure::Missing => "token missing",
            JwtFailure::Malformed => "token malformed",
            JwtFailure::Algorithm => "algorithm not allowed",
            JwtFailure::UnknownKey => "unknown key id",
            JwtFailure::KeysUnavailable => "signing keys unavailable",
            JwtFailure::Signature => "signature invalid",
            JwtFailure::Issuer => "wrong issuer",
            JwtFailure::Audience => "wrong audience",
            JwtFailure::Expired => "expired",
            JwtFailure::NotYetValid => "not yet valid",
        }
    }
}

fn family_of(alg: Algorithm) -> &'static str {
    match alg {
        Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512 => "hmac",
        Algorithm::RS256
        | Algorithm::RS384
        | Algorithm::RS512
        | Algorithm::PS256
        | Algorithm::PS384
        | Algorithm::PS512 => "rsa",
        Algorithm::ES256 | Algorithm::ES384 => "ec",
        Algorithm::EdDSA => "ed",
    }
}

/// One verification key.
#[derive(Clone)]
struct VerifyKey {
    kid: Option<String>,
    /// The JWK's own `alg`, when it names one: the key is used for that algorithm only.
    alg: Option<Algorithm>,
    family: &'static str,
    key: DecodingKey,
}

impl VerifyKey {
    fn fits(&self, alg: Algorithm) -> bool {
        self.family == family_of(alg) && self.alg.is_none_or(|a| a == alg)
    }

    /// A public JWK; symmetric (`oct`) keys and encryption keys are never verification keys.
    fn from_jwk(jwk: &Jwk) -> Option<VerifyKey> {
        if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
            return None;
        }
        let family = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => "rsa",
            AlgorithmParameters::EllipticCurve(_) => "ec",
            AlgorithmParameters::OctetKeyPair(_) => "ed",
            AlgorithmParameters::OctetKey(_) => return None,
        };
        let alg = match jwk.common.key_algorithm {
            Some(ka) => Some(ka.to_string().parse::<Algorithm>().ok()?),
            None => None,
        };
        let key = DecodingKey::from_jwk(jwk).ok()?;
        Some(VerifyKey {
            kid: jwk.common.key_id.clone(),
            alg,
            family,
            key,
        })
    }

    fn from_pem(pem: &str) -> Option<VerifyKey> {
        let b = pem.as_bytes();
        let (family, key) = if let Ok(k) = DecodingKey::from_rsa_pem(b) {
            ("rsa", k)
        } else if let Ok(k) = DecodingKey::from_ec_pem(b) {
            ("ec", k)
        } else if let Ok(k) = DecodingKey::from_ed_pem(b) {
            ("ed", k)
        } else {
            return None;
        };
        Some(VerifyKey {
            kid: None,
            alg: None,
            family,
            key,
        })
    }
}

/// Keys fetched from a JWKS URL.
struct RemoteKeys {
    url: http::Uri,
    keys: ArcSwap<Vec<VerifyKey>>,
    /// Epoch ms of the last successful fetch (0: never).
    fetched_at: AtomicU64,
    /// Epoch ms of the last fetch attempt (0: never).
    attempted_at: AtomicU64,
    /// How many fetches were made (tests, diagnostics).
    fetches: AtomicU64,
    refresh: tokio::sync::Mutex<()>,
}

enum Keys {
    Static(Vec<VerifyKey>),
    Remote(Arc<RemoteKeys>),
}

/// A configured JWT policy (`access.jwt` or `access.cloudflare_access`).
pub struct JwtPolicy {
    issuer: String,
    audience: String,
    algorithms: Vec<Algorithm>,
    leeway_s: u64,
    keys: Keys,
}

/// The token's header as sent, read before anything else is trusted.
#[derive(Deserialize)]
struct RawHeader {
    alg: String,
    #[serde(default)]
    kid: Option<String>,
    #[serde(default)]
    crit: Option<serde_json::Value>,
}

/// The time claims, strictly typed: a string where a number belongs fails the token.
#[derive(Deserialize)]
struct TimeClaims {
    exp: f64,
    #[serde(default)]
    nbf: Option<f64>,
}

fn ensure_crypto_provider() {
    // Exactly one backend is compiled in; installing it explicitly keeps a feature unified in by
    // another crate from turning verification into a panic.
    let _ = jsonwebtoken::crypto::CryptoProvider::install_default(
        &jsonwebtoken::crypto::rust_crypto::DEFAULT_PROVIDER,
    );
}

impl JwtPolicy {
    /// Builds a policy; `at` names the config table in errors.
    pub fn build(
        at: &str,
        issuer: String,
        audience: String,
        algorithms: &[String],
        leeway_s: u64,
        jwks_url: Option<&str>,
        public_keys: &[String],
    ) -> Result<JwtPolicy, ConfigError> {
        ensure_crypto_provider();
        let algorithms = algorithms
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let key = format!("{at}.algorithms[{i}]");
                nthbouncer_config::access::check_jwt_algorithm(&key, a)?;
                a.parse::<Algorithm>()
                    .map_err(|_| ConfigError::new(key, "is not a known algorithm"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let keys = match jwks_url {
            Some(url) => {
                let url = url.parse::<http::Uri>().map_err(|_| {
                    ConfigError::new(format!("{at}.jwks_url"), "is not a valid URL")
                })?;
                Keys::Remote(Arc::new(RemoteKeys {
                    url,
                    keys: ArcSwap::from_pointee(Vec::new()),
                    fetched_at: AtomicU64::new(0),
                    attempted_at: AtomicU64::new(0),
                    fetches: AtomicU64::new(0),
                    refresh: tokio::sync::Mutex::new(()),
                }))
            }
            None => {
                let mut out = Vec::new();
                for (i, text) in public_keys.iter().enumerate() {
                    let text = text.trim();
                    let key = if text.starts_with('{') {
                        serde_json::from_str::<Jwk>(text)
                            .ok()
                            .and_then(|j| VerifyKey::from_jwk(&j))
                    } else {
                        VerifyKey::from_pem(text)
                    };
                    let key = key.ok_or_else(|| {
                        ConfigError::new(
                            format!("{at}.public_keys[{i}]"),
                            "is not a usable public key (RSA, EC or Ed25519; PEM or JWK)",
                        )
                    })?;
                    if !algorithms.iter().any(|a| key.fits(*a)) {
                        return Err(ConfigError::new(
                            format!("{at}.public_keys[{i}]"),
                            "fits none of the configured algorithms",
                        ));
                    }
                    out.push(key);
                }
                Keys::Static(out)
            }
        };
        Ok(JwtPolicy {
            issuer,
            audience,
            algorithms,
            leeway_s,
            keys,
        })
    }

    /// JWKS fetches made so far (0 for static keys).
    pub fn fetches(&self) -> u64 {
        match &self.keys {
            Keys::Static(_) => 0,
            Keys::Remote(r) => r.fetches.load(Ordering::Relaxed),
        }
    }

    /// Verifies `token` at `now_ms`; `client` fetches the JWKS when needed.
    pub async fn verify(
        &self,
        token: &str,
        client: &SharedClient,
        now_ms: u64,
    ) -> Result<(), JwtFailure> {
        if token.is_empty() {
            return Err(JwtFailure::Missing);
        }
        if token.len() > MAX_TOKEN_BYTES {
            return Err(JwtFailure::Malformed);
        }
        let header = raw_header(token).ok_or(JwtFailure::Malformed)?;
        let alg = header
            .alg
            .parse::<Algorithm>()
            .ok()
            .filter(|a| self.algorithms.contains(a))
            .ok_or(JwtFailure::Algorithm)?;
        if header.crit.is_some() {
            // Extensions we would have to understand to verify correctly: we understand none.
            return Err(JwtFailure::Malformed);
        }
        let candidates = match &self.keys {
            Keys::Static(keys) => pick(keys, header.kid.as_deref(), alg),
            Keys::Remote(remote) => {
                let mut keys = remote.keys.load_full();
                let mut found = pick(&keys, header.kid.as_deref(), alg);
                let stale = now_ms.saturating_sub(remote.fetched_at.load(Ordering::Acquire))
                    > JWKS_MAX_AGE_MS;
                if found.is_empty() || stale {
                    if remote.refresh(client, now_ms).await {
                        keys = remote.keys.load_full();
                        found = pick(&keys, header.kid.as_deref(), alg);
                    } else if keys.is_empty() {
                        return Err(JwtFailure::KeysUnavailable);
                    }
                }
                found
            }
        };
        if candidates.is_empty() {
            return Err(JwtFailure::UnknownKey);
        }
        let mut validation = Validation::new(alg);
        validation.algorithms = vec![alg];
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[&self.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        // Time is checked below against our clock (which tests can move), not the crate's.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        let mut failure = JwtFailure::Signature;
        for key in candidates.iter().take(MAX_KEYS_TRIED) {
            match jsonwebtoken::decode::<TimeClaims>(token, &key.key, &validation) {
                Ok(data) => return self.check_times(&data.claims, now_ms),
                Err(e) => {
                    failure = match e.kind() {
                        ErrorKind::InvalidSignature
                        | ErrorKind::InvalidAlgorithm
                        | ErrorKind::InvalidEcdsaKey
                        | ErrorKind::InvalidEddsaKey
                        | ErrorKind::InvalidRsaKey(_)
                        | ErrorKind::InvalidKeyFormat => continue,
                        ErrorKind::InvalidIssuer => JwtFailure::Issuer,
                        ErrorKind::InvalidAudience => JwtFailure::Audience,
                        ErrorKind::MissingRequiredClaim(c) if c == "iss" => JwtFailure::Issuer,
                        ErrorKind::MissingRequiredClaim(c) if c == "aud" => JwtFailure::Audience,
                        _ => JwtFailure::Malformed,
                    };
                    // The signature verified (claims are checked after it): no other key will do.
                    break;
                }
            }
        }
        Err(failure)
    }

    fn check_times(&self, claims: &TimeClaims, now_ms: u64) -> Result<(), JwtFailure> {
        let now = now_ms as f64 / 1000.0;
        let leeway = self.leeway_s as f64;
        if !claims.exp.is_finite() || claims.exp + leeway < now {
            return Err(JwtFailure::Expired);
        }
        if let Some(nbf) = claims.nbf {
            if !nbf.is_finite() || nbf - leeway > now {
                return Err(JwtFailure::NotYetValid);
            }
        }
        Ok(())
    }
}

fn raw_header(token: &str) -> Option<RawHeader> {
    let mut parts = token.split('.');
    let (Some(h), Some(_), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let bytes = BASE64_URL_SAFE_NO_PAD.decode(h).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The keys a token may have been signed with: the one its `kid` names, or — without a `kid` —
/// every key fitting its algorithm.
fn pick(keys: &[VerifyKey], kid: Option<&str>, alg: Algorithm) -> Vec<VerifyKey> {
    keys.iter()
        .filter(|k| k.fits(alg))
        .filter(|k| kid.is_none() || k.kid.as_deref() == kid)
        .cloned()
        .collect()
}

impl RemoteKeys {
    /// Fetches the key set unless another fetch happened within [`JWKS_MIN_REFRESH_MS`];
    /// returns whether the keys may have changed.
    async fn refresh(&self, client: &SharedClient, now_ms: u64) -> bool {
        let allowed = |attempted: u64| {
            attempted == 0 || now_ms.saturating_sub(attempted) >= JWKS_MIN_REFRESH_MS
        };
        if !allowed(self.attempted_at.load(Ordering::Acquire)) {
            return false;
        }
        let before = self.fetched_at.load(Ordering::Acquire);
        let _guard = self.refresh.lock().await;
        // Someone else refreshed while we waited: use theirs.
        if self.fetched_at.load(Ordering::Acquire) != before {
            return true;
        }
        if !allowed(self.attempted_at.load(Ordering::Acquire)) {
            return false;
        }
        self.attempted_at.store(now_ms.max(1), Ordering::Release);
        self.fetches.fetch_add(1, Ordering::Relaxed);
        match fetch_jwks(client, &self.url).await {
            Ok(keys) => {
                tracing::debug!(url = %self.url, keys = keys.len(), "JWKS refreshed");
                self.keys.store(Arc::new(keys));
                self.fetched_at.store(now_ms.max(1), Ordering::Release);
                true
            }
            Err(e) => {
                tracing::warn!(url = %self.url, error = %e, "JWKS fetch failed; keeping the keys we had");
                false
            }
        }
    }
}

/// Why a JWKS refresh failed (logged; the keys fetched before stay in use).
#[derive(Debug, thiserror::Error)]
enum JwksError {
    #[error("the request could not be built: {0}")]
    Request(#[source] http::Error),
    #[error("timed out")]
    Timeout,
    #[error("{0}")]
    Transport(#[source] hyper_util::client::legacy::Error),
    #[error("status {0}")]
    Status(http::StatusCode),
    #[error("timed out reading the body")]
    BodyTimeout,
    #[error("the body could not be read: {0}")]
    Body(#[source] axum::BoxError),
    #[error("not a JWKS: {0}")]
    NotJwks(#[source] serde_json::Error),
    #[error("no usable keys")]
    NoUsableKeys,
}

/// GETs a JWKS (or Cloudflare's certs document, which has the same `keys` array) and keeps the
/// keys we can use; a key we cannot read is skipped, not fatal.
async fn fetch_jwks(client: &SharedClient, url: &http::Uri) -> Result<Vec<VerifyKey>, JwksError> {
    let req = http::Request::get(url.clone())
        .header(http::header::ACCEPT, "application/json")
        .header(http::header::USER_AGENT, "nthbouncer")
        .body(axum::body::Body::empty())
        .map_err(JwksError::Request)?;
    let resp = tokio::time::timeout(JWKS_FETCH_TIMEOUT, client.get().request(req))
        .await
        .map_err(|_| JwksError::Timeout)?
        .map_err(JwksError::Transport)?;
    if !resp.status().is_success() {
        return Err(JwksError::Status(resp.status()));
    }
    let body = tokio::time::timeout(
        JWKS_FETCH_TIMEOUT,
        Limited::new(resp.into_body(), MAX_JWKS_BYTES).collect(),
    )
    .await
    .map_err(|_| JwksError::BodyTimeout)?
    .map_err(JwksError::Body)?
    .to_bytes();
    #[derive(Deserialize)]
    struct Set {
        keys: Vec<serde_json::Value>,
    }
    let set: Set = serde_json::from_slice(&body).map_err(JwksError::NotJwks)?;
    let keys: Vec<VerifyKey> = set
        .keys
        .into_iter()
        .filter_map(|v| serde_json::from_value::<Jwk>(v).ok())
        .filter_map(|j| VerifyKey::from_jwk(&j))
        .collect();
    if keys.is_empty() {
        return Err(JwksError::NoUsableKeys);
    }
    Ok(keys)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_header_is_read_strictly() {
        let enc = |s: &str| BASE64_URL_SAFE_NO_PAD.encode(s);
        let t = format!("{}.{}.sig", enc(r#"{"alg":"none"}"#), enc("{}"));
        assert_eq!(raw_header(&t).unwrap().alg, "none");
        assert!(raw_header("a.b").is_none());
        assert!(raw_header("a.b.c.d").is_none());
        assert!(raw_header(&format!("{}.x.y", enc("[1]"))).is_none());
    }

    /// The config key a `JwtPolicy::build` of `algorithm` with `jwks` and `keys` refuses.
    fn refused_key(algorithm: &str, jwks: Option<&str>, keys: &[&str]) -> String {
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        let built = JwtPolicy::build(
            "jwt",
            "i".into(),
            "a".into(),
            &[algorithm.into()],
            60,
            jwks,
            &keys,
        );
        built.err().unwrap().key
    }

    #[test]
    fn hmac_algorithms_and_bad_keys_are_refused_at_build() {
        let key = refused_key("HS256", Some("https://x/jwks"), &[]);
        assert_eq!(key, "jwt.algorithms[0]");
        let pem = "-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----";
        assert_eq!(refused_key("RS256", None, &[pem]), "jwt.public_keys[0]");
        let oct = r#"{"kty":"oct","k":"c2VjcmV0LXNlY3JldC1zZWNyZXQ","kid":"h"}"#;
        assert_eq!(
            refused_key("RS256", None, &[oct]),
            "jwt.public_keys[0]",
            "a symmetric JWK is never a public key"
        );
    }
}
