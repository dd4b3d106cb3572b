//! Fuzz target `hmac_headers`: the HMAC signing headers through the server's `HmacPolicy::begin`
//! (header shapes, timestamp window) and `Pending::finish_with_body` (signature, nonce), the
//! path every signed request takes; plus requests signed by the client's `Signer`.
//!
//! Input, split at the first seven `\n` (the rest is the body, any bytes):
//!
//! ```text
//! <now_ms> <window_s> <ts_delta_s> <flags>      (a field that does not parse takes a default)
//! <method>
//! <Host header; empty line: none>
//! <request target>
//! <X-Nthpool-Timestamp values, separated by \x1f; empty line: none>
//! <X-Nthpool-Nonce values, likewise>
//! <X-Nthpool-Signature values, likewise>
//! <body>
//! ```
//!
//! Properties:
//! - raw headers: nothing panics; the head fails only as missing, malformed or outside the
//!   window, and passes only with a timestamp within the window; the body is accepted exactly
//!   when a `v1=` value equals the HMAC-SHA256 of the canonical string under a configured
//!   secret, as computed by `ring` (an implementation independent of the server's), so a
//!   random signature never passes; an accepted nonce is refused the second time;
//! - signed by `nthbouncer_client::signing::Signer` (timestamp `now + ts_delta_s`, the nonce
//!   line's first value): a request the server can receive as signed verifies, once; a nonce of
//!   the wrong shape or a timestamp outside the window is refused before the body; a flipped
//!   signature digit or a secret not configured fails.
//!
//! Shared by `fuzz_targets/hmac_headers.rs` and `crates/server/tests/it/fuzz_regressions.rs`.

use std::sync::Arc;

use futures_util::FutureExt;
use http::{HeaderMap, HeaderValue, Method, Uri};
use nthbouncer_client::signing::Signer;
use nthbouncer_coord::{InProcessNonces, NonceStore};
use nthbouncer_server::access::{HmacFailure, HmacPolicy};

const TIMESTAMP: &str = "x-nthpool-timestamp";
const NONCE: &str = "x-nthpool-nonce";
const SIGNATURE: &str = "x-nthpool-signature";
const SECRETS: [&[u8]; 2] = [b"fuzz-signing-secret-0123", b"fuzz-rotated-secret-4567"];
const NOT_CONFIGURED: &[u8] = b"fuzz-unknown-secret-89ab";
/// A plausible clock: 2023-11-14.
const NOW: u64 = 1_700_000_000_000;
const SEPARATOR: u8 = 0x1f;

struct Input<'a> {
    now_ms: u64,
    window_s: u64,
    ts_delta_s: i64,
    flags: u64,
    method: &'a [u8],
    host: &'a [u8],
    target: &'a [u8],
    timestamps: &'a [u8],
    nonces: &'a [u8],
    signatures: &'a [u8],
    body: &'a [u8],
}

fn split(data: &[u8]) -> Input<'_> {
    let mut parts = data.splitn(8, |&b| b == b'\n');
    let mut next = || parts.next().unwrap_or_default();
    let head = String::from_utf8_lossy(next()).into_owned();
    let mut fields = head.split_ascii_whitespace();
    let now_ms = fields.next().and_then(|s| s.parse().ok()).unwrap_or(NOW);
    let window_s = fields
        .next()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(300)
        .clamp(1, 3_600);
    let ts_delta_s = fields.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let flags = fields.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    Input {
        now_ms,
        window_s,
        ts_delta_s,
        flags,
        method: next(),
        host: next(),
        target: next(),
        timestamps: next(),
        nonces: next(),
        signatures: next(),
        body: next(),
    }
}

pub fn run(data: &[u8]) {
    let input = split(data);
    raw_headers(&input);
    client_signed(&input);
}

fn policy(window_s: u64) -> HmacPolicy {
    HmacPolicy::new(SECRETS.iter().map(|s| s.to_vec()).collect(), window_s)
}

fn store() -> Arc<dyn NonceStore> {
    Arc::new(InProcessNonces::new(16))
}

/// Runs a future that cannot pend: the in-process nonce store answers at once.
fn ready<T>(fut: impl std::future::Future<Output = T>) -> T {
    match fut.now_or_never() {
        Some(v) => v,
        None => panic!("the in-process verification pended"),
    }
}

fn values(line: &[u8]) -> Vec<&[u8]> {
    if line.is_empty() {
        return Vec::new();
    }
    line.split(|&b| b == SEPARATOR).collect()
}

fn raw_headers(input: &Input<'_>) {
    let method = Method::from_bytes(input.method).unwrap_or(Method::POST);
    let uri = Uri::try_from(input.target).unwrap_or_else(|_| Uri::from_static("/"));
    let mut headers = HeaderMap::new();
    if !input.host.is_empty() {
        if let Ok(v) = HeaderValue::from_bytes(input.host) {
            headers.insert(http::header::HOST, v);
        }
    }
    // Values a client cannot send (control bytes) never reach us: hyper refuses the request.
    for (name, line) in [
        (TIMESTAMP, input.timestamps),
        (NONCE, input.nonces),
        (SIGNATURE, input.signatures),
    ] {
        for v in values(line) {
            if let Ok(v) = HeaderValue::from_bytes(v) {
                headers.append(name, v);
            }
        }
    }
    let policy = policy(input.window_s);
    let nonces = store();
    let pending = match policy.begin(&method, &uri, &headers, input.now_ms, nonces.clone()) {
        Ok(p) => p,
        Err(f) => {
            assert!(
                matches!(
                    f,
                    HmacFailure::Missing | HmacFailure::Malformed | HmacFailure::OutsideWindow
                ),
                "the head failed with {f:?}"
            );
            return;
        }
    };
    let ts = headers.get(TIMESTAMP).map(HeaderValue::as_bytes);
    let ts_s = ts
        .and_then(|t| std::str::from_utf8(t).ok())
        .and_then(|t| t.parse::<u64>().ok());
    let Some(ts_s) = ts_s else {
        panic!("the head passed without a numeric timestamp: {ts:?}");
    };
    assert!(
        ts_s.abs_diff(input.now_ms / 1000) <= input.window_s,
        "timestamp {ts_s} passed outside the window at {}",
        input.now_ms
    );

    let expected = oracle_accepts(&method, &uri, &headers, input.body);
    let verdict = ready(pending.finish_with_body(input.body));
    if expected {
        assert_eq!(verdict, Ok(()), "a correct signature was refused");
        let again = policy.begin(&method, &uri, &headers, input.now_ms, nonces);
        let again = match again {
            Ok(p) => ready(p.finish_with_body(input.body)),
            Err(f) => panic!("the same head failed the second time: {f:?}"),
        };
        assert_eq!(again, Err(HmacFailure::Replayed), "a replay passed");
    } else {
        assert_eq!(
            verdict,
            Err(HmacFailure::Signature),
            "a wrong signature was not refused as one"
        );
    }
}

/// Whether the request carries a correct signature, computed with `ring` from the protocol's
/// definition: `v1\n{METHOD}\n{Host}\n{path?query}\n{ts}\n{nonce}\n{hex sha256(body)}`.
fn oracle_accepts(method: &Method, uri: &Uri, headers: &HeaderMap, body: &[u8]) -> bool {
    let get = |name| headers.get(name).map_or(&b""[..], HeaderValue::as_bytes);
    let host = match headers.get(http::header::HOST) {
        Some(h) => h.as_bytes(),
        None => uri.authority().map_or(&b""[..], |a| a.as_str().as_bytes()),
    };
    let target = uri.path_and_query().map_or("/", |pq| pq.as_str());
    let body_hex = hex::encode(ring::digest::digest(&ring::digest::SHA256, body));
    let mut canonical = Vec::new();
    for part in [
        b"v1".as_slice(),
        method.as_str().as_bytes(),
        host,
        target.as_bytes(),
        get(TIMESTAMP),
        get(NONCE),
    ] {
        canonical.extend_from_slice(part);
        canonical.push(b'\n');
    }
    canonical.extend_from_slice(body_hex.as_bytes());
    let tags: Vec<Vec<u8>> = SECRETS
        .iter()
        .map(|s| {
            let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, s);
            ring::hmac::sign(&key, &canonical).as_ref().to_vec()
        })
        .collect();
    let Ok(sig) = std::str::from_utf8(get(SIGNATURE)) else {
        return false;
    };
    sig.split(',')
        .filter_map(|part| part.trim().strip_prefix("v1="))
        .filter_map(|h| hex::decode(h).ok())
        .any(|sig| tags.contains(&sig))
}

fn client_signed(input: &Input<'_>) {
    let (Ok(method_s), Ok(host), Ok(target)) = (
        std::str::from_utf8(input.method),
        std::str::from_utf8(input.host),
        std::str::from_utf8(input.target),
    ) else {
        return;
    };
    let nonce_bytes = values(input.nonces).first().copied().unwrap_or_default();
    let Ok(nonce) = std::str::from_utf8(nonce_bytes) else {
        return;
    };
    let Some(ts) = (input.now_ms / 1000).checked_add_signed(input.ts_delta_s) else {
        return;
    };
    // Only what the server can receive exactly as the client signed it.
    let Ok(method) = Method::from_bytes(method_s.as_bytes()) else {
        return;
    };
    let Ok(uri) = Uri::try_from(target) else {
        return;
    };
    let Ok(host_value) = HeaderValue::from_str(host) else {
        return;
    };
    if method.as_str() != method_s || uri.path_and_query().map(|pq| pq.as_str()) != Some(target) {
        return;
    }

    let secret = SECRETS[(input.flags & 1) as usize];
    let signed = Signer::new(secret).sign_at(method_s, host, target, input.body, ts, nonce);
    let mut headers = HeaderMap::new();
    headers.insert(http::header::HOST, host_value);
    signed.apply(&mut headers);

    let nonce_ok = (16..=128).contains(&nonce.len()) && nonce.bytes().all(|b| b.is_ascii_graphic());
    let ts_ok = signed.timestamp.len() <= 12;
    let in_window = ts.abs_diff(input.now_ms / 1000) <= input.window_s;
    let policy = policy(input.window_s);
    let begin = |headers: &HeaderMap, nonces: Arc<dyn NonceStore>| {
        policy.begin(&method, &uri, headers, input.now_ms, nonces)
    };

    let nonces = store();
    let pending = begin(&headers, nonces.clone());
    if !nonce_ok || !ts_ok {
        assert!(
            matches!(
                pending.as_ref().err(),
                Some(HmacFailure::Malformed | HmacFailure::Missing)
            ),
            "a malformed nonce {nonce:?} or timestamp {} passed the head",
            signed.timestamp
        );
        return;
    }
    if !in_window {
        assert_eq!(
            pending.as_ref().err(),
            Some(&HmacFailure::OutsideWindow),
            "timestamp {ts} at {}",
            input.now_ms
        );
        return;
    }
    let pending = match pending {
        Ok(p) => p,
        Err(f) => panic!("a client-signed request failed the head: {f:?}"),
    };
    assert_eq!(
        ready(pending.finish_with_body(input.body)),
        Ok(()),
        "a client-signed request was refused"
    );
    match begin(&headers, nonces) {
        Ok(p) => assert_eq!(
            ready(p.finish_with_body(input.body)),
            Err(HmacFailure::Replayed),
            "a replayed client-signed request passed"
        ),
        Err(f) => panic!("the replayed head failed: {f:?}"),
    }

    // Forgeries: one signature digit flipped, or a secret the pool does not have.
    let hex_sig = signed.signature.trim_start_matches("v1=");
    let flip_at = (input.flags >> 5) as usize % hex_sig.len().max(1);
    let flipped: String = hex_sig
        .char_indices()
        .map(|(i, c)| match (i == flip_at, c) {
            (true, '0') => '1',
            (true, _) => '0',
            (false, c) => c,
        })
        .collect();
    let other = Signer::new(NOT_CONFIGURED).sign_at(method_s, host, target, input.body, ts, nonce);
    for forged in [format!("v1={flipped}"), other.signature] {
        let mut forged_headers = headers.clone();
        let Ok(v) = HeaderValue::from_str(&forged) else {
            panic!("a hex signature is a header value");
        };
        forged_headers.insert(SIGNATURE, v);
        match begin(&forged_headers, store()) {
            Ok(p) => assert_eq!(
                ready(p.finish_with_body(input.body)),
                Err(HmacFailure::Signature),
                "a forged signature passed"
            ),
            Err(f) => panic!("a forged signature failed the head: {f:?}"),
        }
    }
}
