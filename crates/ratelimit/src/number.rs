//! Decimal number parsing shared by every dialect.
//!
//! Origins write numbers as plain ASCII decimals (`59`, `1.234`, `1470173023.123`). This module
//! turns them into integers at a requested scale (seconds to milliseconds, Go duration units to
//! nanoseconds) with checked arithmetic, so a huge or odd value becomes `None` instead of wrapping
//! or panicking. Fractions round **up**: a wait derived from a header is never cut short.

/// Fraction digits that can still change the result: scales here are at most 3.6e12 (an hour in
/// nanoseconds), so digits beyond the 18th only decide whether to round up, never the quotient.
const SIGNIFICANT_FRACTION_DIGITS: usize = 18;

/// A non-negative integer made only of ASCII digits (surrounding whitespace allowed).
///
/// Signs, decimal points and anything that does not fit a `u64` are rejected.
pub(crate) fn parse_uint(text: &str) -> Option<u64> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A non-negative decimal `digits[.digits]` (either side may be empty, not both), returned as
/// `ceil(value * scale)`.
///
/// Returns `None` for signs, exponents, other characters, or a result that does not fit a `u64`.
pub(crate) fn parse_scaled_ceil(text: &str, scale: u64) -> Option<u64> {
    let text = text.trim();
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    if !whole.bytes().all(|b| b.is_ascii_digit()) || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let scale = u128::from(scale);
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        // More than 39 digits cannot fit a u128; that is far beyond u64 anyway.
        whole.parse().ok()?
    };
    let total = whole
        .checked_mul(scale)?
        .checked_add(fraction_ceil(fraction, scale)?)?;
    u64::try_from(total).ok()
}

/// `ceil(0.<fraction> * scale)` for a string of ASCII digits (already validated).
fn fraction_ceil(fraction: &str, scale: u128) -> Option<u128> {
    let cut = fraction.len().min(SIGNIFICANT_FRACTION_DIGITS);
    let (head, tail) = (fraction.get(..cut)?, fraction.get(cut..)?);
    if head.is_empty() {
        return Some(0);
    }
    let numerator: u128 = head.parse().ok()?;
    let denominator = 10u128.checked_pow(u32::try_from(head.len()).ok()?)?;
    let product = numerator.checked_mul(scale)?;
    let quotient = product / denominator;
    let inexact = product % denominator != 0 || tail.bytes().any(|b| b != b'0');
    Some(quotient + u128::from(inexact))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uint_accepts_only_plain_digits() {
        assert_eq!(parse_uint("59"), Some(59));
        assert_eq!(parse_uint(" 0 "), Some(0));
        assert_eq!(parse_uint("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            " ",
            "-1",
            "+1",
            "1.0",
            "1e3",
            "18446744073709551616",
            "٣",
            "12a",
        ] {
            assert_eq!(parse_uint(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn scaled_rounds_up_and_rejects_junk() {
        assert_eq!(parse_scaled_ceil("1.234", 1000), Some(1234));
        assert_eq!(parse_scaled_ceil("1.2341", 1000), Some(1235));
        assert_eq!(parse_scaled_ceil("0.5", 1000), Some(500));
        assert_eq!(parse_scaled_ceil(".5", 1000), Some(500));
        assert_eq!(parse_scaled_ceil("5.", 1000), Some(5000));
        assert_eq!(parse_scaled_ceil("30", 1000), Some(30_000));
        assert_eq!(parse_scaled_ceil("0.0000000000000000000001", 1000), Some(1));
        assert_eq!(
            parse_scaled_ceil("0.1000000000000000000000", 1000),
            Some(100)
        );
        for bad in [
            "",
            ".",
            "-1",
            "1e3",
            "1.2.3",
            "NaN",
            "inf",
            "1,5",
            "99999999999999999999",
        ] {
            assert_eq!(parse_scaled_ceil(bad, 1000), None, "{bad:?}");
        }
        let huge = "9".repeat(60);
        assert_eq!(parse_scaled_ceil(&huge, 1000), None);
        assert_eq!(parse_scaled_ceil(&format!("0.{huge}"), 1000), Some(1000));
    }
}
