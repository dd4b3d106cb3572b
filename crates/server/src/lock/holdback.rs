//! What the lease book puts on record for a pool: not each lease, but a holdback of `count`
//! slots until `until` (what a restart must hold back), written as `count` records
//! (`holdback {i} book {book} of {pool}`) in the store's lease table.
//!
//! Why: a restart needs only how many slots of each pool may still be in use by holders it
//! cannot see, and a record per lease made every grant wait for a commit (half of the lock
//! API's cost, bench/RESULTS.md). With a holdback, a grant waits only when its pool's live leases
//! outgrow the holdback on record (or its deadline passes the holdback's `until`); releases and most
//! grants touch memory alone. Holdbacks are lowered to the live count once a second
//! ([`super::leases`]), so after a crash a pool holds back at most what it held in its last
//! second, never less than what its holders still hold.
//!
//! The invariant, kept by lowering in memory before the lowering is written and raising in
//! memory only after the raise is committed: rows `0..covered` are on record with an `until`
//! of at least `until`, so a grant answered because `live <= covered` is always on record.
//!
//! Owns the bookkeeping only (pure: no IO, no clock of its own); the book's thread writes the
//! [`Plan`]s it hands out.

use std::collections::HashMap;

use nthbouncer_store::LeaseRecord;

/// A raised holdback covers the deadlines of grants for this long after the latest one, so a
/// pool with steady traffic raises its `until` about once a minute, not once per grant.
pub const UNTIL_AHEAD_MS: u64 = 60_000;

type Map<V> = HashMap<String, V, foldhash::fast::RandomState>;

/// A lease answered and not yet released.
struct Live {
    pool: String,
    deadline: u64,
}

#[derive(Default)]
struct PoolHoldback {
    /// Leases of this pool answered and not released (nor past their deadline).
    live: u32,
    /// The latest request deadline of any of its grants.
    latest_deadline: u64,
    /// Rows `0..covered` are on record, with `until` or later.
    covered: u32,
    until: u64,
    /// At most this many rows may be on record (more than `covered` after a failed lowering).
    rows: u32,
}

#[derive(Default)]
pub struct Holdbacks {
    /// Which book (one per start) the rows are this one's: a book never rewrites or deletes
    /// the rows of one before a restart, which hold their slots back until their `until`.
    book: u64,
    live: Map<Live>,
    pools: Map<PoolHoldback>,
}

/// One pool's holdback to write: rows `0..count` until `until`, rows `count..` gone.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    pool: String,
    count: u32,
    until: u64,
    /// Rows from this index on are (re)written.
    write_from: u32,
    /// Rows `count..delete_to` are deleted.
    delete_to: u32,
}

/// The holdbacks one commit writes.
#[derive(Debug, Default)]
pub struct Plan {
    book: u64,
    targets: Vec<Target>,
}

/// The record id of a pool's holdback row. Slot ids are hex, so these never collide with them.
fn row_id(book: u64, pool: &str, i: u32) -> String {
    format!("holdback {i} book {book} of {pool}")
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// The records to write and the ids to delete, in one transaction.
    pub fn records(&self) -> (Vec<LeaseRecord>, Vec<String>) {
        let book = self.book;
        let mut written = Vec::new();
        let mut deleted = Vec::new();
        for t in &self.targets {
            written.extend((t.write_from..t.count).map(|i| LeaseRecord {
                slot_id: row_id(book, &t.pool, i),
                pool: t.pool.clone(),
                request_deadline: t.until,
            }));
            deleted.extend((t.count..t.delete_to).map(|i| row_id(book, &t.pool, i)));
        }
        (written, deleted)
    }
}

impl Holdbacks {
    /// The holdbacks of one book: `book` tells its rows from those of books before a restart
    /// (the time it started at will do).
    pub fn of_book(book: u64) -> Holdbacks {
        Holdbacks {
            book,
            ..Holdbacks::default()
        }
    }

    /// A grant about to be answered. `None` when the holdback on record covers it already;
    /// otherwise its slot id, and the grant must wait for the next commit.
    pub fn grant(&mut self, lease: LeaseRecord) -> Option<String> {
        let holdback = match self.pools.get_mut(&lease.pool) {
            Some(holdback) => holdback,
            None => self.pools.entry(lease.pool.clone()).or_default(),
        };
        holdback.live = holdback.live.saturating_add(1);
        holdback.latest_deadline = holdback.latest_deadline.max(lease.request_deadline);
        let on_record =
            holdback.live <= holdback.covered && lease.request_deadline <= holdback.until;
        let waiting = (!on_record).then(|| lease.slot_id.clone());
        self.live.insert(
            lease.slot_id,
            Live {
                pool: lease.pool,
                deadline: lease.request_deadline,
            },
        );
        waiting
    }

    /// A lease released (or a grant whose commit failed). Unknown ids are ignored.
    pub fn release(&mut self, slot_id: &str) {
        if let Some(gone) = self.live.remove(slot_id) {
            if let Some(holdback) = self.pools.get_mut(&gone.pool) {
                holdback.live = holdback.live.saturating_sub(1);
            }
        }
    }

    /// What to write now: every holdback its live leases outgrew, and with `lower` (once a
    /// second, and at a flush) every holdback above its live count, lowered in memory at once.
    /// Leases past their deadline are forgotten first: no holder can use them any more.
    pub fn plan(&mut self, now: u64, lower: bool) -> Plan {
        if lower {
            let pools = &mut self.pools;
            self.live.retain(|_, lease| {
                let keep = lease.deadline > now;
                if !keep {
                    if let Some(holdback) = pools.get_mut(&lease.pool) {
                        holdback.live = holdback.live.saturating_sub(1);
                    }
                }
                keep
            });
            self.pools
                .retain(|_, c| c.live > 0 || c.covered > 0 || c.rows > 0);
        }
        let mut targets = Vec::new();
        for (pool, holdback) in &mut self.pools {
            let raise = holdback.live > holdback.covered;
            let extend = holdback.live > 0 && holdback.latest_deadline > holdback.until;
            let lowering =
                lower && (holdback.covered > holdback.live || holdback.rows > holdback.live);
            if !(raise || extend || lowering) {
                continue;
            }
            let count = if raise || lowering {
                holdback.live
            } else {
                holdback.covered
            };
            let until = if extend {
                holdback.latest_deadline.saturating_add(UNTIL_AHEAD_MS)
            } else {
                holdback.until
            };
            let write_from = if until > holdback.until {
                0
            } else {
                holdback.covered.min(count)
            };
            // Lowered before it is written: a grant checked meanwhile must not count on rows
            // about to go.
            holdback.covered = holdback.covered.min(count);
            targets.push(Target {
                pool: pool.clone(),
                count,
                until,
                write_from,
                delete_to: holdback.rows.max(count),
            });
        }
        Plan {
            book: self.book,
            targets,
        }
    }

    /// `plan` is on record: its raises now cover the grants that waited for them.
    pub fn committed(&mut self, plan: &Plan) {
        for t in &plan.targets {
            if let Some(holdback) = self.pools.get_mut(&t.pool) {
                holdback.covered = t.count;
                holdback.until = t.until;
                holdback.rows = t.count;
            }
        }
    }

    /// `plan` could not be written: nothing of it is on record, and rows it would have
    /// deleted may still be.
    pub fn failed(&mut self, plan: &Plan) {
        for t in &plan.targets {
            if let Some(holdback) = self.pools.get_mut(&t.pool) {
                holdback.rows = holdback.rows.max(t.delete_to);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lease(pool: &str, i: u32, deadline: u64) -> LeaseRecord {
        LeaseRecord {
            slot_id: format!("{i:032x}"),
            pool: pool.into(),
            request_deadline: deadline,
        }
    }

    /// What the record holds: per pool, row index → until.
    #[derive(Default)]
    struct Record(std::collections::BTreeMap<String, (String, u64)>);

    impl Record {
        fn apply(&mut self, plan: &Plan) {
            let (written, deleted) = plan.records();
            for r in written {
                self.0.insert(r.slot_id, (r.pool, r.request_deadline));
            }
            for id in deleted {
                self.0.remove(&id);
            }
        }
        /// Plans, writes and commits, as the book's thread does when its write succeeds.
        fn write(&mut self, holdbacks: &mut Holdbacks, now: u64, lower: bool) {
            let plan = holdbacks.plan(now, lower);
            self.apply(&plan);
            holdbacks.committed(&plan);
        }
        fn count(&self, pool: &str, now: u64) -> u32 {
            let n = self
                .0
                .values()
                .filter(|(p, until)| p == pool && *until > now)
                .count();
            u32::try_from(n).unwrap()
        }
    }

    #[test]
    fn grants_wait_only_when_the_holdback_grows() {
        let mut holdbacks = Holdbacks::default();
        let mut record = Record::default();
        assert!(holdbacks.grant(lease("p", 1, 1_000)).is_some());
        record.write(&mut holdbacks, 0, false);
        assert_eq!(record.count("p", 0), 1);
        // Released and granted again: the holdback on record covers it, nothing to write.
        holdbacks.release(&lease("p", 1, 0).slot_id);
        assert!(holdbacks.grant(lease("p", 2, 1_000)).is_none());
        assert!(holdbacks.plan(0, false).is_empty());
        // A second one at once outgrows the holdback.
        assert!(holdbacks.grant(lease("p", 3, 1_000)).is_some());
        record.write(&mut holdbacks, 0, false);
        assert_eq!(record.count("p", 0), 2);
        // Both released: lowered at the next lowering, to nothing.
        holdbacks.release(&lease("p", 2, 0).slot_id);
        holdbacks.release(&lease("p", 3, 0).slot_id);
        assert!(holdbacks.plan(0, false).is_empty());
        record.write(&mut holdbacks, 0, true);
        assert_eq!(record.count("p", 0), 0);
        assert!(record.0.is_empty(), "every holdback row deleted");
    }

    #[test]
    fn a_deadline_past_the_holdback_extends_it() {
        let mut holdbacks = Holdbacks::default();
        assert!(holdbacks.grant(lease("p", 1, 1_000)).is_some());
        let plan = holdbacks.plan(0, false);
        holdbacks.committed(&plan);
        holdbacks.release(&lease("p", 1, 0).slot_id);
        // Within the holdback's `until`: covered.
        assert!(holdbacks
            .grant(lease("p", 2, 1_000 + UNTIL_AHEAD_MS))
            .is_none());
        holdbacks.release(&lease("p", 2, 0).slot_id);
        // Past it: waits for the extension.
        assert!(holdbacks
            .grant(lease("p", 3, 1_001 + UNTIL_AHEAD_MS))
            .is_some());
        let plan = holdbacks.plan(0, false);
        let (written, _) = plan.records();
        assert_eq!(written.len(), 1);
        assert_eq!(written[0].request_deadline, 1_001 + 2 * UNTIL_AHEAD_MS);
    }

    #[test]
    fn leases_past_their_deadline_stop_counting_at_a_lowering() {
        let mut holdbacks = Holdbacks::default();
        let mut record = Record::default();
        for i in 0..3 {
            assert!(holdbacks.grant(lease("p", i, 500)).is_some());
        }
        record.write(&mut holdbacks, 0, false);
        assert_eq!(record.count("p", 0), 3);
        // Never released (their holders vanished); at 500 their deadline has passed.
        record.write(&mut holdbacks, 500, true);
        assert!(record.0.is_empty());
    }

    #[test]
    fn a_failed_lowering_is_retried_and_rows_it_missed_are_deleted() {
        let mut holdbacks = Holdbacks::default();
        let mut record = Record::default();
        for i in 0..4 {
            holdbacks.grant(lease("p", i, 1_000));
        }
        record.write(&mut holdbacks, 0, false);
        for i in 0..4 {
            holdbacks.release(&lease("p", i, 0).slot_id);
        }
        let lowering = holdbacks.plan(0, true);
        holdbacks.failed(&lowering); // not applied to the record
        assert_eq!(record.count("p", 0), 4);
        record.write(&mut holdbacks, 0, true);
        assert!(record.0.is_empty(), "{:?}", record.0);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Grant(u8),
        Release(u8),
        Commit { lower: bool, fail: bool },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u8..3).prop_map(Step::Grant),
            3 => (0u8..12).prop_map(Step::Release),
            2 => (any::<bool>(), prop::bool::weighted(0.2))
                .prop_map(|(lower, fail)| Step::Commit { lower, fail }),
        ]
    }

    proptest! {
        /// Whatever the order of grants, releases, lowerings and failed commits: every lease
        /// answered (granted and either covered at once or after a commit that succeeded) and
        /// not released is counted by the record, per pool.
        #[test]
        fn every_answered_lease_is_on_record(steps in prop::collection::vec(step(), 1..200)) {
            let pools = ["a", "b", "c"];
            let mut holdbacks = Holdbacks::default();
            let mut record = Record::default();
            let mut next = 0u32;
            // Answered and not released: slot id → pool.
            let mut answered: Vec<(String, &str)> = Vec::new();
            // Granted, waiting for a commit.
            let mut waiting: Vec<(String, &str)> = Vec::new();
            for s in steps {
                match s {
                    Step::Grant(p) => {
                        let pool = pools[usize::from(p)];
                        next += 1;
                        let l = lease(pool, next, 1_000_000);
                        let id = l.slot_id.clone();
                        match holdbacks.grant(l) {
                            None => answered.push((id, pool)),
                            Some(_) => waiting.push((id, pool)),
                        }
                    }
                    Step::Release(i) => {
                        if !answered.is_empty() {
                            let (id, _) = answered.remove(usize::from(i) % answered.len());
                            holdbacks.release(&id);
                        }
                    }
                    Step::Commit { lower, fail } => {
                        let plan = holdbacks.plan(0, lower);
                        if fail {
                            holdbacks.failed(&plan);
                            // Their grants are refused and given back.
                            for (id, _) in waiting.drain(..) {
                                holdbacks.release(&id);
                            }
                        } else {
                            record.apply(&plan);
                            holdbacks.committed(&plan);
                            answered.append(&mut waiting);
                        }
                    }
                }
                for pool in pools {
                    let held = answered.iter().filter(|(_, p)| *p == pool).count();
                    prop_assert!(
                        record.count(pool, 0) as usize >= held,
                        "pool {pool}: {held} answered, {} on record",
                        record.count(pool, 0)
                    );
                }
            }
            // A lowering with everything released leaves nothing behind.
            for (id, _) in answered.drain(..).chain(waiting.drain(..)) {
                holdbacks.release(&id);
            }
            record.write(&mut holdbacks, 0, true);
            prop_assert!(record.0.is_empty(), "left: {:?}", record.0);
        }
    }
}
