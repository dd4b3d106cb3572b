//! The small chart of a pool's last 15 minutes (its `core::history`), drawn on the server as
//! inline SVG, with the totals beside it in text so the numbers do not depend on seeing colour.
//! The page's script redraws it from `/dashboard/api/pools/{pool}/history` with the same rules.

use std::fmt::Write;

use crate::core::history::Second;

/// Chart height in SVG units (one unit per second across).
const HEIGHT: u32 = 120;

/// The series: field, label, CSS class (the stylesheet colours them).
pub const SERIES: [(&str, &str); 4] = [
    ("admitted", "Admitted"),
    ("refused", "Refused"),
    ("queued", "Queued"),
    ("origin429", "Origin 429s"),
];

fn value(s: &Second, field: &str) -> u32 {
    match field {
        "admitted" => s.admitted,
        "refused" => s.refused,
        "queued" => s.queued,
        _ => s.origin429,
    }
}

/// The chart's `<figure>`: an SVG of one polyline per series and a caption with the totals.
pub fn figure(seconds: &[Second]) -> String {
    let max = seconds
        .iter()
        .flat_map(|s| SERIES.iter().map(move |(f, _)| value(s, f)))
        .max()
        .unwrap_or(0)
        .max(1);
    let mut svg = format!(
        "<svg id=\"history-chart\" viewBox=\"0 0 {} {HEIGHT}\" preserveAspectRatio=\"none\" \
         aria-hidden=\"true\" focusable=\"false\">",
        seconds.len().max(1)
    );
    let mut caption = String::new();
    for (field, label) in SERIES {
        let mut points = String::new();
        let mut total = 0u64;
        for (x, s) in seconds.iter().enumerate() {
            let v = value(s, field);
            total += u64::from(v);
            let y = HEIGHT - v * HEIGHT / max;
            let _ = write!(points, "{x},{y} ");
        }
        let _ = write!(
            svg,
            "<polyline class=\"s-{field}\" data-series=\"{field}\" points=\"{}\"/>",
            points.trim_end()
        );
        let _ = write!(
            caption,
            "<li><span class=\"key s-{field}\"></span>{label}: <strong data-total=\"{field}\">{total}</strong></li>"
        );
    }
    svg.push_str("</svg>");
    format!(
        "<figure class=\"chart\">\n{svg}\n<figcaption>Last 15 minutes, per second (peak {max}); \
         totals:<ul class=\"legend\">{caption}</ul></figcaption>\n</figure>"
    )
}
