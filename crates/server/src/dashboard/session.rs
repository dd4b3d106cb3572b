//! Dashboard sessions: the admin token exchanged for a random session id, kept in memory only
//! as its SHA-256 (a dump of the table opens nothing), each with its own CSRF token and expiry.
//! The table is capped, so a flood of logins cannot grow memory without bound. A session is
//! bound to the admin token it was opened with: changing `server.admin_token` (a reload) ends
//! every session opened with the old one.

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
    /// SHA-256 of the admin token the session was opened with.
    token: [u8; 32],
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
    /// Opens a session at `now` (epoch ms) for admin token `token`; returns its id (the
    /// cookie's value, never stored).
    pub fn open(&self, now: u64, token: &str) -> String {
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
                token: digest(token),
            },
        );
        id
    }

    /// The session `id` names, if it is live at `now` and was opened with admin token `token`
    /// (the current one; `None` when there is none, which ends every session).
    pub fn find(&self, id: &str, now: u64, token: Option<&str>) -> Option<Open> {
        let key = digest(id);
        let current = token.map(digest);
        let mut table = self.by_digest.lock();
        match table.get(&key) {
            Some(s)
                if s.expires_at > now && current.is_some_and(|t| bool::from(t.ct_eq(&s.token))) =>
            {
                Some(Open {
                    csrf: s.csrf.clone(),
                })
            }
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
        let id = s.open(1_000, "tok");
        assert!(s.find(&id, 1_001, Some("tok")).is_some());
        assert!(s.find("not-a-session", 1_001, Some("tok")).is_none());
        assert!(
            s.find(&id, 1_000 + SESSION_TTL_MS, Some("tok")).is_none(),
            "expired"
        );
        let id = s.open(2_000, "tok");
        let Some(open) = s.find(&id, 2_001, Some("tok")) else {
            panic!("the session is live");
        };
        assert!(open.csrf_matches(&open.csrf.clone()));
        assert!(!open.csrf_matches("wrong"));
        s.end(&id);
        assert!(s.find(&id, 2_002, Some("tok")).is_none(), "logged out");
        let id = s.open(3_000, "tok");
        assert!(
            s.find(&id, 3_001, Some("new-token")).is_none(),
            "token changed"
        );
        assert!(s.find(&id, 3_001, None).is_none(), "admin token removed");
    }
}
