//! Throughput of the admission core: acquire+release pairs per second.
//!
//! - `single`: one thread, one pool — the raw cost of the governor;
//! - `contended_one_pool`: 4 threads sharing one `Mutex<Governor>` — what one hot pool costs;
//! - `four_pools`: 4 threads, each on its own pool — should scale with cores, since nothing is
//!   shared across pools (no global lock).
//!
//! Each reported element is one acquire+release pair.

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nthbouncer_governor::{Governor, PoolSettings, Priority, Ticket, TryAcquire};

const THREADS: u64 = 4;

fn pool() -> Governor {
    Governor::new(PoolSettings {
        limit: 64,
        ..PoolSettings::default()
    })
}

/// One acquire+release pair; `id` must be fresh.
fn pair(g: &mut Governor, now: u64, id: u128) {
    let ticket = Ticket {
        id,
        fairness_key: (id & 7) as u64,
        priority: Priority::Normal,
        lease_ms: 30_000,
        grace_ms: 0,
    };
    if let TryAcquire::Admitted(a) = g.try_acquire(now, ticket, false) {
        black_box(g.release(now, a.id));
    }
}

/// Runs `iters` pairs on each of [`THREADS`] threads, `pool_of(t)` choosing thread `t`'s pool.
// A benchmark measures real elapsed time; the clock rule is for the governor's own code.
#[allow(clippy::disallowed_methods)]
fn run_threads<'a>(iters: u64, pool_of: impl Fn(u64) -> &'a Mutex<Governor> + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let pool = pool_of(t);
            s.spawn(move || {
                for i in 0..iters {
                    let id = (u128::from(t) << 64) | u128::from(i);
                    let mut g = pool.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                    pair(&mut g, 1_000 + i / 1_000, id);
                }
            });
        }
    });
    start.elapsed()
}

fn benches(c: &mut Criterion) {
    let mut group = c.benchmark_group("acquire_release");

    group.throughput(Throughput::Elements(1));
    group.bench_function("single", |b| {
        let mut g = pool();
        let mut id: u128 = 0;
        b.iter(|| {
            id += 1;
            pair(&mut g, 1_000, id);
        });
    });

    group.throughput(Throughput::Elements(THREADS));
    group.bench_function("contended_one_pool", |b| {
        b.iter_custom(|iters| {
            let shared = Mutex::new(pool());
            run_threads(iters, |_| &shared)
        });
    });

    group.bench_function("four_pools", |b| {
        b.iter_custom(|iters| {
            let pools: Vec<Mutex<Governor>> = (0..THREADS).map(|_| Mutex::new(pool())).collect();
            run_threads(iters, |t| &pools[t as usize])
        });
    });

    group.finish();
}

criterion_group! {
    name = governor;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(20);
    targets = benches
}
criterion_main!(governor);
