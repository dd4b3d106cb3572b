//! The gate's Lua scripts and the plumbing to call them: loading (`redis::Script` sends
//! `EVALSHA` and falls back to loading the script on `NOSCRIPT`), the keys of one pool, the
//! arguments every script shares, an explicit timeout on every call, and reading replies.
//!
//! Owns no admission rule: those are in the Lua (`lua/prelude.lua` plus one file per
//! operation). It must not know about waiters, learning or fail-open; `gate` does.

use std::time::Duration;

use ::redis::aio::ConnectionManager;
use ::redis::{Script, Value};

use crate::PoolSettings;

/// Why a call to Redis gave no answer the gate can use.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CallError {
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    #[error("unexpected reply from a gate script: {0}")]
    Reply(&'static str),
    #[error("this node's calls to redis for the pool stopped")]
    Stopped,
}

const PRELUDE: &str = include_str!("lua/prelude.lua");
/// The operations a batch runs, as functions (see `lua/ops.lua`).
const OPS: &str = include_str!("lua/ops.lua");

/// One script per gate operation, each the prelude followed by its body.
pub(crate) struct Scripts {
    pub tick: Script,
    pub cancel: Script,
    pub renew: Script,
    pub peek: Script,
    pub adopt: Script,
    pub learn: Script,
    pub snapshot: Script,
    pub batch: Script,
}

/// The prelude, then the operation as a function; then what the call kept in memory is
/// written (`finish`), and the reply gets the pool's generation appended (every operation
/// returns an array).
fn script(body: &str) -> Script {
    Script::new(&format!(
        "{PRELUDE}\nlocal function operation()\n{body}\nend\nlocal reply = operation()\n\
         finish()\ntable.insert(reply, gen_id)\nreturn reply\n"
    ))
}

impl Scripts {
    pub fn new() -> Self {
        Scripts {
            tick: script(include_str!("lua/tick.lua")),
            cancel: script(include_str!("lua/cancel.lua")),
            renew: script(include_str!("lua/renew.lua")),
            peek: script(include_str!("lua/peek.lua")),
            adopt: script(include_str!("lua/adopt.lua")),
            learn: script(include_str!("lua/learn.lua")),
            snapshot: script(include_str!("lua/snapshot.lua")),
            batch: script(&format!("{OPS}\n{}", include_str!("lua/batch.lua"))),
        }
    }
}

/// The names of one pool's keys, all under the pool's hash tag so that they live in one
/// Cluster slot (a script may only touch keys of one slot).
pub(crate) fn pool_keys(prefix: &str, pool: &str) -> Vec<String> {
    [
        "leases",
        "held",
        "waiters",
        "deadlines",
        "queue",
        "meta",
        "rounds",
        "grants",
        "learned",
        "rpm",
        "nodes",
    ]
    .iter()
    .map(|name| pool_key(prefix, pool, name))
    .collect()
}

/// `{prefix}:{{pool}}:{name}`.
pub(crate) fn pool_key(prefix: &str, pool: &str, name: &str) -> String {
    format!("{prefix}:{{{pool}}}:{name}")
}

/// Who is calling: the arguments after the settings that every script takes.
pub(crate) struct Caller<'a> {
    pub node: &'a str,
    pub node_ttl_ms: u64,
    pub wake_prefix: &'a str,
    pub pool: &'a str,
    /// The pool's generation as this caller last saw it (`""` for none).
    pub generation: &'a str,
}

/// Runs `script` for one pool with the shared arguments, then `extra`, within `timeout`, polled
/// on `home` (the node's runtime, see `on_home`).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn call(
    conn: &ConnectionManager,
    home: &tokio::runtime::Handle,
    script: &Script,
    keys: &[String],
    settings: &PoolSettings,
    caller: &Caller<'_>,
    extra: &[String],
    timeout: Duration,
) -> Result<Reply, CallError> {
    let mut inv = script.prepare_invoke();
    for k in keys {
        inv.key(k);
    }
    inv.arg(settings.limit)
        .arg(settings.queue_size)
        .arg(settings.rpm)
        .arg(settings.request_timeout_ms)
        .arg(settings.lease_term_ms)
        .arg(settings.min_limit)
        .arg(u8::from(settings.fair_share))
        .arg(caller.node)
        .arg(caller.node_ttl_ms)
        .arg(caller.wake_prefix)
        .arg(caller.pool)
        .arg(caller.generation);
    for a in extra {
        inv.arg(a);
    }
    // The manager is a cheap handle onto one multiplexed connection; each call gets its own.
    let mut conn = conn.clone();
    let call = inv.invoke_async(&mut conn);
    let value: Value = super::on_home(home, tokio::time::timeout(timeout, call))
        .await
        .map_err(|_| CallError::Timeout(timeout))??;
    let Value::Array(mut items) = value else {
        return Err(CallError::Reply("not an array"));
    };
    let generation = match items.pop() {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
        _ => return Err(CallError::Reply("no generation")),
    };
    Ok(Reply(items, generation))
}

/// A script's reply: a flat array of integers and strings, and the pool's generation.
#[derive(Debug)]
pub(crate) struct Reply(pub Vec<Value>, pub String);

impl Reply {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn int(&self, i: usize) -> Result<i64, CallError> {
        match self.0.get(i) {
            Some(Value::Int(n)) => Ok(*n),
            Some(Value::BulkString(b)) => std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or(CallError::Reply("expected an integer")),
            _ => Err(CallError::Reply("expected an integer")),
        }
    }

    /// A non-negative integer, `None` for the scripts' `-1` (absent).
    pub fn opt(&self, i: usize) -> Result<Option<u64>, CallError> {
        Ok(u64::try_from(self.int(i)?).ok())
    }

    pub fn u64(&self, i: usize) -> Result<u64, CallError> {
        Ok(u64::try_from(self.int(i)?).unwrap_or(0))
    }

    pub fn u32(&self, i: usize) -> Result<u32, CallError> {
        Ok(u32::try_from(self.int(i)?.max(0)).unwrap_or(u32::MAX))
    }

    pub fn str(&self, i: usize) -> Result<String, CallError> {
        match self.0.get(i) {
            Some(Value::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
            Some(Value::SimpleString(s)) => Ok(s.clone()),
            Some(Value::Int(n)) => Ok(n.to_string()),
            _ => Err(CallError::Reply("expected a string")),
        }
    }
}
