//! Absolute times in headers: RFC 3339 timestamps (Anthropic resets) and `Retry-After`
//! (delay-seconds or an HTTP-date), converted to epoch milliseconds or to delays from `now_ms`.
//!
//! The RFC 3339 parser is a small strict one written here, so the crate needs no calendar
//! library: it validates every field, then counts days with proleptic-Gregorian arithmetic.

use std::time::UNIX_EPOCH;

use crate::number::parse_scaled_ceil;

const MS_PER_SECOND: u64 = 1_000;
const SECONDS_PER_DAY: i64 = 86_400;

/// Parses an RFC 3339 date-time (`2024-01-01T00:00:30Z`, `2024-01-01T05:30:30.25+05:30`) into
/// epoch milliseconds; negative for times before 1970. Sub-millisecond fractions round up.
///
/// Strict: four-digit year, two-digit fields, a valid calendar day, seconds up to 60 (a leap
/// second counts as the next second), `Z` or a `±hh:mm` offset. The date/time separator may be
/// `T`, `t` or a space, as RFC 3339 §5.6 allows. Anything else gives `None`.
///
/// ```
/// use nthbouncer_ratelimit::parse_rfc3339;
/// assert_eq!(parse_rfc3339("1970-01-01T00:00:01.5Z"), Some(1_500));
/// assert_eq!(parse_rfc3339("2024-01-01T05:30:30+05:30"), parse_rfc3339("2024-01-01T00:00:30Z"));
/// assert_eq!(parse_rfc3339("2024-02-30T00:00:00Z"), None);
/// ```
#[must_use]
pub fn parse_rfc3339(text: &str) -> Option<i64> {
    let b = text.trim().as_bytes();
    let year = digits(b, 0, 4)?;
    let month = digits(b, 5, 2)?;
    let day = digits(b, 8, 2)?;
    let hour = digits(b, 11, 2)?;
    let minute = digits(b, 14, 2)?;
    let second = digits(b, 17, 2)?;
    let separators_ok = b.get(4) == Some(&b'-')
        && b.get(7) == Some(&b'-')
        && matches!(b.get(10), Some(b'T' | b't' | b' '))
        && b.get(13) == Some(&b':')
        && b.get(16) == Some(&b':');
    if !separators_ok
        || !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }

    let mut pos = 19;
    let mut fraction_ms = 0;
    if b.get(pos) == Some(&b'.') {
        let len = b
            .get(pos + 1..)?
            .iter()
            .take_while(|c| c.is_ascii_digit())
            .count();
        if len == 0 {
            return None;
        }
        let fraction = std::str::from_utf8(b.get(pos..pos + 1 + len)?).ok()?;
        // ".999999" rounds up to a whole 1000 ms, which simply carries into the seconds.
        fraction_ms = i64::try_from(parse_scaled_ceil(fraction, MS_PER_SECOND)?).ok()?;
        pos += 1 + len;
    }

    let offset_seconds = match b.get(pos..)? {
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), _, _, b':', _, _] => {
            let hours = digits(b, pos + 1, 2)?;
            let minutes = digits(b, pos + 4, 2)?;
            if hours > 23 || minutes > 59 {
                return None;
            }
            let magnitude = hours * 3_600 + minutes * 60;
            if *sign == b'-' {
                -magnitude
            } else {
                magnitude
            }
        }
        _ => return None,
    };

    let days = days_since_epoch(year, month, day);
    let seconds = days * SECONDS_PER_DAY + hour * 3_600 + minute * 60 + second - offset_seconds;
    Some(seconds * 1_000 + fraction_ms)
}

/// Parses a `Retry-After` value into a delay in milliseconds from `now_ms`.
///
/// Accepts delay-seconds (`120`; a fraction such as `1.5` is tolerated and rounded up to the
/// millisecond) or an HTTP-date (`Wed, 21 Oct 2015 07:28:00 GMT`, and the obsolete forms
/// `httpdate` understands); a date in the past gives `Some(0)`. Malformed values give `None`.
///
/// ```
/// use nthbouncer_ratelimit::parse_retry_after;
/// assert_eq!(parse_retry_after("120", 0), Some(120_000));
/// let now_ms = 1_445_412_450_000; // 30 s before the date below
/// assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now_ms), Some(30_000));
/// assert_eq!(parse_retry_after("soon", now_ms), None);
/// ```
#[must_use]
pub fn parse_retry_after(value: &str, now_ms: u64) -> Option<u64> {
    let value = value.trim();
    if value.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
        return parse_scaled_ceil(value, MS_PER_SECOND);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let at_ms = u64::try_from(at.duration_since(UNIX_EPOCH).ok()?.as_millis()).ok()?;
    Some(at_ms.saturating_sub(now_ms))
}

/// Delay from `now_ms` until the RFC 3339 instant `text`; `Some(0)` when it is already past.
pub(crate) fn rfc3339_delay_ms(text: &str, now_ms: u64) -> Option<u64> {
    let at = i128::from(parse_rfc3339(text)?);
    u64::try_from((at - i128::from(now_ms)).max(0)).ok()
}

/// `count` ASCII digits at `start`, as a number.
fn digits(b: &[u8], start: usize, count: usize) -> Option<i64> {
    let field = b.get(start..start.checked_add(count)?)?;
    field.iter().try_fold(0i64, |acc, c| {
        c.is_ascii_digit().then(|| acc * 10 + i64::from(c - b'0'))
    })
}

fn is_leap(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to the given date in the proleptic Gregorian calendar.
fn days_since_epoch(year: i64, month: i64, day: i64) -> i64 {
    days_before_year(year) - days_before_year(1970) + days_before_month(year, month) + day - 1
}

/// Days from 0001-01-01 to January 1st of `year`: 365 per year plus one per leap year passed.
/// Euclidean division keeps it right for year 0 too.
fn days_before_year(year: i64) -> i64 {
    let y = year - 1;
    365 * y + y.div_euclid(4) - y.div_euclid(100) + y.div_euclid(400)
}

fn days_before_month(year: i64, month: i64) -> i64 {
    const CUMULATIVE: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let index = usize::try_from(month - 1).unwrap_or(0);
    let base = CUMULATIVE.get(index).copied().unwrap_or(0);
    base + i64::from(month > 2 && is_leap(year))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339("2024-01-01T00:00:30Z"),
            Some(1_704_067_230_000)
        );
        assert_eq!(parse_rfc3339("2000-02-29T12:00:00Z"), Some(951_825_600_000));
        assert_eq!(parse_rfc3339("1969-12-31T23:59:59Z"), Some(-1_000));
        assert_eq!(
            parse_rfc3339("0000-01-01T00:00:00Z"),
            Some(-62_167_219_200_000)
        );
        assert_eq!(
            parse_rfc3339("9999-12-31T23:59:59Z"),
            Some(253_402_300_799_000)
        );
        // GitHub's documented reset 1372700873 written as RFC 3339.
        assert_eq!(
            parse_rfc3339("2013-07-01T17:47:53Z"),
            Some(1_372_700_873_000)
        );
    }

    #[test]
    fn rfc3339_fractions_offsets_and_case() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00.123Z"), Some(123));
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00.1234z"), Some(124));
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00.9999Z"), Some(1_000));
        assert_eq!(parse_rfc3339("1970-01-01t01:00:00+01:00"), Some(0));
        assert_eq!(parse_rfc3339("1970-01-01 00:00:00-00:30"), Some(1_800_000));
        assert_eq!(parse_rfc3339("1970-01-01T00:00:60Z"), Some(60_000));
        assert_eq!(
            parse_rfc3339("2024-06-15T10:20:30.000000001+02:00"),
            parse_rfc3339("2024-06-15T08:20:30.001Z")
        );
    }

    #[test]
    fn rfc3339_rejects_malformed() {
        for bad in [
            "",
            "2024-01-01",
            "2024-01-01T00:00Z",
            "2024-01-01T00:00:00",
            "2024-01-01T00:00:00ZZ",
            "2024-13-01T00:00:00Z",
            "2024-00-01T00:00:00Z",
            "2023-02-29T00:00:00Z",
            "1900-02-29T00:00:00Z",
            "2024-04-31T00:00:00Z",
            "2024-01-00T00:00:00Z",
            "2024-01-01T24:00:00Z",
            "2024-01-01T00:60:00Z",
            "2024-01-01T00:00:61Z",
            "2024-01-01T00:00:00.Z",
            "2024-01-01T00:00:00+0100",
            "2024-01-01T00:00:00+24:00",
            "2024-01-01T00:00:00+01:60",
            "2024-01-01X00:00:00Z",
            "24-01-01T00:00:00Z",
            "+2024-01-01T00:00:00Z",
            "2024-01-01T00:00:00Z trailing",
            "２０２４-01-01T00:00:00Z",
            "1704067230",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn rfc3339_delay_clamps_past_to_zero() {
        let now = 1_704_067_200_000;
        assert_eq!(rfc3339_delay_ms("2024-01-01T00:00:30Z", now), Some(30_000));
        assert_eq!(rfc3339_delay_ms("2023-12-31T23:59:00Z", now), Some(0));
        assert_eq!(rfc3339_delay_ms("0000-01-01T00:00:00Z", u64::MAX), Some(0));
        assert_eq!(
            rfc3339_delay_ms("9999-12-31T23:59:59Z", 0),
            Some(253_402_300_799_000)
        );
    }

    #[test]
    fn retry_after_forms() {
        assert_eq!(parse_retry_after("0", 5), Some(0));
        assert_eq!(parse_retry_after(" 120 ", 5), Some(120_000));
        assert_eq!(parse_retry_after("1.5", 0), Some(1_500));
        let date_ms = 1_445_412_480_000; // Wed, 21 Oct 2015 07:28:00 GMT
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", date_ms - 2_000),
            Some(2_000)
        );
        assert_eq!(
            parse_retry_after("Wednesday, 21-Oct-15 07:28:00 GMT", date_ms),
            Some(0)
        );
        assert_eq!(
            parse_retry_after("Wed Oct 21 07:28:00 2015", date_ms + 1),
            Some(0)
        );
        for bad in [
            "",
            "-1",
            "soon",
            "1e3",
            "Wed, 21 Oct 2015 07:28:00",
            "１２０",
        ] {
            assert_eq!(parse_retry_after(bad, 0), None, "{bad:?}");
        }
    }
}
