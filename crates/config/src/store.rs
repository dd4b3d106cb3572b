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
    },
}

impl std::fmt::Debug for StoreSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreSpec::Sqlite => f.write_str("Sqlite"),
            StoreSpec::Postgres { url } => f
                .debug_struct("Postgres")
                .field("url", &crate::database::mask_database_url(url))
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
        Ok(StoreSpec::Postgres { url })
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
                url: "postgres://app:hunter2@db:5432/nb?sslmode=require".into()
            })
        );
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
