//! The wait queue: who waits for a slot, in which order they are served, and cheap removal.
//!
//! Owns only the ordering of waiters (three priority classes; within a class either round-robin
//! over fairness keys or strict FIFO). It knows nothing about slots, leases, RPM or time: the
//! [`crate::Governor`] decides *whether* the next waiter may be admitted, this module decides
//! *who* it is.
//!
//! Layout, chosen so that push, pop and cancel are all `O(log n)` and a parked waiter costs little
//! memory (10,000 parked waiters must be cheap):
//! - per class, one `BTreeMap<(queue key, seq), Waiter>`: the waiters of one key are a contiguous,
//!   sequence-ordered range, so "oldest waiter of key k" is a range lookup;
//! - per class, a ring of keys that have waiters, as `BTreeMap<ring position, key>`: the front key
//!   is served next and, if it still has waiters, moves to the back with a fresh position;
//! - one `id -> Loc` index over all classes, so cancel never scans.
//!
//! Without fair share every waiter of a class is filed under the single queue key `0`, which turns
//! the ring of one key into strict FIFO by sequence number.

use std::collections::BTreeMap;

// foldhash, not SipHash, as in `leases`: ids are random, keys are our own fairness ids.
use foldhash::{HashMap, HashMapExt};

use crate::Priority;

/// What a parked waiter needs once it is admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Waiter {
    pub(crate) id: u128,
    pub(crate) lease_ms: u64,
    pub(crate) grace_ms: u64,
}

/// A waiter's id as two words. `u128` is 16-byte aligned, which would pad every map entry that
/// holds one; this keeps entries 8-byte aligned (parked waiters are the bulk of the memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Id(u64, u64);

impl From<u128> for Id {
    fn from(id: u128) -> Self {
        // Truncations are the point: high and low halves.
        Id((id >> 64) as u64, id as u64)
    }
}

impl From<Id> for u128 {
    fn from(id: Id) -> Self {
        (u128::from(id.0) << 64) | u128::from(id.1)
    }
}

/// A waiter as stored in its class.
#[derive(Clone, Copy, Debug)]
///
/// Lease and grace are kept as `u32` ms, so two of them take the room one `u64` did and entries
/// stay small; a waiter's longer lease (over 49 days) is granted as 49 days.
struct Parked {
    id: Id,
    lease_ms: u32,
    grace_ms: u32,
}

impl From<Parked> for Waiter {
    fn from(p: Parked) -> Self {
        Waiter {
            id: p.id.into(),
            lease_ms: u64::from(p.lease_ms),
            grace_ms: u64::from(p.grace_ms),
        }
    }
}

/// Where a waiter sits. `key` is the caller's fairness key (kept even when fair share is off, so
/// turning fair share on later can file the waiter under its own key again).
#[derive(Clone, Copy, Debug)]
struct Loc {
    key: u64,
    seq: u64,
    class: u8,
}

/// One priority class.
#[derive(Clone, Debug, Default)]
struct Class {
    waiters: BTreeMap<(u64, u64), Parked>,
    /// Queue key -> its ring position; present iff the key has waiters.
    keys: HashMap<u64, u64>,
    /// Ring position -> queue key; the first entry is served next.
    ring: BTreeMap<u64, u64>,
    next_ring_pos: u64,
}

impl Class {
    fn has_waiters(&self, qkey: u64) -> bool {
        self.waiters
            .range((qkey, 0)..=(qkey, u64::MAX))
            .next()
            .is_some()
    }

    /// Puts `qkey` at the back of the ring.
    fn enter_ring(&mut self, qkey: u64) {
        let pos = self.next_ring_pos;
        self.next_ring_pos += 1;
        self.ring.insert(pos, qkey);
        self.keys.insert(qkey, pos);
    }

    fn push(&mut self, qkey: u64, seq: u64, parked: Parked) {
        self.waiters.insert((qkey, seq), parked);
        if !self.keys.contains_key(&qkey) {
            // A key that had no waiters joins at the back of the ring: it does not jump keys
            // that have been waiting.
            self.enter_ring(qkey);
        }
    }

    fn pop(&mut self) -> Option<Parked> {
        loop {
            let (_, qkey) = self.ring.pop_first()?;
            self.keys.remove(&qkey);
            let oldest = self
                .waiters
                .range((qkey, 0)..=(qkey, u64::MAX))
                .next()
                .map(|(k, p)| (*k, *p));
            // A ring entry without waiters would break the invariant; skipping it (it is already
            // out of the ring) is better than stalling the class.
            let Some((entry, parked)) = oldest else {
                continue;
            };
            self.waiters.remove(&entry);
            if self.has_waiters(qkey) {
                // The key just served goes to the back of the ring: round-robin.
                self.enter_ring(qkey);
            }
            return Some(parked);
        }
    }

    fn remove(&mut self, qkey: u64, seq: u64) -> Option<Parked> {
        let parked = self.waiters.remove(&(qkey, seq))?;
        if !self.has_waiters(qkey) {
            if let Some(pos) = self.keys.remove(&qkey) {
                self.ring.remove(&pos);
            }
        }
        Some(parked)
    }

    fn clear(&mut self) {
        self.waiters.clear();
        self.keys.clear();
        self.ring.clear();
    }
}

/// The pool's wait queue.
#[derive(Clone, Debug)]
pub(crate) struct WaitQueue {
    /// Indexed by [`class_index`]: high, normal, low.
    classes: [Class; 3],
    index: HashMap<Id, Loc>,
    next_seq: u64,
    fair_share: bool,
}

fn class_index(priority: Priority) -> u8 {
    match priority {
        Priority::High => 0,
        Priority::Normal => 1,
        Priority::Low => 2,
    }
}

impl WaitQueue {
    pub(crate) fn new(fair_share: bool) -> Self {
        WaitQueue {
            classes: Default::default(),
            index: HashMap::new(),
            next_seq: 0,
            fair_share,
        }
    }

    fn queue_key(&self, key: u64) -> u64 {
        if self.fair_share {
            key
        } else {
            0
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub(crate) fn len_of(&self, priority: Priority) -> usize {
        self.classes[usize::from(class_index(priority))]
            .waiters
            .len()
    }

    pub(crate) fn contains(&self, id: u128) -> bool {
        self.index.contains_key(&Id::from(id))
    }

    /// Parks a waiter at the back of its key's FIFO. The caller guarantees `id` is not queued.
    pub(crate) fn push(
        &mut self,
        id: u128,
        key: u64,
        priority: Priority,
        lease_ms: u64,
        grace_ms: u64,
    ) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let class = class_index(priority);
        let qkey = self.queue_key(key);
        let id = Id::from(id);
        self.classes[usize::from(class)].push(
            qkey,
            seq,
            Parked {
                id,
                lease_ms: u32::try_from(lease_ms).unwrap_or(u32::MAX),
                grace_ms: u32::try_from(grace_ms).unwrap_or(u32::MAX),
            },
        );
        self.index.insert(id, Loc { key, seq, class });
    }

    /// Removes and returns the waiter to serve next: highest class first, then the ring order.
    pub(crate) fn pop(&mut self) -> Option<Waiter> {
        let parked = self.classes.iter_mut().find_map(Class::pop)?;
        self.index.remove(&parked.id);
        Some(parked.into())
    }

    /// Removes a waiter; `false` if it was not queued.
    pub(crate) fn cancel(&mut self, id: u128) -> bool {
        let Some(loc) = self.index.remove(&Id::from(id)) else {
            return false;
        };
        let qkey = self.queue_key(loc.key);
        self.classes[usize::from(loc.class)]
            .remove(qkey, loc.seq)
            .is_some()
    }

    /// Switches between fair share and strict FIFO, refiling every waiter. Rare (reconfigure),
    /// so an `O(n log n)` rebuild is fine. Sequence numbers are kept, so FIFO order within a key
    /// and class survives, and the new ring starts with the keys whose oldest waiter is oldest.
    pub(crate) fn set_fair_share(&mut self, fair_share: bool) {
        if self.fair_share == fair_share {
            return;
        }
        let mut all: Vec<(u64, u64, u8, Parked)> = Vec::with_capacity(self.index.len());
        for class in &mut self.classes {
            for (_, parked) in std::mem::take(&mut class.waiters) {
                if let Some(loc) = self.index.get(&parked.id) {
                    all.push((loc.seq, loc.key, loc.class, parked));
                }
            }
            class.clear();
        }
        all.sort_unstable_by_key(|entry| entry.0);
        self.fair_share = fair_share;
        for (seq, key, class, parked) in all {
            let qkey = self.queue_key(key);
            self.classes[usize::from(class)].push(qkey, seq, parked);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn drain(q: &mut WaitQueue) -> Vec<u128> {
        std::iter::from_fn(|| q.pop().map(|w| w.id)).collect()
    }

    #[test]
    fn fifo_within_one_key() {
        let mut q = WaitQueue::new(true);
        for id in 1..=5 {
            q.push(id, 7, Priority::Normal, 0, 0);
        }
        assert_eq!(drain(&mut q), vec![1, 2, 3, 4, 5]);
        assert!(q.is_empty());
    }

    #[test]
    fn higher_class_served_first_regardless_of_age() {
        let mut q = WaitQueue::new(true);
        q.push(1, 1, Priority::Low, 0, 0);
        q.push(2, 1, Priority::Normal, 0, 0);
        q.push(3, 1, Priority::High, 0, 0);
        q.push(4, 2, Priority::Normal, 0, 0);
        assert_eq!(q.len_of(Priority::Normal), 2);
        assert_eq!(drain(&mut q), vec![3, 2, 4, 1]);
    }

    #[test]
    fn keys_alternate_under_unequal_floods() {
        let mut q = WaitQueue::new(true);
        // Key 1 floods first with 6 waiters, then key 2 adds 2, then key 3 adds 1.
        for id in 1..=6 {
            q.push(id, 1, Priority::Normal, 0, 0);
        }
        q.push(101, 2, Priority::Normal, 0, 0);
        q.push(102, 2, Priority::Normal, 0, 0);
        q.push(201, 3, Priority::Normal, 0, 0);
        assert_eq!(drain(&mut q), vec![1, 101, 201, 2, 102, 3, 4, 5, 6]);
    }

    #[test]
    fn without_fair_share_strict_fifo_across_keys() {
        let mut q = WaitQueue::new(false);
        q.push(1, 1, Priority::Normal, 0, 0);
        q.push(2, 1, Priority::Normal, 0, 0);
        q.push(3, 2, Priority::Normal, 0, 0);
        q.push(4, 1, Priority::Normal, 0, 0);
        assert_eq!(drain(&mut q), vec![1, 2, 3, 4]);
    }

    #[test]
    fn cancel_removes_only_that_waiter_and_empty_keys_leave_the_ring() {
        let mut q = WaitQueue::new(true);
        q.push(1, 1, Priority::Normal, 0, 0);
        q.push(2, 2, Priority::Normal, 0, 0);
        q.push(3, 1, Priority::Normal, 0, 0);
        assert!(q.cancel(2));
        assert!(!q.cancel(2));
        assert!(!q.contains(2));
        assert_eq!(q.len(), 2);
        // Key 2 is gone from the ring; key 1 is served in order.
        assert_eq!(drain(&mut q), vec![1, 3]);
        // A key that emptied by cancel and comes back joins the ring again.
        q.push(4, 2, Priority::Normal, 0, 0);
        assert!(q.cancel(4));
        q.push(5, 2, Priority::Normal, 0, 0);
        assert_eq!(drain(&mut q), vec![5]);
        assert!(q
            .classes
            .iter()
            .all(|c| c.ring.is_empty() && c.keys.is_empty()));
    }

    #[test]
    fn toggling_fair_share_keeps_fifo_per_key() {
        let mut q = WaitQueue::new(false);
        for (id, key) in [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2)] {
            q.push(id, key, Priority::Normal, 9, 0);
        }
        q.set_fair_share(true);
        assert_eq!(drain(&mut q), vec![1, 4, 2, 5, 3]);
        for (id, key) in [(1, 1), (2, 2), (3, 1)] {
            q.push(id, key, Priority::High, 9, 0);
        }
        q.set_fair_share(false);
        assert!(q.cancel(2));
        let got: Vec<Waiter> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(
            got,
            vec![
                Waiter {
                    id: 1,
                    lease_ms: 9,
                    grace_ms: 0
                },
                Waiter {
                    id: 3,
                    lease_ms: 9,
                    grace_ms: 0
                }
            ]
        );
    }

    #[test]
    fn ids_round_trip() {
        for id in [
            0u128,
            1,
            u128::from(u64::MAX),
            u128::from(u64::MAX) + 1,
            u128::MAX,
            0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
        ] {
            assert_eq!(u128::from(Id::from(id)), id);
        }
    }

    #[test]
    fn per_waiter_entries_stay_small() {
        // The two per-waiter entries (index + class map); nodes and hash slack come on top.
        let index_entry = std::mem::size_of::<(Id, Loc)>();
        let class_entry = std::mem::size_of::<((u64, u64), Parked)>();
        assert!(
            index_entry + class_entry <= 80,
            "{index_entry} + {class_entry}"
        );
    }
}
