//! The one group-commit writer. Callers hand it items through a bounded channel; one task
//! commits them in batches, so a commit (an fsync on SQLite) is shared by everything that
//! arrived while the previous one ran. A caller either waits for its item's commit
//! ([`Batcher::submit`]: a job's `202`, a lease grant) or hands it over without waiting
//! ([`Batcher::enqueue`]: an access-log row, a released lease).
//!
//! Owns the batching, the replies and the optional pacing of commits; what a commit writes is
//! the [`Commit`] implementation's business.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// What a batch is committed with.
pub trait Commit: Send + 'static {
    type Item: Send + 'static;
    /// What each item's caller is answered once its batch is committed.
    type Done: Send + 'static;
    /// Commits `items` in one go: one answer per item, in order.
    fn commit(
        &mut self,
        items: Vec<Self::Item>,
    ) -> impl Future<Output = Result<Vec<Self::Done>, nthbouncer_store::StoreError>> + Send;
}

/// Why an item's commit did not happen.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommitError {
    #[error("the writer has stopped")]
    Stopped,
    #[error("the commit failed: {0}")]
    Failed(#[source] Arc<nthbouncer_store::StoreError>),
}

/// How a writer batches.
#[derive(Clone, Copy, Debug)]
pub struct BatchConfig {
    /// Items waiting at most (the channel's bound).
    pub capacity: usize,
    /// Items in one commit at most.
    pub max_batch: usize,
    /// While items keep coming, the shortest time between two commits: a commit costs about as
    /// much as a few hundred rows, so many tiny batches would cost more than the rows. A lone
    /// item after a quiet spell is committed at once. `None`: commit as soon as possible.
    pub min_interval: Option<Duration>,
}

type Reply<D> = oneshot::Sender<Result<D, CommitError>>;

enum Msg<T, D> {
    Item(T, Option<Reply<D>>),
    /// Answered once everything queued before it is committed.
    Flush(oneshot::Sender<()>),
}

/// The handle callers use; clones share the one writer task.
pub struct Batcher<T, D> {
    tx: mpsc::Sender<Msg<T, D>>,
}

impl<T, D> Clone for Batcher<T, D> {
    fn clone(&self) -> Self {
        Batcher {
            tx: self.tx.clone(),
        }
    }
}

impl<T: Send + 'static, D: Send + 'static> Batcher<T, D> {
    /// Starts the writer task. It ends once every handle is dropped and the queue is drained.
    pub fn start<C: Commit<Item = T, Done = D>>(
        committer: C,
        config: BatchConfig,
    ) -> (Self, JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(config.capacity);
        let task = tokio::spawn(run(committer, rx, config));
        (Batcher { tx }, task)
    }

    /// Hands over `item` and waits until the batch holding it is committed.
    pub async fn submit(&self, item: T) -> Result<D, CommitError> {
        let (reply, done) = oneshot::channel();
        self.tx
            .send(Msg::Item(item, Some(reply)))
            .await
            .map_err(|_| CommitError::Stopped)?;
        done.await.map_err(|_| CommitError::Stopped)?
    }

    /// Hands over `item` without waiting; `false` if the queue is full (the item is dropped).
    pub fn enqueue(&self, item: T) -> bool {
        self.tx.try_send(Msg::Item(item, None)).is_ok()
    }

    /// Waits until everything handed over so far is committed (tests, shutdown).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

async fn run<C: Commit>(
    mut committer: C,
    mut rx: mpsc::Receiver<Msg<C::Item, C::Done>>,
    config: BatchConfig,
) {
    let mut msgs = Vec::with_capacity(config.max_batch);
    let mut last_commit: Option<tokio::time::Instant> = None;
    while rx.recv_many(&mut msgs, config.max_batch).await > 0 {
        if let (Some(interval), Some(last)) = (config.min_interval, last_commit) {
            fill(&mut rx, &mut msgs, config.max_batch, last + interval).await;
        }
        let mut items = Vec::with_capacity(msgs.len());
        let mut replies = Vec::with_capacity(msgs.len());
        let mut flushes = Vec::new();
        for msg in msgs.drain(..) {
            match msg {
                Msg::Item(item, reply) => {
                    items.push(item);
                    replies.push(reply);
                }
                Msg::Flush(done) => flushes.push(done),
            }
        }
        if !items.is_empty() {
            last_commit = Some(crate::core::time::now());
            answer(committer.commit(items).await, replies);
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

/// Lets the batch fill until `until`, then takes what came meanwhile (up to a full batch).
/// It sleeps through the window rather than waking for each item: the items come from the
/// connection threads, and every wake-up of this task from another thread is a futex call and
/// a context switch, about as much CPU as the item's whole row (see `app::serve::threads`). A
/// flush asked for during the window waits for its end.
async fn fill<T, D>(
    rx: &mut mpsc::Receiver<Msg<T, D>>,
    msgs: &mut Vec<Msg<T, D>>,
    max_batch: usize,
    until: tokio::time::Instant,
) {
    if msgs.len() < max_batch && !msgs.iter().any(|m| matches!(m, Msg::Flush(_))) {
        tokio::time::sleep_until(until).await;
    }
    while msgs.len() < max_batch {
        match rx.try_recv() {
            Ok(msg) => msgs.push(msg),
            Err(_) => break,
        }
    }
}

fn answer<D>(
    outcome: Result<Vec<D>, nthbouncer_store::StoreError>,
    replies: Vec<Option<Reply<D>>>,
) {
    match outcome {
        Ok(done) => {
            for (reply, d) in replies.into_iter().zip(done) {
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(d));
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, items = replies.len(), "a batch could not be committed");
            let e = CommitError::Failed(Arc::new(e));
            for reply in replies.into_iter().flatten() {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Records the batches it commits; fails a batch holding the item 13.
    struct Recording(Arc<parking_lot::Mutex<Vec<Vec<u32>>>>);

    impl Commit for Recording {
        type Item = u32;
        type Done = u32;
        async fn commit(
            &mut self,
            items: Vec<u32>,
        ) -> Result<Vec<u32>, nthbouncer_store::StoreError> {
            if items.contains(&13) {
                return Err(nthbouncer_store::StoreError::Backend("unlucky".into()));
            }
            self.0.lock().push(items.clone());
            Ok(items.into_iter().map(|i| i * 2).collect())
        }
    }

    fn config() -> BatchConfig {
        BatchConfig {
            capacity: 64,
            max_batch: 8,
            min_interval: None,
        }
    }

    #[tokio::test]
    async fn every_item_is_answered_with_its_own_result() {
        let batches = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let (batcher, _task) = Batcher::start(Recording(batches.clone()), config());
        // 100.. never holds the unlucky 13.
        let answers = futures_util::future::join_all((100..120).map(|i| {
            let b = batcher.clone();
            async move { b.submit(i).await.unwrap() }
        }))
        .await;
        assert_eq!(answers, (100..120).map(|i| i * 2).collect::<Vec<_>>());
        let committed: Vec<u32> = batches.lock().iter().flatten().copied().collect();
        assert_eq!(committed.len(), 20);
        assert!(batches.lock().iter().all(|b| b.len() <= 8));
    }

    #[tokio::test]
    async fn a_failed_batch_fails_its_callers_and_the_writer_goes_on() {
        let batches = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let (batcher, _task) = Batcher::start(Recording(batches), config());
        assert!(matches!(
            batcher.submit(13).await,
            Err(CommitError::Failed(_))
        ));
        assert_eq!(batcher.submit(2).await.unwrap(), 4);
        assert!(batcher.enqueue(3));
        batcher.flush().await;
    }

    #[tokio::test]
    async fn a_stopped_writer_says_so() {
        let (batcher, task) = Batcher::start(Recording(Arc::default()), config());
        task.abort();
        let _ = task.await;
        assert!(matches!(batcher.submit(1).await, Err(CommitError::Stopped)));
    }
}
