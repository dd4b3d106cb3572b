//! One pool's token budget on Redis (SPEC §12): the ledger every node sharing the Redis (the
//! same key prefix) charges, so N nodes admit one budget between them, not N.
//!
//! Owns the calls to `lua/tokens.lua` and the typed reading of its replies. The rules are the
//! script's (mirroring the governor's pure `TokenBudget`); where a node's callers wait, and
//! what it does while Redis is away, is its caller's (the server's token gate), as is which of
//! its waiters has waited long enough to hold the budget. It must not know about HTTP.
//!
//! # Layout
//! - `{prefix}:{pool}:tok:charges`: hash charge id → `seq:at:input:output:finishedSeq`.
//! - `{prefix}:{pool}:tok:meta`: hash of the admission sequence, the tokens admitted, the
//!   script's clock, the origin's last announcements, the charge the budget is held for, and
//!   the running sums that spare a call from rereading the window (below).
//! - `{prefix}:{pool}:tok:order` and `tok:ends`: the charges ordered by admission and by when
//!   they ended (those in flight last).
//! - `{prefix}:{pool}:tok:blocks`: the input and output of the charges admitted, and of those
//!   ended, per block of 32 sequence numbers (what an announcement needs).
//!
//! Under the pool's hash tag like the gate's keys; forgotten ten minutes after the pool's last
//! use.
//!
//! # Cost
//! A call reads the charges that left the window since the last call and the ledger's oldest
//! (to drop what no budget counts any more); an announcement also reads one block's charges
//! and one sum per block since the request that carried it. Never the whole window. The sums the rules need
//! are kept by the calls that change them. A ledger written by an older version is indexed
//! again once, by the first call that finds it so (and again if one of them changes it behind
//! the indexes: nodes sharing a Redis should run one version).

use std::sync::Arc;

use ::redis::Script;
use nthbouncer_governor::{BudgetSource, TokenCost, TokenPart, TokenSettings, TokenWindow, Usage};

use super::script::{pool_key, CallError, Reply};
use super::Node;

/// How long a waiter's hold on the shared budget lasts unless its node asks again (it does at
/// least every [`HOLD_RENEW_MS`] while the waiter waits): a node that went away lets go.
pub const HOLD_TTL_MS: u64 = 2_000;
/// Longest time between two admission attempts of a node for its waiters.
pub const HOLD_RENEW_MS: u64 = 250;

/// What the shared budget looks like after a call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenView {
    pub remaining: Option<u64>,
    pub budget: Option<u64>,
    pub source: Option<BudgetSource>,
    /// Tokens charged in total on every node (estimates, corrected by reconciliation).
    pub admitted_tokens: u64,
    /// Another charge's waiter holds the budget: nothing else is admitted until it is.
    pub held: bool,
    /// What the origin's announced input and output budgets have left, when it splits them.
    pub input_remaining: Option<u64>,
    pub output_remaining: Option<u64>,
}

/// The answer to [`RedisTokens::admit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedAdmit {
    Admitted(TokenView),
    /// Larger than a whole budget (the total, or a part's): `estimate` is the cost's part that
    /// does not fit in that `budget`.
    Exceeds {
        estimate: u64,
        budget: u64,
    },
    /// No room now (or the budget is held for another); when the budget alone would let it.
    Refused {
        view: TokenView,
        retry_after_ms: Option<u64>,
    },
}

/// What a node tells the shared ledger after an admission. [`RedisTokens::report`] sends
/// several in one call, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenReport {
    /// The request of a charge ended; the usage its answer reported, if any.
    Finish(u128, Option<Usage>),
    /// A charge taken back whole (its request never reached the origin).
    Refund(u128),
    /// A charge's waiter no longer waits.
    Unhold(u128),
    /// The origin's word on its budget (or one part of it), from the answer to a charge.
    Observe(Option<u128>, TokenPart, TokenWindow),
}

impl TokenReport {
    /// The script's operation, its charge, and its four arguments (unused ones `-1`).
    fn encode(&self) -> (&'static str, Option<u128>, [String; 4]) {
        let none = || num(None);
        match *self {
            TokenReport::Finish(id, actual) => {
                let [t, i, o] = match actual {
                    None => [None, None, None],
                    Some(Usage::Total(t)) => [Some(t), None, None],
                    Some(Usage::Split(c)) => [Some(c.total()), Some(c.input), Some(c.output)],
                };
                ("finish", Some(id), [num(t), num(i), num(o), none()])
            }
            TokenReport::Refund(id) => ("refund", Some(id), [none(), none(), none(), none()]),
            TokenReport::Unhold(id) => ("unhold", Some(id), [none(), none(), none(), none()]),
            TokenReport::Observe(id, part, window) => {
                let part = match part {
                    TokenPart::Total => "t",
                    TokenPart::Input => "i",
                    TokenPart::Output => "o",
                };
                (
                    "observe",
                    id,
                    [
                        part.to_owned(),
                        num(window.limit),
                        num(window.remaining),
                        num(window.reset_ms),
                    ],
                )
            }
        }
    }
}

/// One pool's shared token ledger, as one node calls it.
pub struct RedisTokens {
    node: Arc<Node>,
    keys: [String; 5],
    script: Script,
}

/// A charge's field in the ledger's `charges` hash.
fn charge_field(id: u128) -> String {
    format!("{id:032x}")
}

fn num(v: Option<u64>) -> String {
    v.and_then(|v| i64::try_from(v).ok())
        .unwrap_or(-1)
        .to_string()
}

impl RedisTokens {
    pub(crate) fn new(node: Arc<Node>, pool: &str) -> RedisTokens {
        let prefix = node.options.key_prefix.clone();
        RedisTokens {
            node,
            keys: [
                pool_key(&prefix, pool, "tok:charges"),
                pool_key(&prefix, pool, "tok:meta"),
                pool_key(&prefix, pool, "tok:order"),
                pool_key(&prefix, pool, "tok:ends"),
                pool_key(&prefix, pool, "tok:blocks"),
            ],
            script: Script::new(include_str!("lua/tokens.lua")),
        }
    }

    /// The node's runtime: where a budget's own tasks (its reporter, its ticker) belong, not
    /// on whichever connection thread opened the pool (a stopping server ends those first).
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.node.runtime
    }

    /// After a failed call, how long before Redis is tried again.
    pub fn retry_after_ms(&self) -> u64 {
        u64::try_from(self.node.options.retry_redis_after.as_millis()).unwrap_or(u64::MAX)
    }

    /// `Some(expected_nodes)` when a node admits its share on its own while Redis is away.
    pub fn fail_open(&self) -> Option<u32> {
        self.node.options.fail_open
    }

    /// One call of the script's operation `op`; timed and, failing, counted (`measure`).
    async fn call(
        &self,
        op: &'static str,
        settings: &TokenSettings,
        id: Option<u128>,
        extra: &[String],
    ) -> Result<(String, TokenView, Option<u64>), CallError> {
        let started = super::measure::start();
        let result: Result<(String, TokenView, Option<u64>), CallError> = async {
            let mut inv = self.script.prepare_invoke();
            for k in &self.keys {
                inv.key(k);
            }
            inv.arg(op)
                .arg(settings.tpm)
                .arg(settings.window_ms.max(1))
                .arg(HOLD_TTL_MS)
                .arg(id.map(charge_field).unwrap_or_default());
            for a in extra {
                inv.arg(a);
            }
            let mut conn = self.node.conn.clone();
            let timeout = self.node.options.command_timeout;
            let call = inv.invoke_async(&mut conn);
            let value: ::redis::Value =
                super::on_home(&self.node.runtime, tokio::time::timeout(timeout, call))
                    .await
                    .map_err(|_| CallError::Timeout(timeout))??;
            let ::redis::Value::Array(items) = value else {
                return Err(CallError::Reply("not an array"));
            };
            let r = Reply(items, String::new());
            if r.len() < 9 {
                return Err(CallError::Reply("short token reply"));
            }
            let source = match r.int(3)? {
                1 => Some(BudgetSource::Configured),
                2 => Some(BudgetSource::Announced),
                3 => Some(BudgetSource::Both),
                _ => None,
            };
            let view = TokenView {
                remaining: r.opt(1)?,
                budget: r.opt(2)?,
                source,
                admitted_tokens: r.u64(4)?,
                held: r.int(6)? == 1,
                input_remaining: r.opt(7)?,
                output_remaining: r.opt(8)?,
            };
            Ok((r.str(0)?, view, r.opt(5)?))
        }
        .await;
        super::measure::record("tokens", op, started, &result);
        result
    }

    /// Charges `cost` for `id` if it fits and nobody else holds the budget. `holder`: the
    /// caller's waiter has waited its hold, so if it does not fit the budget is held for it
    /// (until it is admitted, [`RedisTokens::unhold`], or [`HOLD_TTL_MS`] without asking).
    pub async fn admit(
        &self,
        settings: &TokenSettings,
        id: u128,
        cost: TokenCost,
        holder: bool,
    ) -> Result<SharedAdmit, CallError> {
        let extra = [
            cost.input.to_string(),
            cost.output.to_string(),
            u8::from(holder).to_string(),
        ];
        let (verdict, view, retry) = self.call("admit", settings, Some(id), &extra).await?;
        Ok(match verdict.as_str() {
            "admitted" => SharedAdmit::Admitted(view),
            // Its reply carries the estimate and the budget where remaining and budget go.
            "exceeds" => SharedAdmit::Exceeds {
                estimate: view.remaining.unwrap_or(0),
                budget: view.budget.unwrap_or(0),
            },
            _ => SharedAdmit::Refused {
                view,
                retry_after_ms: retry,
            },
        })
    }

    /// The request of charge `id` ended; `actual` is the usage its answer reported.
    pub async fn finish(
        &self,
        settings: &TokenSettings,
        id: u128,
        actual: Option<Usage>,
    ) -> Result<TokenView, CallError> {
        self.report(settings, &[TokenReport::Finish(id, actual)])
            .await
    }

    /// Which of `ids` the ledger holds charges for, in order (one `HMGET` for all of them). For
    /// a node with no budget in force, whose charges are rare: a lock released there cannot
    /// tell whether the node that granted it charged it, so it reports every release and
    /// finishes only the charged ones. A charge is written before its lease or request goes
    /// on, so one that is not there now never will be.
    pub async fn charged(&self, ids: &[u128]) -> Result<Vec<bool>, CallError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.node.conn.clone();
        let timeout = self.node.options.command_timeout;
        let mut cmd = ::redis::cmd("HMGET");
        cmd.arg(&self.keys[0]);
        for id in ids {
            cmd.arg(charge_field(*id));
        }
        let query = cmd.query_async(&mut conn);
        let found: Vec<Option<Vec<u8>>> =
            super::on_home(&self.node.runtime, tokio::time::timeout(timeout, query))
                .await
                .map_err(|_| CallError::Timeout(timeout))??;
        if found.len() != ids.len() {
            return Err(CallError::Reply(
                "HMGET answered for another number of fields",
            ));
        }
        Ok(found.iter().map(Option::is_some).collect())
    }

    /// Takes a charge back whole (its request never reached the origin).
    pub async fn refund(&self, settings: &TokenSettings, id: u128) -> Result<TokenView, CallError> {
        self.report(settings, &[TokenReport::Refund(id)]).await
    }

    /// `id`'s waiter no longer waits: the budget is not held for it any more.
    pub async fn unhold(&self, settings: &TokenSettings, id: u128) -> Result<TokenView, CallError> {
        self.report(settings, &[TokenReport::Unhold(id)]).await
    }

    /// The origin's word on its token budget (or on one `part` of a split one), from the
    /// answer to charge `id` (if known).
    pub async fn observe(
        &self,
        settings: &TokenSettings,
        id: Option<u128>,
        part: TokenPart,
        window: TokenWindow,
    ) -> Result<TokenView, CallError> {
        self.report(settings, &[TokenReport::Observe(id, part, window)])
            .await
    }

    /// Sends `reports` in order in one call (one alone as its own operation); the budget as it
    /// stands after them. They share the call's reading of the ledger and its writing back, the
    /// larger part of a short call.
    pub async fn report(
        &self,
        settings: &TokenSettings,
        reports: &[TokenReport],
    ) -> Result<TokenView, CallError> {
        if let [one] = reports {
            let (op, id, args) = one.encode();
            return Ok(self.call(op, settings, id, &args).await?.1);
        }
        let mut extra = Vec::with_capacity(reports.len() * 6);
        for r in reports {
            let (op, id, args) = r.encode();
            extra.push(op.to_owned());
            extra.push(id.map(charge_field).unwrap_or_default());
            extra.extend(args);
        }
        Ok(self.call("batch", settings, None, &extra).await?.1)
    }

    /// The budget as it stands.
    pub async fn peek(&self, settings: &TokenSettings) -> Result<TokenView, CallError> {
        Ok(self.call("peek", settings, None, &[]).await?.1)
    }
}
