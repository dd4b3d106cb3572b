//! The IETF httpapi rate-limit drafts, in all three shapes origins still send:
//!
//! - drafts 00–06: `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (delay seconds),
//!   where `RateLimit-Limit` may append quota policies (`100, 100;w=60`) and, from draft 05,
//!   `RateLimit-Policy: 100;w=60` may carry them instead;
//! - draft 07: the dictionary `RateLimit: limit=100, remaining=50, reset=30` beside
//!   `RateLimit-Policy: 100;w=60`;
//! - drafts 08 onwards: named items, `RateLimit-Policy: "default";q=100;w=60` and
//!   `RateLimit: "default";r=50;t=30`, possibly several per field.
//!
//! Each shape yields request windows; the crate root keeps the tightest. Policies whose quota
//! unit (`qu`) is not `requests` (content bytes, concurrent requests) are left out, because they
//! do not measure the request budget.

use crate::dialects::reset_seconds;
use crate::fields::{Field, Fields, Part};
use crate::number::parse_uint;
use crate::report::Window;
use crate::structured::{dict_get, members, Bare, Member};

/// One declared quota policy.
struct Policy {
    /// Drafts 08+ name their policies; earlier ones identify them by quota alone.
    name: Option<String>,
    quota: Option<u64>,
    window_ms: Option<u64>,
    /// Whether the quota counts requests (the default unit).
    counts_requests: bool,
}

impl Policy {
    fn from_member(member: &Member<'_>) -> Option<Policy> {
        if member.key.is_some() {
            return None;
        }
        let window_ms = member.param("w").and_then(Bare::seconds_ms);
        let counts_requests = member.param("qu").is_none_or(|unit| {
            unit.text()
                .is_some_and(|u| u.eq_ignore_ascii_case("requests"))
        });
        match &member.value {
            Bare::Number(_) => Some(Policy {
                name: None,
                quota: member.value.uint(),
                window_ms,
                counts_requests,
            }),
            Bare::Text(name) => Some(Policy {
                name: Some(name.clone()),
                quota: member.param("q").and_then(Bare::uint),
                window_ms,
                counts_requests,
            }),
            Bare::Other => None,
        }
    }
}

/// Every request window the IETF fields describe.
pub(crate) fn windows(fields: &Fields<'_>, now_ms: u64) -> Vec<Window> {
    let mut policies: Vec<Policy> = fields
        .values(Field::IetfPolicy)
        .flat_map(members)
        .filter_map(|m| Policy::from_member(&m))
        .collect();
    let mut out = Vec::new();

    let ratelimit: Vec<Member<'_>> = fields
        .values(Field::IetfRateLimit)
        .flat_map(members)
        .collect();
    // Draft 07: a dictionary with one budget.
    if ["limit", "remaining", "reset"]
        .iter()
        .any(|key| dict_get(&ratelimit, key).is_some())
    {
        let number = |key: &str| dict_get(&ratelimit, key).map(|m| &m.value);
        let limit = number("limit").and_then(Bare::uint);
        push(
            &mut out,
            Window {
                limit,
                remaining: number("remaining").and_then(Bare::uint),
                reset_ms: number("reset").and_then(Bare::seconds_ms),
                window_ms: policy_window(&policies, limit),
            },
        );
    }
    // Drafts 08+: one item per policy, joined to RateLimit-Policy by name.
    for item in ratelimit.iter().filter(|m| m.key.is_none()) {
        let Some(name) = item.value.text() else {
            continue;
        };
        let policy = policies.iter().find(|p| p.name.as_deref() == Some(name));
        if policy.is_some_and(|p| !p.counts_requests) {
            continue;
        }
        push(
            &mut out,
            Window {
                limit: policy.and_then(|p| p.quota),
                remaining: item.param("r").and_then(Bare::uint),
                reset_ms: item.param("t").and_then(Bare::seconds_ms),
                window_ms: policy.and_then(|p| p.window_ms),
            },
        );
    }

    // Drafts 00–06: separate fields; the limit's first member is the current limit and any
    // further members are quota policies.
    let limit_members: Vec<Member<'_>> = fields
        .values(Field::Ietf(Part::Limit))
        .flat_map(members)
        .collect();
    let current = limit_members.first();
    policies.extend(limit_members.iter().skip(1).filter_map(Policy::from_member));
    let triple = Window {
        limit: current.and_then(|m| m.value.uint()),
        remaining: fields.first(Field::Ietf(Part::Remaining), parse_uint),
        // Drafts say delay seconds, but some servers send epoch seconds here as GitHub does.
        reset_ms: fields.first(Field::Ietf(Part::Reset), |v| reset_seconds(v, now_ms)),
        window_ms: None,
    };
    // The policy window only qualifies a triple that is there, not stand-alone policies.
    if !triple.is_empty() {
        let own_window = current
            .and_then(|m| m.param("w"))
            .and_then(Bare::seconds_ms);
        out.push(Window {
            window_ms: own_window.or_else(|| policy_window(&policies, triple.limit)),
            ..triple
        });
    }

    // Policies alone still teach the quota and its window.
    if out.is_empty() {
        for policy in policies.iter().filter(|p| p.counts_requests) {
            push(
                &mut out,
                Window {
                    limit: policy.quota,
                    window_ms: policy.window_ms,
                    ..Window::default()
                },
            );
        }
    }
    out
}

fn push(out: &mut Vec<Window>, window: Window) {
    if !window.is_empty() {
        out.push(window);
    }
}

/// The window length of the policy a numeric limit refers to: the policy with that quota, or
/// the only policy when there is just one.
fn policy_window(policies: &[Policy], limit: Option<u64>) -> Option<u64> {
    let with_window: Vec<&Policy> = policies
        .iter()
        .filter(|p| p.counts_requests && p.window_ms.is_some())
        .collect();
    let matching = limit.and_then(|limit| with_window.iter().find(|p| p.quota == Some(limit)));
    match (matching, with_window.as_slice()) {
        (Some(policy), _) => policy.window_ms,
        (None, [only]) => only.window_ms,
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(headers: &[(&str, &str)]) -> Vec<Window> {
        windows(&Fields::collect(headers.iter().copied()), 1_000_000_000_000)
    }

    #[test]
    fn policy_matching_by_quota_then_single() {
        let got = parse(&[
            ("ratelimit", "limit=10, remaining=1, reset=1"),
            ("ratelimit-policy", "10;w=1, 1000;w=3600"),
        ]);
        assert_eq!(got.first().and_then(|w| w.window_ms), Some(1_000));
        let got = parse(&[
            ("ratelimit", "limit=7"),
            ("ratelimit-policy", "10;w=1, 1000;w=3600"),
        ]);
        assert_eq!(got.first().and_then(|w| w.window_ms), None);
        let got = parse(&[("ratelimit", "limit=7"), ("ratelimit-policy", "10;w=1")]);
        assert_eq!(got.first().and_then(|w| w.window_ms), Some(1_000));
    }

    #[test]
    fn non_request_units_are_left_out() {
        let got = parse(&[
            (
                "RateLimit-Policy",
                r#""bytes";q=1000000;qu="content-bytes";w=60, "calls";q=10;w=1"#,
            ),
            ("RateLimit", r#""bytes";r=0;t=60, "calls";r=9;t=1"#),
        ]);
        assert_eq!(
            got,
            vec![Window {
                limit: Some(10),
                remaining: Some(9),
                reset_ms: Some(1_000),
                window_ms: Some(1_000)
            }]
        );
    }

    #[test]
    fn unknown_policy_name_still_reports_remaining() {
        let got = parse(&[("RateLimit", r#""mystery";r=3;t=5"#)]);
        assert_eq!(
            got,
            vec![Window {
                remaining: Some(3),
                reset_ms: Some(5_000),
                ..Window::default()
            }]
        );
    }
}
