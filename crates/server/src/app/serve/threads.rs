//! Connection threads: one single-threaded runtime per core, each serving the connections it
//! is handed from accept to close, the way nginx runs one event loop per worker.
//!
//! Why: on the shared work-stealing runtime a connection's readiness is seen by whichever
//! worker polls the I/O driver, and the other worker is woken (a futex, a context switch) to
//! share the work. Per request that costs little CPU, but under load the wake-ups and the
//! hand-overs leave cores idle while clients wait: with a cached `GET` costing about what
//! nginx spends, nthbouncer answered 0.7× nginx's requests per second (bench/RESULTS.md, "Connection
//! threads"). A connection pinned to one thread is read, served and written there, and its
//! thread sleeps only when none of its connections has anything to do.
//!
//! What runs here: a connection's task and whatever its requests spawn (an upstream
//! connection the proxy opens, a lease's renewal). Each thread calls origins through its own
//! upstream client (its lane, `upstream::SharedClient`), so its pooled upstream connections
//! are driven on the same thread as the requests that use them. Background work (the access-log writer, job
//! runners, webhook deliveries, settings sync) stays on the main runtime, and nothing here
//! needs to know which runtime it is on: tasks talk through channels and `Arc`s as before.
//! The exception: a connection shared by every runtime must not be opened here, for its socket
//! and its driver task would end with this thread, before a stopping server's last statements.
//! The stores' connections are made on the main runtime and Redis's on the coordination's own
//! thread, whoever asks (`nthbouncer_store::postgres`'s `OnHomeRuntime`; the Redis coordination's
//! `on_home`, which polls every call of a node with the node's own runtime current).
//! Owns the threads and the choice of one for a new connection; must not look at requests.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// The connection threads, started together and stopped when this is dropped.
pub(crate) struct ConnectionThreads {
    handles: Vec<Handle>,
    next: AtomicUsize,
    stop: CancellationToken,
}

impl ConnectionThreads {
    /// Starts `count` threads (at least one), each running its own runtime until dropped.
    pub(crate) fn start(count: usize) -> std::io::Result<ConnectionThreads> {
        let stop = CancellationToken::new();
        let mut handles = Vec::with_capacity(count.max(1));
        for i in 0..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(runtime.handle().clone());
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("nthbouncer-conn-{i}"))
                .spawn(move || {
                    // Lane 0 is the main runtime's.
                    crate::upstream::enter_lane(i + 1);
                    runtime.block_on(stop.cancelled());
                    // Not `drop`: a blocking task still running must not hold this thread.
                    runtime.shutdown_background();
                })?;
        }
        Ok(ConnectionThreads {
            handles,
            next: AtomicUsize::new(0),
            stop,
        })
    }

    /// Runs a connection's task on the next thread, round robin: with keep-alive clients the
    /// connections, and so the load, spread evenly.
    pub(crate) fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        self.handles[i].spawn(task);
    }

    /// Stops the threads: their runtimes drop whatever tasks they still hold (called once the
    /// server has drained; tasks hold the serving state, so a drop alone could come late).
    pub(crate) fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for ConnectionThreads {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tasks_run_on_the_connection_threads_round_robin() -> std::io::Result<()> {
        let threads = ConnectionThreads::start(2)?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..4 {
            let tx = tx.clone();
            threads.spawn(async move {
                let name = std::thread::current().name().map(str::to_owned);
                let _ = tx.send(name);
            });
        }
        let mut names = Vec::new();
        for _ in 0..4 {
            names.push(rx.recv().await.flatten().unwrap_or_default());
        }
        names.sort();
        assert_eq!(
            names,
            [
                "nthbouncer-conn-0",
                "nthbouncer-conn-0",
                "nthbouncer-conn-1",
                "nthbouncer-conn-1"
            ]
        );
        drop(threads);
        Ok(())
    }
}
