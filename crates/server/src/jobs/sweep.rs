//! Start-up resumption of unfinished jobs, and the sweeper: overdue jobs become `expired`, jobs
//! past their retention are deleted.
//!
//! Resumption reads the unfinished jobs in pages of [`RESUME_PAGE`], without their request
//! bodies (each runner loads its own when its turn comes), so a restart with a large backlog
//! does not hold every body in memory at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use nthbouncer_store::JobCursor;

use crate::jobs::backoff::Backoff;
use crate::jobs::runner::spawn_runner;
use crate::jobs::Jobs;

/// Unfinished jobs read per page at start-up.
pub const RESUME_PAGE: u32 = 256;
/// Failed page reads in a row after which resumption gives up (the jobs left resume at the
/// next start).
const RESUME_TRIES: u32 = 6;

/// Starts a runner for every unfinished job, page by page; each takes its place in its pool's
/// backlog. Called once at start-up, before the server serves.
pub async fn resume(state: &Arc<Jobs>) {
    let mut after: Option<JobCursor> = None;
    let mut resumed = 0u64;
    let mut backoff = Backoff::new();
    loop {
        let page = match state
            .store
            .unfinished_jobs_page(after.as_ref(), RESUME_PAGE)
            .await
        {
            Ok(page) => page,
            Err(e) if backoff.failures() + 1 < RESUME_TRIES => {
                let wait = backoff.next_delay();
                tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64,
                    "cannot read unfinished jobs; retrying");
                tokio::time::sleep(wait).await;
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, resumed,
                    "cannot read unfinished jobs; the rest resume at the next start");
                return;
            }
        };
        backoff.reset();
        let Some(last) = page.last() else { break };
        after = Some(JobCursor::after(&last.job));
        for unfinished in page {
            let pending = state.backlog.adopt(&unfinished.job.pool);
            spawn_runner(state.clone(), unfinished.job, pending);
            resumed += 1;
        }
    }
    if resumed > 0 {
        tracing::info!(jobs = resumed, "resuming unfinished jobs");
    }
}

/// Runs the sweeper until the process ends.
pub async fn run_sweeper(state: Arc<Jobs>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        sweep(&state).await;
    }
}

/// Expires overdue jobs and deletes those past retention.
pub async fn sweep(state: &Jobs) {
    let now = state.now();
    let active: HashMap<String, Vec<String>> = state
        .pools
        .snapshot()
        .pools
        .values()
        .map(|p| (p.name.clone(), p.active_destination_ids()))
        .collect();
    match state.store.expire_jobs(now, &active).await {
        Ok(expired) if !expired.is_empty() => {
            tracing::info!(jobs = expired.len(), "jobs expired");
            state.notify_deliveries();
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "expiring jobs failed"),
    }
    if let Err(e) = state.store.delete_retained(now).await {
        tracing::warn!(error = %e, "deleting retained jobs failed");
    }
}
