//! The group-commit writer of new jobs: callers hand it a job and get their answer once the
//! batch holding it is committed, so a `202` is only ever sent for a durable job.

use std::sync::Arc;

use nthbouncer_store::{JobStore, NewJob};
use tokio::sync::{mpsc, oneshot};

const INTAKE_BATCH: usize = 512;

/// The group-commit writer of new jobs.
#[derive(Clone)]
pub struct JobIntake {
    tx: mpsc::Sender<(NewJob, oneshot::Sender<Result<(), String>>)>,
}

impl JobIntake {
    pub fn start(store: Arc<dyn JobStore>) -> JobIntake {
        let (tx, mut rx) = mpsc::channel::<(NewJob, oneshot::Sender<Result<(), String>>)>(4096);
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(INTAKE_BATCH);
            while rx.recv_many(&mut batch, INTAKE_BATCH).await > 0 {
                let jobs: Vec<NewJob> = batch.iter().map(|(j, _)| j.clone()).collect();
                let outcome = store.insert_jobs(&jobs).await.map_err(|e| e.to_string());
                for (_, done) in batch.drain(..) {
                    let _ = done.send(outcome.clone());
                }
            }
        });
        JobIntake { tx }
    }

    /// Returns once the job is committed.
    pub async fn submit(&self, job: NewJob) -> Result<(), String> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send((job, done))
            .await
            .map_err(|_| "job intake stopped".to_string())?;
        wait.await.map_err(|_| "job intake stopped".to_string())?
    }
}
