//! `kind = "database"` pools (SPEC §8): the `postgres://` upstream, a managed credential, and
//! the `[pools.database]` table.
//!
//! Owns the rules of a database pool's settings and the masking of the upstream's password on
//! read. Must not open connections (the server's `database` feature does, through
//! `nthbouncer-sqlhttp`). No error built here quotes the upstream URL: it holds the password.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{resolve_secret, ConfigError};

pub const DEFAULT_MAX_RESPONSE_BYTES: u64 = 10 * 1024 * 1024;
pub const MAX_MAX_RESPONSE_BYTES: u64 = 1024 * 1024 * 1024;
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 10_000;
pub const MAX_CONNECT_TIMEOUT_MS: u64 = 300_000;
pub const MAX_STATEMENT_TIMEOUT_MS: u64 = 86_400_000;

/// The password of a `postgres://` URL as shown on read.
pub const MASKED_PASSWORD: &str = "****";

/// `[pools.database]`: settings of a database pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSpec {
    /// Most bytes one answer may encode to; past it the query is cancelled and the caller gets
    /// `507 response_too_large`.
    pub max_response_bytes: u64,
    /// PostgreSQL's `statement_timeout` on every session of the pool; 0 leaves the server's.
    pub statement_timeout_ms: u64,
    /// Longest opening a connection may take (TCP, TLS, authentication).
    pub connect_timeout_ms: u64,
    /// PEM file of CA certificates trusted besides the public roots (`sslmode=require` with a
    /// private CA).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub ca_file: Option<PathBuf>,
}

impl Default for DatabaseSpec {
    fn default() -> Self {
        DatabaseSpec {
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            statement_timeout_ms: 0,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            ca_file: None,
        }
    }
}

impl DatabaseSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        let between = |key: &str, v: u64, min: u64, max: u64| {
            if (min..=max).contains(&v) {
                Ok(())
            } else {
                Err(ConfigError::new(
                    format!("{at}.{key}"),
                    format!("must be between {min} and {max} (got {v})"),
                ))
            }
        };
        between(
            "max_response_bytes",
            self.max_response_bytes,
            1,
            MAX_MAX_RESPONSE_BYTES,
        )?;
        between(
            "statement_timeout_ms",
            self.statement_timeout_ms,
            0,
            MAX_STATEMENT_TIMEOUT_MS,
        )?;
        between(
            "connect_timeout_ms",
            self.connect_timeout_ms,
            1,
            MAX_CONNECT_TIMEOUT_MS,
        )?;
        if let Some(path) = &self.ca_file {
            if path.as_os_str().is_empty() {
                return Err(ConfigError::new(
                    format!("{at}.ca_file"),
                    "must be a path to a PEM file",
                ));
            }
        }
        Ok(())
    }
}

/// Checks a database pool's `upstream` (after `env:` is resolved): a `postgres://` or
/// `postgresql://` URL with a user and a host. The message never quotes the URL.
pub fn check_database_url(key: &str, raw: &str) -> Result<String, ConfigError> {
    let url = resolve_secret(key, raw)?;
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .ok_or_else(|| {
            ConfigError::new(
                key,
                "a database pool's upstream must start with postgres:// or postgresql://",
            )
        })?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let (userinfo, host) = match authority.rsplit_once('@') {
        Some((u, h)) => (u, h),
        None => ("", authority),
    };
    let user = userinfo.split(':').next().unwrap_or_default();
    if user.is_empty() {
        return Err(ConfigError::new(
            key,
            "a database pool's upstream must name a user (postgres://user:password@host/db)",
        ));
    }
    if host.is_empty() || host.starts_with(':') {
        return Err(ConfigError::new(
            key,
            "a database pool's upstream must name a host (postgres://user:password@host/db)",
        ));
    }
    Ok(url)
}

/// A `postgres://` URL with its password (if any) replaced by [`MASKED_PASSWORD`]. Anything
/// that does not look like such a URL is masked whole: a read never shows a credential.
pub fn mask_database_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return crate::mask(url);
    };
    let rest = &url[scheme_end..];
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_len];
    let Some(at) = authority.rfind('@') else {
        return url.to_string();
    };
    let userinfo = &authority[..at];
    let Some(colon) = userinfo.find(':') else {
        return url.to_string();
    };
    format!(
        "{}{}:{MASKED_PASSWORD}{}",
        &url[..scheme_end],
        &userinfo[..colon],
        &url[scheme_end + at..]
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_without_being_quoted() {
        let ok = check_database_url("k", "postgres://app:hunter2@db:5432/shop?sslmode=require");
        assert!(ok.is_ok());
        for bad in [
            "http://app:hunter2@db/shop",
            "postgres://:hunter2@db/shop",
            "postgres://app:hunter2@/shop",
            "postgres://app:hunter2@:5432/shop",
        ] {
            let e = check_database_url("k", bad).unwrap_err();
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn the_password_is_masked_and_nothing_else() {
        assert_eq!(
            mask_database_url("postgres://app:hunter2@db:5432/shop?sslmode=require"),
            "postgres://app:****@db:5432/shop?sslmode=require"
        );
        assert_eq!(
            mask_database_url("postgresql://a:p@ss@h/d"),
            "postgresql://a:****@h/d"
        );
        assert_eq!(
            mask_database_url("postgres://app@db/shop"),
            "postgres://app@db/shop"
        );
        assert!(!mask_database_url("garbage-hunter2-secret").contains("hunter2"));
    }
}
