//! Support for the access-policy tests: a request signer written from SPEC §9 (independent of
//! the server's), a recording upstream that tells whether a request body arrived complete, a
//! key server for JWKS and Cloudflare certs, and throwaway test keys.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use hmac::{Hmac, Mac};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};

use crate::loopback::serve_http;

/// HMAC-SHA256 over the canonical string of SPEC §9, as hex.
pub fn sign(
    secret: &str,
    method: &str,
    host: &str,
    target: &str,
    timestamp: &str,
    nonce: &str,
    body: &[u8],
) -> String {
    let canonical = format!(
        "v1\n{method}\n{host}\n{target}\n{timestamp}\n{nonce}\n{}",
        hex::encode(Sha256::digest(body))
    );
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(canonical.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// A fresh nonce (32 hex chars).
pub fn nonce() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

/// What the recording upstream saw of one request.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    pub target: String,
    pub headers: http::HeaderMap,
    pub body: Vec<u8>,
    /// The body ended cleanly (not aborted).
    pub complete: bool,
}

/// An upstream that reads every request body to its end (or abort) and records it.
pub struct Recorder {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Recorded>>>,
}

impl Recorder {
    pub async fn start() -> Recorder {
        let seen: Arc<Mutex<Vec<Recorded>>> = Arc::default();
        let s = seen.clone();
        let addr = serve_http(move |req: Request<Incoming>| {
            let s = s.clone();
            async move {
                let method = req.method().to_string();
                let target = req.uri().to_string();
                let headers = req.headers().clone();
                let mut body = req.into_body();
                let mut bytes = Vec::new();
                let mut complete = true;
                while let Some(frame) = body.frame().await {
                    match frame {
                        Ok(f) => {
                            if let Some(d) = f.data_ref() {
                                bytes.extend_from_slice(d);
                            }
                        }
                        Err(_) => {
                            complete = false;
                            break;
                        }
                    }
                }
                let len = bytes.len();
                s.lock().push(Recorded {
                    method,
                    target,
                    headers,
                    body: bytes,
                    complete,
                });
                Response::new(Full::new(Bytes::from(format!("received {len}"))))
            }
        })
        .await;
        Recorder { addr, seen }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Recorded> {
        self.seen.lock().clone()
    }

    /// Requests whose body arrived complete.
    pub fn completed(&self) -> usize {
        self.seen.lock().iter().filter(|r| r.complete).count()
    }
}

/// A loopback server answering every GET with the current document (a JWKS, or Cloudflare's
/// certs), counting the fetches.
pub struct KeyServer {
    pub addr: SocketAddr,
    pub document: Arc<Mutex<String>>,
    pub fetches: Arc<AtomicU64>,
}

impl KeyServer {
    pub async fn start(document: String) -> KeyServer {
        let doc = Arc::new(Mutex::new(document));
        let fetches = Arc::new(AtomicU64::new(0));
        let (d, f) = (doc.clone(), fetches.clone());
        let addr = serve_http(move |_req| {
            let (d, f) = (d.clone(), f.clone());
            async move {
                f.fetch_add(1, Ordering::SeqCst);
                let body = d.lock().clone();
                let mut r = Response::new(Full::new(Bytes::from(body)));
                *r.status_mut() = StatusCode::OK;
                r.headers_mut()
                    .insert("content-type", "application/json".parse().unwrap());
                r
            }
        })
        .await;
        KeyServer {
            addr,
            document: doc,
            fetches,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn set(&self, document: String) {
        *self.document.lock() = document;
    }

    pub fn fetches(&self) -> u64 {
        self.fetches.load(Ordering::SeqCst)
    }
}

/// A JWK (public part) of an RSA key, as JWKS endpoints publish it.
pub fn rsa_jwk(key: &jwt_simple::prelude::RS256KeyPair, kid: &str) -> serde_json::Value {
    use base64::prelude::*;
    let c = key.public_key().to_components();
    serde_json::json!({
        "kty": "RSA",
        "use": "sig",
        "alg": "RS256",
        "kid": kid,
        "n": BASE64_URL_SAFE_NO_PAD.encode(&c.n),
        "e": BASE64_URL_SAFE_NO_PAD.encode(&c.e),
    })
}

/// A JWKS document of `keys`.
pub fn jwks(keys: &[serde_json::Value]) -> String {
    serde_json::json!({ "keys": keys }).to_string()
}

/// A token with `alg: none` and no signature, built by hand (no library mints one).
pub fn unsigned_token(claims: &serde_json::Value) -> String {
    use base64::prelude::*;
    let header = BASE64_URL_SAFE_NO_PAD.encode(br#"{"alg":"none","typ":"JWT"}"#);
    let payload = BASE64_URL_SAFE_NO_PAD.encode(claims.to_string());
    format!("{header}.{payload}.")
}

/// A throwaway RSA 2048 test key (PKCS#8), generated for these tests only.
pub const RSA_KEY_1: &str = r"-----BEGIN PRIVATE KEY-----
MIIEvgIBADANBgkqhkiG9w0BAQEFAASCBKgwggSkAgEAAoIBAQDN/W1lq08BrHyj
i1kTVk5nZOdG3A/TcWTSAW7LrGFCoB80eCWGVZf/cubHnR27WOqr3J/SMLuWOCxd
Rm+RUsjmn1zASS2xF6QL9VXEBdlUhcf8AQYYnUWtqmUR2u9RiDHZOb6pkQnq/sgZ
BantL5LZR2/MaC+kzAeqIyH8NVlqb7w7Whr+/z8MjFvdrzl4t4Nfv39+YqXdfkGz
jQRVy36Dz3B5/uJelw23qz3ZZ4WKmi3M9e053JZ5t5CWIYwGhHBJbF0dtq6YqSet
OIpSOJewpWq/pRS9XQuHVJ+XZvuCTXGtPCT/AfH6G4wMzhNPrxVHSOQI/7Mh5tqb
R3NQo2GHAgMBAAECggEAU8crW6rZVr5u8NsnbtBu0el9kNnGzAH19d2kUMz6v6y9
FEt7Q5ADYl86klwJ8B0BUMXJ8KRmXvnYvVT84lePoxCUmhYJMdoCG+T7rV6Nni1N
AWbvMkqgwLmpIqJvLDNextEQBQoaxQs7mcWub2umZ52A0FtdaUKcKWvhkiCmjb1K
KaZ7qJ1UX5GeegQT+QXX+R8P/vexIP46bi2RhqcKBTdQXYfr2nbDirxa5w8UHp20
BQBoL4we/Vkj8mXJZUGMdwxWaZCT3bKaErqJXWgODHCkI345XDYalm5D90xLRkQv
voho2H1YEq3tZQfTDOC9oTn5N/ywrnANuIyQq4abhQKBgQDsq5k3DKcFgpxl6C/w
FQiVGULfc+arxU/DNgxZcdh8rRuw72p16XdsbSeVOpjV26HbEfCXlpnMLqmAGERI
rlMqzzvSu/Nz13dzjLPTHrwAkjyP3/ElyOWns4kC+bw2gflTUi4mTWf3TfychHAE
Nn8JCWLEcrGjrrWxWfcnstwBewKBgQDe0FnlFXaR5m14bHExPjVzJIe6CPDj4LQJ
+b/swoykW1Xfy1lWr3vDy3krWyPO5VZag0+zD1wt1VK7oIFMXNO95qJ0Jg/W61Vs
rUY+Nxu5ymhoWZL95mVzbedkuPq8JAJdsI5jL3SaZxC5q/WLFsnhkeDuyGg05+SD
CTFH3WykZQKBgQCF+i5mB3eVmvbGicZ5dq7BGOfOb2Ip4yzgKXycNeKD0ctXQnFW
BrBgZPp/dAiJKChcR6+XYN33xIKXzST6sBTMqzwGc/fBoDwy4Xf7D+8Fs8Ms/20Y
Ir4/TVdGo/F0OefWzzLo4/DzAub6A88V03Pevb130CXXr1OT7oYHpyz8eQKBgQCX
NrVbeEaA2+49RPNI5RwnKYqHYdwB+xSUlI+BIcOLI4VTHVFjODL5fRSdrPvPROtn
ACjNr8XyQQ0l0tcNOQ5mmah0xQQI6quN1saOIJ5LZ6eV8fyFHaCKRvM78yIPHy0P
4muvupwa0YmTSLWakHuv/221AANgrGPz3gA48nfx1QKBgDAH7NUAjzRhJEAwHz5c
SOGFCLySSaWusnZTHlH662Y5kHKjZ9jCV0VMddw1Ezq+Pi4bOmvdUkm53soQMOXB
a7f9HbQ/Ea0mn0iUbePvw1cqhYeuuSjB9ei1R2PGR8S0qp+NpweP7EM7djiV9LJC
JFmu0exMOnVa1hJ8CxYOYuaq
-----END PRIVATE KEY-----";

/// A throwaway RSA 2048 test key (PKCS#8), generated for these tests only.
pub const RSA_KEY_2: &str = r"-----BEGIN PRIVATE KEY-----
MIIEvgIBADANBgkqhkiG9w0BAQEFAASCBKgwggSkAgEAAoIBAQC7WYAGBEpTuYYh
EDh+cn9BkTY53uM2A2Neb2SjjU+P//9e/heDptC40EuZmg8/OYqmFj9yABLg65zO
r4GTR6TxonwL0ERsIMp/h78w/DTcJFUfb+bTbs4ANChGKUG/fueO3WrtxMbpsRb2
WZPmUM1nUmY6ikilH0oIn3gecNjm61MxUFf392MP9X33d57scLmbAlxwoSiN0/JY
lm9uzcdZk4bH4bhv0iDupW1dfS+7TVuPXA80Zr5TvUE78X54OgJrXyJ8ceAD0dIA
+OB6cGEFEgc694F4GzoLxMG+EjScswruD0pXWCMcRM+DJ8j2BErY1/XIQsrJwO3F
cfhphbitAgMBAAECggEAKxZn57pX386UxwjkfUxW8Rz1BDU7O0JnOaJT2nuW907Q
jCfS/5+/dCnPoUl5xTg2J4GJYO4caWc2vqBFpDo/eKU+czcYbWfTOqZdNeZjP9gJ
TbweMbVTol9cfdpiOSj2F3jb7Ugq2Tc1yT2L0tX1j5Q3V7JTB8rc64PFi/a3I9BI
/+358F+zZ+xM8aHel69PeyGx1ki9rxZR2flXDPR/S+vE4wyj6eIYkX8soJCbEnRL
SsrNAEsNgQxwYfLUZWddAb0twEjziEM5vyZZtLjm4itUe91nGuAc85OuSpvprD4/
Dk0GThuPP7WqRgPrqwr3DLZeCB0Tl8jEXEf1DTvaYQKBgQD1usvThJTck185Fqm4
Vumxj20nfYgSM58O6I34sDVSAWJ4Mb9jfP1jTzdZQDCf2uILN4tbhi0QJhQtJkg5
hVFlB6Gdp1kLxW4w9MKY7OQjzrJzHobYsLc9jxWy4GiH0piCu6CyTdQ0qtTQwmcM
xJi8gesVUH0YVhyC5RCEaZeInQKBgQDDLg/V6UoWmUMOLjKbYB8Br31PYMHwpBs+
JbJitvXNI5+NqwqqGa7drfkhEdJwyzmHIkC3+d+qY5q8dGFtXkFX/1U1UdqO6Lbw
MqwE3sh/o0qzsMs0XtAWaShl6laba4sb9BjlfA2aMe8BjWWPDqIrGH3NU5oNPJSl
FPFKMovLUQKBgG82nJtdjPYLqPQwgp3QkDHxhOhzkwsR2/ImZGLidS9pOwTFFybS
4ed5acZ2G8uth9Klz+ebYXfGlCkfA18tLHp6KrYskEuYjleP3ybRSCvAl9ksPsGB
sV0mDh8IG6clNCsu+frY6KrxiiH1aihILgxbDGd4JzXFe1/uhjw3ggKtAoGBAKe3
Hf5nT7WpjvhRdEUVTK+LF7es4hohOhOmGuo+Y2saMFFw52IRXbS5ePkUsmsgBlf7
c/djLPHiUyWbL9jmBGpUSujdZFwm1oQCVtR8h3c+XsOXqJVg35hSVld1DWTR/aBQ
mVAg0CNuwvznfpx2K52ylu9n5ll3dBeCrnBejMdxAoGBALK03iiF40cLXJUlCbKD
APxF7AO9irAJ2A4rWHayNVXrdwAyWwb1teBbXWoGpSVdIFxU10txlxZ3H1zTS16w
XMXOBUq/gbkGlrCmbFH+si6aaPFkzXM6p3rr6Ui2BuHae8U+hH9XMMTdH8LdXCP0
krhNyqckZPeDUfwv9kwecLNY
-----END PRIVATE KEY-----";

/// A throwaway P-256 test key (PKCS#8), generated for these tests only.
pub const EC_KEY_1: &str = r"-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgAIu1xi511rlBWUVT
DLFcoeb6JB3ZE3jrrZogMXC+GuWhRANCAAQ1kW32g2gZOcGXNy8NmAbknWt67NdK
zqZsdMk5oSqzbpyNRhFoex/59AldqaHZFsb9nL51QlwMXtnxBkC2X+aY
-----END PRIVATE KEY-----";
