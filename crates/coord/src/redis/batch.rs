//! A pool's acquires and releases, gathered into one script call.
//!
//! Owns the queue of this node's acquire and release operations for one pool and the task that
//! sends them: while one call is in flight, the operations that arrive wait, and go together in
//! the next (`lua/batch.lua`), each answered with what its own script would have returned. Under
//! load, a request then costs Redis a share of one call instead of a call of its own (every
//! call's fixed part, the prelude's reads, is paid once per batch). A lone operation goes at
//! once, as before.
//!
//! It must not interpret replies: the gate does, as for a single call. Order is kept: the
//! operations of one call run in the order they were queued, as they would one call after
//! another.

use std::sync::Weak;

use ::redis::Value;
use tokio::sync::{mpsc, oneshot};

use super::gate::Shared;
use super::script::{CallError, Reply};

/// At most this many operations per call (a bound on one script's run time in Redis).
const MAX_OPS: usize = 128;

/// An operation that can go in a batch.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    /// `op_acquire`'s 9 arguments.
    Acquire,
    /// `op_release`'s 5 arguments, and the 7 of what was learned when it learns.
    Release,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Acquire => "acquire",
            Op::Release => "release",
        }
    }
}

/// One queued operation and where its reply goes.
pub(crate) struct Queued {
    pub op: Op,
    pub args: Vec<String>,
    pub reply: oneshot::Sender<Result<Reply, CallError>>,
}

/// Sends the queued operations of one gate, a batch per call, until the gate is gone.
pub(crate) async fn run(gate: Weak<Shared>, mut queue: mpsc::UnboundedReceiver<Queued>) {
    let mut ops = Vec::with_capacity(MAX_OPS);
    while queue.recv_many(&mut ops, MAX_OPS).await > 0 {
        let Some(shared) = gate.upgrade() else {
            return;
        };
        let mut args = Vec::with_capacity(1 + ops.len() * 10);
        args.push(ops.len().to_string());
        for queued in &mut ops {
            args.push(queued.op.name().to_owned());
            args.append(&mut queued.args);
        }
        let result = shared.call(&shared.node().scripts.batch, &args).await;
        drop(shared);
        match result {
            Ok(Reply(items, generation)) if items.len() == ops.len() => {
                for (queued, item) in ops.drain(..).zip(items) {
                    let reply = match item {
                        Value::Array(values) => Ok(Reply(values, generation.clone())),
                        _ => Err(CallError::Reply("a batch's reply is not an array")),
                    };
                    // A caller that went away meanwhile has its call finished by its guard, which
                    // holds the receiver; none left means nobody waits.
                    let _ = queued.reply.send(reply);
                }
            }
            Ok(_) => {
                for queued in ops.drain(..) {
                    let _ = queued.reply.send(Err(CallError::Reply(
                        "a batch's replies do not match its calls",
                    )));
                }
            }
            Err(e) => {
                for queued in ops.drain(..) {
                    let _ = queued.reply.send(Err(e.clone()));
                }
            }
        }
    }
}
