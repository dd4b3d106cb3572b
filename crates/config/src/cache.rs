//! `[pools.cache]`: the proxy's shared response cache (SPEC §4, §12). Absent (the default), a
//! pool has no cache at all; present, its keys have the defaults below.

use serde::{Deserialize, Serialize};

use crate::ConfigError;

/// `cache.ttl_s`: at least a second, at most a week.
pub const MAX_TTL_S: u64 = 604_800;
/// `cache.max_bytes`: at least 64 KiB, at most 64 GiB.
pub const MIN_MAX_BYTES: u64 = 64 * 1024;
pub const MAX_MAX_BYTES: u64 = 64 * 1024 * 1024 * 1024;
/// `cache.max_entry_bytes`: at most 64 MiB (and at most `max_bytes`).
pub const MAX_MAX_ENTRY_BYTES: u64 = 64 * 1024 * 1024;
/// `cache.vary`: at most this many header names.
pub const MAX_VARY: usize = 32;

/// `[pools.cache]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CacheSpec {
    /// The longest an entry is served, in seconds; the origin's `max-age`/`s-maxage` may
    /// shorten it, never lengthen it.
    pub ttl_s: u64,
    /// Bytes all entries of the pool may take (bodies, headers and keys), on each node.
    pub max_bytes: u64,
    /// Largest entry kept; a larger answer is passed through uncached.
    pub max_entry_bytes: u64,
    /// Request headers whose values are part of the key (besides method, path and query).
    pub vary: Vec<String>,
    /// One entry serves every key of the pool; off, each pool key has its own entries.
    pub shared_across_keys: bool,
}

impl Default for CacheSpec {
    fn default() -> Self {
        CacheSpec {
            ttl_s: 60,
            max_bytes: 64 * 1024 * 1024,
            max_entry_bytes: 1024 * 1024,
            vary: Vec::new(),
            shared_across_keys: false,
        }
    }
}

impl CacheSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        if !(1..=MAX_TTL_S).contains(&self.ttl_s) {
            return Err(ConfigError::new(
                format!("{at}.ttl_s"),
                format!("must be between 1 and {MAX_TTL_S} (got {})", self.ttl_s),
            ));
        }
        if !(MIN_MAX_BYTES..=MAX_MAX_BYTES).contains(&self.max_bytes) {
            return Err(ConfigError::new(
                format!("{at}.max_bytes"),
                format!(
                    "must be between {MIN_MAX_BYTES} and {MAX_MAX_BYTES} (got {})",
                    self.max_bytes
                ),
            ));
        }
        let entry_max = MAX_MAX_ENTRY_BYTES.min(self.max_bytes);
        if !(1..=entry_max).contains(&self.max_entry_bytes) {
            return Err(ConfigError::new(
                format!("{at}.max_entry_bytes"),
                format!(
                    "must be between 1 and {entry_max} (64 MiB, and at most max_bytes; got {})",
                    self.max_entry_bytes
                ),
            ));
        }
        if self.vary.len() > MAX_VARY {
            return Err(ConfigError::new(
                format!("{at}.vary"),
                format!("at most {MAX_VARY} header names"),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, name) in self.vary.iter().enumerate() {
            let key = format!("{at}.vary[{i}]");
            let parsed = http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| ConfigError::new(&key, format!("{name:?} is not a header name")))?;
            // The origin never sees them (SPEC §2): they cannot change its answer.
            if parsed.as_str().starts_with("x-nthpool-") {
                return Err(ConfigError::new(
                    &key,
                    "X-Nthpool-* headers never reach the origin and cannot vary its answer",
                ));
            }
            if !seen.insert(parsed) {
                return Err(ConfigError::new(&key, format!("{name:?} is listed twice")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::Config;

    const BASE: &str = "[[pools]]\nname = \"x\"\nupstream = \"http://a\"\n";

    fn err(table: &str) -> crate::ConfigError {
        Config::from_toml_str(&format!("{BASE}[pools.cache]\n{table}")).unwrap_err()
    }

    #[test]
    fn off_by_default_and_defaults_when_present() {
        let c = Config::from_toml_str(BASE).unwrap();
        assert!(c.pools[0].cache.is_none());
        let c = Config::from_toml_str(&format!("{BASE}[pools.cache]\nttl_s = 5\n")).unwrap();
        let cache = c.pools[0].cache.clone().unwrap();
        assert_eq!(cache.ttl_s, 5);
        assert_eq!(cache.max_bytes, 64 * 1024 * 1024);
        assert_eq!(cache.max_entry_bytes, 1024 * 1024);
        assert!(!cache.shared_across_keys);
    }

    #[test]
    fn errors_name_the_key_and_rule() {
        let e = err("ttl_s = 0\n");
        assert_eq!(e.key, "pools[0].cache.ttl_s");
        assert!(e.rule.contains("between 1 and"), "{e}");
        assert_eq!(err("max_bytes = 10\n").key, "pools[0].cache.max_bytes");
        let e = err("max_bytes = 100000\nmax_entry_bytes = 100001\n");
        assert_eq!(e.key, "pools[0].cache.max_entry_bytes");
        assert_eq!(
            err("max_entry_bytes = 0\n").key,
            "pools[0].cache.max_entry_bytes"
        );
        assert_eq!(
            err("vary = [\"bad header\"]\n").key,
            "pools[0].cache.vary[0]"
        );
        assert_eq!(
            err("vary = [\"accept\", \"Accept\"]\n").key,
            "pools[0].cache.vary[1]"
        );
        assert_eq!(
            err("vary = [\"X-Nthpool-Key\"]\n").key,
            "pools[0].cache.vary[0]"
        );
        let e = err("ttl = 5\n");
        assert_eq!(e.key, "pools[0].cache.ttl", "{e}");
        assert!(e.rule.contains("unknown field"), "{e}");
    }
}
