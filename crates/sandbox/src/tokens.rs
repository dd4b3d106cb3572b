//! The sandbox's hidden tokens-per-minute limit: a token bucket of `tpm` tokens that refills
//! continuously over `token_window_ms` (as OpenAI's does). A chat completion is charged its
//! prompt (its words: the sandbox's own simple count, deliberately not a real tokenizer) plus
//! its `max_tokens` on arrival; past the bucket's level it gets a 429. When it is answered, the
//! part of `max_tokens` the reply did not use is given back. Answers announce the bucket with
//! OpenAI's `x-ratelimit-{limit,remaining,reset}-tokens`.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::Value;

/// What the `-tokens` headers say for one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TokenView {
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    /// Until the bucket is full again.
    pub(crate) reset: Duration,
}

#[derive(Debug)]
pub(crate) struct TokenBucket {
    tpm: u64,
    window: Duration,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    pub(crate) fn new(tpm: u64, window: Duration) -> Self {
        TokenBucket {
            tpm,
            window: window.max(Duration::from_millis(1)),
            state: Mutex::new((tpm as f64, Instant::now())),
        }
    }

    fn per_sec(&self) -> f64 {
        self.tpm as f64 / self.window.as_secs_f64()
    }

    fn refill(&self, state: &mut (f64, Instant), now: Instant) {
        let gained = now.saturating_duration_since(state.1).as_secs_f64() * self.per_sec();
        state.0 = (state.0 + gained).min(self.tpm as f64);
        state.1 = now;
    }

    fn view(&self, level: f64) -> TokenView {
        let missing = (self.tpm as f64 - level).max(0.0);
        TokenView {
            limit: self.tpm,
            remaining: level.max(0.0).floor() as u64,
            reset: Duration::from_secs_f64(missing / self.per_sec()),
        }
    }

    /// Charges `cost` tokens, or refuses with the time until they would fit.
    pub(crate) fn charge(&self, cost: u64) -> Result<TokenView, (Duration, TokenView)> {
        let mut state = self.state.lock();
        self.refill(&mut state, Instant::now());
        let cost = cost as f64;
        if cost > state.0 {
            let wait = Duration::from_secs_f64((cost - state.0) / self.per_sec());
            return Err((wait, self.view(state.0)));
        }
        state.0 -= cost;
        Ok(self.view(state.0))
    }

    /// Gives back `tokens` charged but not used.
    pub(crate) fn give_back(&self, tokens: u64) {
        let mut state = self.state.lock();
        self.refill(&mut state, Instant::now());
        state.0 = (state.0 + tokens as f64).min(self.tpm as f64);
    }
}

/// The sandbox's count of a request's prompt: the words of every message's text.
pub(crate) fn prompt_words(request: &Value) -> u64 {
    let Some(messages) = request.get("messages").and_then(Value::as_array) else {
        return 0;
    };
    let words = |s: &str| s.split_whitespace().count() as u64;
    messages
        .iter()
        .filter_map(|m| m.get("content"))
        .map(|c| match c {
            Value::String(s) => words(s),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .map(words)
                .sum(),
            _ => 0,
        })
        .sum()
}

/// The output cap a request asks for (`max_completion_tokens` or `max_tokens`), 0 if none.
pub(crate) fn max_tokens(request: &Value) -> u64 {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| request.get(*k).and_then(Value::as_u64))
        .unwrap_or(0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn charges_refuses_and_gives_back() {
        let b = TokenBucket::new(100, Duration::from_secs(3600));
        let v = b.charge(60).unwrap();
        assert_eq!((v.limit, v.remaining), (100, 40));
        assert!(v.reset > Duration::from_secs(2000));
        let (wait, v) = b.charge(50).unwrap_err();
        assert_eq!(v.remaining, 40);
        assert!(wait > Duration::from_secs(300));
        b.give_back(30);
        assert_eq!(b.charge(70).unwrap().remaining, 0);
    }

    #[test]
    fn counts_words_and_caps() {
        let req = serde_json::json!({
            "max_tokens": 5,
            "messages": [{"role":"system","content":"be brief"},
                         {"role":"user","content":[{"type":"text","text":"one two three"}]}]
        });
        assert_eq!(prompt_words(&req), 5);
        assert_eq!(max_tokens(&req), 5);
    }
}
