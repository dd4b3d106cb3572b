//! Go `time.Duration` strings, the reset format of OpenAI-style `x-ratelimit-reset-*` headers.
//!
//! The grammar follows Go's `time.ParseDuration`: an optional sign, then one or more
//! `<decimal><unit>` pieces (`6m0s`, `1h2m3.5s`, `0.5s`, `20ms`, `850µs`), or a bare `0`.
//! Negative durations are how origins say "unknown", so they are rejected rather than clamped.

use crate::number::parse_scaled_ceil;

const NANOS_PER_MILLI: u64 = 1_000_000;

/// Parses a Go duration string into whole milliseconds, rounding any sub-millisecond rest up.
///
/// Units: `h`, `m`, `s`, `ms`, `us`, `µs` (micro sign), `μs` (Greek mu), `ns`. Negative values,
/// missing units, unknown units and durations beyond `u64` nanoseconds (about 584 years) give
/// `None`.
///
/// ```
/// use nthbouncer_ratelimit::parse_go_duration;
/// assert_eq!(parse_go_duration("6m0s"), Some(360_000));
/// assert_eq!(parse_go_duration("1h2m3.5s"), Some(3_723_500));
/// assert_eq!(parse_go_duration("850µs"), Some(1)); // rounded up: never wake early
/// assert_eq!(parse_go_duration("-1s"), None);
/// ```
#[must_use]
pub fn parse_go_duration(text: &str) -> Option<u64> {
    let text = text.trim();
    let text = text.strip_prefix('+').unwrap_or(text);
    if text.starts_with('-') {
        return None;
    }
    // Go accepts a lone zero without a unit, and nothing else unit-less.
    if text == "0" {
        return Some(0);
    }
    if text.is_empty() {
        return None;
    }
    let mut rest = text;
    let mut total_ns: u64 = 0;
    while !rest.is_empty() {
        let number_len = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.')
            .count();
        let (number, after) = (rest.get(..number_len)?, rest.get(number_len..)?);
        let unit_len = after
            .char_indices()
            .find(|(_, c)| c.is_ascii_digit() || *c == '.')
            .map_or(after.len(), |(i, _)| i);
        let (unit, next) = (after.get(..unit_len)?, after.get(unit_len..)?);
        let piece = parse_scaled_ceil(number, unit_nanos(unit)?)?;
        total_ns = total_ns.checked_add(piece)?;
        rest = next;
    }
    Some(total_ns.div_ceil(NANOS_PER_MILLI))
}

fn unit_nanos(unit: &str) -> Option<u64> {
    Some(match unit {
        "ns" => 1,
        // U+00B5 MICRO SIGN and U+03BC GREEK SMALL LETTER MU are both accepted by Go.
        "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_published_examples() {
        assert_eq!(parse_go_duration("1s"), Some(1_000));
        assert_eq!(parse_go_duration("6m0s"), Some(360_000));
        assert_eq!(parse_go_duration("20ms"), Some(20));
    }

    #[test]
    fn every_unit_and_fractions() {
        assert_eq!(parse_go_duration("1h"), Some(3_600_000));
        assert_eq!(parse_go_duration("1h2m3.5s"), Some(3_723_500));
        assert_eq!(parse_go_duration("0.5s"), Some(500));
        assert_eq!(parse_go_duration(".5s"), Some(500));
        assert_eq!(parse_go_duration("5.s"), Some(5_000));
        assert_eq!(parse_go_duration("1.5h"), Some(5_400_000));
        assert_eq!(parse_go_duration("8.64s"), Some(8_640));
        assert_eq!(parse_go_duration("2m59.56s"), Some(179_560));
        assert_eq!(parse_go_duration("850us"), Some(1));
        assert_eq!(parse_go_duration("850\u{b5}s"), Some(1));
        assert_eq!(parse_go_duration("850\u{3bc}s"), Some(1));
        assert_eq!(parse_go_duration("2000000ns"), Some(2));
        assert_eq!(parse_go_duration("1ns"), Some(1));
        assert_eq!(parse_go_duration("0"), Some(0));
        assert_eq!(parse_go_duration("0s"), Some(0));
        assert_eq!(parse_go_duration("+1s"), Some(1_000));
        assert_eq!(parse_go_duration(" 1s "), Some(1_000));
    }

    #[test]
    fn malformed_is_none() {
        for bad in [
            "",
            "-1s",
            "-0s",
            "1",
            "s",
            ".s",
            "1x",
            "1S",
            "1 s",
            "1s ms",
            "1..5s",
            "1sec",
            "µs",
            "1m-1s",
            "١s",
            "99999999999999999999h",
            "5124096h",
        ] {
            assert_eq!(parse_go_duration(bad), None, "{bad:?}");
        }
    }
}
