//! Seen HMAC nonces on Redis, shared by every node serving a pool.
//!
//! Owns one pool's nonce keys (`{prefix}:{pool}:nonce:{hex}`): recording is one
//! `SET key 1 NX PX ttl`, so "first sighting" is decided by Redis once for all nodes, and Redis
//! forgets a nonce when its signature could no longer pass anyway. Must not verify signatures.

use std::time::Duration;

use ::redis::aio::ConnectionManager;

use super::script::pool_key;
use crate::{NonceKey, NonceStore, NonceVerdict};

/// One pool's seen nonces in Redis.
pub struct RedisNonces {
    conn: ConnectionManager,
    /// The node's runtime (see `on_home`).
    home: tokio::runtime::Handle,
    prefix: String,
    timeout: Duration,
}

impl RedisNonces {
    pub(crate) fn new(
        conn: ConnectionManager,
        home: tokio::runtime::Handle,
        prefix: &str,
        pool: &str,
        timeout: Duration,
    ) -> Self {
        RedisNonces {
            conn,
            home,
            prefix: pool_key(prefix, pool, "nonce:"),
            timeout,
        }
    }
}

#[async_trait::async_trait]
impl NonceStore for RedisNonces {
    /// The lifetime is the caller's (`expires_at_ms - now_ms`, both on its clock), so no two
    /// clocks are compared. Redis unreachable answers [`NonceVerdict::Full`]: the nonce was not
    /// recorded, and refusing the request is the only answer that cannot admit a replay.
    async fn check_and_record(
        &self,
        nonce: NonceKey,
        now_ms: u64,
        expires_at_ms: u64,
    ) -> NonceVerdict {
        let key = format!("{}{}", self.prefix, hex::encode(nonce.0));
        let ttl = expires_at_ms.saturating_sub(now_ms).max(1);
        let mut cmd = ::redis::cmd("SET");
        cmd.arg(&key).arg(1).arg("NX").arg("PX").arg(ttl);
        let mut conn = self.conn.clone();
        let set = cmd.query_async::<Option<String>>(&mut conn);
        match super::on_home(&self.home, tokio::time::timeout(self.timeout, set)).await {
            Ok(Ok(Some(_))) => NonceVerdict::Fresh,
            Ok(Ok(None)) => NonceVerdict::Replayed,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "nonce store unreachable; refusing the nonce");
                NonceVerdict::Full
            }
            Err(_) => {
                tracing::warn!("nonce store did not answer in time; refusing the nonce");
                NonceVerdict::Full
            }
        }
    }
}
