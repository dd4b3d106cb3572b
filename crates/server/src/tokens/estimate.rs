//! A request's cost in tokens before it is sent (SPEC §12, token budgets): its prompt counted
//! from its JSON body, plus the output it may produce.
//!
//! Shapes understood: OpenAI chat completions (`messages`), responses (`input`,
//! `instructions`), completions (`prompt`), embeddings (`input`), and Anthropic messages
//! (`system`, `messages`). The prompt's text is every string under those fields except names
//! of roles and types and data URLs. It is counted with OpenAI's own encodings (o200k_base or
//! cl100k_base, embedded in `tiktoken-rs`, chosen by the body's `model`) for OpenAI models,
//! and otherwise — Anthropic publishes no tokenizer for its current models — as one token per
//! [`BYTES_PER_TOKEN_X10`]/10 bytes of text, a figure calibrated against o200k_base on English
//! prose and code, rounded towards more tokens. Each message adds a few tokens of framing
//! (OpenAI's published rule: 3 per message, 3 to prime the answer).
//!
//! Output: the request's own cap (`max_tokens`, `max_completion_tokens`, `max_output_tokens`),
//! else the pool's default; embeddings produce none. A body that is not JSON, or not one of
//! these shapes, costs the pool's default cost.

use nthbouncer_governor::{TokenCost, Usage};
use serde_json::Value;

/// Bytes of text per token for models without a public tokenizer, times ten (3.5 bytes).
pub const BYTES_PER_TOKEN_X10: u64 = 35;
/// Framing tokens per message, and to prime the answer (OpenAI's chat format).
const PER_MESSAGE: u64 = 3;
const REPLY_PRIMING: u64 = 3;

/// How a prompt was counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// With this OpenAI encoding.
    Tokenizer(&'static str),
    /// By bytes of text ([`BYTES_PER_TOKEN_X10`]).
    Bytes,
    /// Not a request shape we know: the pool's default cost.
    Default,
}

/// A request's estimated cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Estimate {
    pub prompt: u64,
    pub output: u64,
    pub method: Method,
}

impl Estimate {
    /// What a body we do not read, or cannot read as a request, costs.
    pub fn fallback(defaults: Defaults) -> Estimate {
        Estimate {
            prompt: defaults.cost,
            output: 0,
            method: Method::Default,
        }
    }

    pub fn total(&self) -> u64 {
        self.prompt.saturating_add(self.output)
    }

    /// As the budget charges it: the prompt is input, the output cap output.
    pub fn cost(&self) -> TokenCost {
        TokenCost {
            input: self.prompt,
            output: self.output,
        }
    }
}

/// What the estimate falls back on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Defaults {
    /// The output a request that states no cap is counted for.
    pub output_tokens: u64,
    /// The cost of a body that is not a request shape we know.
    pub cost: u64,
}

/// The estimate for a request with this JSON body.
pub fn estimate(body: &[u8], defaults: Defaults) -> Estimate {
    let fallback = Estimate::fallback(defaults);
    let Ok(Value::Object(req)) = serde_json::from_slice::<Value>(body) else {
        return fallback;
    };
    let model = req.get("model").and_then(Value::as_str).unwrap_or("");
    let counter = Counter::for_model(model);
    let mut prompt = 0u64;
    let mut known = false;
    for field in ["messages", "input", "prompt", "system", "instructions"] {
        let Some(v) = req.get(field) else { continue };
        known = true;
        if let Value::Array(items) = v {
            if field == "messages" || items.iter().any(Value::is_object) {
                prompt = prompt.saturating_add(PER_MESSAGE * items.len() as u64);
            }
        }
        prompt = prompt.saturating_add(text_tokens(v, &counter));
    }
    if !known {
        return fallback;
    }
    if req.contains_key("messages") {
        prompt = prompt.saturating_add(REPLY_PRIMING);
    }
    let embeddings = !req.contains_key("messages")
        && req.get("input").is_some()
        && !req.contains_key("instructions")
        && !req.contains_key("max_output_tokens")
        && model.contains("embedding");
    let cap = ["max_completion_tokens", "max_output_tokens", "max_tokens"]
        .iter()
        .find_map(|k| req.get(*k).and_then(Value::as_u64));
    let output = match cap {
        Some(cap) => cap,
        None if embeddings => 0,
        None => defaults.output_tokens,
    };
    Estimate {
        prompt,
        output,
        method: counter.method(),
    }
}

/// Counts text in tokens, with a real encoding when the model has one.
struct Counter {
    bpe: Option<(&'static str, &'static tiktoken_rs::CoreBPE)>,
}

impl Counter {
    fn for_model(model: &str) -> Counter {
        use tiktoken_rs::tokenizer::Tokenizer;
        let encoding = match tiktoken_rs::tokenizer::get_tokenizer(model) {
            Some(Tokenizer::O200kBase | Tokenizer::O200kHarmony) => {
                Some(("o200k_base", tiktoken_rs::o200k_base_singleton()))
            }
            Some(Tokenizer::Cl100kBase) => {
                Some(("cl100k_base", tiktoken_rs::cl100k_base_singleton()))
            }
            // Older encodings and unknown models: the byte estimate is close enough.
            _ => None,
        };
        Counter { bpe: encoding }
    }

    fn method(&self) -> Method {
        self.bpe
            .map_or(Method::Bytes, |(name, _)| Method::Tokenizer(name))
    }

    fn count(&self, text: &str) -> u64 {
        match self.bpe {
            Some((_, bpe)) => bpe.count_ordinary(text) as u64,
            None => by_bytes(text.len() as u64),
        }
    }
}

/// Tokens for `bytes` of text without a tokenizer (rounded up).
pub fn by_bytes(bytes: u64) -> u64 {
    bytes.saturating_mul(10).div_ceil(BYTES_PER_TOKEN_X10)
}

/// Tokens of every prompt string under `v`: content and text, not role or type names, not
/// images.
fn text_tokens(v: &Value, counter: &Counter) -> u64 {
    match v {
        Value::String(s) if s.starts_with("data:") => 0,
        Value::String(s) => counter.count(s),
        Value::Array(items) => items
            .iter()
            .map(|i| text_tokens(i, counter))
            .fold(0, u64::saturating_add),
        Value::Object(map) => map
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "type" | "role" | "id" | "cache_control"))
            .filter(|(k, _)| !k.contains("url") && k.as_str() != "source")
            .map(|(_, v)| text_tokens(v, counter))
            .fold(0, u64::saturating_add),
        Value::Number(_) | Value::Bool(_) | Value::Null => 0,
    }
}

/// The tokens an answer's JSON body reports having used (`usage`: OpenAI's `total_tokens`, or
/// prompt/input plus completion/output, Anthropic's with its cache reads and writes).
pub fn usage(body: &[u8]) -> Option<Usage> {
    let v: Value = serde_json::from_slice(body).ok()?;
    usage_of(&v)
}

/// [`usage`] of a parsed answer (or one streamed chunk of it): its input (prompt, with
/// Anthropic's cache reads and writes) and output apart when it says both, else its total.
pub fn usage_of(v: &Value) -> Option<Usage> {
    let u = v
        .get("usage")
        .or_else(|| v.get("response").and_then(|r| r.get("usage")))?;
    let n = |k: &str| u.get(k).and_then(Value::as_u64);
    let input = n("prompt_tokens").or(n("input_tokens"));
    let output = n("completion_tokens").or(n("output_tokens"));
    let cached =
        n("cache_creation_input_tokens").unwrap_or(0) + n("cache_read_input_tokens").unwrap_or(0);
    let total = n("total_tokens");
    match (input, output) {
        (Some(i), Some(o)) if total.is_none_or(|t| t == i + o + cached) => {
            Some(Usage::Split(TokenCost {
                input: i + cached,
                output: o,
            }))
        }
        _ if total.is_some() => total.map(Usage::Total),
        (None, None) => None,
        (i, o) => Some(Usage::Total(i.unwrap_or(0) + o.unwrap_or(0) + cached)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const D: Defaults = Defaults {
        output_tokens: 100,
        cost: 777,
    };

    fn est(body: &str) -> Estimate {
        estimate(body.as_bytes(), D)
    }

    #[test]
    fn known_counts_of_fixed_strings() {
        // "hello world" is 2 tokens in both encodings; the pangram 10 in o200k_base.
        let o200k = Counter::for_model("gpt-4o");
        assert_eq!(o200k.method(), Method::Tokenizer("o200k_base"));
        assert_eq!(o200k.count("hello world"), 2);
        assert_eq!(
            o200k.count("The quick brown fox jumps over the lazy dog."),
            10
        );
        let cl100k = Counter::for_model("gpt-4");
        assert_eq!(cl100k.method(), Method::Tokenizer("cl100k_base"));
        assert_eq!(cl100k.count("hello world"), 2);
        assert_eq!(cl100k.count("tiktoken is great!"), 6);
        let claude = Counter::for_model("claude-sonnet-4-5");
        assert_eq!(claude.method(), Method::Bytes);
        assert_eq!(claude.count("hello world"), 4);
    }

    #[test]
    fn chat_completions() {
        let e = est(r#"{"model":"gpt-4o","max_completion_tokens":50,"messages":[
                {"role":"system","content":"hello world"},
                {"role":"user","content":[{"type":"text","text":"hello world"},
                  {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}"#);
        assert_eq!(e.prompt, 2 * 3 + 2 + 2 + 3);
        assert_eq!(e.output, 50);
        assert_eq!(e.total(), 63);
    }

    #[test]
    fn responses_completions_and_embeddings() {
        let r = est(
            r#"{"model":"gpt-4o","instructions":"hello world","input":"hello world","max_output_tokens":7}"#,
        );
        assert_eq!((r.prompt, r.output), (4, 7));
        let c = est(r#"{"model":"gpt-4","prompt":["hello world","hello world"]}"#);
        assert_eq!((c.prompt, c.output), (4, 100));
        let e = est(r#"{"model":"text-embedding-3-small","input":["hello world"]}"#);
        assert_eq!((e.prompt, e.output), (2, 0));
    }

    #[test]
    fn anthropic_messages_by_bytes() {
        let e = est(
            r#"{"model":"claude-sonnet-4-5","max_tokens":256,"system":"hello world",
                "messages":[{"role":"user","content":"hello world"}]}"#,
        );
        assert_eq!(e.method, Method::Bytes);
        assert_eq!(e.prompt, 4 + 3 + 4 + 3);
        assert_eq!(e.output, 256);
    }

    #[test]
    fn unknown_bodies_cost_the_default() {
        for body in ["not json", "[1,2]", r#"{"query":"select 1"}"#] {
            let e = est(body);
            assert_eq!((e.total(), e.method), (777, Method::Default), "{body}");
        }
    }

    #[test]
    fn usage_in_every_dialect() {
        let u = |s: &str| usage(s.as_bytes());
        let split = |input, output| Some(Usage::Split(TokenCost { input, output }));
        assert_eq!(
            u(r#"{"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#),
            split(5, 7)
        );
        assert_eq!(
            u(r#"{"usage":{"input_tokens":5,"output_tokens":7}}"#),
            split(5, 7)
        );
        assert_eq!(
            u(r#"{"usage":{"input_tokens":5,"output_tokens":7,"cache_read_input_tokens":3}}"#),
            split(8, 7)
        );
        assert_eq!(
            u(r#"{"type":"response.completed","response":{"usage":{"total_tokens":9}}}"#),
            Some(Usage::Total(9))
        );
        assert_eq!(u(r#"{"usage":{"prompt_tokens":5}}"#), Some(Usage::Total(5)));
        assert_eq!(u(r#"{"choices":[]}"#), None);
        assert_eq!(u("nope"), None);
    }
}

/// The byte estimate against OpenAI's o200k_base on typical prompts (the README's figures).
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod calibration {
    use super::*;

    pub(super) const PROSE: &str = "Summarise the following customer email in two sentences and \
        suggest a polite reply. Hello, I ordered a pair of running shoes three weeks ago and they \
        still have not arrived. The tracking page has said 'in transit' for ten days. Could you \
        tell me where the parcel is, or send a replacement? I need them for a race next month.";
    pub(super) const CODE: &str = "fn main() {\n    let xs: Vec<u32> = (1..=10).collect();\n    \
        let total: u32 = xs.iter().map(|x| x * x).sum();\n    println!(\"sum of squares: {}\", \
        total);\n}\n// Explain what this Rust program prints and why.";
    pub(super) const JSON_DATA: &str = r#"Extract the names: [{"id":1,"name":"Ada Lovelace",
        "born":1815},{"id":2,"name":"Alan Turing","born":1912},{"id":3,"name":"Grace Hopper",
        "born":1906}]"#;

    pub(super) const SPANISH: &str = "Resume el siguiente correo en dos frases y sugiere una \
        respuesta amable. Hola, pedí unas zapatillas hace tres semanas y todavía no han llegado. \
        ¿Podrían decirme dónde está el paquete o enviar uno nuevo?";
    pub(super) const JAPANESE: &str = "次のメールを二文で要約し、丁寧な返信を提案してください。\
        三週間前にランニングシューズを注文しましたが、まだ届いていません。";

    #[test]
    fn the_byte_estimate_stays_near_o200k_on_typical_prompts() {
        let bpe = tiktoken_rs::o200k_base_singleton();
        for (what, text) in [
            ("prose", PROSE),
            ("code", CODE),
            ("json", JSON_DATA),
            ("spanish", SPANISH),
            ("japanese", JAPANESE),
        ] {
            let real = bpe.count_ordinary(text) as f64;
            let guess = by_bytes(text.len() as u64) as f64;
            let error = (guess - real) / real;
            println!(
                "{what}: {} bytes, o200k {real}, estimate {guess}, error {:+.0}%",
                text.len(),
                error * 100.0
            );
            assert!(error.abs() < 0.35, "{what}: {error}");
        }
    }
}
