//! The batching writer of attempt starts: runners that got their slot hand it their job and get
//! the started attempt (its number and request body) once the batch holding it is written. On
//! PostgreSQL a batch is one statement (`JobStore::start_attempts_with_body`), so the jobs
//! starting together on a node cost one round trip and one commit rather than one each; a lone
//! start goes out at once. A store that would only loop over a batch (SQLite) is called by each
//! runner directly: one task writing every start in turn would hold the runners back.

use std::sync::Arc;

use nthbouncer_store::{JobStore, StoreError};

use crate::core::batch::{BatchConfig, Batcher, Commit, CommitError};

const CONFIG: BatchConfig = BatchConfig {
    capacity: 4096,
    max_batch: 256,
    // No wait to fill a batch: each start holds a slot, so it goes out as soon as the last
    // batch is written, with whatever came in meanwhile.
    min_interval: None,
};

/// A started attempt: its number and the job's request body.
pub type Started = Option<(u32, Vec<u8>)>;

struct Start(Arc<dyn JobStore>);

impl Commit for Start {
    type Item = (String, u64);
    type Done = Started;
    async fn commit(&mut self, jobs: Vec<(String, u64)>) -> Result<Vec<Started>, StoreError> {
        self.0.start_attempts_with_body(&jobs).await
    }
}

/// The batching writer of attempt starts, or the store itself.
#[derive(Clone)]
pub enum AttemptStarts {
    Batched(Batcher<(String, u64), Started>),
    OneByOne(Arc<dyn JobStore>),
}

impl AttemptStarts {
    pub fn start(store: Arc<dyn JobStore>) -> AttemptStarts {
        if store.starts_in_batches() {
            AttemptStarts::Batched(Batcher::start(Start(store), CONFIG).0)
        } else {
            AttemptStarts::OneByOne(store)
        }
    }

    /// Starts job `id`'s next attempt at `now` (see `JobStore::start_attempt_with_body`):
    /// `None` if the job is gone, terminal or another node's.
    pub async fn start_attempt(&self, id: &str, now: u64) -> Result<Started, CommitError> {
        match self {
            AttemptStarts::Batched(batcher) => batcher.submit((id.to_string(), now)).await,
            AttemptStarts::OneByOne(store) => store
                .start_attempt_with_body(id, now)
                .await
                .map_err(|e| CommitError::Failed(Arc::new(e))),
        }
    }
}
