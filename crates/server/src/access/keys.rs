//! Caller authentication on every pool route (SPEC §2): the pool key, in the forms the pool
//! accepts. The key's format and checksum are checked before any lookup; lookups compare
//! SHA-256 digests. Failure reasons go to the access log, never to the caller.

use std::sync::Arc;

use http::HeaderMap;
use nthbouncer_config::keys;

use crate::core::extract;
use crate::pools::registry::PoolRuntime;

pub const KEY_HEADER: &str = "x-nthpool-key";

/// An authenticated caller.
#[derive(Clone, Debug)]
pub struct Caller {
    pub key_id: Arc<str>,
    pub fairness: u64,
    /// The `Authorization` header carried the pool key: it must not be forwarded upstream.
    pub used_authorization: bool,
}

/// Why authentication failed (for the access log only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthFailure {
    Missing,
    Malformed,
    Unknown,
    Revoked,
    Expired,
}

impl AuthFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            AuthFailure::Missing => "no pool key presented",
            AuthFailure::Malformed => "pool key malformed or checksum mismatch",
            AuthFailure::Unknown => "unknown pool key",
            AuthFailure::Revoked => "pool key revoked",
            AuthFailure::Expired => "pool key expired",
        }
    }
}

/// Finds the key the caller presents, in the forms this pool accepts.
fn presented_key<'a>(pool: &PoolRuntime, headers: &'a HeaderMap) -> Option<(&'a str, bool)> {
    if pool.accept_header {
        if let Some(v) = headers.get(KEY_HEADER) {
            return v.to_str().ok().map(|s| (s.trim(), false));
        }
    }
    if pool.accept_bearer || pool.accept_nthbouncer {
        let (scheme, token) = extract::scheme_and_token(extract::authorization(headers)?)?;
        let accepted = (pool.accept_bearer && scheme.eq_ignore_ascii_case("bearer"))
            || (pool.accept_nthbouncer && scheme.eq_ignore_ascii_case("nthbouncer"));
        if accepted {
            return Some((token, true));
        }
    }
    None
}

/// Authenticates a request against a pool's keys at time `now` (epoch ms).
pub fn authenticate(
    pool: &PoolRuntime,
    headers: &HeaderMap,
    now: u64,
) -> Result<Caller, AuthFailure> {
    let (key, used_authorization) = presented_key(pool, headers).ok_or(AuthFailure::Missing)?;
    keys::check_format(key).map_err(|_| AuthFailure::Malformed)?;
    let digest = keys::digest(key);
    let index = pool.keys.load();
    let entry = index.by_digest.get(&digest).ok_or(AuthFailure::Unknown)?;
    if entry.revoked {
        return Err(AuthFailure::Revoked);
    }
    if entry.expires_at.is_some_and(|at| at <= now) {
        return Err(AuthFailure::Expired);
    }
    Ok(Caller {
        key_id: entry.id.clone(),
        fairness: entry.fairness,
        used_authorization,
    })
}
