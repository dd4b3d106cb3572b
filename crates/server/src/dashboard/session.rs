//! Dashboard sessions: the admin token exchanged for a random session id, kept in memory only
//! as its SHA-256 (a dump of the table opens nothing), each with its own CSRF token and expiry.
//! The table is capped, so a flood of logins cannot grow memory without bound.

use std::collections::HashMap;

use parking_lot::Mutex;
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// How long a session lasts from login.
pub const SESSION_TTL_MS: u64 = 12 * 60 * 60 * 1000;
/// The most sessions held at once; past it the one closest to expiry goes.
const MAX_SESSIONS: usize = 1024;

struct Session {
    csrf: String,
    expires_at: u64,
}

#[derive(Default)]
pub struct Sessions {
    by_digest: Mutex<HashMap<[u8; 32], Session>>,
}

/// A live session as a request presents it.
pub struct Open {
    pub csrf: String,
}

impl Open {
    /// Whether `given` is this session's CSRF token (constant time).
    pub fn csrf_matches(&self, given: &str) -> bool {
        bool::from(self.csrf.as_bytes().ct_eq(given.as_bytes()))
    }
}

fn random_hex() -> String {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    hex::encode(bytes)
}

fn digest(id: &str) -> [u8; 32] {
    Sha256::digest(id.as_bytes()).into()
}

impl Sessions {
    /// Opens a session at `now` (epoch ms); returns its id (the cookie's value, never stored).
    pub fn open(&self, now: u64) -> String {
        let id = random_hex();
        let mut table = self.by_digest.lock();
        table.retain(|_, s| s.expires_at > now);
        if table.len() >= MAX_SESSIONS {
            let oldest = table
                .iter()
                .min_by_key(|(_, s)| s.expires_at)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                table.remove(&k);
            }
        }
        table.insert(
            digest(&id),
            Session {
                csrf: random_hex(),
                expires_at: now + SESSION_TTL_MS,
            },
        );
        id
    }

    /// The session `id` names, if it is live at `now`.
    pub fn find(&self, id: &str, now: u64) -> Option<Open> {
        let key = digest(id);
        let mut table = self.by_digest.lock();
        match table.get(&key) {
            Some(s) if s.expires_at > now => Some(Open {
                csrf: s.csrf.clone(),
            }),
            Some(_) => {
                table.remove(&key);
                None
            }
            None => None,
        }
    }

    /// Ends the session `id` (logout).
    pub fn end(&self, id: &str) {
        self.by_digest.lock().remove(&digest(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_expire_and_end() {
        let s = Sessions::default();
        let id = s.open(1_000);
        assert!(s.find(&id, 1_001).is_some());
        assert!(s.find("not-a-session", 1_001).is_none());
        assert!(s.find(&id, 1_000 + SESSION_TTL_MS).is_none(), "expired");
        let id = s.open(2_000);
        let Some(open) = s.find(&id, 2_001) else {
            panic!("the session is live");
        };
        assert!(open.csrf_matches(&open.csrf.clone()));
        assert!(!open.csrf_matches("wrong"));
        s.end(&id);
        assert!(s.find(&id, 2_002).is_none(), "logged out");
    }
}
