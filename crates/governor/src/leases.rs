//! Held slots and their lease deadlines.
//!
//! Owns the set of slot holders and the order in which their leases expire. It applies the lease
//! rules (a lease never runs past its request deadline; renew at the cap is refused) but does not
//! decide admission or touch the queue.
//!
//! Deadlines are kept in a `BTreeSet<(deadline, id)>` beside the holder map, so the next expiry
//! and the reclaim of one expired slot are both `O(log n)`.

use std::collections::BTreeSet;

// foldhash, not SipHash: the ids are random (`SlotId::random`), and the map is read on every
// admission and release (SipHash cost ~160 instructions a lookup, bench/RESULTS.md).
use foldhash::HashMap;

use crate::RenewRefusal;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) lease_deadline: u64,
    pub(crate) request_deadline: u64,
    pub(crate) granted_at: u64,
    /// The pool's admission count right after this grant (see `Adaptive::admitted`).
    pub(crate) seq: u64,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Leases {
    held: HashMap<u128, Held>,
    expiries: BTreeSet<(u64, u128)>,
}

impl Leases {
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    pub(crate) fn contains(&self, id: u128) -> bool {
        self.held.contains_key(&id)
    }

    /// When `id` was granted and the admission count right after, if it is held.
    pub(crate) fn granted(&self, id: u128) -> Option<(u64, u64)> {
        self.held.get(&id).map(|h| (h.granted_at, h.seq))
    }

    /// Records a grant. The caller guarantees `id` is not held.
    pub(crate) fn grant(&mut self, id: u128, held: Held) {
        self.expiries.insert((held.lease_deadline, id));
        self.held.insert(id, held);
    }

    pub(crate) fn release(&mut self, id: u128) -> Option<Held> {
        let held = self.held.remove(&id)?;
        self.expiries.remove(&(held.lease_deadline, id));
        Some(held)
    }

    /// Extends a lease by `term_ms` from `now`, never past its request deadline. A lease whose
    /// deadline has already passed is treated as reclaimed: it is removed and `NotFound` is
    /// returned, so a late renew cannot resurrect a slot the holder had abandoned.
    pub(crate) fn renew(&mut self, now: u64, id: u128, term_ms: u64) -> Result<u64, RenewRefusal> {
        let held = self.held.get(&id).copied().ok_or(RenewRefusal::NotFound)?;
        if held.lease_deadline <= now {
            self.release(id);
            return Err(RenewRefusal::NotFound);
        }
        if held.lease_deadline >= held.request_deadline {
            return Err(RenewRefusal::Capped);
        }
        let new_deadline = now.saturating_add(term_ms).min(held.request_deadline);
        // Renewing never shortens a lease (a term shorter than what is left keeps the old one).
        let new_deadline = new_deadline.max(held.lease_deadline);
        self.expiries.remove(&(held.lease_deadline, id));
        self.expiries.insert((new_deadline, id));
        self.held.insert(
            id,
            Held {
                lease_deadline: new_deadline,
                ..held
            },
        );
        Ok(new_deadline)
    }

    /// Removes one holder whose lease deadline is `<= now`, earliest first.
    pub(crate) fn pop_expired(&mut self, now: u64) -> Option<u128> {
        let &(deadline, id) = self.expiries.first()?;
        if deadline > now {
            return None;
        }
        self.expiries.pop_first();
        self.held.remove(&id);
        Some(id)
    }

    pub(crate) fn next_expiry(&self) -> Option<u64> {
        self.expiries.first().map(|&(deadline, _)| deadline)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn held(lease: u64, request: u64) -> Held {
        Held {
            lease_deadline: lease,
            request_deadline: request,
            granted_at: 0,
            seq: 0,
        }
    }

    #[test]
    fn renew_extends_up_to_the_cap_then_refuses() {
        let mut l = Leases::default();
        l.grant(1, held(30_000, 70_000));
        assert_eq!(l.renew(10_000, 1, 30_000), Ok(40_000));
        assert_eq!(l.renew(39_000, 1, 30_000), Ok(69_000));
        assert_eq!(l.renew(60_000, 1, 30_000), Ok(70_000));
        assert_eq!(l.renew(61_000, 1, 30_000), Err(RenewRefusal::Capped));
        assert_eq!(l.next_expiry(), Some(70_000));
        assert_eq!(l.renew(0, 2, 30_000), Err(RenewRefusal::NotFound));
    }

    #[test]
    fn renew_after_lease_deadline_is_not_found_and_frees() {
        let mut l = Leases::default();
        l.grant(1, held(30_000, 70_000));
        assert_eq!(l.renew(30_000, 1, 30_000), Err(RenewRefusal::NotFound));
        assert!(!l.contains(1));
        assert_eq!(l.next_expiry(), None);
    }

    #[test]
    fn expired_leases_pop_earliest_first_one_at_a_time() {
        let mut l = Leases::default();
        l.grant(1, held(300, 1_000));
        l.grant(2, held(100, 1_000));
        l.grant(3, held(500, 1_000));
        assert_eq!(l.pop_expired(99), None);
        assert_eq!(l.pop_expired(300), Some(2));
        assert_eq!(l.pop_expired(300), Some(1));
        assert_eq!(l.pop_expired(300), None);
        assert_eq!(l.len(), 1);
        assert_eq!(l.release(3).map(|h| h.lease_deadline), Some(500));
        assert_eq!(l.next_expiry(), None);
    }
}
