//! `[pools.tokens]`: how a pool with a token budget (`concurrency.tpm`, or one learned from the
//! origin's token headers) estimates a request's cost (SPEC §12).

use serde::{Deserialize, Serialize};

use crate::ConfigError;

/// `tokens.max_body_bytes`: at most 64 MiB.
pub const MAX_MAX_BODY_BYTES: u64 = 64 * 1024 * 1024;
/// `tokens.hold_ms` and `tokens.window_ms`: at most an hour.
pub const MAX_TOKEN_MS: u64 = 3_600_000;

/// `[pools.tokens]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TokensSpec {
    /// Largest request body read to estimate its cost; a larger one costs `default_cost`.
    pub max_body_bytes: u64,
    /// The cost of a request whose body is not an LLM request we know (or is too large).
    pub default_cost: u64,
    /// The output counted for a request that states no cap (`max_tokens`, ...).
    pub default_output_tokens: u64,
    /// How long a request that does not fit lets later ones that do pass before the budget
    /// is held for it.
    pub hold_ms: u64,
    /// The window `concurrency.tpm` applies to (a minute).
    pub window_ms: u64,
}

impl Default for TokensSpec {
    fn default() -> Self {
        TokensSpec {
            max_body_bytes: 1024 * 1024,
            default_cost: 1_000,
            default_output_tokens: 1_024,
            hold_ms: 5_000,
            window_ms: 60_000,
        }
    }
}

impl TokensSpec {
    pub fn validate(&self, at: &str) -> Result<(), ConfigError> {
        if self.max_body_bytes == 0 || self.max_body_bytes > MAX_MAX_BODY_BYTES {
            return Err(ConfigError::new(
                format!("{at}.max_body_bytes"),
                format!("must be between 1 and {MAX_MAX_BODY_BYTES}"),
            ));
        }
        for (name, v, min) in [
            ("hold_ms", self.hold_ms, 0),
            ("window_ms", self.window_ms, 1),
        ] {
            if v < min || v > MAX_TOKEN_MS {
                return Err(ConfigError::new(
                    format!("{at}.{name}"),
                    format!("must be between {min} and {MAX_TOKEN_MS}"),
                ));
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

    #[test]
    fn tpm_and_the_tokens_table() {
        let c = Config::from_toml_str(BASE).unwrap();
        assert_eq!(c.pools[0].concurrency.tpm, 0);
        assert!(c.pools[0].tokens.is_none());
        let c = Config::from_toml_str(&format!(
            "{BASE}[pools.concurrency]\ntpm = 30000\n[pools.tokens]\nhold_ms = 100\n"
        ))
        .unwrap();
        assert_eq!(c.pools[0].concurrency.tpm, 30_000);
        let t = c.pools[0].tokens.clone().unwrap();
        assert_eq!(
            (t.hold_ms, t.max_body_bytes, t.window_ms),
            (100, 1_048_576, 60_000)
        );
        for (bad, key) in [
            ("window_ms = 0", "pools[0].tokens.window_ms"),
            ("max_body_bytes = 0", "pools[0].tokens.max_body_bytes"),
            ("hold_ms = 3600001", "pools[0].tokens.hold_ms"),
        ] {
            let e = Config::from_toml_str(&format!("{BASE}[pools.tokens]\n{bad}\n")).unwrap_err();
            assert_eq!(e.key, key, "{bad}");
        }
    }
}
