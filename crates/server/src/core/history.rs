//! A pool's last 15 minutes, second by second (SPEC §12 "Dashboard data"): how many callers
//! were admitted, refused, waited in the queue, and how many origin `429`s were seen.
//!
//! Bounded memory: [`SECONDS`] buckets of four counters, reused round-robin. Each counter is one
//! `AtomicU64` holding the second it counts (high bits) beside its count (low bits), so a bump
//! is a compare-and-swap with no lock, and a bucket left over from an older lap of the ring reads
//! as zero without anyone having to clear it. Times come from the caller (the injected clock).
//!
//! The ring is allocated a minute ([`CHUNK`] buckets) at a time, the first time a second in that
//! minute is counted: the whole ring is 28.8 KB, and a server with many configured pools that
//! are mostly idle must not pay that for each (1,000 idle pools were 28 MiB of history alone,
//! bench/RESULTS.md). A chunk never allocated reads as zeros, like a bucket of an older lap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// How many seconds the ring remembers.
pub const SECONDS: usize = 900;

/// Buckets allocated together: one minute. Divides [`SECONDS`].
const CHUNK: usize = 60;
const CHUNKS: usize = SECONDS / CHUNK;
const _: () = assert!(SECONDS.is_multiple_of(CHUNK));

/// One minute of buckets, four counters each.
type Chunk = [[AtomicU64; 4]; CHUNK];

/// Bits of a counter word that hold the count; the rest hold the epoch second.
const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// What one second counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Admitted = 0,
    Refused = 1,
    /// A caller that waited in the queue, counted the second it left it (admitted or not).
    Queued = 2,
    /// Origin `429`s reported back to the gate (by the proxy, a job, or a lock release).
    Origin429 = 3,
}

/// One second's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Second {
    /// Epoch seconds.
    pub at: u64,
    pub admitted: u32,
    pub refused: u32,
    pub queued: u32,
    pub origin429: u32,
}

#[derive(Default)]
pub struct History {
    chunks: [OnceLock<Box<Chunk>>; CHUNKS],
}

impl History {
    /// Counts `n` of `event` in the second of `now_ms` (epoch ms).
    pub fn add(&self, now_ms: u64, event: Event, n: u32) {
        if n == 0 {
            return;
        }
        let second = now_ms / 1000;
        let (chunk, offset) = slot(second);
        let chunk = self.chunks[chunk]
            .get_or_init(|| Box::new(std::array::from_fn(|_| Default::default())));
        let cell = &chunk[offset][event as usize];
        let mut current = cell.load(Ordering::Relaxed);
        loop {
            let count = if current >> COUNT_BITS == second {
                current & COUNT_MASK
            } else {
                0
            };
            // Saturates rather than spilling into the second's bits.
            let next = (second << COUNT_BITS) | (count + u64::from(n)).min(COUNT_MASK);
            match cell.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(seen) => current = seen,
            }
        }
    }

    /// The last [`SECONDS`] seconds up to and including the one of `now_ms`, oldest first.
    pub fn last(&self, now_ms: u64) -> Vec<Second> {
        let now = now_ms / 1000;
        let first = now.saturating_sub(SECONDS as u64 - 1);
        (first..=now)
            .map(|at| {
                let (chunk, offset) = slot(at);
                let cells = self.chunks[chunk].get().map(|c| &c[offset]);
                let read = |e: Event| {
                    let Some(cells) = cells else { return 0 };
                    let word = cells[e as usize].load(Ordering::Relaxed);
                    if word >> COUNT_BITS == at {
                        (word & COUNT_MASK) as u32
                    } else {
                        0
                    }
                };
                Second {
                    at,
                    admitted: read(Event::Admitted),
                    refused: read(Event::Refused),
                    queued: read(Event::Queued),
                    origin429: read(Event::Origin429),
                }
            })
            .collect()
    }
}

/// The chunk and the bucket within it that count `second`.
fn slot(second: u64) -> (usize, usize) {
    let slot = (second % SECONDS as u64) as usize;
    (slot / CHUNK, slot % CHUNK)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = 1_700_000_000_000;

    #[test]
    fn counts_per_second_and_forgets_a_lap_ago() {
        let h = History::default();
        h.add(T, Event::Admitted, 1);
        h.add(T + 999, Event::Admitted, 2);
        h.add(T + 1000, Event::Refused, 1);
        h.add(T + 1000, Event::Origin429, 0);
        let last = h.last(T + 1000);
        assert_eq!(last.len(), SECONDS);
        let (a, b) = (last[SECONDS - 2], last[SECONDS - 1]);
        assert_eq!((a.at, a.admitted, a.refused), (T / 1000, 3, 0));
        assert_eq!(
            (b.at, b.admitted, b.refused, b.origin429),
            (T / 1000 + 1, 0, 1, 0)
        );
        // A lap later the refused second's bucket counts afresh; its old count reads as zero.
        let lap = T + 1000 + SECONDS as u64 * 1000;
        h.add(lap, Event::Queued, 1);
        let last = h.last(lap);
        assert_eq!(
            (last[SECONDS - 1].queued, last[SECONDS - 1].refused),
            (1, 0)
        );
        assert!(last.iter().all(|s| s.refused == 0 && s.admitted == 0));
    }

    #[test]
    fn allocates_only_the_minutes_it_counts() {
        let h = History::default();
        assert!(h.chunks.iter().all(|c| c.get().is_none()));
        assert!(h.last(T).iter().all(|s| *s
            == Second {
                at: s.at,
                ..Second::default()
            }));
        h.add(T, Event::Admitted, 1);
        h.add(T + 1000, Event::Admitted, 1);
        assert_eq!(h.chunks.iter().filter(|c| c.get().is_some()).count(), 1);
        // A second in the next minute of the ring takes the next chunk.
        h.add(T + CHUNK as u64 * 1000, Event::Refused, 1);
        assert_eq!(h.chunks.iter().filter(|c| c.get().is_some()).count(), 2);
        let last = h.last(T + CHUNK as u64 * 1000);
        let counted: u32 = last.iter().map(|s| s.admitted + s.refused).sum();
        assert_eq!(counted, 3);
    }
}
