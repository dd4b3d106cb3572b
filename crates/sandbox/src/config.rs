//! The sandbox's knobs: the hidden limits it enforces and how slowly it answers.

use serde::{Deserialize, Serialize};

/// How the sandbox behaves. Everything here is "hidden" from clients except
/// what `announce` chooses to reveal through `x-ratelimit-*` headers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    /// Hidden concurrency limit: requests arriving while this many are in
    /// flight get a 429. Never announced in headers. `0` disables it.
    pub limit: u32,
    /// Hidden requests-per-minute limit over a rolling 60 s window of
    /// accepted requests. `0` disables it.
    pub rpm: u32,
    /// Fixed latency added to every admitted request before it is answered.
    pub latency_ms: u64,
    /// Extra latency drawn uniformly from `0..=latency_jitter_ms` per request.
    pub latency_jitter_ms: u64,
    /// Send OpenAI-style `x-ratelimit-*-requests` headers (only meaningful
    /// when `rpm` is set, since that is the only limit such headers describe).
    pub announce: bool,
    /// Hidden tokens-per-minute limit on chat completions (prompt words plus `max_tokens`,
    /// charged on arrival), announced with `x-ratelimit-*-tokens`. `0` disables it.
    pub tpm: u64,
    /// The period over which the token limits refill (a minute by default).
    pub token_window_ms: u64,
    /// Hidden input-tokens-per-minute limit on Anthropic messages (`POST /v1/messages`: the
    /// prompt's words, charged on arrival), announced with
    /// `anthropic-ratelimit-input-tokens-*`. `0` disables it.
    pub input_tpm: u64,
    /// Hidden output-tokens-per-minute limit on Anthropic messages (`max_tokens`, charged on
    /// arrival, what the answer did not use given back), announced with
    /// `anthropic-ratelimit-output-tokens-*`. `0` disables it.
    pub output_tpm: u64,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            limit: 8,
            rpm: 0,
            latency_ms: 50,
            latency_jitter_ms: 0,
            announce: true,
            tpm: 0,
            token_window_ms: 60_000,
            input_tpm: 0,
            output_tpm: 0,
        }
    }
}
