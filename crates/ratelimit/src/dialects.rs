//! The vendor header families: OpenAI, Anthropic, and the `x-ratelimit-*` triple that GitHub,
//! Discord and many others send. Each reader turns its headers into [`Window`]s and leaves the
//! choosing between dialects to the crate root.

use crate::datetime::rfc3339_delay_ms;
use crate::duration::parse_go_duration;
use crate::fields::{Budget, Field, Fields, Part};
use crate::number::{parse_scaled_ceil, parse_uint};
use crate::report::{Dialect, Window};

/// Values of `x-ratelimit-reset` at or above this many seconds are epoch times (GitHub);
/// below it they are delays (most others). 10^9 s is 2001-09-09, and no origin waits 31 years.
const EPOCH_THRESHOLD_MS: u64 = 1_000_000_000_000;

/// OpenAI's window for one budget: integer limit/remaining, Go-duration reset.
pub(crate) fn openai(fields: &Fields<'_>, budget: Budget) -> Option<Window> {
    let window = Window {
        limit: fields.first(Field::OpenAi(budget, Part::Limit), parse_uint),
        remaining: fields.first(Field::OpenAi(budget, Part::Remaining), parse_uint),
        reset_ms: fields.first(Field::OpenAi(budget, Part::Reset), parse_go_duration),
        window_ms: None,
    };
    (!window.is_empty()).then_some(window)
}

/// Anthropic's window for one budget: integer limit/remaining, RFC 3339 reset.
pub(crate) fn anthropic(fields: &Fields<'_>, budget: Budget, now_ms: u64) -> Option<Window> {
    let window = Window {
        limit: fields.first(Field::Anthropic(budget, Part::Limit), parse_uint),
        remaining: fields.first(Field::Anthropic(budget, Part::Remaining), parse_uint),
        reset_ms: fields.first(Field::Anthropic(budget, Part::Reset), |v| {
            rfc3339_delay_ms(v, now_ms)
        }),
        window_ms: None,
    };
    (!window.is_empty()).then_some(window)
}

/// The `x-ratelimit-{limit,remaining,reset,used}` family, plus Discord's `reset-after`.
///
/// `remaining` falls back to `limit - used` (GitHub always sends both, but proxies trim
/// headers). The reset prefers `x-ratelimit-reset-after`, a delay immune to clock skew, over
/// `x-ratelimit-reset`; the presence of `reset-after` is what marks the answer as Discord's.
pub(crate) fn plain(fields: &Fields<'_>, now_ms: u64) -> Option<(Dialect, Window)> {
    let limit = fields.first(Field::Plain(Part::Limit), parse_uint);
    let used = fields.first(Field::PlainUsed, parse_uint);
    let remaining = fields
        .first(Field::Plain(Part::Remaining), parse_uint)
        .or_else(|| limit?.checked_sub(used?));
    let reset_after = fields.first(Field::PlainResetAfter, |v| parse_scaled_ceil(v, 1_000));
    let reset_ms = reset_after
        .or_else(|| fields.first(Field::Plain(Part::Reset), |v| reset_seconds(v, now_ms)));
    let window = Window {
        limit,
        remaining,
        reset_ms,
        window_ms: None,
    };
    if window.is_empty() {
        return None;
    }
    let dialect = if fields.has(Field::PlainResetAfter) {
        Dialect::Discord
    } else {
        Dialect::GitHubStyle
    };
    Some((dialect, window))
}

/// A reset in seconds that may be an epoch time or a delay (see [`EPOCH_THRESHOLD_MS`]);
/// fractions are allowed (Discord sends `1470173023.123`). Returns the delay from `now_ms`.
pub(crate) fn reset_seconds(value: &str, now_ms: u64) -> Option<u64> {
    let ms = parse_scaled_ceil(value, 1_000)?;
    Some(if ms >= EPOCH_THRESHOLD_MS {
        ms.saturating_sub(now_ms)
    } else {
        ms
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_seconds_splits_at_ten_to_the_ninth() {
        let now = 1_372_700_000_000;
        assert_eq!(reset_seconds("1372700873", now), Some(873_000));
        assert_eq!(reset_seconds("1372699999", now), Some(0));
        assert_eq!(reset_seconds("999999999", now), Some(999_999_999_000));
        assert_eq!(reset_seconds("1000000000", 0), Some(1_000_000_000_000));
        assert_eq!(reset_seconds("30", now), Some(30_000));
        assert_eq!(
            reset_seconds("1470173023.123", 1_470_173_022_000),
            Some(1_123)
        );
        assert_eq!(reset_seconds("-5", now), None);
    }

    #[test]
    fn plain_remaining_falls_back_to_limit_minus_used() {
        let fields = Fields::collect([("x-ratelimit-limit", "60"), ("x-ratelimit-used", "4")]);
        assert_eq!(plain(&fields, 0).map(|(_, w)| w.remaining), Some(Some(56)));
        // used > limit is nonsense: no remaining rather than a wrapped one.
        let fields = Fields::collect([("x-ratelimit-limit", "4"), ("x-ratelimit-used", "60")]);
        assert_eq!(plain(&fields, 0).map(|(_, w)| w.remaining), Some(None));
    }

    #[test]
    fn plain_tags_discord_by_reset_after() {
        let fields = Fields::collect([("x-ratelimit-remaining", "1")]);
        assert_eq!(
            plain(&fields, 0).map(|(d, _)| d),
            Some(Dialect::GitHubStyle)
        );
        let fields = Fields::collect([("x-ratelimit-reset-after", "1.234")]);
        assert_eq!(
            plain(&fields, 0),
            Some((
                Dialect::Discord,
                Window {
                    reset_ms: Some(1_234),
                    ..Window::default()
                }
            ))
        );
        assert_eq!(
            plain(&Fields::collect([("x-ratelimit-limit", "many")]), 0),
            None
        );
    }
}
