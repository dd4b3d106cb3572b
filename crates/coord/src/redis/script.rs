//! The gate's Lua scripts and the plumbing to call them: loading, the keys of one pool, the
//! arguments every script shares, an explicit timeout on every call, and reading replies.
//!
//! On Redis 7 the gate's operations are the functions of one library (`FCALL`), loaded when a
//! call finds it missing (`FUNCTION LOAD`, at the first call and again after Redis lost it): the
//! prelude's few dozen functions are then defined once, not again in every call, which was most
//! of a short call's time in Redis. A Redis without functions (6) gets the same code as scripts
//! (`redis::Script`: `EVALSHA`, loading the script on `NOSCRIPT`).
//!
//! Owns no admission rule: those are in the Lua (`lua/prelude.lua` plus one file per
//! operation). It must not know about waiters, learning or fail-open; `gate` does.

use std::sync::atomic::{AtomicBool, Ordering};
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

impl CallError {
    /// The failure's kind, as the metrics label it.
    pub fn kind(&self) -> &'static str {
        match self {
            CallError::Timeout(_) => "timeout",
            CallError::Redis(_) => "redis",
            CallError::Reply(_) => "reply",
            CallError::Stopped => "stopped",
        }
    }
}

const PRELUDE: &str = include_str!("lua/prelude.lua");
/// The operations a batch runs, as functions (see `lua/ops.lua`).
const OPS: &str = include_str!("lua/ops.lua");

/// The operations, by name: each one's body (`lua/{name}.lua`) runs after the prelude's
/// `begin`; then what the call kept in memory is written (`finish`), and the reply gets the
/// pool's generation appended (every operation returns an array). `batch` runs the functions
/// of `lua/ops.lua`.
const OPERATIONS: [(&str, &str); 8] = [
    ("tick", include_str!("lua/tick.lua")),
    ("cancel", include_str!("lua/cancel.lua")),
    ("renew", include_str!("lua/renew.lua")),
    ("peek", include_str!("lua/peek.lua")),
    ("adopt", include_str!("lua/adopt.lua")),
    ("learn", include_str!("lua/learn.lua")),
    ("snapshot", include_str!("lua/snapshot.lua")),
    ("batch", include_str!("lua/batch.lua")),
];

/// One gate operation: a function of the library, and the same code as a script.
pub(crate) struct GateScript {
    /// The operation's name (`tick`, `batch`, ...), as the metrics label it.
    name: &'static str,
    function: String,
    script: Script,
}

/// The gate's operations, and whether this Redis runs them as functions.
pub(crate) struct Scripts {
    pub tick: GateScript,
    pub cancel: GateScript,
    pub renew: GateScript,
    pub peek: GateScript,
    pub adopt: GateScript,
    pub learn: GateScript,
    pub snapshot: GateScript,
    pub batch: GateScript,
    /// The library's source for `FUNCTION LOAD`. Its name carries a hash of its code, so nodes
    /// of two versions on one Redis each call their own.
    library: String,
    /// Until a call finds this Redis without functions (or unable to load the library).
    functions: AtomicBool,
}

/// The operation `name` with `body`, as the function of a library whose name is `library`, and
/// as a script (the prelude shadows `KEYS` and `ARGV` with the call's, so a script hands its
/// own to `begin` before that).
fn operation(library: &str, name: &'static str, body: &str) -> GateScript {
    let ops = if name == "batch" { OPS } else { "" };
    GateScript {
        name,
        function: format!("{library}_{name}"),
        script: Script::new(&format!(
            "local CALL_KEYS, CALL_ARGV = KEYS, ARGV\n{PRELUDE}\n{ops}\n\
             local function operation()\n{body}\nend\n\
             begin(CALL_KEYS, CALL_ARGV)\nlocal reply = operation()\n\
             finish()\ntable.insert(reply, gen_id)\nreturn reply\n"
        )),
    }
}

/// The library's code (without its name line): the prelude, the batch's operations, each
/// operation as a local function, and their registration.
fn library_code(library: &str) -> String {
    let mut code = format!("{PRELUDE}\n{OPS}\n");
    for (name, body) in OPERATIONS {
        code.push_str(&format!("local function op_{name}()\n{body}\nend\n"));
    }
    code.push_str(
        "local function run(operation)\n\
         \x20 return function(keys, args)\n\
         \x20   begin(keys, args)\n\
         \x20   local reply = operation()\n\
         \x20   finish()\n\
         \x20   table.insert(reply, gen_id)\n\
         \x20   return reply\n\
         \x20 end\n\
         end\n",
    );
    for (name, _) in OPERATIONS {
        code.push_str(&format!(
            "redis.register_function('{library}_{name}', run(op_{name}))\n"
        ));
    }
    code
}

impl Scripts {
    pub fn new() -> Self {
        // The name depends on the code, and the code on the name (its functions' names): the
        // hash is of the code under a placeholder name.
        let hash = Script::new(&library_code("nbgate")).get_hash().to_owned();
        let library = format!("nbgate_{}", hash.get(..16).unwrap_or(&hash));
        let op = |name: &'static str| {
            let body = OPERATIONS
                .iter()
                .find(|(n, _)| *n == name)
                .map_or("", |(_, body)| body);
            operation(&library, name, body)
        };
        Scripts {
            tick: op("tick"),
            cancel: op("cancel"),
            renew: op("renew"),
            peek: op("peek"),
            adopt: op("adopt"),
            learn: op("learn"),
            snapshot: op("snapshot"),
            batch: op("batch"),
            library: format!("#!lua name={library}\n{}", library_code(&library)),
            functions: AtomicBool::new(true),
        }
    }

    /// Whether calls go as functions (`FCALL`) for now.
    pub fn as_functions(&self) -> bool {
        self.functions.load(Ordering::Relaxed)
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

/// Whether a server error's text contains `what` (Redis answers both cases below as `ERR`
/// with a message).
fn says(e: &::redis::RedisError, what: &str) -> bool {
    e.to_string().to_ascii_lowercase().contains(what)
}

/// Runs `which` for one pool with the shared arguments, then `extra`, within `timeout` (each
/// command sent), polled on `home` (the node's runtime, see `on_home`); timed and, failing,
/// counted (`measure`).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn call(
    conn: &ConnectionManager,
    home: &tokio::runtime::Handle,
    scripts: &Scripts,
    which: &GateScript,
    keys: &[String],
    settings: &PoolSettings,
    caller: &Caller<'_>,
    extra: &[String],
    timeout: Duration,
) -> Result<Reply, CallError> {
    let started = super::measure::start();
    let result: Result<Reply, CallError> = async {
        let shared = (
            settings.limit,
            settings.queue_size,
            settings.rpm,
            settings.request_timeout_ms,
            settings.lease_term_ms,
            settings.min_limit,
            u8::from(settings.fair_share),
            caller.node,
            caller.node_ttl_ms,
            caller.wake_prefix,
            caller.pool,
            caller.generation,
        );
        // The manager is a cheap handle onto one multiplexed connection; each call gets its own.
        let mut conn = conn.clone();
        let value = if scripts.as_functions() {
            let mut fcall = ::redis::cmd("FCALL");
            fcall.arg(&which.function).arg(keys.len()).arg(keys);
            fcall.arg(shared).arg(extra);
            match send(&mut conn, home, &fcall, timeout).await {
                Err(CallError::Redis(e)) if says(&e, "function not found") => {
                    load_library(&mut conn, home, scripts, timeout).await?;
                    Some(send(&mut conn, home, &fcall, timeout).await)
                }
                // Redis 6, or a user whose ACL does not allow `FCALL`.
                Err(CallError::Redis(e))
                    if says(&e, "unknown command") || e.code() == Some("NOPERM") =>
                {
                    tracing::info!(
                        error = %e,
                        "no Redis functions here (they need Redis 7, and an ACL that allows FCALL): \
                         the gate's operations go as scripts"
                    );
                    scripts.functions.store(false, Ordering::Relaxed);
                    None
                }
                other => Some(other),
            }
        } else {
            None
        };
        let value = match value {
            Some(value) => value?,
            None => {
                let mut inv = which.script.prepare_invoke();
                for k in keys {
                    inv.key(k);
                }
                inv.arg(shared).arg(extra);
                let call = inv.invoke_async(&mut conn);
                super::on_home(home, tokio::time::timeout(timeout, call))
                    .await
                    .map_err(|_| CallError::Timeout(timeout))??
            }
        };
        let Value::Array(mut items) = value else {
            return Err(CallError::Reply("not an array"));
        };
        let generation = match items.pop() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
            _ => return Err(CallError::Reply("no generation")),
        };
        Ok(Reply(items, generation))
    }
    .await;
    super::measure::record("gate", which.name, started, &result);
    result
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

/// Sends `cmd` within `timeout`, polled on `home`.
async fn send(
    conn: &mut ConnectionManager,
    home: &tokio::runtime::Handle,
    cmd: &::redis::Cmd,
    timeout: Duration,
) -> Result<Value, CallError> {
    let call = cmd.query_async::<Value>(conn);
    Ok(super::on_home(home, tokio::time::timeout(timeout, call))
        .await
        .map_err(|_| CallError::Timeout(timeout))??)
}

/// Loads the gate's library (again: Redis lost it, or never had it). A library Redis refuses
/// would be a bug of ours; the node then goes on with scripts, which run the same code.
async fn load_library(
    conn: &mut ConnectionManager,
    home: &tokio::runtime::Handle,
    scripts: &Scripts,
    timeout: Duration,
) -> Result<(), CallError> {
    let mut load = ::redis::cmd("FUNCTION");
    load.arg("LOAD").arg("REPLACE").arg(&scripts.library);
    match send(conn, home, &load, timeout).await {
        Ok(_) => Ok(()),
        Err(CallError::Redis(e)) if e.code().is_some() => {
            tracing::warn!(error = %e, "Redis refused the gate's function library: the gate's operations go as scripts");
            scripts.functions.store(false, Ordering::Relaxed);
            Ok(())
        }
        Err(e) => Err(e),
    }
}
