//! The coordination seam on Redis: several nodes share one pool's limit, queue, RPM window and
//! learned state exactly.
//!
//! Owns the connection (one `ConnectionManager` per [`RedisCoordination`], i.e. per node), the
//! node's identity and its wake-up subscription, and the gates it opens ([`RedisGate`], in
//! `gate`), the nonce stores ([`RedisNonces`], in `nonces`) and the token ledgers
//! ([`RedisTokens`], in `tokens`: one token budget per pool across the nodes). The admission rules run in Lua
//! scripts (`script`, `lua/`), one atomic script per operation keyed by slot id or ticket; they
//! mirror `nthbouncer-governor`. A pool's acquires and releases are gathered into one call
//! while the previous one is in flight (`batch`): the same operations in the same order,
//! paying each call's fixed cost once per batch. It must not know about HTTP.
//!
//! # Layout
//! Every key of pool `p` is `{prefix}:{p}:…` — the pool name is the Cluster hash tag, so a
//! pool's keys share one slot and each script touches one slot only (Cluster itself is
//! untested). `leases` is a sorted set of slot ids scored by lease deadline in the server's
//! `TIME` milliseconds: no node clock sets or judges a deadline. Waiters are ordered tickets
//! (`HINCRBY seq`) in one sorted set, `queue`, scored by priority class first (each class a
//! span of scores of its own); with `fair_share` a ticket's score within its class is its
//! fairness key's round (start-time fair queuing), so keys take turns within a class and each
//! key stays FIFO; ties go by ticket. A freed slot is granted *by the script that freed
//! it* to the head waiter, recorded for the waiter's node to collect, and that node is woken
//! on its channel `{prefix}:wake:{node}` (pub/sub, at most once: every node with waiters also
//! polls at `poll_interval`, which doubles as its heartbeat; a waiter whose node stopped
//! calling for `node_ttl` is dropped at dispatch instead of granted).
//!
//! # What differs from one node
//! - An exchange slot (a proxied call) is leased for one `lease_term_ms` and renewed by its node
//!   in the background, rather than held to its request deadline: a node that dies gives its
//!   slots back within one term. A lease the node cannot confirm (reclaimed, or Redis
//!   unreachable past its deadline) is reported through [`crate::PoolGate::lease_watch`]:
//!   self-fencing.
//! - Kept slots: while a pool has room to spare (nobody queued, a quarter of its slots free, no
//!   pause, RPM gate or pace, an effective limit of 16 or more), a node keeps an exchange slot
//!   leased after its call ends and lends it to its next exchange without calling Redis (the
//!   gate's `Keeping`). It stays counted against the limit, so the limit holds; an acquire short
//!   of a slot anywhere, or a learned change, makes every keeper free what it keeps idle at once
//!   (`{prefix}:wake:reclaim`), and a slot idle for a poll interval is freed anyway. Until then
//!   the pool's in-flight count, read on another node, includes it.
//! - Adaptive learning runs in the governor's pure code on the node that observes the outcome
//!   (one learner per gate per node, on the server's clock); the resulting learned limit, pace
//!   and pause (a spent announced budget travels as a pause until its reset; the learner counts
//!   no admissions, so its budget estimate is what the last answer announced) are stored in Redis and enforced by the scripts for every node. A pause only
//!   lengthens; the learned limit and pace are last-writer-wins between nodes that both
//!   learned, and fade after ten minutes without a write.
//! - Redis unreachable: acquire refuses with [`crate::Refusal::CoordinationUnavailable`]
//!   (fail closed), or with [`RedisOptions::fail_open`] admits up to `limit / expected_nodes`
//!   on this node alone until Redis answers again.

mod batch;
mod gate;
pub mod measure;
mod nonces;
mod script;
mod tokens;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use futures_util::StreamExt;
use parking_lot::Mutex;

pub use gate::RedisGate;
pub use nonces::RedisNonces;
pub use script::CallError;
pub use tokens::{RedisTokens, SharedAdmit, TokenReport, TokenView, HOLD_RENEW_MS, HOLD_TTL_MS};

use crate::{Clock, Coordination, NonceStore, PoolGate, PoolSettings, SystemClock};

/// How a node talks to Redis.
#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// `redis://host:port/db`.
    pub url: String,
    /// First part of every key and channel (`nb` by default); tests use one of their own. Must
    /// not contain `{` or `}` (the pool's hash tag follows it).
    pub key_prefix: String,
    /// `Some(expected_nodes)`: while Redis is unreachable, admit up to
    /// `limit / expected_nodes` (at least 1) on this node alone. `None`: refuse (fail closed).
    pub fail_open: Option<u32>,
    /// Longest wait for any one Redis call.
    pub command_timeout: Duration,
    /// Longest wait for a connection.
    pub connect_timeout: Duration,
    /// How often a node with waiters asks Redis for their grants when no wake-up came, and
    /// refreshes its heartbeat.
    pub poll_interval: Duration,
    /// A node silent for this long is considered gone: its waiters are not granted slots.
    pub node_ttl: Duration,
    /// After a failed call, how long a fail-open node stays on its own before trying Redis again.
    pub retry_redis_after: Duration,
}

impl RedisOptions {
    pub fn new(url: impl Into<String>) -> Self {
        RedisOptions {
            url: url.into(),
            key_prefix: "nb".to_owned(),
            fail_open: None,
            command_timeout: Duration::from_millis(1_000),
            connect_timeout: Duration::from_millis(500),
            poll_interval: Duration::from_millis(500),
            node_ttl: Duration::from_millis(5_000),
            retry_redis_after: Duration::from_millis(1_000),
        }
    }
}

/// Why a [`RedisCoordination`] could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("invalid redis url: {0}")]
    Url(::redis::RedisError),
    #[error("key prefix must not be empty or contain '{{' or '}}'")]
    Prefix,
    #[error("cannot start the coordination's thread: {0}")]
    Thread(std::io::Error),
}

/// What every gate of one node shares.
pub(crate) struct Node {
    pub id: String,
    pub conn: ConnectionManager,
    pub options: RedisOptions,
    pub scripts: script::Scripts,
    pub clock: Arc<dyn Clock>,
    /// `{prefix}:wake:` — a node's channel is this plus its id.
    pub wake_prefix: String,
    /// Open gates by pool, for wake-ups (a pool may be opened more than once, e.g. reopened
    /// while the old gate still drains).
    pub gates: Mutex<HashMap<String, Vec<Weak<gate::Shared>>>>,
    /// The runtime of the node's own thread (see [`NodeThread`]): the node's tasks (each gate's
    /// batches and ticker, the connection's driver, the wake-up subscription) run there, not on
    /// whichever runtime first touched a gate (a connection thread's ends before the last calls
    /// of a stopping server).
    pub runtime: tokio::runtime::Handle,
    /// Stops that thread when the node goes.
    _thread: NodeThread,
}

/// The thread every Redis task of a node runs on: one single-threaded runtime. A call then goes
/// out and its answer comes back on one thread: the batch task hands its call to the
/// connection's driver, and the driver reads the reply and completes the batch, without a
/// hand-over between threads. Only the caller's own thread is woken, once, for its answer. On
/// a work-stealing runtime these tasks moved between its workers, and each move woke one
/// (bench/RESULTS.md, "The node's Redis tasks on a thread of their own"). Ends when the node is
/// dropped.
struct NodeThread {
    /// Dropped with the node: the thread's `block_on` ends, and its tasks are dropped.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl NodeThread {
    fn start() -> std::io::Result<(NodeThread, tokio::runtime::Handle)> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("nthbouncer-redis".to_owned())
            .spawn(move || {
                let _ = runtime.block_on(stopped);
                // Not `drop`: the last reference to the node may be dropped by a task of this
                // very runtime, and a blocking task must not hold the thread.
                runtime.shutdown_background();
            })?;
        Ok((NodeThread { _stop: stop }, handle))
    }
}

/// Redis [`Coordination`]: one per node. Gates of the same pool opened by different nodes (or
/// different `RedisCoordination`s in one process) share one limit.
pub struct RedisCoordination {
    node: Arc<Node>,
    listener: tokio::task::JoinHandle<()>,
}

impl RedisCoordination {
    /// Sets up the connection without waiting for Redis (a node may start while Redis is down:
    /// it then fails closed or open like any later outage), starts the node's thread, and
    /// subscribes to the node's wake-up channel in the background.
    pub fn new(options: RedisOptions, clock: Arc<dyn Clock>) -> Result<Self, SetupError> {
        if options.key_prefix.is_empty() || options.key_prefix.contains(['{', '}']) {
            return Err(SetupError::Prefix);
        }
        let (thread, runtime) = NodeThread::start().map_err(SetupError::Thread)?;
        let client = client_for(&options.url).map_err(SetupError::Url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            .set_response_timeout(Some(options.command_timeout))
            // One attempt per call: a caller must learn quickly that Redis is away (to refuse or
            // fail open), and the next call tries again anyway.
            .set_number_of_retries(0);
        let conn = ConnectionManager::new_lazy_with_config(calls_client(&client), config)
            .map_err(SetupError::Url)?;
        let id = format!("{:016x}", rand::random::<u64>());
        let wake_prefix = format!("{}:wake:", options.key_prefix);
        let node = Arc::new(Node {
            id,
            conn,
            options,
            scripts: script::Scripts::new(),
            clock,
            wake_prefix,
            gates: Mutex::new(HashMap::new()),
            runtime: runtime.clone(),
            _thread: thread,
        });
        let listener = runtime.spawn(listen(client, Arc::downgrade(&node)));
        Ok(RedisCoordination { node, listener })
    }

    /// On the system clock.
    pub fn system(options: RedisOptions) -> Result<Self, SetupError> {
        Self::new(options, Arc::new(SystemClock::new()))
    }

    /// This node's id (random per coordination), as it appears in Redis.
    pub fn node_id(&self) -> &str {
        &self.node.id
    }

    /// Answers whether Redis answers (`PING`), within the command timeout.
    pub async fn ping(&self) -> Result<(), CallError> {
        let mut conn = self.node.conn.clone();
        let timeout = self.node.options.command_timeout;
        let cmd = ::redis::cmd("PING");
        let ping = cmd.query_async::<()>(&mut conn);
        on_home(&self.node.runtime, tokio::time::timeout(timeout, ping))
            .await
            .map_err(|_| CallError::Timeout(timeout))??;
        Ok(())
    }

    /// `Some((maxmemory, policy))` when this Redis may evict keys to stay under a memory
    /// limit. Every key the coordination keeps there expires, so the `volatile-*` policies
    /// evict them as surely as the `allkeys-*` ones: a lost lease set or ledger index
    /// undercounts until it is rebuilt. Exact limits need `maxmemory-policy noeviction` (Redis
    /// then refuses writes when full, and calls fail as when Redis is away) or no `maxmemory`.
    pub async fn eviction_risk(&self) -> Result<Option<(u64, String)>, CallError> {
        let mut conn = self.node.conn.clone();
        let timeout = self.node.options.command_timeout;
        let mut cmd = ::redis::cmd("INFO");
        cmd.arg("memory");
        let info = cmd.query_async::<String>(&mut conn);
        let info = on_home(&self.node.runtime, tokio::time::timeout(timeout, info))
            .await
            .map_err(|_| CallError::Timeout(timeout))??;
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let limit = field("maxmemory")
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        let policy = field("maxmemory_policy").unwrap_or("noeviction");
        Ok((limit > 0 && policy != "noeviction").then(|| (limit, policy.to_owned())))
    }

    /// Whether this node admits its share on its own while Redis is away (`fail_open`).
    pub fn fails_open(&self) -> bool {
        self.node.options.fail_open.is_some()
    }

    /// After a failed call, how long before Redis is tried again (the `Retry-After` of a
    /// refusal while it is away).
    pub fn retry_after(&self) -> Duration {
        self.node.options.retry_redis_after
    }

    /// Opens the gate of `pool` as a concrete [`RedisGate`].
    pub fn open_gate(&self, pool: &str, settings: PoolSettings) -> Arc<RedisGate> {
        Arc::new(RedisGate::new(Arc::clone(&self.node), pool, settings))
    }

    /// The token ledger of `pool`, shared by every node (see `tokens`).
    pub fn token_ledger(&self, pool: &str) -> Arc<RedisTokens> {
        Arc::new(RedisTokens::new(Arc::clone(&self.node), pool))
    }

    /// The seen-nonce store of `pool`, shared by every node.
    pub fn nonces(&self, pool: &str) -> Arc<dyn NonceStore> {
        Arc::new(RedisNonces::new(
            self.node.conn.clone(),
            self.node.runtime.clone(),
            &self.node.options.key_prefix,
            pool,
            self.node.options.command_timeout,
        ))
    }
}

impl Drop for RedisCoordination {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl Coordination for RedisCoordination {
    fn open(&self, pool: &str, settings: PoolSettings) -> Arc<dyn PoolGate> {
        self.open_gate(pool, settings)
    }
}

/// A client for `url` whose TCP connections send at once (`TCP_NODELAY`; redis-rs leaves Nagle's
/// algorithm on by default). A node's calls share one multiplexed connection: with Nagle on, a
/// call written while another's bytes are still unacknowledged waits for that call's reply
/// (which carries the acknowledgement) before it leaves, so concurrent calls would go out one
/// round trip apart. Public so that a peer measured beside a node (the bench's Lua semaphore)
/// connects the same way.
pub fn client_for(url: &str) -> ::redis::RedisResult<::redis::Client> {
    use ::redis::IntoConnectionInfo;
    let info = url.into_connection_info()?;
    let tcp = ::redis::io::tcp::TcpSettings::default().set_nodelay(true);
    ::redis::Client::open(info.set_tcp_settings(tcp))
}

/// Polls `call` (one of the node's calls to Redis) with `home`, the node's runtime, as the
/// current one, whichever thread polls it. redis-rs spawns the driver of the node's connection
/// on the current runtime when it makes the connection (at the first call) or makes it again
/// (after a call met a closed one). Made from a call on a connection thread, the driver would
/// end with that thread's runtime, which a stopping server ends before its last calls (the
/// frees of kept slots): every call after that would fail.
pub(crate) async fn on_home<T>(home: &tokio::runtime::Handle, call: impl Future<Output = T>) -> T {
    let mut call = std::pin::pin!(call);
    std::future::poll_fn(|cx| {
        let _home = home.enter();
        call.as_mut().poll(cx)
    })
    .await
}

/// The client of a node's calls: `client`'s address and settings, on RESP3 (Redis 6 or later).
/// On RESP3 redis-rs hears at once that Redis closed the connection (its `timeout`, `CLIENT
/// KILL`, a restart, a proxy's idle cut) and connects again in the background; on RESP2 it only
/// finds out from the next call, which fails: a caller refused, or a release missed, with Redis
/// up all along. The scripts' replies (arrays of integers and strings) read the same on both.
/// The wake-up subscription keeps `client` as it is.
fn calls_client(client: &::redis::Client) -> ::redis::Client {
    let info = client.get_connection_info().clone();
    let redis = info
        .redis_settings()
        .clone()
        .set_protocol(::redis::ProtocolVersion::RESP3);
    // Infallible in practice: the same settings opened `client`.
    ::redis::Client::open(info.clone().set_redis_settings(redis)).unwrap_or_else(|_| client.clone())
}

/// Keeps the node subscribed to its wake-up channel and to the reclaims of kept slots
/// (`{prefix}:wake:reclaim`, every node's; see the gate's `Keeping`), and wakes or reclaims the
/// named pool's gates on each message. A broken subscription is re-made after a pause;
/// meanwhile the gates poll, and their checks see what a lost reclaim would have said.
async fn listen(client: ::redis::Client, node: Weak<Node>) {
    loop {
        let Some((channel, reclaims, timeout, retry, clock)) = node.upgrade().map(|n| {
            (
                format!("{}{}", n.wake_prefix, n.id),
                format!("{}reclaim", n.wake_prefix),
                n.options.connect_timeout,
                n.options.retry_redis_after,
                Arc::clone(&n.clock),
            )
        }) else {
            return;
        };
        let subscribed = tokio::time::timeout(timeout, async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&[&channel, &reclaims]).await?;
            Ok::<_, ::redis::RedisError>(pubsub)
        })
        .await;
        match subscribed {
            Ok(Ok(pubsub)) => {
                let mut messages = pubsub.into_on_message();
                while let Some(msg) = messages.next().await {
                    let Some(node) = node.upgrade() else {
                        return;
                    };
                    let pool: String = msg.get_payload().unwrap_or_default();
                    let gates: Vec<_> = node
                        .gates
                        .lock()
                        .get(&pool)
                        .map(|gates| gates.iter().filter_map(Weak::upgrade).collect())
                        .unwrap_or_default();
                    let reclaim = msg.get_channel_name() == reclaims;
                    for gate in gates {
                        if reclaim {
                            gate.reclaim();
                        } else {
                            gate.wake();
                        }
                    }
                }
                tracing::debug!("redis wake-up subscription ended; re-subscribing");
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "redis wake-up subscription failed"),
            Err(_) => tracing::debug!("redis wake-up subscription timed out"),
        }
        let retry = u64::try_from(retry.as_millis()).unwrap_or(u64::MAX);
        clock
            .sleep_until_monotonic(clock.monotonic_ms().saturating_add(retry))
            .await;
    }
}

#[cfg(test)]
#[allow(clippy::expect_used)]
mod tests {
    use super::{calls_client, client_for};

    #[test]
    fn a_nodes_redis_connections_send_at_once_and_keep_the_urls_settings() {
        let client = client_for("redis://:s3cret@127.0.0.1:6390/4").expect("a valid URL");
        let info = client.get_connection_info();
        assert!(info.tcp_settings().nodelay(), "Nagle's algorithm left on");
        assert_eq!(info.addr().to_string(), "127.0.0.1:6390");
        assert_eq!(info.redis_settings().db(), 4);
        assert_eq!(info.redis_settings().password(), Some("s3cret"));
        assert!(client_for("not a url").is_err());
    }

    #[test]
    fn a_nodes_calls_speak_resp3_with_the_urls_settings() {
        let client = client_for("redis://:s3cret@127.0.0.1:6390/4").expect("a valid URL");
        let calls = calls_client(&client);
        let info = calls.get_connection_info();
        assert_eq!(
            info.redis_settings().protocol(),
            ::redis::ProtocolVersion::RESP3
        );
        assert!(info.tcp_settings().nodelay(), "Nagle's algorithm left on");
        assert_eq!(info.addr().to_string(), "127.0.0.1:6390");
        assert_eq!(info.redis_settings().db(), 4);
        assert_eq!(info.redis_settings().password(), Some("s3cret"));
        // The subscription's client is left as the URL says.
        let subscription = client.get_connection_info().redis_settings().protocol();
        assert_eq!(subscription, ::redis::ProtocolVersion::RESP2);
    }
}
