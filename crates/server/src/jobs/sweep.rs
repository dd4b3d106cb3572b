//! Start-up resumption of unfinished jobs, and the sweeper: overdue jobs become `expired`, jobs
//! past their retention are deleted.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::jobs::runner::spawn_runner;
use crate::jobs::Jobs;

/// Resumes every unfinished job (start-up) and runs the sweeper until the process ends.
pub async fn resume_and_sweep(state: Arc<Jobs>) {
    match state.store.unfinished_jobs().await {
        Ok(jobs) => {
            if !jobs.is_empty() {
                tracing::info!(jobs = jobs.len(), "resuming unfinished jobs");
            }
            for job in jobs {
                spawn_runner(state.clone(), job);
            }
        }
        Err(e) => tracing::error!(error = %e, "cannot read unfinished jobs"),
    }
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
