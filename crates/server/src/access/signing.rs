//! HMAC request signing (SPEC §9, `access.hmac`).
//!
//! The caller signs
//! `"v1\n{METHOD}\n{host}\n{path?query}\n{timestamp}\n{nonce}\n{hex sha256(body)}"` with a shared
//! secret and sends `X-Nthpool-Timestamp`, `X-Nthpool-Nonce` and `X-Nthpool-Signature: v1=<hex>`.
//! We check, in this order: the timestamp is within the window, a signature matches (constant
//! time, any configured secret), the nonce is unseen — so only correctly signed requests can
//! occupy the nonce store.
//!
//! The head is checked up front ([`HmacPolicy::begin`]); the caller then reads the body whole
//! (bounded) and hands it to [`Pending::finish_with_body`]: nothing of a signed request leaves
//! the gateway before its signature and nonce passed.

use std::sync::Arc;

use hmac::{Hmac, Mac};
use http::{HeaderMap, Method, Uri};
use nthbouncer_coord::{NonceKey, NonceStore, NonceVerdict};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

pub const TIMESTAMP_HEADER: &str = "x-nthpool-timestamp";
pub const NONCE_HEADER: &str = "x-nthpool-nonce";
pub const SIGNATURE_HEADER: &str = "x-nthpool-signature";
pub const MIN_NONCE_LEN: usize = 16;
pub const MAX_NONCE_LEN: usize = 128;
/// Most `v1=` values one request may carry (rotation needs two; more is someone fishing).
pub const MAX_SIGNATURES: usize = 4;

/// Why a signed request failed (for the access log only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HmacFailure {
    Missing,
    Malformed,
    OutsideWindow,
    Signature,
    Replayed,
    NonceStoreFull,
    /// The body ended in an error (or was dropped) before it could be verified.
    BodyIncomplete,
}

impl HmacFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            HmacFailure::Missing => "hmac: signature headers missing",
            HmacFailure::Malformed => "hmac: timestamp, nonce or signature malformed",
            HmacFailure::OutsideWindow => "hmac: timestamp outside the window",
            HmacFailure::Signature => "hmac: signature mismatch",
            HmacFailure::Replayed => "hmac: nonce replayed",
            HmacFailure::NonceStoreFull => {
                "hmac: nonce could not be recorded (store full or failing)"
            }
            HmacFailure::BodyIncomplete => "hmac: body ended before it was verified",
        }
    }
}

/// A pool's signing settings.
pub struct HmacPolicy {
    secrets: Arc<[Vec<u8>]>,
    window_s: u64,
}

impl std::fmt::Debug for HmacPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HmacPolicy")
            .field("secrets", &self.secrets.len())
            .field("window_s", &self.window_s)
            .finish()
    }
}

/// A request whose head passed; the body hash decides the rest.
pub struct Pending {
    secrets: Arc<[Vec<u8>]>,
    /// The canonical string up to and including the nonce line.
    prefix: Vec<u8>,
    signatures: Vec<[u8; 32]>,
    nonce: NonceKey,
    now_ms: u64,
    expires_at_ms: u64,
    nonces: Arc<dyn NonceStore>,
}

fn single<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a [u8]>, HmacFailure> {
    let mut all = headers.get_all(name).iter();
    match (all.next(), all.next()) {
        (None, _) => Ok(None),
        (Some(v), None) => Ok(Some(v.as_bytes())),
        (Some(_), Some(_)) => Err(HmacFailure::Malformed),
    }
}

fn parse_signatures(value: &[u8]) -> Result<Vec<[u8; 32]>, HmacFailure> {
    let text = std::str::from_utf8(value).map_err(|_| HmacFailure::Malformed)?;
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim) {
        // Other schemes are for other versions of the protocol; we speak v1.
        let Some(hex_sig) = part.strip_prefix("v1=") else {
            continue;
        };
        let mut sig = [0u8; 32];
        hex::decode_to_slice(hex_sig, &mut sig).map_err(|_| HmacFailure::Malformed)?;
        out.push(sig);
    }
    if out.is_empty() || out.len() > MAX_SIGNATURES {
        return Err(HmacFailure::Malformed);
    }
    Ok(out)
}

impl HmacPolicy {
    pub fn new(secrets: Vec<Vec<u8>>, window_s: u64) -> Self {
        HmacPolicy {
            secrets: secrets.into(),
            window_s,
        }
    }

    /// Checks the head: headers present and well formed, timestamp within the window. The
    /// signature itself needs the body's hash ([`Pending::finish`]).
    pub fn begin(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        now_ms: u64,
        nonces: Arc<dyn NonceStore>,
    ) -> Result<Pending, HmacFailure> {
        let ts = single(headers, TIMESTAMP_HEADER)?;
        let nonce = single(headers, NONCE_HEADER)?;
        let sig = single(headers, SIGNATURE_HEADER)?;
        let (Some(ts), Some(nonce), Some(sig)) = (ts, nonce, sig) else {
            return Err(HmacFailure::Missing);
        };
        if ts.is_empty() || ts.len() > 12 || !ts.iter().all(u8::is_ascii_digit) {
            return Err(HmacFailure::Malformed);
        }
        if !(MIN_NONCE_LEN..=MAX_NONCE_LEN).contains(&nonce.len())
            || !nonce.iter().all(|b| b.is_ascii_graphic())
        {
            return Err(HmacFailure::Malformed);
        }
        let signatures = parse_signatures(sig)?;
        let ts_s = std::str::from_utf8(ts)
            .ok()
            .and_then(|t| t.parse::<u64>().ok())
            .ok_or(HmacFailure::Malformed)?;
        // Whole seconds on both sides: the edges of the window are inclusive.
        if ts_s.abs_diff(now_ms / 1000) > self.window_s {
            return Err(HmacFailure::OutsideWindow);
        }
        // `Host` exactly as sent (HTTP/2: the authority), the target exactly as received.
        let host: &[u8] = match headers.get(http::header::HOST) {
            Some(h) => h.as_bytes(),
            None => uri.authority().map_or(&b""[..], |a| a.as_str().as_bytes()),
        };
        let target = uri.path_and_query().map_or("/", |pq| pq.as_str());
        let mut prefix = Vec::with_capacity(96 + host.len() + target.len() + nonce.len());
        for part in [
            b"v1".as_slice(),
            method.as_str().as_bytes(),
            host,
            target.as_bytes(),
            ts,
            nonce,
        ] {
            prefix.extend_from_slice(part);
            prefix.push(b'\n');
        }
        let digest = Sha256::digest(nonce);
        let mut key = [0u8; 16];
        key.copy_from_slice(&digest[..16]);
        Ok(Pending {
            secrets: self.secrets.clone(),
            prefix,
            signatures,
            nonce: NonceKey(key),
            now_ms,
            // A replay passes the window until the end of second `ts + window`.
            expires_at_ms: ts_s
                .saturating_add(self.window_s)
                .saturating_add(1)
                .saturating_mul(1000),
            nonces,
        })
    }
}

impl Pending {
    /// Whether any configured secret signed this request with this body hash (hex SHA-256).
    fn signature_matches(&self, body_sha256: &[u8; 32]) -> bool {
        let body_hex = hex::encode(body_sha256);
        let mut matched = false;
        for secret in self.secrets.iter() {
            let Ok(mut mac) = HmacSha256::new_from_slice(secret) else {
                continue;
            };
            mac.update(&self.prefix);
            mac.update(body_hex.as_bytes());
            for sig in &self.signatures {
                // `verify_slice` compares in constant time. Keep going after a match so the time
                // taken does not tell which secret or which value matched.
                matched |= mac.clone().verify_slice(sig).is_ok();
            }
        }
        matched
    }

    /// Signature, then nonce.
    pub async fn finish(self, body_sha256: [u8; 32]) -> Result<(), HmacFailure> {
        if !self.signature_matches(&body_sha256) {
            return Err(HmacFailure::Signature);
        }
        match self
            .nonces
            .check_and_record(self.nonce, self.now_ms, self.expires_at_ms)
            .await
        {
            NonceVerdict::Fresh => Ok(()),
            NonceVerdict::Replayed => Err(HmacFailure::Replayed),
            NonceVerdict::Full => Err(HmacFailure::NonceStoreFull),
        }
    }

    /// For a body known whole (or empty).
    pub async fn finish_with_body(self, body: &[u8]) -> Result<(), HmacFailure> {
        self.finish(Sha256::digest(body).into()).await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use nthbouncer_coord::InProcessNonces;

    const SECRET: &[u8] = b"0123456789abcdef-secret";
    const NOW: u64 = 1_700_000_000_000;

    fn sign(secret: &[u8], canonical: &str) -> String {
        let mut mac = HmacSha256::new_from_slice(secret).unwrap();
        mac.update(canonical.as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    fn canonical(ts: &str, nonce: &str, body: &[u8]) -> String {
        format!(
            "v1\nPOST\np.localhost:8080\n/v1/x?b=2&a=1\n{ts}\n{nonce}\n{}",
            hex::encode(Sha256::digest(body))
        )
    }

    fn head(ts: &str, nonce: &str, sig: &str) -> (Method, Uri, HeaderMap) {
        let mut h = HeaderMap::new();
        h.insert("host", "p.localhost:8080".parse().unwrap());
        h.insert(TIMESTAMP_HEADER, ts.parse().unwrap());
        h.insert(NONCE_HEADER, nonce.parse().unwrap());
        h.insert(SIGNATURE_HEADER, sig.parse().unwrap());
        (Method::POST, "/v1/x?b=2&a=1".parse().unwrap(), h)
    }

    fn policy() -> HmacPolicy {
        HmacPolicy::new(vec![b"another-secret-0123".to_vec(), SECRET.to_vec()], 300)
    }

    fn store() -> Arc<dyn NonceStore> {
        Arc::new(InProcessNonces::new(100))
    }

    #[tokio::test]
    async fn a_signed_request_passes_once() {
        let ts = (NOW / 1000).to_string();
        let nonce = "nonce-0123456789abcdef";
        let sig = format!("v2=zz, v1={}", sign(SECRET, &canonical(&ts, nonce, b"{}")));
        let (m, u, h) = head(&ts, nonce, &sig);
        let nonces = store();
        let p = policy().begin(&m, &u, &h, NOW, nonces.clone()).unwrap();
        p.finish_with_body(b"{}").await.unwrap();
        let p = policy().begin(&m, &u, &h, NOW, nonces).unwrap();
        assert_eq!(p.finish_with_body(b"{}").await, Err(HmacFailure::Replayed));
    }

    #[tokio::test]
    async fn every_part_of_the_canonical_string_counts() {
        let ts = (NOW / 1000).to_string();
        let nonce = "nonce-0123456789abcdef";
        let good = sign(SECRET, &canonical(&ts, nonce, b"{}"));
        let (m, u, h) = head(&ts, nonce, &format!("v1={good}"));
        // Tampered body.
        let p = policy().begin(&m, &u, &h, NOW, store()).unwrap();
        assert_eq!(
            p.finish_with_body(b"{ }").await,
            Err(HmacFailure::Signature)
        );
        // Tampered query, method, host.
        let other_uri: Uri = "/v1/x?b=2&a=2".parse().unwrap();
        let p = policy().begin(&m, &other_uri, &h, NOW, store()).unwrap();
        assert_eq!(p.finish_with_body(b"{}").await, Err(HmacFailure::Signature));
        let p = policy().begin(&Method::PUT, &u, &h, NOW, store()).unwrap();
        assert_eq!(p.finish_with_body(b"{}").await, Err(HmacFailure::Signature));
        let mut h2 = h.clone();
        h2.insert("host", "p.localhost".parse().unwrap());
        let p = policy().begin(&m, &u, &h2, NOW, store()).unwrap();
        assert_eq!(p.finish_with_body(b"{}").await, Err(HmacFailure::Signature));
        // Wrong secret.
        let bad = sign(b"not-the-secret-at-all", &canonical(&ts, nonce, b"{}"));
        let (m, u, h) = head(&ts, nonce, &format!("v1={bad}"));
        let p = policy().begin(&m, &u, &h, NOW, store()).unwrap();
        assert_eq!(p.finish_with_body(b"{}").await, Err(HmacFailure::Signature));
    }

    /// The README's curl/openssl recipe produced this signature.
    #[tokio::test]
    async fn an_openssl_signature_verifies() {
        let mut h = HeaderMap::new();
        h.insert("host", "p.localhost:8080".parse().unwrap());
        h.insert(TIMESTAMP_HEADER, "1700000000".parse().unwrap());
        h.insert(NONCE_HEADER, "0123456789abcdef0123".parse().unwrap());
        h.insert(
            SIGNATURE_HEADER,
            "v1=a3134113ef42fd45bd891ea8c3b6507ad2cb18c3e935c3e0f09f71a978900944"
                .parse()
                .unwrap(),
        );
        let uri: Uri = "/v1/x?a=1&b=two".parse().unwrap();
        let p = HmacPolicy::new(vec![b"test-secret-0123456789".to_vec()], 300);
        let pending = p.begin(&Method::POST, &uri, &h, NOW, store()).unwrap();
        assert_eq!(pending.finish_with_body(br#"{"a":1}"#).await, Ok(()));
    }

    #[test]
    fn the_head_is_checked_before_the_body() {
        let p = policy();
        let nonce = "nonce-0123456789abcdef";
        let sig = format!("v1={}", "ab".repeat(32));
        let at = |ts: u64| {
            let (m, u, h) = head(&ts.to_string(), nonce, &sig);
            p.begin(&m, &u, &h, NOW, store()).err()
        };
        assert_eq!(at(NOW / 1000 - 300), None);
        assert_eq!(at(NOW / 1000 + 300), None);
        assert_eq!(at(NOW / 1000 - 301), Some(HmacFailure::OutsideWindow));
        assert_eq!(at(NOW / 1000 + 301), Some(HmacFailure::OutsideWindow));
        let ts = (NOW / 1000).to_string();
        let bad = |ts: &str, nonce: &str, sig: &str| {
            let (m, u, h) = head(ts, nonce, sig);
            p.begin(&m, &u, &h, NOW, store()).err()
        };
        assert_eq!(bad("12a", nonce, &sig), Some(HmacFailure::Malformed));
        assert_eq!(bad(&ts, "short", &sig), Some(HmacFailure::Malformed));
        assert_eq!(bad(&ts, nonce, "v1=abc"), Some(HmacFailure::Malformed));
        assert_eq!(bad(&ts, nonce, "v2=abc"), Some(HmacFailure::Malformed));
        let many = vec![sig.clone(); MAX_SIGNATURES + 1].join(",");
        assert_eq!(bad(&ts, nonce, &many), Some(HmacFailure::Malformed));
        let (m, u, mut h) = head(&ts, nonce, &sig);
        h.remove(NONCE_HEADER);
        assert_eq!(
            p.begin(&m, &u, &h, NOW, store()).err(),
            Some(HmacFailure::Missing)
        );
        h.append(NONCE_HEADER, nonce.parse().unwrap());
        h.append(NONCE_HEADER, nonce.parse().unwrap());
        assert_eq!(
            p.begin(&m, &u, &h, NOW, store()).err(),
            Some(HmacFailure::Malformed)
        );
    }
}
