//! Where coordination state lives (SPEC §10, §12): `server.coordination` is `"in-process"` (one
//! node) or `"redis://host:port/db"` (several nodes sharing each pool's limit), with what a
//! node does while Redis is away (`coordination_fail`, `expected_nodes`) and how it talks to
//! it (`coordination_prefix`, `coordination_timeout_ms`).
//!
//! Owns the rules of those keys and the resolved [`Coordination`] the server builds from. A
//! Redis URL may carry a password: no error, log line or `Debug` output here quotes it.

use serde::{Deserialize, Serialize};

use crate::{resolve_secret, ConfigError, ServerSpec};

/// `server.coordination_fail`: what admission does while Redis cannot be reached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CoordinationFail {
    /// Refuse: `503 coordination_unavailable` with `Retry-After`.
    #[default]
    Closed,
    /// Each node admits up to `limit / expected_nodes` on its own until Redis answers again.
    Open,
}

/// The coordination a server runs with, resolved and checked.
#[derive(Clone, PartialEq, Eq)]
pub enum Coordination {
    InProcess,
    Redis(RedisCoordination),
}

/// `server.coordination = "redis://…"` and its companions.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisCoordination {
    /// The URL with `env:` resolved (it may hold a password: never print it).
    pub url: String,
    /// `Some(n)` with `coordination_fail = "open"`: admit `limit / n` per node while Redis is away.
    pub fail_open: Option<u32>,
    pub key_prefix: String,
    pub timeout_ms: u64,
}

impl std::fmt::Debug for RedisCoordination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCoordination")
            .field("url", &"<redacted>")
            .field("fail_open", &self.fail_open)
            .field("key_prefix", &self.key_prefix)
            .field("timeout_ms", &self.timeout_ms)
            .finish()
    }
}

impl std::fmt::Debug for Coordination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Coordination::InProcess => f.write_str("InProcess"),
            Coordination::Redis(r) => r.fmt(f),
        }
    }
}

/// Most nodes `expected_nodes` may name.
pub const MAX_EXPECTED_NODES: u32 = 1_000;
/// Longest `coordination_timeout_ms`.
pub const MAX_COORDINATION_TIMEOUT_MS: u64 = 60_000;

impl ServerSpec {
    /// `server.coordination` as it may be shown (a log line, a reload's refusal): a Redis URL's
    /// password masked, like `store`'s.
    pub fn coordination_shown(&self) -> String {
        if self.coordination == "in-process" || self.coordination.starts_with("env:") {
            return self.coordination.clone();
        }
        crate::database::mask_database_url(&self.coordination)
    }

    /// The coordination this server runs with, with every rule of its keys checked.
    pub fn coordination(&self) -> Result<Coordination, ConfigError> {
        const KEY: &str = "server.coordination";
        if self.coordination == "in-process" {
            if self.coordination_fail == CoordinationFail::Open {
                return Err(ConfigError::new(
                    "server.coordination_fail",
                    "\"open\" needs server.coordination = \"redis://…\"",
                ));
            }
            return Ok(Coordination::InProcess);
        }
        let looks_like_redis = |s: &str| {
            s.starts_with("redis://") || s.starts_with("rediss://") || s.starts_with("env:")
        };
        if !looks_like_redis(&self.coordination) {
            return Err(ConfigError::new(
                KEY,
                "must be \"in-process\" or \"redis://host:port/db\"",
            ));
        }
        let url = resolve_secret(KEY, &self.coordination)?;
        check_redis_url(KEY, &url)?;
        let prefix = &self.coordination_prefix;
        let prefix_ok = !prefix.is_empty()
            && prefix.len() <= 64
            && prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
        if !prefix_ok {
            return Err(ConfigError::new(
                "server.coordination_prefix",
                "must be 1 to 64 characters of letters, digits, '-', '_', '.' or ':'",
            ));
        }
        if self.coordination_timeout_ms == 0
            || self.coordination_timeout_ms > MAX_COORDINATION_TIMEOUT_MS
        {
            return Err(ConfigError::new(
                "server.coordination_timeout_ms",
                format!(
                    "must be between 1 and {MAX_COORDINATION_TIMEOUT_MS} (got {})",
                    self.coordination_timeout_ms
                ),
            ));
        }
        let fail_open = match (self.coordination_fail, self.expected_nodes) {
            (_, Some(n)) if n == 0 || n > MAX_EXPECTED_NODES => {
                return Err(ConfigError::new(
                    "server.expected_nodes",
                    format!("must be between 1 and {MAX_EXPECTED_NODES} (got {n})"),
                ))
            }
            (CoordinationFail::Closed, _) => None,
            (CoordinationFail::Open, Some(n)) => Some(n),
            (CoordinationFail::Open, None) => {
                return Err(ConfigError::new(
                    "server.expected_nodes",
                    "must be set when server.coordination_fail = \"open\" (each node then \
                     admits limit / expected_nodes while Redis is away)",
                ))
            }
        };
        Ok(Coordination::Redis(RedisCoordination {
            url,
            fail_open,
            key_prefix: prefix.clone(),
            timeout_ms: self.coordination_timeout_ms,
        }))
    }
}

/// `redis://[user[:password]@]host[:port][/db]`, checked without ever quoting it.
fn check_redis_url(key: &str, url: &str) -> Result<(), ConfigError> {
    let rule = |r: &str| Err(ConfigError::new(key, r.to_owned()));
    if url.starts_with("rediss://") {
        return rule("rediss:// (Redis over TLS) is not supported in this version; use redis://");
    }
    let Some(rest) = url.strip_prefix("redis://") else {
        return rule("must start with redis://");
    };
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a, p),
        None => (rest, ""),
    };
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = match host_port.strip_prefix('[') {
        Some(v6) => v6.split_once(']').map(|(h, _)| h).unwrap_or_default(),
        None => host_port.split(':').next().unwrap_or_default(),
    };
    if host.is_empty() {
        return rule("the redis:// URL names no host");
    }
    let port = host_port
        .strip_prefix('[')
        .and_then(|v6| v6.split_once(']').map(|(_, p)| p))
        .unwrap_or_else(|| host_port.split_once(':').map_or("", |(_, p)| p));
    let port = port.strip_prefix(':').unwrap_or(port);
    if !port.is_empty() && port.parse::<u16>().map_or(true, |p| p == 0) {
        return rule("the redis:// URL's port must be a number between 1 and 65535");
    }
    let db = path.split(['?', '#']).next().unwrap_or_default();
    if !db.is_empty() && db.parse::<u32>().is_err() {
        return rule("the redis:// URL's path must be a database number (redis://host:port/0)");
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    #[test]
    fn the_shown_coordination_masks_a_redis_password() {
        let with = |c: &str| ServerSpec {
            coordination: c.into(),
            ..ServerSpec::default()
        };
        assert_eq!(with("in-process").coordination_shown(), "in-process");
        assert_eq!(with("env:REDIS_URL").coordination_shown(), "env:REDIS_URL");
        let shown = with("redis://:hunter2@cache:6379/0").coordination_shown();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.starts_with("redis://:") && shown.ends_with("@cache:6379/0"));
        let shown = with("redis://app:hunter2@cache/1").coordination_shown();
        assert!(
            !shown.contains("hunter2") && shown.starts_with("redis://app:"),
            "{shown}"
        );
    }

    use crate::Config;

    use super::*;

    fn server(extra: &str) -> Result<Coordination, ConfigError> {
        let c = Config::from_toml_str(&format!("[server]\n{extra}"))?;
        c.server.coordination()
    }

    #[test]
    fn redis_coordination_is_accepted_with_its_companions() {
        assert_eq!(server("").unwrap(), Coordination::InProcess);
        let Coordination::Redis(r) = server(
            "coordination = \"redis://127.0.0.1:6379/3\"\ncoordination_fail = \"open\"\n\
             expected_nodes = 3\ncoordination_prefix = \"team-a\"\ncoordination_timeout_ms = 250\n",
        )
        .unwrap() else {
            panic!("not redis");
        };
        assert_eq!(r.url, "redis://127.0.0.1:6379/3");
        assert_eq!(r.fail_open, Some(3));
        assert_eq!((r.key_prefix.as_str(), r.timeout_ms), ("team-a", 250));
        let Coordination::Redis(r) = server("coordination = \"redis://cache\"\n").unwrap() else {
            panic!("not redis");
        };
        assert_eq!((r.fail_open, r.key_prefix.as_str()), (None, "nb"));
    }

    #[test]
    fn bad_coordination_settings_name_the_key_and_never_quote_a_password() {
        let cases = [
            ("coordination = \"memcached://x\"\n", "server.coordination"),
            ("coordination = \"redis://\"\n", "server.coordination"),
            (
                "coordination = \"redis://:hunter2@h:99999\"\n",
                "server.coordination",
            ),
            (
                "coordination = \"redis://:hunter2@h/x\"\n",
                "server.coordination",
            ),
            ("coordination = \"rediss://h\"\n", "server.coordination"),
            ("coordination_fail = \"open\"\n", "server.coordination_fail"),
            (
                "coordination = \"redis://h\"\ncoordination_fail = \"open\"\n",
                "server.expected_nodes",
            ),
            (
                "coordination = \"redis://h\"\nexpected_nodes = 0\n",
                "server.expected_nodes",
            ),
            (
                "coordination = \"redis://h\"\ncoordination_prefix = \"a{b}\"\n",
                "server.coordination_prefix",
            ),
            (
                "coordination = \"redis://h\"\ncoordination_timeout_ms = 0\n",
                "server.coordination_timeout_ms",
            ),
            (
                "coordination = \"env:NTHBOUNCER_TEST_SURELY_UNSET\"\n",
                "server.coordination",
            ),
        ];
        for (text, key) in cases {
            let e = server(text).unwrap_err();
            assert_eq!(e.key, key, "{text}: {e}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
        let e = Config::from_toml_str("[server]\ncoordination_fail = \"sometimes\"\n").unwrap_err();
        assert!(e.to_string().contains("coordination_fail"), "{e}");
    }

    #[test]
    fn a_redis_url_is_never_shown_in_debug_output() {
        let c = server("coordination = \"redis://:hunter2@h:6379/0\"\n").unwrap();
        assert!(!format!("{c:?}").contains("hunter2"));
    }
}
