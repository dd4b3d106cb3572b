//! Seen request nonces, for HMAC replay protection (SPEC §9).
//!
//! A signed request carries a nonce; a nonce seen again while its signature could still pass the
//! timestamp window is a replay. Which nonces were seen is coordination state: several nodes
//! serving one pool must share it, so it sits behind [`NonceStore`] beside the gates, and a Redis
//! implementation (`SET key 1 NX PXAT expiry`) will sit beside [`InProcessNonces`].
//!
//! Only requests whose signature already verified reach the store, so unauthenticated callers
//! cannot fill it. It is bounded all the same: when full of unexpired nonces it refuses new ones
//! ([`NonceVerdict::Full`]) rather than forget one early, because forgetting would reopen a replay.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use parking_lot::Mutex;

/// A digest of a nonce (the caller hashes it: stored keys have a fixed size whatever the nonce's
/// length). Collisions must be infeasible, so use a cryptographic hash.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct NonceKey(pub [u8; 16]);

/// What the store says about a nonce.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum NonceVerdict {
    /// Not seen before (within its lifetime); now recorded.
    Fresh,
    /// Seen before and not yet expired: a replay.
    Replayed,
    /// The store is full of unexpired nonces; the nonce was not recorded.
    Full,
}

/// Where seen nonces live. One store per pool.
#[async_trait::async_trait]
pub trait NonceStore: Send + Sync + 'static {
    /// Records `nonce` as seen until `expires_at_ms` (epoch ms), unless it was already seen and has
    /// not expired. `now_ms` is the caller's clock, so tests move time instead of waiting.
    async fn check_and_record(
        &self,
        nonce: NonceKey,
        now_ms: u64,
        expires_at_ms: u64,
    ) -> NonceVerdict;
}

/// One node's nonce store: a map of unexpired nonces plus a min-heap of expiries, bounded by
/// `capacity`. Expired entries are dropped on every call, oldest first.
pub struct InProcessNonces {
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    seen: HashMap<NonceKey, u64>,
    expiries: BinaryHeap<Reverse<(u64, NonceKey)>>,
}

impl InProcessNonces {
    pub fn new(capacity: usize) -> Self {
        InProcessNonces {
            capacity: capacity.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Unexpired nonces held (as of the last call).
    pub fn len(&self) -> usize {
        self.inner.lock().seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets `nonce` (one recorded here whose durable record then failed, so that its request
    /// was refused: the caller may try it again).
    pub fn forget(&self, nonce: NonceKey) {
        // Its heap entry stays and is skipped when it comes due (see `Inner::purge`).
        self.inner.lock().seen.remove(&nonce);
    }

    /// The synchronous core of [`NonceStore::check_and_record`].
    pub fn record(&self, nonce: NonceKey, now_ms: u64, expires_at_ms: u64) -> NonceVerdict {
        let mut inner = self.inner.lock();
        inner.purge(now_ms);
        if inner.seen.get(&nonce).is_some_and(|&exp| exp > now_ms) {
            return NonceVerdict::Replayed;
        }
        if inner.seen.len() >= self.capacity {
            return NonceVerdict::Full;
        }
        let expires = expires_at_ms.max(now_ms.saturating_add(1));
        inner.seen.insert(nonce, expires);
        inner.expiries.push(Reverse((expires, nonce)));
        NonceVerdict::Fresh
    }
}

impl Inner {
    fn purge(&mut self, now_ms: u64) {
        while let Some(Reverse((exp, key))) = self.expiries.peek().copied() {
            if exp > now_ms {
                break;
            }
            self.expiries.pop();
            // The key may have been recorded again with a later expiry after this one lapsed.
            if self.seen.get(&key) == Some(&exp) {
                self.seen.remove(&key);
            }
        }
    }
}

#[async_trait::async_trait]
impl NonceStore for InProcessNonces {
    async fn check_and_record(
        &self,
        nonce: NonceKey,
        now_ms: u64,
        expires_at_ms: u64,
    ) -> NonceVerdict {
        self.record(nonce, now_ms, expires_at_ms)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn key(n: u8) -> NonceKey {
        NonceKey([n; 16])
    }

    #[test]
    fn a_nonce_is_fresh_once_then_a_replay_until_it_expires() {
        let s = InProcessNonces::new(10);
        assert_eq!(s.record(key(1), 1_000, 2_000), NonceVerdict::Fresh);
        assert_eq!(s.record(key(1), 1_500, 2_500), NonceVerdict::Replayed);
        assert_eq!(s.record(key(2), 1_500, 2_500), NonceVerdict::Fresh);
        // A replay does not extend the first sighting's life.
        assert_eq!(s.record(key(1), 2_000, 3_000), NonceVerdict::Fresh);
        assert_eq!(s.record(key(1), 2_999, 4_000), NonceVerdict::Replayed);
        assert_eq!(s.len(), 1, "key 2 expired at 2500");
        s.record(key(9), 10_000, 11_000);
        assert_eq!(s.len(), 1, "expired nonces are dropped");
    }

    #[test]
    fn a_full_store_refuses_rather_than_forgets() {
        let s = InProcessNonces::new(3);
        for n in 0..3 {
            assert_eq!(
                s.record(key(n), 0, 1_000 + u64::from(n)),
                NonceVerdict::Fresh
            );
        }
        assert_eq!(s.record(key(7), 500, 1_500), NonceVerdict::Full);
        // Replays are still recognised when full.
        assert_eq!(s.record(key(1), 500, 1_500), NonceVerdict::Replayed);
        // Once the oldest expires, there is room again.
        assert_eq!(s.record(key(7), 1_000, 2_000), NonceVerdict::Fresh);
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn a_forgotten_nonce_is_fresh_again_and_its_old_expiry_is_harmless() {
        let s = InProcessNonces::new(10);
        assert_eq!(s.record(key(1), 0, 1_000), NonceVerdict::Fresh);
        s.forget(key(1));
        assert!(s.is_empty());
        assert_eq!(s.record(key(1), 10, 5_000), NonceVerdict::Fresh);
        // The first record's heap entry comes due and must not remove the second.
        assert_eq!(s.record(key(2), 2_000, 3_000), NonceVerdict::Fresh);
        assert_eq!(s.record(key(1), 2_000, 6_000), NonceVerdict::Replayed);
    }

    #[tokio::test]
    async fn the_trait_answers_like_the_core() {
        let s: std::sync::Arc<dyn NonceStore> = std::sync::Arc::new(InProcessNonces::new(4));
        assert_eq!(
            s.check_and_record(key(3), 0, 100).await,
            NonceVerdict::Fresh
        );
        assert_eq!(
            s.check_and_record(key(3), 50, 150).await,
            NonceVerdict::Replayed
        );
    }
}
