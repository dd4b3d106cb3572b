//! TLS (SPEC §12) end to end over loopback, with certificates made at test time (rcgen): HTTPS
//! and HTTP/2 on the listener, certificates by SNI, TLS 1.1 refused, certificates swapped by a
//! reload while a connection stays open, RSA keys (PKCS#8 and PKCS#1), client certificates as a
//! pool's access policy (and the `421` that keeps a connection opened for one host from being
//! reused for such a pool), and an origin behind a private CA reached with `[pools.upstream_tls]`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use nthbouncer_testkit::tls::{
    client, get, write, write_leaf, Alpn, Ca, ExtendedKeyUsagePurpose, Https, Leaf,
};
use nthbouncer_testkit::{gateway, pool_toml, Gateway, Upstream, ADMIN_TOKEN};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The `[server.tls]` of a gateway whose default certificate (from `ca`) covers the API host and
/// the pools `p`, `m` and `n`, and `extra` (more TOML for `[server.tls]`).
fn server_tls(dir: &Path, ca: &Ca, extra: &str) -> String {
    let leaf = ca.server(&["p.localhost", "m.localhost", "n.localhost", "api.localhost"]);
    let (c, k) = write_leaf(dir, "server", &leaf);
    format!("[server.tls]\ncert_file = \"{c}\"\nkey_file = \"{k}\"\n{extra}")
}

fn port(gw: &Gateway) -> u16 {
    gw.running.addr.port()
}

/// A gateway on TLS (the default certificate from `ca`) with pool `p` in front of `up`.
async fn tls_gateway(dir: &Path, ca: &Ca, up: &Upstream) -> Gateway {
    gateway(&(server_tls(dir, ca, "") + &pool_toml("p", &up.url(), "limit = 2"))).await
}

/// A client that trusts only `ca` and shows no certificate.
fn trusting(ca: &Ca, alpn: Alpn) -> Https {
    client(&[&ca.pem()], None, alpn, None)
}

/// GET `path` on `host` through `c`: status and HTTP version (the handshake must succeed).
async fn at(c: &Https, gw: &Gateway, host: &str, path: &str) -> (u16, http::Version) {
    let (status, version, _) = get(c, host, port(gw), path).await.unwrap();
    (status, version)
}

#[tokio::test]
async fn https_and_h2_reach_the_upstream() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test root");
    let gw = tls_gateway(dir.path(), &ca, &up).await;
    let (h1, h2) = (trusting(&ca, Alpn::Http1), trusting(&ca, Alpn::H2));
    let http_11 = at(&h1, &gw, "p.localhost", "/v1/a").await;
    assert_eq!(http_11, (200, http::Version::HTTP_11));
    let http_2 = at(&h2, &gw, "p.localhost", "/v1/b").await;
    assert_eq!(http_2, (200, http::Version::HTTP_2));
    assert_eq!(up.total(), 2, "both reached the upstream");
    // The API host too, over h2.
    assert_eq!(at(&h2, &gw, "api.localhost", "/healthz").await.0, 200);
    // Plain HTTP on a TLS listener is not served.
    let plain = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{}/healthz", port(&gw)))
        .header("host", "api.localhost")
        .send()
        .await;
    assert!(plain.is_err() || plain.unwrap().status() != 200);
}

#[tokio::test]
async fn sni_picks_the_certificate_and_a_wrong_name_is_refused_by_the_client() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (ca, other_ca) = (Ca::new("main root"), Ca::new("customer root"));
    let custom = other_ca.server(&["api.customer.example"]);
    let (c, k) = write_leaf(dir.path(), "custom", &custom);
    let extra = format!(
        "[[server.tls.certs]]\nnames = [\"api.customer.example\"]\ncert_file = \"{c}\"\nkey_file = \"{k}\"\n"
    );
    let toml = server_tls(dir.path(), &ca, &extra)
        + &pool_toml("p", &up.url(), "limit = 2").replace(
            "[pools.concurrency]",
            "custom_domains = [\"api.customer.example\"]\n[pools.concurrency]",
        );
    let gw = gateway(&toml).await;

    // The custom domain is served its own certificate (only the customer's CA is trusted).
    let customer = client(&[&other_ca.pem()], None, Alpn::Http1, None);
    let (status, _, _) = get(&customer, "api.customer.example", port(&gw), "/v1/x")
        .await
        .unwrap();
    assert_eq!(status, 200);
    // The pool's own name gets the default certificate, which that client does not trust.
    assert!(get(&customer, "p.localhost", port(&gw), "/v1/x")
        .await
        .is_err());
    // A name no certificate covers gets the default one, and the client refuses it.
    let main = client(&[&ca.pem()], None, Alpn::Http1, Some("nowhere.example"));
    let refused = get(&main, "p.localhost", port(&gw), "/v1/x")
        .await
        .unwrap_err();
    assert!(
        refused.contains("NotValidForName") || refused.contains("certificate"),
        "{refused}"
    );
    assert_eq!(up.total(), 1);
}

/// A TLS 1.1 ClientHello (no `supported_versions`, legacy version 3.2, one TLS 1.0 suite).
fn tls11_client_hello() -> Vec<u8> {
    let mut body = vec![0x03, 0x02];
    body.extend_from_slice(&[7u8; 32]); // random
    body.push(0); // session id
    body.extend_from_slice(&[0x00, 0x02, 0x00, 0x2f]); // TLS_RSA_WITH_AES_128_CBC_SHA
    body.extend_from_slice(&[0x01, 0x00]); // null compression
    let mut hs = vec![0x01, 0x00, 0x00, body.len() as u8];
    hs.extend_from_slice(&body);
    let mut record = vec![0x16, 0x03, 0x02, 0x00, hs.len() as u8];
    record.extend_from_slice(&hs);
    record
}

#[tokio::test]
async fn tls_1_1_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("root");
    let gw = gateway(&server_tls(dir.path(), &ca, "")).await;
    let mut s = tokio::net::TcpStream::connect(gw.running.addr)
        .await
        .unwrap();
    s.write_all(&tls11_client_hello()).await.unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer).await;
    // An alert record (content type 21), never a ServerHello (22).
    assert_eq!(answer.first(), Some(&0x15), "{answer:?}");
}

#[tokio::test]
async fn a_reload_swaps_certificates_for_new_connections_only() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (old_ca, new_ca) = (Ca::new("old root"), Ca::new("new root"));
    let gw = tls_gateway(dir.path(), &old_ca, &up).await;
    let tls = gw.running.state.tls.clone().expect("TLS is on");

    // One HTTP/2 connection, opened before the swap.
    let open = trusting(&old_ca, Alpn::H2);
    assert_eq!(at(&open, &gw, "p.localhost", "/v1/1").await.0, 200);

    let leaf = new_ca.server(&["p.localhost", "api.localhost"]);
    write_leaf(dir.path(), "server", &leaf);
    tls.reload().unwrap();

    // The open connection goes on (a new one would be refused: its certificate is the new CA's).
    assert_eq!(at(&open, &gw, "p.localhost", "/v1/2").await.0, 200);
    let fresh_old = trusting(&old_ca, Alpn::H2);
    assert!(get(&fresh_old, "p.localhost", port(&gw), "/v1/3")
        .await
        .is_err());
    let fresh_new = trusting(&new_ca, Alpn::Http1);
    assert_eq!(at(&fresh_new, &gw, "p.localhost", "/v1/4").await.0, 200);

    // A bad file changes nothing: the error names the key, the new certificate stays.
    write(dir.path(), "server.crt", "not a certificate");
    let e = tls.reload().unwrap_err();
    assert_eq!(e.key, "server.tls.cert_file", "{e}");
    let again = trusting(&new_ca, Alpn::Http1);
    assert_eq!(at(&again, &gw, "p.localhost", "/v1/5").await.0, 200);

    // A re-read config may name other files: they are used, and reloaded from then on.
    let third_ca = Ca::new("third root");
    let (cert, key) = write_leaf(dir.path(), "third", &third_ca.server(&["p.localhost"]));
    let spec = nthbouncer_config::ServerTlsSpec {
        cert_file: cert.into(),
        key_file: key.into(),
        certs: Vec::new(),
    };
    tls.use_spec(&spec).unwrap();
    tls.reload().unwrap();
    let third = trusting(&third_ca, Alpn::Http1);
    assert_eq!(at(&third, &gw, "p.localhost", "/v1/6").await.0, 200);
    assert_eq!(up.total(), 5);
}

/// An HTTPS origin with a certificate from `ca` for `name`; with `client_ca`, it requires a
/// client certificate from it. Answers every request with `origin ok`.
async fn https_origin(ca: &Ca, name: &str, client_ca: Option<&Ca>) -> SocketAddr {
    let leaf = ca.server(&[name]);
    let certs: Vec<_> = CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match client_ca {
        Some(c) => {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(c.cert.der().clone()).unwrap();
            let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .unwrap();
            builder.with_client_cert_verifier(v)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder.with_single_cert(certs, key).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else {
                    return;
                };
                let svc = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                        Bytes::from_static(b"origin ok"),
                    )))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_origin_behind_a_private_ca_is_reached_with_upstream_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (private, client_ca) = (Ca::new("corp root"), Ca::new("corp clients"));
    let origin = https_origin(&private, "origin.corp.internal", None).await;
    let mtls_origin = https_origin(&private, "origin.corp.internal", Some(&client_ca)).await;
    let ca_file = write(dir.path(), "corp.pem", &private.pem())
        .display()
        .to_string();
    let (cc, ck) = write_leaf(dir.path(), "gw-client", &client_ca.client("nthbouncer"));
    let pool = |name: &str, addr: SocketAddr, tls: &str| {
        pool_toml(name, &format!("https://{addr}"), "limit = 2").replace(
            "[pools.concurrency]",
            &format!("[pools.upstream_tls]\n{tls}\n[pools.concurrency]"),
        )
    };
    let sni = "server_name = \"origin.corp.internal\"";
    let toml = pool(
        "private",
        origin,
        &format!("ca_file = \"{ca_file}\"\n{sni}"),
    ) + &pool(
        "mutual",
        mtls_origin,
        &format!("ca_file = \"{ca_file}\"\ncert_file = \"{cc}\"\nkey_file = \"{ck}\"\n{sni}"),
    ) + &pool(
        "nocert",
        mtls_origin,
        &format!("ca_file = \"{ca_file}\"\n{sni}"),
    ) + &pool_toml("public", &format!("https://{origin}"), "limit = 2");
    let gw = gateway(&toml).await;

    for (pool, want) in [
        ("private", 200),
        ("mutual", 200),
        ("nocert", 502),
        ("public", 502),
    ] {
        let r = gw.get(pool, "/v1/x").send().await.unwrap();
        let status = r.status().as_u16();
        let body = r.text().await.unwrap();
        assert_eq!(status, want, "{pool}: {body}");
        if want == 200 {
            assert_eq!(body, "origin ok");
        }
    }
}

#[tokio::test]
async fn mtls_pools_take_only_the_right_client_certificates() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (ca, clients, strangers) = (Ca::new("root"), Ca::new("clients"), Ca::new("strangers"));
    let clients_file = write(dir.path(), "clients.pem", &clients.pem())
        .display()
        .to_string();
    let mtls = |subjects: &str| {
        format!(
            "[pools.access.mtls]\nca_file = \"{clients_file}\"\nallowed_subjects = [{subjects}]\n"
        )
    };
    let toml = server_tls(dir.path(), &ca, "")
        + &pool_toml("p", &up.url(), "limit = 4")
        + &pool_toml("m", &up.url(), "limit = 4")
        + &mtls("")
        + &pool_toml("n", &up.url(), "limit = 4")
        + &mtls("\"CN=someone-else\"")
        + "allowed_sans = [\"worker-3.internal\"]\n";
    let gw = gateway(&toml).await;
    let pem = ca.pem();
    let worker = clients.client("worker-1");
    let stranger = strangers.client("worker-1");
    // GET /v1/x on `host` showing `identity` (status and body).
    let showing = |identity: Option<&Leaf>, alpn: Alpn, host: &'static str| {
        let (c, port) = (client(&[&pem], identity, alpn, None), port(&gw));
        async move {
            let (status, _, body) = get(&c, host, port, "/v1/x").await.unwrap();
            (status, body)
        }
    };

    let (status, _) = showing(Some(&worker), Alpn::H2, "m.localhost").await;
    assert_eq!(status, 200, "a certificate from the pool's CA");
    let (status, none_body) = showing(None, Alpn::Http1, "m.localhost").await;
    assert_eq!(status, 401, "no certificate");
    let (status, other_body) = showing(Some(&stranger), Alpn::Http1, "m.localhost").await;
    assert_eq!(status, 401, "a certificate from another CA");
    let shown = |body: &str| {
        let mut v: serde_json::Value = serde_json::from_str(body).unwrap();
        v.as_object_mut().unwrap().remove("requestId");
        v
    };
    assert_eq!(
        shown(&none_body),
        shown(&other_body),
        "the same uniform refusal"
    );
    assert_eq!(shown(&none_body)["error"], "unauthorized");
    let (status, _) = showing(Some(&worker), Alpn::Http1, "n.localhost").await;
    assert_eq!(status, 401, "a subject not on allowed_subjects");
    let worker3 = clients.issue(
        &["worker-3.internal"],
        "worker-3",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let (status, _) = showing(Some(&worker3), Alpn::Http1, "n.localhost").await;
    assert_eq!(status, 200, "a SAN on allowed_sans");
    // Pools without the policy do not care.
    let (status, _) = showing(None, Alpn::Http1, "p.localhost").await;
    assert_eq!(status, 200);

    // A connection opened for p (SNI) is not reused for m, even with the right certificate.
    let coalesced = client(&[&pem], Some(&worker), Alpn::H2, Some("p.localhost"));
    let (status, _, body) = get(&coalesced, "m.localhost", port(&gw), "/v1/x")
        .await
        .unwrap();
    assert_eq!(status, 421, "{body}");
    assert!(body.contains("\"misdirected\""), "{body}");
    assert_eq!(up.total(), 3);

    // The access log says why, and who the certificate named.
    gw.flush_access_log().await;
    let req = http::Request::get(format!(
        "https://api.localhost:{}/admin/pools/m/access-log?limit=100",
        port(&gw)
    ))
    .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
    .body(Full::new(Bytes::new()))
    .unwrap();
    let resp = client(&[&pem], None, Alpn::Http1, None)
        .request(req)
        .await
        .unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let log: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let reasons: Vec<&str> = log["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["reason"].as_str())
        .collect();
    let has = |want: &str| reasons.iter().any(|r| r.contains(want));
    assert!(has("mtls: no client certificate"), "{reasons:?}");
    assert!(
        has("mtls: client certificate not signed by access.mtls.ca_file; client certificate subject=\"CN=worker-1\""),
        "{reasons:?}"
    );
    assert!(
        has("client certificate subject=\"CN=worker-1\""),
        "{reasons:?}"
    );
}

/// RSA keys serve as well as EC ones, in both PEM forms a key file comes in: PKCS#8 and the
/// older PKCS#1 (`BEGIN RSA PRIVATE KEY`, what `openssl genrsa -traditional` and many CAs'
/// tooling write). The client trusts only the CA that issued the RSA certificate, so a
/// completed handshake means that certificate was served and its key signed the handshake.
#[tokio::test]
async fn rsa_keys_serve_as_pkcs8_and_as_pkcs1() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    // RSA key generation is seconds of CPU in a debug build: off the runtime's threads.
    let (ca, leaf) = tokio::task::spawn_blocking(|| {
        let ca = Ca::new("rsa root");
        let leaf = ca.server_rsa(&["p.localhost", "api.localhost"]);
        (ca, leaf)
    })
    .await
    .unwrap();
    assert!(leaf.pkcs8.starts_with("-----BEGIN PRIVATE KEY-----"));
    assert!(leaf.pkcs1.starts_with("-----BEGIN RSA PRIVATE KEY-----"));
    let cert = write(dir.path(), "rsa.crt", &leaf.cert)
        .display()
        .to_string();
    let pem = ca.pem();
    for (form, key) in [("pkcs8", &leaf.pkcs8), ("pkcs1", &leaf.pkcs1)] {
        let key = write(dir.path(), &format!("rsa-{form}.key"), key)
            .display()
            .to_string();
        let toml = format!("[server.tls]\ncert_file = \"{cert}\"\nkey_file = \"{key}\"\n")
            + &pool_toml("p", &up.url(), "limit = 2");
        let gw = gateway(&toml).await;
        for (alpn, version) in [
            (Alpn::Http1, http::Version::HTTP_11),
            (Alpn::H2, http::Version::HTTP_2),
        ] {
            let (status, got, _) = get(
                &client(&[&pem], None, alpn, None),
                "p.localhost",
                port(&gw),
                &format!("/v1/{form}"),
            )
            .await
            .unwrap_or_else(|e| panic!("{form} key, {version:?}: {e}"));
            assert_eq!((status, got), (200, version), "{form} key");
        }
    }
    assert_eq!(
        up.total(),
        4,
        "two requests per key form reached the upstream"
    );
}

#[tokio::test]
async fn tls_config_errors_name_the_key_and_the_rule() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("root");
    let leaf = ca.server(&["p.localhost"]);
    let (c, k) = write_leaf(dir.path(), "good", &leaf);
    let other = ca.server(&["p.localhost"]);
    let (_, other_key) = write_leaf(dir.path(), "other", &other);
    let junk = write(dir.path(), "junk.pem", "hello").display().to_string();
    let missing = dir.path().join("missing.pem").display().to_string();
    let check = |cert: &str, key: &str| {
        let toml = format!("[server.tls]\ncert_file = \"{cert}\"\nkey_file = \"{key}\"\n");
        let config = nthbouncer_config::Config::from_toml_str(&toml).unwrap();
        nthbouncer_server::check_config(&config)
    };
    check(&c, &k).unwrap();
    for (cert, key, want_key, want_rule) in [
        (&missing, &k, "server.tls.cert_file", "cannot read"),
        (&junk, &k, "server.tls.cert_file", "no CERTIFICATE"),
        (&c, &junk, "server.tls.key_file", "no private key"),
        (&c, &c, "server.tls.key_file", "no private key"),
        (&c, &other_key, "server.tls.key_file", "is not the key"),
    ] {
        let e = check(cert, key).unwrap_err();
        assert_eq!(e.key, want_key, "{e}");
        assert!(e.rule.contains(want_rule), "{e}");
    }
    // access.mtls needs [server.tls]; a bad CA file is named.
    let pool = pool_toml("m", "http://127.0.0.1:9", "limit = 1");
    let e = nthbouncer_config::Config::from_toml_str(&format!(
        "{pool}[pools.access.mtls]\nca_file = \"{c}\"\n"
    ))
    .unwrap_err();
    assert_eq!(e.key, "pools[0].access.mtls");
    let toml = format!(
        "[server.tls]\ncert_file = \"{c}\"\nkey_file = \"{k}\"\n{pool}[pools.access.mtls]\nca_file = \"{junk}\"\n"
    );
    let e =
        nthbouncer_server::check_config(&nthbouncer_config::Config::from_toml_str(&toml).unwrap())
            .unwrap_err();
    assert_eq!(e.key, "pools[0].access.mtls.ca_file", "{e}");
    let toml = format!("{pool}[pools.upstream_tls]\ncert_file = \"{c}\"\n");
    let e = nthbouncer_config::Config::from_toml_str(&toml).unwrap_err();
    assert_eq!(e.key, "pools[0].upstream_tls.key_file", "{e}");
}

#[tokio::test]
async fn curl_speaks_https_and_h2_to_the_gateway() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("root");
    let gw = tls_gateway(dir.path(), &ca, &up).await;
    let ca_file = write(dir.path(), "ca.pem", &ca.pem());
    let port = port(&gw);
    let curl = |version: &'static str| {
        tokio::process::Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_version} %{http_code}",
            ])
            .args(["--cacert", ca_file.to_str().unwrap(), version])
            .args(["--resolve", &format!("p.localhost:{port}:127.0.0.1")])
            .args(["-H", &format!("x-nthpool-key: {}", nthbouncer_testkit::KEY)])
            .arg(format!("https://p.localhost:{port}/v1/curl"))
            .output()
    };
    let h2 = curl("--http2").await.unwrap();
    assert_eq!(String::from_utf8_lossy(&h2.stdout), "2 200");
    let h1 = curl("--http1.1").await.unwrap();
    assert_eq!(String::from_utf8_lossy(&h1.stdout), "1.1 200");
    assert_eq!(up.total(), 2);
}
