//! Request signing for pools with `access.hmac` (SPEC §9).
//!
//! Each request carries `X-Nthpool-Timestamp` (unix seconds), `X-Nthpool-Nonce` (new for every
//! request) and `X-Nthpool-Signature: v1=<hex>`, the HMAC-SHA256 with the pool's secret of
//!
//! ```text
//! v1\n{METHOD}\n{Host header as sent}\n{path?query as sent}\n{timestamp}\n{nonce}\n{hex sha256(body)}
//! ```
//!
//! ```no_run
//! use nthbouncer_client::signing::Signer;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let signer = Signer::new("the pool's signing secret");
//! let http = reqwest::Client::new();
//! let mut req = http
//!     .post("http://demo.localhost:8080/v1/chat/completions")
//!     .header("x-nthpool-key", "nb_live_…")
//!     .body(r#"{"model":"demo","messages":[]}"#)
//!     .build()?;
//! signer.sign_request(&mut req)?;
//! let resp = http.execute(req).await?;
//! # Ok(())
//! # }
//! ```
//!
//! A streamed body cannot be signed by [`Signer::sign_request`]; hash it yourself and use
//! [`Signer::sign_digest`].

use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderValue};
use sha2::{Digest, Sha256};

pub const TIMESTAMP_HEADER: &str = "x-nthpool-timestamp";
pub const NONCE_HEADER: &str = "x-nthpool-nonce";
pub const SIGNATURE_HEADER: &str = "x-nthpool-signature";

/// Why a request could not be signed.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("the request body is a stream; hash it and use Signer::sign_digest")]
    StreamedBody,
    #[error("the request URL has no host")]
    NoHost,
}

/// The three headers of one signed request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignedHeaders {
    /// Unix seconds.
    pub timestamp: String,
    pub nonce: String,
    /// `v1=<hex>`.
    pub signature: String,
}

impl SignedHeaders {
    /// Sets the headers, replacing any earlier signature.
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (name, value) in self.pairs() {
            if let Ok(v) = HeaderValue::from_str(value) {
                headers.insert(name, v);
            }
        }
    }

    /// `(header name, value)` pairs, for clients other than reqwest.
    pub fn pairs(&self) -> [(&'static str, &str); 3] {
        [
            (TIMESTAMP_HEADER, &self.timestamp),
            (NONCE_HEADER, &self.nonce),
            (SIGNATURE_HEADER, &self.signature),
        ]
    }
}

/// Signs requests with one secret.
#[derive(Clone)]
pub struct Signer {
    secret: Vec<u8>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Signer { secret: <redacted> }")
    }
}

/// A fresh nonce: 128 random bits as 32 hex characters.
pub fn new_nonce() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Signer {
    pub fn new(secret: impl AsRef<[u8]>) -> Self {
        Signer {
            secret: secret.as_ref().to_vec(),
        }
    }

    /// Signs with the current time and a fresh nonce. `host` is the `Host` header exactly as it
    /// will be sent (with its port, if any); `path_and_query` the request target as sent.
    pub fn sign(
        &self,
        method: &str,
        host: &str,
        path_and_query: &str,
        body: &[u8],
    ) -> SignedHeaders {
        self.sign_at(method, host, path_and_query, body, unix_now(), &new_nonce())
    }

    /// Signs with a given timestamp and nonce.
    pub fn sign_at(
        &self,
        method: &str,
        host: &str,
        path_and_query: &str,
        body: &[u8],
        timestamp: u64,
        nonce: &str,
    ) -> SignedHeaders {
        let digest: [u8; 32] = Sha256::digest(body).into();
        self.sign_digest(method, host, path_and_query, &digest, timestamp, nonce)
    }

    /// Signs a request whose body's SHA-256 is already known (a streamed body).
    pub fn sign_digest(
        &self,
        method: &str,
        host: &str,
        path_and_query: &str,
        body_sha256: &[u8; 32],
        timestamp: u64,
        nonce: &str,
    ) -> SignedHeaders {
        let timestamp = timestamp.to_string();
        let canonical = format!(
            "v1\n{method}\n{host}\n{path_and_query}\n{timestamp}\n{nonce}\n{}",
            hex::encode(body_sha256)
        );
        // HMAC takes keys of any length: this cannot fail.
        let signature = match Hmac::<Sha256>::new_from_slice(&self.secret) {
            Ok(mut mac) => {
                mac.update(canonical.as_bytes());
                hex::encode(mac.finalize().into_bytes())
            }
            Err(_) => String::new(),
        };
        SignedHeaders {
            timestamp,
            nonce: nonce.to_string(),
            signature: format!("v1={signature}"),
        }
    }

    /// Signs a built reqwest request in place (current time, fresh nonce). The host is the
    /// request's `Host` header if set, else the URL's host and explicit port, as reqwest sends it.
    pub fn sign_request(&self, req: &mut reqwest::Request) -> Result<(), SignError> {
        let body: &[u8] = match req.body() {
            None => b"",
            Some(b) => b.as_bytes().ok_or(SignError::StreamedBody)?,
        };
        let url = req.url();
        let host = match req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
        {
            Some(h) => h.to_string(),
            None => {
                let host = url.host_str().ok_or(SignError::NoHost)?;
                match url.port() {
                    Some(port) => format!("{host}:{port}"),
                    None => host.to_string(),
                }
            }
        };
        let target = match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_string(),
        };
        let signed = self.sign(req.method().as_str(), &host, &target, body);
        signed.apply(req.headers_mut());
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const SECRET: &str = "test-secret-0123456789";
    const NONCE: &str = "0123456789abcdef0123";

    /// Computed with the README's openssl recipe.
    #[test]
    fn signatures_match_the_openssl_recipe() {
        let s = Signer::new(SECRET);
        let h = s.sign_at(
            "POST",
            "p.localhost:8080",
            "/v1/x?a=1&b=two",
            br#"{"a":1}"#,
            1_700_000_000,
            NONCE,
        );
        assert_eq!(
            h.signature,
            "v1=a3134113ef42fd45bd891ea8c3b6507ad2cb18c3e935c3e0f09f71a978900944"
        );
        assert_eq!(h.timestamp, "1700000000");
        let h = s.sign_at("GET", "p.localhost:8080", "/", b"", 1_700_000_000, NONCE);
        assert_eq!(
            h.signature,
            "v1=99befaf150091ddfacd933cc30097635c3be2f86cc8833a67c0247ad52c01864"
        );
    }

    #[test]
    fn a_reqwest_request_is_signed_as_it_will_be_sent() {
        let s = Signer::new(SECRET);
        let client = reqwest::Client::new();
        let mut req = client
            .post("http://p.localhost:8080/v1/x?a=1&b=two")
            .body(r#"{"a":1}"#)
            .build()
            .unwrap();
        s.sign_request(&mut req).unwrap();
        let ts: u64 = req.headers()[TIMESTAMP_HEADER]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let nonce = req.headers()[NONCE_HEADER].to_str().unwrap().to_string();
        assert_eq!(nonce.len(), 32);
        let expected = s.sign_at(
            "POST",
            "p.localhost:8080",
            "/v1/x?a=1&b=two",
            br#"{"a":1}"#,
            ts,
            &nonce,
        );
        assert_eq!(req.headers()[SIGNATURE_HEADER], expected.signature.as_str());

        // An explicit Host header wins over the URL's (a gateway reached by IP).
        let mut req = client
            .get("http://127.0.0.1:8080/")
            .header("host", "p.localhost")
            .build()
            .unwrap();
        s.sign_request(&mut req).unwrap();
        let ts: u64 = req.headers()[TIMESTAMP_HEADER]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let nonce = req.headers()[NONCE_HEADER].to_str().unwrap().to_string();
        let expected = s.sign_at("GET", "p.localhost", "/", b"", ts, &nonce);
        assert_eq!(req.headers()[SIGNATURE_HEADER], expected.signature.as_str());
        assert!(!format!("{s:?}").contains(SECRET));
    }
}
