//! Prometheus metrics. One process-wide recorder (the `metrics` facade is global); per-pool
//! handles are registered once when a pool is built, so the hot path never formats labels.
//! Gauges of live state are read from the gates at scrape time, so they are never stale.

use std::sync::OnceLock;

use metrics::{Counter, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Seconds; from 1 ms to 2 minutes.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Seconds, for calls to Redis (mostly well under a millisecond): from 100 µs to 5 s.
const REDIS_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The recorder's handle, installing the recorder the first time.
pub fn handle() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let builder = || {
            // A full name's buckets take precedence over a suffix's.
            PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(nthbouncer_coord::redis::measure::CALL_SECONDS.into()),
                        REDIS_BUCKETS,
                    )
                })
                .unwrap_or_else(|_| PrometheusBuilder::new())
        };
        match builder().install_recorder() {
            Ok(handle) => handle,
            // Another recorder is installed (an embedding program's): render our own, empty.
            Err(_) => builder().build_recorder().handle(),
        }
    })
}

/// Per-pool metric handles.
#[derive(Clone)]
pub struct PoolMetrics {
    pub admitted_proxy: Counter,
    pub admitted_lock: Counter,
    pub admitted_sql: Counter,
    pub refused_429: Counter,
    pub refused_504: Counter,
    pub unauthorized: Counter,
    pub upstream_errors: Counter,
    /// Tokens admitted by the pool's token budget (estimates at admission).
    pub admitted_tokens: Counter,
    pub queue_wait: Histogram,
    pub upstream_latency: Histogram,
}

impl PoolMetrics {
    pub fn new(pool: &str) -> PoolMetrics {
        handle();
        let p = pool.to_string();
        PoolMetrics {
            admitted_proxy: metrics::counter!("nthbouncer_admitted_total", "pool" => p.clone(), "route" => "proxy"),
            admitted_lock: metrics::counter!("nthbouncer_admitted_total", "pool" => p.clone(), "route" => "lock"),
            admitted_sql: metrics::counter!("nthbouncer_admitted_total", "pool" => p.clone(), "route" => "sql"),
            refused_429: metrics::counter!("nthbouncer_refused_total", "pool" => p.clone(), "reason" => "too_many_requests"),
            refused_504: metrics::counter!("nthbouncer_refused_total", "pool" => p.clone(), "reason" => "queue_timeout"),
            unauthorized: metrics::counter!("nthbouncer_refused_total", "pool" => p.clone(), "reason" => "unauthorized"),
            upstream_errors: metrics::counter!("nthbouncer_upstream_errors_total", "pool" => p.clone()),
            admitted_tokens: metrics::counter!("nthbouncer_admitted_tokens_total", "pool" => p.clone()),
            queue_wait: metrics::histogram!("nthbouncer_queue_wait_seconds", "pool" => p.clone()),
            upstream_latency: metrics::histogram!("nthbouncer_upstream_latency_seconds", "pool" => p),
        }
    }
}

/// Sets the live gauges of one pool (called at scrape time).
pub fn set_pool_gauges(pool: &str, snap: &nthbouncer_coord::Snapshot) {
    let p = pool.to_string();
    metrics::gauge!("nthbouncer_pool_in_flight", "pool" => p.clone())
        .set(f64::from(snap.in_flight));
    metrics::gauge!("nthbouncer_pool_queued", "pool" => p.clone()).set(f64::from(snap.queued));
    metrics::gauge!("nthbouncer_pool_effective_limit", "pool" => p.clone())
        .set(f64::from(snap.effective_limit));
    metrics::gauge!("nthbouncer_pool_configured_limit", "pool" => p)
        .set(f64::from(snap.configured_limit));
}
