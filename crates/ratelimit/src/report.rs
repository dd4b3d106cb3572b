//! The normalised outcome of one upstream response: the types callers consume.

use std::cmp::Ordering;
use std::fmt;

/// What one upstream response said about the origin's limits.
///
/// Every field is optional because origins say as much or as little as they like; a field the
/// headers did not supply (or supplied malformed) is `None`. All durations are milliseconds from
/// the `now_ms` given to [`parse`](crate::parse), never absolute times.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateReport {
    /// The origin refused this request for rate reasons: status 429, or GitHub's 403 with an
    /// exhausted budget or a `Retry-After`.
    pub throttled: bool,
    /// How long the origin asked us to hold off. From `retry-after-ms`, else `Retry-After`, on
    /// an error answer (status 400 and up, or 0 for "status unknown"); on a throttled answer
    /// without either, derived from the windows (see [`parse`](crate::parse)).
    pub retry_after_ms: Option<u64>,
    /// The request budget. When several dialects describe one, the most constraining.
    pub requests: Option<Window>,
    /// The token budget (OpenAI `-tokens`, Anthropic `tokens`, which Anthropic defines as its
    /// most restrictive token limit). When both dialects describe one, the most constraining.
    pub tokens: Option<Window>,
    /// Anthropic's input-token budget.
    pub input_tokens: Option<Window>,
    /// Anthropic's output-token budget.
    pub output_tokens: Option<Window>,
    /// The dialect that supplied `requests`; without one, the dialect of the first token budget;
    /// without any budget, [`Dialect::RetryAfter`] when a retry hint was read. For "last throttle
    /// cause" logs.
    pub source: Option<Dialect>,
}

impl RateReport {
    /// Every budget the report carries, request budget first.
    pub fn windows(&self) -> impl Iterator<Item = &Window> {
        [
            &self.requests,
            &self.tokens,
            &self.input_tokens,
            &self.output_tokens,
        ]
        .into_iter()
        .flatten()
    }

    /// How long to hold off before the next request: the origin's retry hint, or else, when a
    /// budget is already spent (even on a successful answer), the longest reset among the spent
    /// budgets, since each of them must refill first.
    #[must_use]
    pub fn wait_ms(&self) -> Option<u64> {
        self.retry_after_ms.or_else(|| self.exhausted_reset_ms())
    }

    /// The longest reset among exhausted windows that say when they reset.
    pub(crate) fn exhausted_reset_ms(&self) -> Option<u64> {
        self.windows()
            .filter(|w| w.is_exhausted())
            .filter_map(|w| w.reset_ms)
            .max()
    }

    /// True when no header contributed anything.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        *self == RateReport::default()
    }
}

/// One budget as an origin describes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// Units (requests or tokens) the budget allows per window.
    pub limit: Option<u64>,
    /// Units left in the current window.
    pub remaining: Option<u64>,
    /// Milliseconds from `now_ms` until the budget refills (0 if the origin's reset time has
    /// already passed).
    pub reset_ms: Option<u64>,
    /// Length of the policy window, when the origin states it (IETF `w=`).
    pub window_ms: Option<u64>,
}

impl Window {
    /// True when no field is known.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        *self == Window::default()
    }

    /// True when the origin reports nothing left in this window.
    #[must_use]
    pub fn is_exhausted(&self) -> bool {
        self.remaining == Some(0)
    }

    /// Orders windows by how hard they constrain the next requests: `Less` means `self` is the
    /// tighter one.
    ///
    /// The measure is headroom per unit of time, `remaining / reset`, compared by
    /// cross-multiplying so there is no division or rounding. Two spent windows compare by which
    /// stays shut longer. A window whose remaining count is unknown constrains less than any
    /// whose count is known; between two such windows the lower quota per window length is
    /// tighter. Anything incomparable is `Equal`, letting the caller's order break the tie.
    pub(crate) fn tightness(&self, other: &Window) -> Ordering {
        match (self.remaining, other.remaining) {
            (Some(0), Some(0)) => other.reset_ms.unwrap_or(0).cmp(&self.reset_ms.unwrap_or(0)),
            (Some(mine), Some(theirs)) => match (self.reset_ms, other.reset_ms) {
                // A reset of 0 is about to refill; counting it as 1 ms keeps the product
                // meaningful instead of making every such window look infinitely tight.
                (Some(my_reset), Some(their_reset)) => {
                    let lhs = u128::from(mine) * u128::from(their_reset.max(1));
                    let rhs = u128::from(theirs) * u128::from(my_reset.max(1));
                    lhs.cmp(&rhs).then(mine.cmp(&theirs))
                }
                _ => mine.cmp(&theirs),
            },
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => match (self.limit, self.window_ms, other.limit, other.window_ms) {
                (Some(my_limit), Some(my_window), Some(their_limit), Some(their_window)) => {
                    let lhs = u128::from(my_limit) * u128::from(their_window.max(1));
                    let rhs = u128::from(their_limit) * u128::from(my_window.max(1));
                    lhs.cmp(&rhs)
                }
                _ => Ordering::Equal,
            },
        }
    }
}

/// The header family a budget was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`.
    OpenAi,
    /// `anthropic-ratelimit-*`.
    Anthropic,
    /// `x-ratelimit-{limit,remaining,reset,used}` without `x-ratelimit-reset-after`.
    GitHubStyle,
    /// `ratelimit-*`, `RateLimit` and `RateLimit-Policy` from the IETF httpapi drafts.
    IetfDraft,
    /// `x-ratelimit-*` with `x-ratelimit-reset-after`.
    Discord,
    /// Only `Retry-After` / `retry-after-ms` spoke.
    RetryAfter,
}

impl Dialect {
    /// A stable lower-case name for logs and metrics labels.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::OpenAi => "openai",
            Dialect::Anthropic => "anthropic",
            Dialect::GitHubStyle => "github",
            Dialect::IetfDraft => "ietf",
            Dialect::Discord => "discord",
            Dialect::RetryAfter => "retry-after",
        }
    }
}

impl fmt::Display for Dialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The tightest of `candidates`; on a tie the earlier one, so callers list by preference.
pub(crate) fn tightest(candidates: &[(Dialect, Window)]) -> Option<(Dialect, Window)> {
    candidates
        .iter()
        .copied()
        .min_by(|(_, a), (_, b)| a.tightness(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(remaining: Option<u64>, reset_ms: Option<u64>) -> Window {
        Window {
            remaining,
            reset_ms,
            ..Window::default()
        }
    }

    #[test]
    fn tightness_prefers_less_headroom_per_time() {
        // 10 left over 1 s is looser than 50 left over 60 s.
        let fast = w(Some(10), Some(1_000));
        let slow = w(Some(50), Some(60_000));
        assert_eq!(slow.tightness(&fast), Ordering::Less);
        // Spent windows: the one shut longer binds.
        assert_eq!(
            w(Some(0), Some(9)).tightness(&w(Some(0), Some(1))),
            Ordering::Less
        );
        // A spent window beats any with headroom.
        assert_eq!(
            w(Some(0), Some(0)).tightness(&w(Some(1), Some(1_000_000))),
            Ordering::Less
        );
        // Unknown remaining loses to known.
        assert_eq!(
            w(None, Some(1)).tightness(&w(Some(5), None)),
            Ordering::Greater
        );
        // Unknown reset: fall back to remaining.
        assert_eq!(
            w(Some(3), None).tightness(&w(Some(5), Some(1))),
            Ordering::Less
        );
        // Policies only: lower quota per window length.
        let per_second = Window {
            limit: Some(10),
            window_ms: Some(1_000),
            ..Window::default()
        };
        let per_hour = Window {
            limit: Some(1_000),
            window_ms: Some(3_600_000),
            ..Window::default()
        };
        assert_eq!(per_hour.tightness(&per_second), Ordering::Less);
        // Extremes do not overflow.
        let max = w(Some(u64::MAX), Some(u64::MAX));
        assert_eq!(max.tightness(&max), Ordering::Equal);
    }

    #[test]
    fn tightest_keeps_first_on_tie() {
        let same = w(Some(1), Some(1));
        let picked = tightest(&[(Dialect::Anthropic, same), (Dialect::OpenAi, same)]);
        assert_eq!(picked.map(|(d, _)| d), Some(Dialect::Anthropic));
        assert_eq!(tightest(&[]), None);
    }

    #[test]
    fn wait_uses_longest_spent_reset() {
        let report = RateReport {
            requests: Some(w(Some(0), Some(1_000))),
            tokens: Some(w(Some(0), Some(360_000))),
            input_tokens: Some(w(Some(5), Some(9_999_999))),
            ..RateReport::default()
        };
        assert_eq!(report.wait_ms(), Some(360_000));
        let hinted = RateReport {
            retry_after_ms: Some(7),
            ..report
        };
        assert_eq!(hinted.wait_ms(), Some(7));
        assert!(RateReport::default().is_empty());
        assert_eq!(RateReport::default().wait_ms(), None);
    }

    #[test]
    fn dialect_names() {
        assert_eq!(Dialect::OpenAi.to_string(), "openai");
        assert_eq!(Dialect::RetryAfter.as_str(), "retry-after");
    }
}
