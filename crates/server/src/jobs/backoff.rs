//! Bounded exponential backoff for the job layer's store calls: a store that fails for a while
//! (locked, disk full, restarting) must not strand a job until the next start. Each wait doubles
//! from [`FIRST`] up to [`MAX`]; the call is retried until it succeeds or the server stops (the
//! runner is cancelled then, and the job resumes at the next start).

use std::future::Future;
use std::time::Duration;

use nthbouncer_store::StoreError;

/// The first wait after a failure.
pub const FIRST: Duration = Duration::from_millis(100);
/// The longest wait between two tries.
pub const MAX: Duration = Duration::from_secs(5);

/// The waits between tries of one operation: [`FIRST`], doubling, capped at [`MAX`].
#[derive(Debug, Default)]
pub struct Backoff {
    failures: u32,
}

impl Backoff {
    pub fn new() -> Backoff {
        Backoff::default()
    }

    /// Counts a failure and returns how long to wait before the next try.
    pub fn next_delay(&mut self) -> Duration {
        let doublings = self.failures.min(16);
        self.failures = self.failures.saturating_add(1);
        FIRST.saturating_mul(1 << doublings).min(MAX)
    }

    /// Failures counted so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// The operation succeeded: the next failure waits [`FIRST`] again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

/// Runs `op` until it succeeds, waiting [`Backoff`] between failures and logging each at warn
/// (`what` names the operation, `job` the job it is for).
pub async fn until_ok<T, F, Fut>(what: &'static str, job: &str, mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut backoff = Backoff::new();
    loop {
        match op().await {
            Ok(v) => {
                if backoff.failures() > 0 {
                    tracing::info!(%job, operation = what, failures = backoff.failures(),
                        "the store answered again");
                }
                return v;
            }
            Err(e) => {
                let wait = backoff.next_delay();
                tracing::warn!(%job, operation = what, error = %e, failures = backoff.failures(),
                    retry_in_ms = wait.as_millis() as u64, "job store call failed; retrying");
                tokio::time::sleep(wait).await;
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_cap_and_reset() {
        let mut b = Backoff::new();
        let waits: Vec<u64> = (0..9).map(|_| b.next_delay().as_millis() as u64).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        for _ in 0..100 {
            assert_eq!(b.next_delay(), MAX);
        }
        b.reset();
        assert_eq!(b.next_delay(), FIRST);
    }

    #[tokio::test]
    async fn until_ok_retries_until_the_store_answers() {
        let mut tries = 0;
        let v = until_ok("test", "job_1", || {
            tries += 1;
            let n = tries;
            async move {
                if n < 4 {
                    Err(StoreError::Backend("locked".into()))
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(v, 4);
    }
}
