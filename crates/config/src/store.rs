//! `server.store`: the embedded SQLite store, or a PostgreSQL database several nodes share.

use crate::{resolve_secret, ConfigError, ServerSpec};

/// The durable store a server runs on, resolved and checked.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// `"sqlite"`: a WAL file under `data_dir`.
    Sqlite,
    /// `"postgres://…"` (or `env:NAME` holding one).
    Postgres {
        /// The URL with `env:` resolved (it may hold a password: never print it).
        url: String,
        /// `server.store_claim_lease_ms`.
        claim_lease_ms: u64,
    },
}

/// Default `server.store_claim_lease_ms`: two minutes, longer than any webhook attempt.
pub const DEFAULT_CLAIM_LEASE_MS: u64 = 120_000;
/// Bounds of `server.store_claim_lease_ms`.
pub const MIN_CLAIM_LEASE_MS: u64 = 1_000;
pub const MAX_CLAIM_LEASE_MS: u64 = 3_600_000;

impl std::fmt::Debug for StoreSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreSpec::Sqlite => f.write_str("Sqlite"),
            StoreSpec::Postgres {
                url,
                claim_lease_ms,
            } => f
                .debug_struct("Postgres")
                .field("url", &crate::database::mask_database_url(url))
                .field("claim_lease_ms", claim_lease_ms)
                .finish(),
        }
    }
}

impl ServerSpec {
    /// The store this server runs on, with the key's rule checked. The message never quotes
    /// the URL.
    pub fn store(&self) -> Result<StoreSpec, ConfigError> {
        const KEY: &str = "server.store";
        const RULE: &str = "must be \"sqlite\" or \"postgres://user[:password]@host[:port]/db\" \
                            (env:NAME allowed)";
        if self.store == "sqlite" {
            return Ok(StoreSpec::Sqlite);
        }
        let looks_like_postgres =
            |s: &str| s.starts_with("postgres://") || s.starts_with("postgresql://");
        if !looks_like_postgres(&self.store) && !self.store.starts_with("env:") {
            return Err(ConfigError::new(KEY, RULE));
        }
        let url = resolve_secret(KEY, &self.store)?;
        let rest = url
            .strip_prefix("postgres://")
            .or_else(|| url.strip_prefix("postgresql://"))
            .ok_or_else(|| ConfigError::new(KEY, RULE))?;
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        if host.is_empty() || host.starts_with(':') {
            return Err(ConfigError::new(
                KEY,
                "a PostgreSQL store must name a host (postgres://user@host/db)",
            ));
        }
        let lease = self.store_claim_lease_ms;
        if !(MIN_CLAIM_LEASE_MS..=MAX_CLAIM_LEASE_MS).contains(&lease) {
            return Err(ConfigError::new(
                "server.store_claim_lease_ms",
                format!("must be {MIN_CLAIM_LEASE_MS}..={MAX_CLAIM_LEASE_MS} (got {lease})"),
            ));
        }
        Ok(StoreSpec::Postgres {
            url,
            claim_lease_ms: lease,
        })
    }

    /// `server.store` fit to show: a URL's password masked.
    pub fn store_shown(&self) -> String {
        if self.store == "sqlite" || self.store.starts_with("env:") {
            return self.store.clone();
        }
        crate::database::mask_database_url(&self.store)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(store: &str) -> ServerSpec {
        ServerSpec {
            store: store.into(),
            ..ServerSpec::default()
        }
    }

    #[test]
    fn sqlite_postgres_and_nothing_else() {
        assert_eq!(with("sqlite").store().ok(), Some(StoreSpec::Sqlite));
        let pg = with("postgres://app:hunter2@db:5432/nb?sslmode=require")
            .store()
            .ok();
        assert_eq!(
            pg,
            Some(StoreSpec::Postgres {
                url: "postgres://app:hunter2@db:5432/nb?sslmode=require".into(),
                claim_lease_ms: DEFAULT_CLAIM_LEASE_MS,
            })
        );
        let mut short = with("postgres://db/nb");
        short.store_claim_lease_ms = 999;
        let err = short.store().err().map(|e| e.key);
        assert_eq!(err.as_deref(), Some("server.store_claim_lease_ms"));
        assert!(!format!("{pg:?}").contains("hunter2"));
        for bad in [
            "mysql://x/y",
            "postgres:///nb",
            "postgres://app:hunter2@:5432/nb",
            "",
        ] {
            let err = with(bad).store().err();
            let err = err.map(|e| (e.key, e.rule.contains("hunter2")));
            assert_eq!(err, Some(("server.store".to_string(), false)), "{bad}");
        }
        assert_eq!(
            with("postgres://app:hunter2@db/nb").store_shown(),
            "postgres://app:****@db/nb"
        );
    }
}
