//! TLS for tests: certificate authorities and certificates made at test time (rcgen), and a
//! rustls client (hyper) that trusts only the roots it is given, may present a client
//! certificate, speaks HTTP/1.1 or HTTP/2, and resolves every name to loopback.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::KEY;

pub use rcgen::ExtendedKeyUsagePurpose;

/// A certificate authority made for one test.
pub struct Ca {
    pub cert: rcgen::Certificate,
    pub key: KeyPair,
}

/// A certificate and its key, as PEM.
#[derive(Clone)]
pub struct Leaf {
    pub cert: String,
    pub key: String,
}

/// A server certificate whose key is RSA (2048 bits), with that one key written both ways a
/// PEM file holds it: PKCS#8 (`BEGIN PRIVATE KEY`) and PKCS#1 (`BEGIN RSA PRIVATE KEY`).
pub struct RsaLeaf {
    pub cert: String,
    pub pkcs8: String,
    pub pkcs1: String,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    pub fn issue(&self, names: &[&str], cn: &str, usage: ExtendedKeyUsagePurpose) -> Leaf {
        let mut p = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        p.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// A server certificate for `names` on a fresh RSA key. The key is made by the `rsa` crate
    /// (rcgen on ring cannot generate RSA keys, only sign with them); 2048 bits, the least
    /// webpki accepts. CPU-heavy (a second or more in a debug build): call it off the runtime.
    pub fn server_rsa(&self, names: &[&str]) -> RsaLeaf {
        use rsa::pkcs1::EncodeRsaPrivateKey;
        use rsa::pkcs8::{EncodePrivateKey, LineEnding};
        let rsa = rsa::RsaPrivateKey::new(&mut rand::rngs::OsRng, 2048).unwrap();
        let pkcs8 = rsa.to_pkcs8_pem(LineEnding::LF).unwrap().to_string();
        let pkcs1 = rsa.to_pkcs1_pem(LineEnding::LF).unwrap().to_string();
        let key = KeyPair::from_pkcs8_pem_and_sign_algo(&pkcs8, &rcgen::PKCS_RSA_SHA256).unwrap();
        let mut p = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
        p.distinguished_name.push(DnType::CommonName, names[0]);
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        RsaLeaf {
            cert: cert.pem(),
            pkcs8,
            pkcs1,
        }
    }

    pub fn server(&self, names: &[&str]) -> Leaf {
        self.issue(names, names[0], ExtendedKeyUsagePurpose::ServerAuth)
    }

    pub fn client(&self, cn: &str) -> Leaf {
        self.issue(&[], cn, ExtendedKeyUsagePurpose::ClientAuth)
    }
}

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Writes a leaf's two files; returns their paths as TOML strings.
pub fn write_leaf(dir: &Path, name: &str, leaf: &Leaf) -> (String, String) {
    let c = write(dir, &format!("{name}.crt"), &leaf.cert);
    let k = write(dir, &format!("{name}.key"), &leaf.key);
    (c.display().to_string(), k.display().to_string())
}

/// Every name resolves to loopback: `https://p.localhost:PORT` reaches the gateway with the
/// pool's name as SNI and `Host`, as a real client would send them.
#[derive(Clone)]
pub struct Loopback;

impl tower::Service<Name> for Loopback {
    type Response = std::iter::Once<SocketAddr>;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Name) -> Self::Future {
        std::future::ready(Ok(std::iter::once(SocketAddr::from(([127, 0, 0, 1], 0)))))
    }
}

pub type Https = Client<hyper_rustls::HttpsConnector<HttpConnector<Loopback>>, Full<Bytes>>;

#[derive(Clone, Copy, PartialEq)]
pub enum Alpn {
    Http1,
    H2,
}

/// A rustls client trusting `roots` only, presenting `identity` if given, speaking `alpn`;
/// `sni` overrides the name sent (else the URL's host).
pub fn client(roots: &[&str], identity: Option<&Leaf>, alpn: Alpn, sni: Option<&str>) -> Https {
    let mut store = rustls::RootCertStore::empty();
    for pem in roots {
        for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            store.add(c.unwrap()).unwrap();
        }
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(store);
    let config = match identity {
        Some(leaf) => builder
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
                    .map(Result::unwrap)
                    .collect(),
                PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let mut http = HttpConnector::new_with_resolver(Loopback);
    http.enforce_http(false);
    let b = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only();
    let b = match sni {
        Some(name) => b.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(
            ServerName::try_from(name.to_string()).unwrap(),
        )),
        None => b,
    };
    let https = match alpn {
        Alpn::Http1 => b.enable_http1().wrap_connector(http),
        Alpn::H2 => b.enable_http2().wrap_connector(http),
    };
    Client::builder(TokioExecutor::new())
        .http2_only(alpn == Alpn::H2)
        .build(https)
}

/// GET `https://{host}:{port}{path}` with the pool key: status, version, body.
pub async fn get(
    c: &Https,
    host: &str,
    port: u16,
    path: &str,
) -> Result<(u16, http::Version, String), String> {
    send(c, http::Method::GET, host, port, path, "").await
}

/// A request with the pool key to `https://{host}:{port}{path}`: status, version, body.
pub async fn send(
    c: &Https,
    method: http::Method,
    host: &str,
    port: u16,
    path: &str,
    body: &str,
) -> Result<(u16, http::Version, String), String> {
    let req = http::Request::builder()
        .method(method)
        .uri(format!("https://{host}:{port}{path}"))
        .header("x-nthpool-key", KEY)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = c.request(req).await.map_err(|e| format!("{e:?}"))?;
    let (status, version) = (resp.status().as_u16(), resp.version());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Ok((status, version, String::from_utf8_lossy(&body).into_owned()))
}
