//! Caller authentication on every pool route (SPEC §2): the pool key, in the forms the pool
//! accepts. The key's format and checksum are checked before any lookup; lookups compare
//! SHA-256 digests. Failure reasons go to the access log, never to the caller.

// foldhash, not SipHash: the index is keyed by SHA-256 digests (uniform, not chosen by
// anyone) and looked up on every request.
use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;

use http::HeaderMap;
use nthbouncer_config::{keys, AuthMethod};
use nthbouncer_store::StoredKey;

use crate::core::extract;
use crate::core::ManagedBy;

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

/// The forms of the pool key a pool accepts (`auth.accept`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Accept {
    pub header: bool,
    pub bearer: bool,
    pub nthbouncer: bool,
}

impl Accept {
    pub fn of(methods: &[AuthMethod]) -> Accept {
        Accept {
            header: methods.contains(&AuthMethod::Header),
            bearer: methods.contains(&AuthMethod::Bearer),
            nthbouncer: methods.contains(&AuthMethod::Nthbouncer),
        }
    }
}

/// One accepted key, as the hot path needs it.
#[derive(Clone, Debug)]
pub struct KeyEntry {
    /// Public id (`key_…`), safe to log.
    pub id: Arc<str>,
    pub fairness: u64,
    pub expires_at: Option<u64>,
    pub revoked: bool,
    pub managed_by: ManagedBy,
    pub label: Option<String>,
    pub created_at: u64,
    pub revoked_at: Option<u64>,
}

/// A pool's keys by SHA-256 digest. Lookups compare digests, never plaintext, so timing tells an
/// attacker nothing about a key.
#[derive(Default, Debug)]
pub struct KeyIndex {
    pub by_digest: HashMap<[u8; 32], KeyEntry>,
}

impl KeyIndex {
    /// Config keys first, then the store's keys for this pool (a store key never shadows a
    /// config key of the same digest).
    pub fn build(config_digests: &[[u8; 32]], stored: &[StoredKey]) -> KeyIndex {
        let mut by_digest = HashMap::with_capacity(config_digests.len() + stored.len());
        for d in config_digests {
            by_digest.insert(
                *d,
                KeyEntry {
                    id: keys::key_id_from_digest(d).into(),
                    fairness: keys::fairness_id(d),
                    expires_at: None,
                    revoked: false,
                    managed_by: ManagedBy::Config,
                    label: None,
                    created_at: 0,
                    revoked_at: None,
                },
            );
        }
        for k in stored {
            let Some(d) = hex::decode(&k.hash)
                .ok()
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
            else {
                tracing::warn!(key_id = %k.id, "stored key has an unreadable hash; ignored");
                continue;
            };
            by_digest.entry(d).or_insert_with(|| KeyEntry {
                id: k.id.as_str().into(),
                fairness: keys::fairness_id(&d),
                expires_at: k.expires_at,
                revoked: k.revoked_at.is_some(),
                managed_by: ManagedBy::Api,
                label: k.label.clone(),
                created_at: k.created_at,
                revoked_at: k.revoked_at,
            });
        }
        KeyIndex { by_digest }
    }
}

/// Finds the key the caller presents, in the forms the pool accepts.
fn presented_key(accept: Accept, headers: &HeaderMap) -> Option<(&str, bool)> {
    if accept.header {
        if let Some(v) = headers.get(KEY_HEADER) {
            return v.to_str().ok().map(|s| (s.trim(), false));
        }
    }
    if accept.bearer || accept.nthbouncer {
        let (scheme, token) = extract::scheme_and_token(extract::authorization(headers)?)?;
        let accepted = (accept.bearer && scheme.eq_ignore_ascii_case("bearer"))
            || (accept.nthbouncer && scheme.eq_ignore_ascii_case("nthbouncer"));
        if accepted {
            return Some((token, true));
        }
    }
    None
}

/// Authenticates a request against a pool's keys at time `now` (epoch ms).
pub fn authenticate(
    accept: Accept,
    index: &KeyIndex,
    headers: &HeaderMap,
    now: u64,
) -> Result<Caller, AuthFailure> {
    let (key, used_authorization) = presented_key(accept, headers).ok_or(AuthFailure::Missing)?;
    keys::check_format(key).map_err(|_| AuthFailure::Malformed)?;
    let digest = keys::digest(key);
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
