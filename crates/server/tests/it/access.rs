//! End-to-end access policies (SPEC §2, §9) over loopback: HMAC request signing, JWTs minted by
//! an independent library (jwt-simple) against a local JWKS, Cloudflare Access tokens against a
//! local certs endpoint, IP allowlists with and without trusted proxies, failure throttling, and
//! policies combined. Time is a `ManualClock` started at the wall clock (tokens are minted with
//! real time); nothing here sleeps on purpose or asserts a duration.

use std::collections::HashSet;
use std::sync::Arc;

use bytes::Bytes;
use jwt_simple::prelude::*;
use nthbouncer_coord::ManualClock;
use nthbouncer_testkit::access::*;
use nthbouncer_testkit::*;
use reqwest::Method;
use serde_json::{json, Value};

const SECRET_OLD: &str = "old-signing-secret-0123456789";
const SECRET_NEW: &str = "new-signing-secret-0123456789";
const ISSUER: &str = "https://id.test";
const AUDIENCE: &str = "gateway";

/// A gateway on a `ManualClock` that starts at the wall clock (tokens are minted on it), and
/// that clock.
async fn start(toml: &str) -> (Gateway, Arc<ManualClock>) {
    clocked_at(toml, wall_ms()).await
}

/// The body every credential refusal carries, 401 and 403 alike.
fn uniform() -> Value {
    json!({"error": "unauthorized", "message": "missing or invalid credentials"})
}

/// The status and the JSON body, less its `requestId` (checked against `x-request-id`: every
/// refusal names its request, and otherwise says the same whatever failed).
async fn status_and_body(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let id = r.headers().get("x-request-id").cloned();
    let text = r.text().await.unwrap();
    let mut body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    if let Some(obj) = body.as_object_mut() {
        let named = obj.remove("requestId");
        assert_eq!(
            named.as_ref().and_then(Value::as_str).map(str::as_bytes),
            id.as_ref().map(|v| v.as_bytes()),
            "an error body names its request id"
        );
    }
    (status, body)
}

/// Access-log reasons of a pool, newest first.
async fn log_reasons(gw: &Gateway, pool: &str) -> Vec<String> {
    gw.access_log(pool, "?limit=1000")
        .await
        .iter()
        .filter_map(|i| i["reason"].as_str().map(str::to_string))
        .collect()
}

/// An unsigned lock acquire for pool segment `pool` on the API host, with the test key.
fn unsigned_acquire(gw: &Gateway, pool: &str) -> reqwest::RequestBuilder {
    gw.api_anon(Method::POST, &format!("/pools/{pool}/lock/acquire"))
        .header("x-nthpool-key", KEY)
}

// ------------------------------------------------------------------------------------------
// HMAC

/// One signed request through pool `p` (host `p.localhost`).
struct Signed<'a> {
    method: Method,
    /// Path and query as sent.
    target: &'a str,
    body: &'a [u8],
    secret: &'a str,
    ts: u64,
    nonce: String,
}

impl<'a> Signed<'a> {
    fn new(method: Method, target: &'a str, body: &'a [u8], ts: u64) -> Self {
        Signed {
            method,
            target,
            body,
            secret: SECRET_NEW,
            ts,
            nonce: nonce(),
        }
    }

    fn signature(&self, host: &str) -> String {
        sign(
            self.secret,
            self.method.as_str(),
            host,
            self.target,
            &self.ts.to_string(),
            &self.nonce,
            self.body,
        )
    }

    /// `rb` with this request's timestamp and nonce, and `signature` as its signature header.
    fn signed_as(&self, rb: reqwest::RequestBuilder, signature: String) -> reqwest::RequestBuilder {
        rb.header("x-nthpool-timestamp", self.ts.to_string())
            .header("x-nthpool-nonce", &self.nonce)
            .header("x-nthpool-signature", signature)
    }

    /// The request for `host` with the signature headers, the body not yet attached.
    fn request(&self, gw: &Gateway, host: &str) -> reqwest::RequestBuilder {
        let url = format!("{}{}", gw.base, self.target);
        let rb = gw
            .client
            .request(self.method.clone(), url)
            .header("host", host);
        self.signed_as(rb, format!("v1={}", self.signature(host)))
    }

    /// Sends it to `host` with the test key and `body` (which may differ from the signed one).
    async fn send_body(
        &self,
        gw: &Gateway,
        host: &str,
        body: impl Into<reqwest::Body>,
    ) -> reqwest::Response {
        send(
            self.request(gw, host)
                .header("x-nthpool-key", KEY)
                .body(body),
        )
        .await
    }

    async fn send(&self, gw: &Gateway) -> (u16, Value) {
        let mut req = self.request(gw, "p.localhost").header("x-nthpool-key", KEY);
        if !self.body.is_empty() {
            req = req.body(self.body.to_vec());
        }
        status_and_body(req.send().await.unwrap()).await
    }
}

fn hmac_pool(upstream: &str) -> String {
    format!(
        "[[pools]]\nname = \"p\"\nupstream = \"{upstream}\"\nkeys = [\"{KEY}\"]\n\
         [pools.access.hmac]\nsecrets = [\"{SECRET_OLD}\", \"{SECRET_NEW}\"]\nwindow_s = 300\n"
    )
}

#[tokio::test]
async fn hmac_signed_requests_pass_and_forgeries_are_refused() {
    let up = Recorder::start().await;
    let (gw, clock) = start(&hmac_pool(&up.url())).await;
    let now = clock.now_s();

    // Valid: a POST with a body, signed with the new secret.
    let body = br#"{"model":"m","messages":[]}"#;
    let ok = Signed::new(Method::POST, "/v1/chat?x=1&y=two", body, now);
    let (status, _) = ok.send(&gw).await;
    assert_eq!(status, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].complete);
    assert_eq!(seen[0].body, body.to_vec());
    assert_eq!(seen[0].target, "/v1/chat?x=1&y=two");
    for h in [
        "x-nthpool-signature",
        "x-nthpool-nonce",
        "x-nthpool-timestamp",
        "x-nthpool-key",
    ] {
        assert!(
            !seen[0].headers.contains_key(h),
            "{h} crossed to the upstream"
        );
    }

    // Valid: a GET without a body, signed with the old secret (rotation); the window's edge.
    let mut get = Signed::new(Method::GET, "/v1/models", b"", now - 300);
    get.secret = SECRET_OLD;
    assert_eq!(get.send(&gw).await.0, 200);
    // Several v1 values: any may match.
    let multi = Signed::new(Method::GET, "/v1/models", b"", now);
    let both = format!(
        "v1={}, v1={}",
        "0".repeat(64),
        multi.signature("p.localhost")
    );
    let r = send(multi.signed_as(gw.get("p", "/v1/models"), both)).await;
    assert_eq!(r.status(), 200);
    let admitted = up.completed();
    assert_eq!(admitted, 3);

    let mut refusals = Vec::new();
    // Wrong secret.
    let mut wrong = Signed::new(Method::POST, "/v1/chat", body, now);
    wrong.secret = "not-the-configured-secret-000";
    refusals.push(wrong.send(&gw).await);
    // Stale and future timestamps.
    refusals.push(
        Signed::new(Method::POST, "/v1/chat", body, now - 301)
            .send(&gw)
            .await,
    );
    refusals.push(
        Signed::new(Method::POST, "/v1/chat", body, now + 301)
            .send(&gw)
            .await,
    );
    // A replayed nonce (the very first request, byte for byte).
    refusals.push(ok.send(&gw).await);
    // A tampered body: signed for one body, sent with another of the same length.
    let tampered = Signed::new(Method::POST, "/v1/chat", body, now);
    let r = tampered
        .send_body(
            &gw,
            "p.localhost",
            br#"{"model":"M","messages":[]}"#.to_vec(),
        )
        .await;
    refusals.push(status_and_body(r).await);
    // A tampered query.
    let q = Signed::new(Method::GET, "/v1/models?limit=1", b"", now);
    let sig = format!("v1={}", q.signature("p.localhost"));
    let r = send(q.signed_as(gw.get("p", "/v1/models?limit=1000"), sig)).await;
    refusals.push(status_and_body(r).await);
    // No signature at all.
    refusals.push(status_and_body(send(gw.get("p", "/v1/models")).await).await);

    for (i, (status, body)) in refusals.iter().enumerate() {
        assert_eq!(*status, 401, "refusal {i}");
        assert_eq!(body, &uniform(), "refusal {i} must not say what failed");
    }
    assert_eq!(
        up.completed(),
        admitted,
        "no forged request reached the upstream whole: {:?}",
        up.seen()
            .iter()
            .map(|r| (&r.target, r.complete))
            .collect::<Vec<_>>()
    );

    // The access log keeps what the caller was not told.
    let reasons = log_reasons(&gw, "p").await;
    for want in [
        "hmac: signature mismatch",
        "hmac: timestamp outside the window",
        "hmac: nonce replayed",
        "hmac: signature headers missing",
    ] {
        assert!(
            reasons.iter().any(|r| r == want),
            "{want} not in {reasons:?}"
        );
    }
}

#[tokio::test]
async fn hmac_signed_bodies_are_verified_before_anything_is_forwarded() {
    let up = Recorder::start().await;
    let (gw, clock) = start(&hmac_pool(&up.url())).await;
    let now = clock.now_s();
    let chunks = ["first chunk;", "second chunk;", "third chunk"];
    let whole: Vec<u8> = chunks.concat().into_bytes();
    let stream = |parts: Vec<&'static str>| {
        reqwest::Body::wrap_stream(futures_util::stream::iter(
            parts
                .into_iter()
                .map(|p| Ok::<_, std::io::Error>(Bytes::from_static(p.as_bytes()))),
        ))
    };

    // Chunked (no Content-Length), signed over the whole body.
    let ok = Signed::new(Method::PUT, "/upload", &whole, now);
    let r = ok
        .send_body(&gw, "p.localhost", stream(chunks.to_vec()))
        .await;
    assert_eq!(r.status(), 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].complete);
    assert_eq!(seen[0].body, whole);

    // The same signature over a body whose last chunk was changed in flight.
    let forged = Signed::new(Method::PUT, "/upload", &whole, now);
    let r = forged
        .send_body(
            &gw,
            "p.localhost",
            stream(vec!["first chunk;", "second chunk;", "THIRD CHUNK"]),
        )
        .await;
    let (status, body) = status_and_body(r).await;
    assert_eq!(status, 401);
    assert_eq!(body, uniform());
    assert_eq!(
        up.seen().len(),
        1,
        "nothing of the forged request reached the upstream"
    );
    gw.wait_freed("p", "the slot freed").await;
    let reasons = log_reasons(&gw, "p").await;
    assert_eq!(
        reasons.first().map(String::as_str),
        Some("hmac: signature mismatch")
    );
}

/// Before: the head of a signed request (and all but its last chunk) was forwarded, with the
/// managed credentials, while its body was still arriving; a handler acting on the head ran for
/// someone without the secret. Now nothing leaves the gateway before the signature verifies.
#[tokio::test]
async fn a_signed_request_still_arriving_reaches_nothing_upstream() {
    let up = Recorder::start().await;
    let (gw, clock) = start(&hmac_pool(&up.url())).await;
    let now = clock.now_s();
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    let body = reqwest::Body::wrap_stream(futures_util::stream::unfold(rx, |mut rx| async {
        rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
    }));
    let forged = Signed::new(Method::DELETE, "/records/7", b"the real body", now);
    let request = forged
        .request(&gw, "p.localhost")
        .header("x-nthpool-key", KEY)
        .body(body)
        .send();
    let call = tokio::spawn(request);
    tx.send(Bytes::from_static(b"a forged ")).await.unwrap();
    // The gateway has the head and a first chunk; give it every chance to forward them.
    for _ in 0..50 {
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    assert_eq!(up.seen().len(), 0, "the head went upstream before the body");
    tx.send(Bytes::from_static(b"body")).await.unwrap();
    drop(tx);
    let r = call.await.unwrap().unwrap();
    assert_eq!(status_and_body(r).await, (401, uniform()));
    assert_eq!(up.seen().len(), 0, "a forged request reached the upstream");
}

/// A signed body past `access.hmac.max_body_bytes` is refused with 413 before anything is sent.
#[tokio::test]
async fn a_signed_body_over_its_bound_is_413() {
    let up = Recorder::start().await;
    let toml = hmac_pool(&up.url()).replace(
        "[pools.access.hmac]\n",
        "[pools.access.hmac]\nmax_body_bytes = 16\n",
    );
    let (gw, clock) = start(&toml).await;
    let big = vec![b'x'; 64];
    let signed = Signed::new(Method::POST, "/upload", &big, clock.now_s());
    let r = signed.send_body(&gw, "p.localhost", big.clone()).await;
    assert_eq!(r.status(), 413);
    assert_eq!(up.seen().len(), 0);
}

#[tokio::test]
async fn hmac_applies_to_the_lock_api() {
    let up = Recorder::start().await;
    let (gw, clock) = start(&hmac_pool(&up.url())).await;
    let now = clock.now_s();
    let api = "api.localhost";

    let unsigned = send(unsigned_acquire(&gw, "p")).await;
    assert_eq!(status_and_body(unsigned).await, (401, uniform()));
    // The pool named in percent-encoding is the same pool, with the same checks.
    let encoded = send(unsigned_acquire(&gw, "%70")).await;
    assert_eq!(status_and_body(encoded).await, (401, uniform()));

    let body = br#"{"waitMs":0}"#;
    let acquire = Signed::new(Method::POST, "/pools/p/lock/acquire", body, now);
    let r = acquire.send_body(&gw, api, body.to_vec()).await;
    assert_eq!(r.status(), 200);
    let grant: Value = r.json().await.unwrap();
    let slot = grant["slotId"].as_str().unwrap().to_string();

    // Body tampered after signing.
    let tampered = Signed::new(Method::POST, "/pools/p/lock/acquire", body, now);
    let r = tampered
        .send_body(&gw, api, br#"{"waitMs":9}"#.to_vec())
        .await;
    assert_eq!(status_and_body(r).await, (401, uniform()));

    let renew_path = format!("/pools/p/lock/{slot}/renew");
    let renew = Signed::new(Method::POST, &renew_path, b"", now);
    let r = send(renew.request(&gw, api).header("x-nthpool-key", KEY)).await;
    assert_eq!(r.status(), 200);

    let release_path = format!("/pools/p/lock/{slot}/release");
    let report = br#"{"status":200}"#;
    let release = Signed::new(Method::POST, &release_path, report, now);
    let r = release.send_body(&gw, api, report.to_vec()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["released"], true);
}

#[tokio::test]
async fn nonces_survive_a_settings_change() {
    let up = Recorder::start().await;
    let (gw, clock) = start("").await;
    let spec = json!({
        "name": "p",
        "upstream": up.url(),
        "keys": [KEY],
        "access": {"hmac": {"secrets": [SECRET_NEW]}},
    });
    let r = send(gw.api(Method::POST, "/admin/pools").json(&spec)).await;
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let shown = send(gw.api(Method::GET, "/admin/pools/p")).await;
    let shown = shown.text().await.unwrap();
    assert!(
        !shown.contains(SECRET_NEW),
        "the HMAC secret is masked on read: {shown}"
    );

    let req = Signed::new(Method::GET, "/x", b"", clock.now_s());
    assert_eq!(req.send(&gw).await.0, 200);
    let mut updated = spec.clone();
    updated["concurrency"] = json!({"limit": 3});
    let r = send(gw.api(Method::PUT, "/admin/pools/p").json(&updated)).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(
        req.send(&gw).await,
        (401, uniform()),
        "a replay after an update"
    );
}

// ------------------------------------------------------------------------------------------
// JWT

fn rsa_key(pem: &str, kid: &str) -> RS256KeyPair {
    RS256KeyPair::from_pem(pem).unwrap().with_key_id(kid)
}

fn claims(valid_for_s: u64) -> JWTClaims<NoCustomClaims> {
    Claims::create(Duration::from_secs(valid_for_s))
        .with_issuer(ISSUER)
        .with_audience(AUDIENCE)
}

fn jwt_pool(upstream: &str, keys_toml: &str) -> String {
    format!(
        "[[pools]]\nname = \"p\"\nupstream = \"{upstream}\"\nkeys = [\"{KEY}\"]\n\
         [pools.access.jwt]\nissuer = \"{ISSUER}\"\naudience = \"{AUDIENCE}\"\n{keys_toml}\n"
    )
}

async fn with_jwt(gw: &Gateway, token: &str) -> (u16, Value) {
    let r = send(gw.get("p", "/anything").header("x-nthpool-jwt", token)).await;
    status_and_body(r).await
}

#[tokio::test]
async fn jwt_from_a_jwks_with_rotation_and_a_refresh_rate_limit() {
    let up = Upstream::start().await;
    let k1 = rsa_key(RSA_KEY_1, "k1");
    let k2 = rsa_key(RSA_KEY_2, "k2");
    let jwks_server = KeyServer::start(jwks(&[rsa_jwk(&k1, "k1")])).await;
    let toml = jwt_pool(
        &up.url(),
        &format!(
            "jwks_url = \"{}\"\nalgorithms = [\"RS256\", \"ES256\"]",
            jwks_server.url("/jwks")
        ),
    );
    let (gw, clock) = start(&toml).await;

    // A valid token, in our header and as `Authorization: Bearer` (the key in its own header).
    let token = k1.sign(claims(3600)).unwrap();
    assert_eq!(with_jwt(&gw, &token).await.0, 200);
    assert_eq!(jwks_server.fetches(), 1);
    let r = send(gw.get("p", "/echo").bearer_auth(&token)).await;
    assert_eq!(r.status(), 200);
    let echo: Value = r.json().await.unwrap();
    assert!(
        echo["headers"].get("authorization").is_none(),
        "the JWT crossed: {echo}"
    );
    assert!(echo["headers"].get("x-nthpool-jwt").is_none());
    // Within the leeway (60 s) an expired token still passes.
    let mut late = claims(0);
    late.expires_at = Some(Duration::from_secs(clock.now_s() - 30));
    assert_eq!(with_jwt(&gw, &k1.sign(late).unwrap()).await.0, 200);

    // The issuer rotates to k2. A token naming k2 right after our fetch is refused: refreshes
    // are rate-limited, and so are forged kids, which never reach the issuer.
    jwks_server.set(jwks(&[rsa_jwk(&k1, "k1"), rsa_jwk(&k2, "k2")]));
    let t2 = k2.sign(claims(3600)).unwrap();
    assert_eq!(with_jwt(&gw, &t2).await, (401, uniform()));
    for i in 0..4 {
        let forged = rsa_key(RSA_KEY_2, &format!("forged-{i}"));
        assert_eq!(
            with_jwt(&gw, &forged.sign(claims(3600)).unwrap()).await.0,
            401
        );
    }
    assert_eq!(
        jwks_server.fetches(),
        1,
        "forged kids must not make us fetch"
    );
    // After the refresh interval the unknown kid triggers one fetch, and k2 works.
    clock.advance(31_000);
    assert_eq!(with_jwt(&gw, &t2).await.0, 200);
    assert_eq!(jwks_server.fetches(), 2);
    let forged = rsa_key(RSA_KEY_2, "forged-late");
    assert_eq!(
        with_jwt(&gw, &forged.sign(claims(3600)).unwrap()).await.0,
        401
    );
    assert_eq!(jwks_server.fetches(), 2);

    // A new failure window: the claims and algorithms that must be refused.
    clock.advance(61_000);
    let now = clock.now_s();
    let mut expired = claims(0);
    expired.expires_at = Some(Duration::from_secs(now - 3600));
    let mut not_yet = claims(7200);
    not_yet.invalid_before = Some(Duration::from_secs(now + 3600));
    let wrong_aud = Claims::create(Duration::from_secs(3600))
        .with_issuer(ISSUER)
        .with_audience("someone-else");
    let wrong_iss = Claims::create(Duration::from_secs(3600))
        .with_issuer("https://evil.test")
        .with_audience(AUDIENCE);
    let unsigned = unsigned_token(&json!({
        "iss": ISSUER, "aud": AUDIENCE, "exp": now + 3600,
    }));
    // The classic confusion: HS256 "signed" with the issuer's public key as the secret.
    let public_pem = k1.public_key().to_pem().unwrap();
    let confused = HS256Key::from_bytes(public_pem.as_bytes())
        .with_key_id("k1")
        .authenticate(claims(3600))
        .unwrap();
    let cases = [
        ("expired", k1.sign(expired).unwrap()),
        ("not yet valid", k1.sign(not_yet).unwrap()),
        ("wrong audience", k1.sign(wrong_aud).unwrap()),
        ("wrong issuer", k1.sign(wrong_iss).unwrap()),
        ("alg none", unsigned),
        ("HS256 with the public key", confused),
        ("garbage", "not.a.jwt".to_string()),
    ];
    for (what, token) in &cases {
        assert_eq!(with_jwt(&gw, token).await, (401, uniform()), "{what}");
    }
    let r = send(gw.get("p", "/anything")).await;
    assert_eq!(status_and_body(r).await, (401, uniform()), "no token");
    let reasons = log_reasons(&gw, "p").await;
    for want in [
        "jwt: expired",
        "jwt: not yet valid",
        "jwt: wrong audience",
        "jwt: wrong issuer",
        "jwt: algorithm not allowed",
        "jwt: unknown key id",
        "jwt: token missing",
    ] {
        assert!(
            reasons.iter().any(|r| r == want),
            "{want} not in {reasons:?}"
        );
    }
    assert_eq!(jwks_server.fetches(), 2);
}

#[tokio::test]
async fn jwt_with_static_public_keys() {
    let up = Upstream::start().await;
    let k1 = rsa_key(RSA_KEY_1, "k1");
    let ec = ES256KeyPair::from_pem(EC_KEY_1).unwrap();
    let toml = jwt_pool(
        &up.url(),
        &format!(
            "algorithms = [\"RS256\", \"ES256\"]\npublic_keys = ['''{}''', '''{}''']",
            k1.public_key().to_pem().unwrap(),
            ec.public_key().to_pem().unwrap()
        ),
    );
    let (gw, _clock) = start(&toml).await;
    // No kid: every key of the token's algorithm is tried.
    let plain = RS256KeyPair::from_pem(RSA_KEY_1).unwrap();
    assert_eq!(
        with_jwt(&gw, &plain.sign(claims(600)).unwrap()).await.0,
        200
    );
    assert_eq!(with_jwt(&gw, &ec.sign(claims(600)).unwrap()).await.0, 200);
    let stranger = RS256KeyPair::from_pem(RSA_KEY_2).unwrap();
    assert_eq!(
        with_jwt(&gw, &stranger.sign(claims(600)).unwrap()).await,
        (401, uniform())
    );
    // The token is needed *and* the key: a JWT does not replace the pool key.
    let r = send(
        gw.pool("p", Method::GET, "/anything")
            .header("x-nthpool-jwt", plain.sign(claims(600)).unwrap()),
    )
    .await;
    assert_eq!(status_and_body(r).await, (401, uniform()));
}

// ------------------------------------------------------------------------------------------
// Cloudflare Access

#[tokio::test]
async fn cloudflare_access_tokens_against_a_local_certs_endpoint() {
    let up = Upstream::start().await;
    let k1 = rsa_key(RSA_KEY_1, "cf-1");
    let certs = json!({
        "keys": [rsa_jwk(&k1, "cf-1")],
        "public_cert": {"kid": "cf-1", "cert": "-----BEGIN CERTIFICATE-----\n…"},
        "public_certs": [{"kid": "cf-1", "cert": "-----BEGIN CERTIFICATE-----\n…"}],
    });
    let certs_server = KeyServer::start(certs.to_string()).await;
    let team = "team.cloudflareaccess.com";
    let aud = "4714c1358e65fe4b408ad6d432a5f878f08194bdb4752441fd56faefa9b2b6f2";
    let toml = format!(
        "[[pools]]\nname = \"p\"\nupstream = \"{}\"\nkeys = [\"{KEY}\"]\n\
         [pools.access.cloudflare_access]\nteam_domain = \"{team}\"\naudience = \"{aud}\"\n\
         certs_url = \"{}\"\n",
        up.url(),
        certs_server.url("/cdn-cgi/access/certs")
    );
    let (gw, _clock) = start(&toml).await;
    let cf = |c: JWTClaims<NoCustomClaims>| k1.sign(c).unwrap();
    let good = || {
        Claims::create(Duration::from_secs(600))
            .with_issuer(format!("https://{team}"))
            .with_audiences(HashSet::from([aud.to_string(), "another-app".to_string()]))
            .with_subject("user@example.com")
    };
    let with_token = |token: Option<String>| {
        let mut r = gw.get("p", "/echo");
        if let Some(t) = token {
            r = r.header("cf-access-jwt-assertion", t);
        }
        send(r)
    };

    let r = with_token(Some(cf(good()))).await;
    assert_eq!(r.status(), 200);
    let echo: Value = r.json().await.unwrap();
    assert!(echo["headers"].get("cf-access-jwt-assertion").is_none());
    assert_eq!(certs_server.fetches(), 1);

    let other_app = Claims::create(Duration::from_secs(600))
        .with_issuer(format!("https://{team}"))
        .with_audiences(HashSet::from(["another-app".to_string()]));
    let other_team = Claims::create(Duration::from_secs(600))
        .with_issuer("https://other.cloudflareaccess.com")
        .with_audiences(HashSet::from([aud.to_string()]));
    let es = ES256KeyPair::from_pem(EC_KEY_1)
        .unwrap()
        .with_key_id("cf-1")
        .sign(good())
        .unwrap();
    for (what, token) in [
        ("audience of another app", Some(cf(other_app))),
        ("another team's issuer", Some(cf(other_team))),
        ("ES256 (Cloudflare signs RS256)", Some(es)),
        ("no assertion", None),
    ] {
        let r = with_token(token).await;
        assert_eq!(status_and_body(r).await, (401, uniform()), "{what}");
    }
    // The assertion is read from its own header only.
    let r = send(gw.get("p", "/echo").header("x-nthpool-jwt", cf(good()))).await;
    assert_eq!(r.status(), 401);
}

// ------------------------------------------------------------------------------------------
// IP allowlist, trusted proxies, throttling, combinations

#[tokio::test]
async fn ip_allowlist_without_trusted_proxies_ignores_forwarded_for() {
    let up = Upstream::start().await;
    let toml = format!(
        "[[pools]]\nname = \"far\"\nupstream = \"{u}\"\nkeys = [\"{KEY}\"]\n\
         [pools.access]\nip_allow = [\"10.0.0.0/8\"]\n\
         [[pools]]\nname = \"near\"\nupstream = \"{u}\"\nkeys = [\"{KEY}\"]\n\
         [pools.access]\nip_allow = [\"127.0.0.1/32\", \"::1\"]\n",
        u = up.url()
    );
    let (gw, _clock) = start(&toml).await;
    assert_eq!(send(gw.get("near", "/x")).await.status(), 200);
    // The peer (127.0.0.1) is no proxy of ours: its X-Forwarded-For is the client's own claim.
    for _ in 0..12 {
        let r = send(gw.get("far", "/x").header("x-forwarded-for", "10.1.2.3")).await;
        assert_eq!(status_and_body(r).await, (403, uniform()));
    }
    // Allowlist misses are not counted as guesses: still 403, never 429.
    let log = gw.access_log("far", "?limit=1000").await;
    assert_eq!(log[0]["clientAddr"], "127.0.0.1");
    assert_eq!(log[0]["reason"], "client address not in access.ip_allow");
}

#[tokio::test]
async fn ip_allowlist_behind_trusted_proxies_uses_the_right_most_untrusted_hop() {
    let up = Upstream::start().await;
    let toml = format!(
        "[server]\ntrusted_proxies = [\"127.0.0.1/32\", \"10.0.0.0/8\"]\n\
         [[pools]]\nname = \"p\"\nupstream = \"{}\"\nkeys = [\"{KEY}\"]\n\
         [pools.access]\nip_allow = [\"203.0.113.0/24\"]\n",
        up.url()
    );
    let (gw, _clock) = start(&toml).await;
    let via = |xff: Option<&'static str>| {
        let mut r = gw.get("p", "/echo");
        if let Some(x) = xff {
            r = r.header("x-forwarded-for", x);
        }
        async move { r.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(via(Some("203.0.113.7")).await, 200);
    assert_eq!(
        via(Some("198.51.100.1, 203.0.113.7")).await,
        200,
        "spoofed left hop ignored"
    );
    assert_eq!(
        via(Some("203.0.113.7, 10.0.0.5")).await,
        200,
        "through two proxies"
    );
    assert_eq!(via(Some("203.0.113.7, 198.51.100.1")).await, 403);
    assert_eq!(via(Some("::ffff:198.51.100.9")).await, 403);
    assert_eq!(via(None).await, 403, "the proxy itself is not allowed");
    let log = gw.access_log("p", "?limit=1000").await;
    assert_eq!(log[0]["clientAddr"], "127.0.0.1");
    assert_eq!(
        log[1]["clientAddr"], "198.51.100.9",
        "mapped address normalised"
    );
    assert_eq!(log[3]["clientAddr"], "203.0.113.7");
}

#[tokio::test]
async fn key_hmac_and_allowlist_combine() {
    let up = Recorder::start().await;
    let toml = format!(
        "[server]\ntrusted_proxies = [\"127.0.0.1/32\"]\n{}[pools.access]\nip_allow = [\"203.0.113.0/24\"]\n",
        hmac_pool(&up.url())
    );
    // `[pools.access]` after `[pools.access.hmac]` is valid TOML: the tables merge.
    let (gw, clock) = start(&toml).await;
    let now = clock.now_s();
    let send = |key: Option<&'static str>, xff: &'static str, signed: bool| {
        let s = Signed::new(Method::GET, "/v1/models", b"", now);
        let mut r = if signed {
            s.request(&gw, "p.localhost")
        } else {
            gw.pool("p", Method::GET, "/v1/models")
        };
        r = r.header("x-forwarded-for", xff);
        if let Some(k) = key {
            r = r.header("x-nthpool-key", k);
        }
        async move { status_and_body(r.send().await.unwrap()).await }
    };
    assert_eq!(send(Some(KEY), "203.0.113.1", true).await.0, 200);
    assert_eq!(send(None, "203.0.113.1", true).await, (401, uniform()));
    assert_eq!(
        send(Some("wrong-key-0123456789abc"), "203.0.113.1", true).await,
        (401, uniform())
    );
    assert_eq!(
        send(Some(KEY), "203.0.113.1", false).await,
        (401, uniform())
    );
    assert_eq!(
        send(Some(KEY), "198.51.100.1", true).await,
        (403, uniform())
    );
    assert_eq!(up.completed(), 1);
}

#[tokio::test]
async fn repeated_failures_are_answered_429_for_a_while() {
    let up = Upstream::start().await;
    let toml = format!(
        "[server]\ntrusted_proxies = [\"127.0.0.1/32\"]\n{}",
        pool_toml("p", &up.url(), "limit = 4")
    );
    let (gw, clock) = start(&toml).await;
    let from = |client: &'static str, key: &'static str| {
        send(
            gw.pool("p", Method::GET, "/x")
                .header("x-forwarded-for", client)
                .header("x-nthpool-key", key),
        )
    };
    let attacker = "203.0.113.66";
    for _ in 0..MAX {
        let r = from(attacker, "guess-0123456789abcdef").await;
        assert_eq!(r.status(), 401);
    }
    // Blocked now, even with the right key; others are not.
    let r = from(attacker, KEY).await;
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "retry-after {retry}");
    assert_eq!(status_and_body(r).await.1["error"], "too_many_requests");
    assert_eq!(from("203.0.113.67", KEY).await.status(), 200);
    // The lock API shares the count.
    let r = send(unsigned_acquire(&gw, "p").header("x-forwarded-for", attacker)).await;
    assert_eq!(r.status(), 429);
    clock.advance(61_000);
    assert_eq!(from(attacker, KEY).await.status(), 200);
    let reasons = log_reasons(&gw, "p").await;
    assert!(reasons
        .iter()
        .any(|r| r == "throttled after repeated failed authentication"));
}

/// Failures before a block (`MAX_FAILURES`).
const MAX: u32 = internals::MAX_FAILURES;

trait ClockExt {
    fn now_s(&self) -> u64;
}

impl ClockExt for ManualClock {
    fn now_s(&self) -> u64 {
        nthbouncer_coord::Clock::now_ms(self) / 1000
    }
}

/// A signed request promoted to an async job is stored only when its body matches the
/// signature; the stored job keeps none of the signing headers.
#[tokio::test]
async fn hmac_signed_async_jobs_verify_the_body() {
    let up = Recorder::start().await;
    let toml = async_pool_toml(&hmac_pool(&up.url()), "", NO_WEBHOOK);
    let (gw, clock) = start(&toml).await;
    let now = clock.now_s();
    let body = br#"{"job":"real"}"#;
    let good = Signed::new(Method::POST, "/work", body, now);
    let r = send(
        good.request(&gw, "p.localhost")
            .header("x-nthpool-key", KEY)
            .header("x-nthpool-async", "1")
            .body(body.to_vec()),
    )
    .await;
    assert_eq!(r.status(), 202);
    let job: Value = r.json().await.unwrap();
    assert!(job["jobId"].is_string());

    // The same signature over a different body: refused, no job.
    let forged = Signed::new(Method::POST, "/work", body, now);
    let r = send(
        forged
            .request(&gw, "p.localhost")
            .header("x-nthpool-key", KEY)
            .header("x-nthpool-async", "1")
            .body(br#"{"job":"forged"}"#.to_vec()),
    )
    .await;
    let (status, answer) = status_and_body(r).await;
    assert_eq!(status, 401);
    assert_eq!(answer, uniform());
    let jobs = gw.admin_json("/admin/pools/p/jobs").await;
    assert_eq!(
        jobs["items"].as_array().unwrap().len(),
        1,
        "only the genuine job was stored: {jobs}"
    );
}
