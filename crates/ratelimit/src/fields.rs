//! Which response headers this crate reads, and the lines of them found in one response.
//!
//! Names match ASCII case-insensitively. Every header the parser understands is listed once in
//! [`KNOWN`], so "do we read header X?" is answered by searching this file.

/// Which budget a per-budget header describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Budget {
    Requests,
    Tokens,
    InputTokens,
    OutputTokens,
}

/// Which number of a budget a header carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Limit,
    Remaining,
    Reset,
}

/// One understood header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Field {
    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`.
    OpenAi(Budget, Part),
    /// `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`.
    Anthropic(Budget, Part),
    /// `x-ratelimit-{limit,remaining,reset}` (GitHub, Discord and many others).
    Plain(Part),
    /// `x-ratelimit-used` (GitHub).
    PlainUsed,
    /// `x-ratelimit-reset-after` (Discord).
    PlainResetAfter,
    /// `ratelimit-{limit,remaining,reset}` (IETF drafts up to -06).
    Ietf(Part),
    /// `ratelimit-policy` (IETF drafts -05 onwards).
    IetfPolicy,
    /// `ratelimit` (IETF drafts -07 onwards).
    IetfRateLimit,
    /// `retry-after` (RFC 9110).
    RetryAfter,
    /// `retry-after-ms` (OpenAI-style clients and Azure).
    RetryAfterMs,
}

use Budget::{InputTokens, OutputTokens, Requests, Tokens};
use Part::{Limit, Remaining, Reset};

/// Every header name this crate reads, lower case.
pub(crate) const KNOWN: [(&str, Field); 30] = [
    ("x-ratelimit-limit-requests", Field::OpenAi(Requests, Limit)),
    (
        "x-ratelimit-remaining-requests",
        Field::OpenAi(Requests, Remaining),
    ),
    ("x-ratelimit-reset-requests", Field::OpenAi(Requests, Reset)),
    ("x-ratelimit-limit-tokens", Field::OpenAi(Tokens, Limit)),
    (
        "x-ratelimit-remaining-tokens",
        Field::OpenAi(Tokens, Remaining),
    ),
    ("x-ratelimit-reset-tokens", Field::OpenAi(Tokens, Reset)),
    (
        "anthropic-ratelimit-requests-limit",
        Field::Anthropic(Requests, Limit),
    ),
    (
        "anthropic-ratelimit-requests-remaining",
        Field::Anthropic(Requests, Remaining),
    ),
    (
        "anthropic-ratelimit-requests-reset",
        Field::Anthropic(Requests, Reset),
    ),
    (
        "anthropic-ratelimit-tokens-limit",
        Field::Anthropic(Tokens, Limit),
    ),
    (
        "anthropic-ratelimit-tokens-remaining",
        Field::Anthropic(Tokens, Remaining),
    ),
    (
        "anthropic-ratelimit-tokens-reset",
        Field::Anthropic(Tokens, Reset),
    ),
    (
        "anthropic-ratelimit-input-tokens-limit",
        Field::Anthropic(InputTokens, Limit),
    ),
    (
        "anthropic-ratelimit-input-tokens-remaining",
        Field::Anthropic(InputTokens, Remaining),
    ),
    (
        "anthropic-ratelimit-input-tokens-reset",
        Field::Anthropic(InputTokens, Reset),
    ),
    (
        "anthropic-ratelimit-output-tokens-limit",
        Field::Anthropic(OutputTokens, Limit),
    ),
    (
        "anthropic-ratelimit-output-tokens-remaining",
        Field::Anthropic(OutputTokens, Remaining),
    ),
    (
        "anthropic-ratelimit-output-tokens-reset",
        Field::Anthropic(OutputTokens, Reset),
    ),
    ("x-ratelimit-limit", Field::Plain(Limit)),
    ("x-ratelimit-remaining", Field::Plain(Remaining)),
    ("x-ratelimit-reset", Field::Plain(Reset)),
    ("x-ratelimit-used", Field::PlainUsed),
    ("x-ratelimit-reset-after", Field::PlainResetAfter),
    ("ratelimit-limit", Field::Ietf(Limit)),
    ("ratelimit-remaining", Field::Ietf(Remaining)),
    ("ratelimit-reset", Field::Ietf(Reset)),
    ("ratelimit-policy", Field::IetfPolicy),
    ("ratelimit", Field::IetfRateLimit),
    ("retry-after", Field::RetryAfter),
    ("retry-after-ms", Field::RetryAfterMs),
];

/// The field `name` stands for, if it is one this crate reads (any ASCII case, surrounding
/// whitespace ignored). Every known name starts with `x`, `a` or `r`: the first byte turns
/// the usual answer headers (`date`, `content-type`, `content-length`, ...) away before the
/// list is searched, which every proxied answer would otherwise pay for (about 1,000
/// instructions for three such headers, bench/RESULTS.md).
pub(crate) fn field_of(name: &str) -> Option<Field> {
    let known_start = |b: &u8| matches!(b, b'x' | b'X' | b'a' | b'A' | b'r' | b'R');
    // Decided before trimming (which tests every end character for Unicode whitespace) when
    // the first byte is plain ASCII that no trim removes.
    match name.as_bytes().first() {
        Some(b) if b.is_ascii() && !char::from(*b).is_whitespace() && !known_start(b) => {
            return None
        }
        None => return None,
        _ => {}
    }
    let name = name.trim();
    if !name.as_bytes().first().is_some_and(known_start) {
        return None;
    }
    KNOWN
        .iter()
        .find(|(known, _)| known.eq_ignore_ascii_case(name))
        .map(|(_, field)| *field)
}

/// The understood header lines of one response, in arrival order. Unknown names are dropped.
pub(crate) struct Fields<'a> {
    lines: Vec<(Field, &'a str)>,
}

impl<'a> Fields<'a> {
    pub(crate) fn collect(headers: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let lines = headers
            .into_iter()
            .filter_map(|(name, value)| Some((field_of(name)?, value.trim())))
            .collect();
        Fields { lines }
    }

    /// Every line of `field`, in arrival order (repeated list fields such as `RateLimit` are
    /// legitimately split over several lines).
    pub(crate) fn values(&self, field: Field) -> impl Iterator<Item = &'a str> + '_ {
        self.lines
            .iter()
            .filter(move |(f, _)| *f == field)
            .map(|(_, value)| *value)
    }

    /// The first line of `field` that `parse` accepts: a malformed duplicate does not hide a
    /// good one.
    pub(crate) fn first<T>(
        &self,
        field: Field,
        parse: impl FnMut(&'a str) -> Option<T>,
    ) -> Option<T> {
        self.values(field).find_map(parse)
    }

    /// Whether no header named a known field.
    pub(crate) fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    pub(crate) fn has(&self, field: Field) -> bool {
        self.values(field).next().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_name_passes_the_first_byte_filter() {
        for (name, field) in KNOWN {
            assert_eq!(field_of(name), Some(field), "{name}");
            assert_eq!(field_of(&name.to_ascii_uppercase()), Some(field), "{name}");
            assert_eq!(field_of(&format!(" {name} ")), Some(field), "{name}");
            assert_eq!(field_of(&format!("\u{a0}{name}\t")), Some(field), "{name}");
            assert_eq!(field_of(&format!("\u{b}{name}")), Some(field), "{name}");
        }
        for other in [
            "date",
            "content-type",
            "content-length",
            "x-request-id",
            "",
            " ",
            " date",
            "\u{a0}content-type",
        ] {
            assert_eq!(field_of(other), None, "{other}");
        }
    }

    #[test]
    fn names_are_unique_lower_case_and_match_any_case() {
        for (i, (name, field)) in KNOWN.iter().enumerate() {
            assert_eq!(*name, name.to_ascii_lowercase());
            assert!(KNOWN
                .iter()
                .skip(i + 1)
                .all(|(n, f)| n != name && f != field));
            let upper = name.to_ascii_uppercase();
            let fields = Fields::collect([(upper.as_str(), " 1 ")]);
            assert_eq!(fields.values(*field).collect::<Vec<_>>(), vec!["1"]);
        }
    }

    #[test]
    fn first_skips_unparseable_duplicates() {
        let fields = Fields::collect([
            ("Retry-After", "soon"),
            ("x-unrelated", "5"),
            ("retry-after", "7"),
        ]);
        assert_eq!(
            fields.first(Field::RetryAfter, |v| v.parse::<u8>().ok()),
            Some(7)
        );
        assert!(!fields.has(Field::RetryAfterMs));
    }
}
