//! The batching writers of attempt starts and finishes: a runner that got its slot hands its job
//! to the start writer and gets the started attempt (its number and request body) once the batch
//! holding it is written; a runner whose call came back hands its result to the finish writer
//! and frees its slot once that batch is committed. On PostgreSQL a batch is one statement
//! (`JobStore::start_attempts_with_body`, `JobStore::finish_attempts`), so the attempts starting
//! or ending together on a node cost one round trip and one commit rather than one each; a lone
//! write goes out at once. A store that would only loop over a batch (SQLite) is called by each
//! runner directly: one task writing every attempt in turn would hold the runners back.

use std::sync::Arc;

use nthbouncer_store::{AttemptEnd, Finish, JobStore, StoreError};

use crate::core::batch::{BatchConfig, Batcher, Commit, CommitError};

const CONFIG: BatchConfig = BatchConfig {
    capacity: 4096,
    max_batch: 256,
    // No wait to fill a batch: each write holds a slot, so it goes out as soon as the last
    // batch is written, with whatever came in meanwhile.
    min_interval: None,
};

/// A started attempt: its number and the job's request body.
pub type Started = Option<(u32, Vec<u8>)>;

/// An attempt's end, kept by its runner for retries while the store is down.
pub struct Ended {
    pub id: String,
    pub attempt: u32,
    pub finish: Finish,
    /// The pool's active destinations when the attempt ended: one delivery each.
    pub destination_ids: Vec<String>,
}

struct Starts(Arc<dyn JobStore>);

impl Commit for Starts {
    type Item = (String, u64);
    type Done = Started;
    async fn commit(&mut self, jobs: Vec<(String, u64)>) -> Result<Vec<Started>, StoreError> {
        self.0.start_attempts_with_body(&jobs).await
    }
}

struct Finishes(Arc<dyn JobStore>);

impl Commit for Finishes {
    /// The end and the time of this try.
    type Item = (Arc<Ended>, u64);
    type Done = bool;
    async fn commit(&mut self, ends: Vec<(Arc<Ended>, u64)>) -> Result<Vec<bool>, StoreError> {
        let ends: Vec<AttemptEnd<'_>> = ends.iter().map(|(e, now)| e.at(*now)).collect();
        self.0.finish_attempts(&ends).await
    }
}

impl Ended {
    fn at(&self, now: u64) -> AttemptEnd<'_> {
        AttemptEnd {
            id: &self.id,
            attempt: self.attempt,
            finish: &self.finish,
            now,
            destination_ids: &self.destination_ids,
        }
    }
}

/// The batching writers of attempt starts and finishes, or the store itself.
#[derive(Clone)]
pub enum AttemptWrites {
    Batched {
        starts: Batcher<(String, u64), Started>,
        finishes: Batcher<(Arc<Ended>, u64), bool>,
        store: Arc<dyn JobStore>,
    },
    OneByOne(Arc<dyn JobStore>),
}

impl AttemptWrites {
    pub fn start(store: Arc<dyn JobStore>) -> AttemptWrites {
        if store.attempts_in_batches() {
            AttemptWrites::Batched {
                starts: Batcher::start(Starts(store.clone()), CONFIG).0,
                finishes: Batcher::start(Finishes(store.clone()), CONFIG).0,
                store,
            }
        } else {
            AttemptWrites::OneByOne(store)
        }
    }

    /// Starts job `id`'s next attempt at `now` (see `JobStore::start_attempt_with_body`):
    /// `None` if the job is gone, terminal or another node's.
    pub async fn start_attempt(&self, id: &str, now: u64) -> Result<Started, CommitError> {
        match self {
            AttemptWrites::Batched { starts, .. } => starts.submit((id.to_string(), now)).await,
            AttemptWrites::OneByOne(store) => store
                .start_attempt_with_body(id, now)
                .await
                .map_err(|e| CommitError::Failed(Arc::new(e))),
        }
    }

    /// Ends an attempt at `now` (see `JobStore::finish_attempt`): `false` if fenced off.
    pub async fn finish_attempt(&self, ended: &Arc<Ended>, now: u64) -> Result<bool, StoreError> {
        let store = match self {
            AttemptWrites::Batched {
                finishes, store, ..
            } => match finishes.submit((ended.clone(), now)).await {
                Ok(finished) => return Ok(finished),
                Err(CommitError::Failed(e)) => return Err((*e).clone()),
                // The writer is gone (the server is stopping): the result is still written.
                Err(CommitError::Stopped) => store,
            },
            AttemptWrites::OneByOne(store) => store,
        };
        let end = ended.at(now);
        store
            .finish_attempt(end.id, end.attempt, end.finish, now, end.destination_ids)
            .await
    }
}
