//! The group-commit writer of new jobs: callers hand it a job and get their answer once the
//! batch holding it is committed, so a `202` is only ever sent for a durable job.

use std::sync::Arc;

use nthbouncer_store::{JobStore, NewJob, StoreError};

use crate::core::batch::{BatchConfig, Batcher, Commit, CommitError};

const CONFIG: BatchConfig = BatchConfig {
    capacity: 4096,
    max_batch: 512,
    min_interval: None,
};

struct Insert(Arc<dyn JobStore>);

impl Commit for Insert {
    type Item = NewJob;
    type Done = ();
    async fn commit(&mut self, jobs: Vec<NewJob>) -> Result<Vec<()>, StoreError> {
        self.0.insert_jobs(&jobs).await?;
        Ok(vec![(); jobs.len()])
    }
}

/// The group-commit writer of new jobs.
#[derive(Clone)]
pub struct JobIntake(Batcher<NewJob, ()>);

impl JobIntake {
    pub fn start(store: Arc<dyn JobStore>) -> JobIntake {
        JobIntake(Batcher::start(Insert(store), CONFIG).0)
    }

    /// Returns once the job is committed.
    pub async fn submit(&self, job: NewJob) -> Result<(), CommitError> {
        self.0.submit(job).await
    }
}
