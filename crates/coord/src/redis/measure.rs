//! What the node's calls to Redis take and how they fail, as metrics (the `metrics` facade;
//! the server installs the Prometheus recorder, and without one nothing is kept): every gate
//! and token-ledger script call is timed into [`CALL_SECONDS`], labelled by its script
//! (`gate`, `tokens`) and operation, and a failed one is counted in [`ERRORS_TOTAL`] by kind.
//! It decides nothing: callers act on a call's result as they would without it.

use std::time::Instant;

use super::script::CallError;

/// Histogram of the time from sending a script call to its reply (or its failure), seconds.
pub const CALL_SECONDS: &str = "nthbouncer_redis_call_seconds";
/// Counter of script calls that gave no usable answer, by `kind` (`timeout`, `redis`,
/// `reply`, `stopped`).
pub const ERRORS_TOTAL: &str = "nthbouncer_redis_errors_total";

/// When a call starts. The one reading of `Instant` outside the injected clock (the crate's
/// clock rule): a metric's duration decides nothing, and the clock's milliseconds are too
/// coarse for calls that mostly take a fraction of one.
#[allow(clippy::disallowed_methods)]
pub(crate) fn start() -> Instant {
    Instant::now()
}

/// Records one call of `script`'s operation `op`, sent at `started`, that ended in `result`.
pub(crate) fn record<T>(
    script: &'static str,
    op: &'static str,
    started: Instant,
    result: &Result<T, CallError>,
) {
    metrics::histogram!(CALL_SECONDS, "script" => script, "op" => op)
        .record(started.elapsed().as_secs_f64());
    if let Err(e) = result {
        metrics::counter!(ERRORS_TOTAL, "script" => script, "op" => op, "kind" => e.kind())
            .increment(1);
    }
}
