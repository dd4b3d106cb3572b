//! A pool's Access log page: the store's rows, newest first, filtered by outcome, key and time
//! (epoch ms) and paginated by the admin API's cursor rules (`core::pagination`).

use std::fmt::Write;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use nthbouncer_store::{AccessLogEntry, AccessLogQuery};
use serde::Deserialize;

use super::form::Problems;
use super::pages::{self, esc, time, url_segment, Flash};
use super::{pool_html, Answer, DashRef, Dashboard};
use crate::core::error::ApiError;
use crate::core::extract::{epoch_ms, Path};
use crate::core::pagination;
use crate::pools::registry::PoolRuntime;

/// Rows per page.
const PAGE: u32 = 50;

#[derive(Deserialize, Default)]
pub struct Filters {
    outcome: Option<String>,
    key_id: Option<String>,
    since: Option<String>,
    until: Option<String>,
    cursor: Option<String>,
}

fn given(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// An epoch-ms filter as typed.
fn millis(field: &str, v: &Option<String>) -> Result<Option<u64>, ApiError> {
    let parsed = given(v)
        .map(|raw| {
            raw.parse::<u64>().map_err(|_| {
                ApiError::invalid(field, format!("{field} must be epoch milliseconds"))
            })
        })
        .transpose()?;
    epoch_ms(field, parsed)
}

/// `GET /dashboard/pools/{pool}/access-log?outcome=&key_id=&since=&until=&cursor=`.
pub async fn page(
    State(d): DashRef,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(f): Query<Filters>,
) -> Answer {
    let (open, pool) = d.open_pool(&headers, &name)?;
    let (status, problems, rows) =
        Problems::of_read(read(&d, &pool, &f).await, &["since", "until"]);
    let mut body = filters(&pool, &f, &problems);
    body.push_str(&table(&pool, &f, &rows));
    let page = pool_html(status, &pool, "/access-log", &open, Flash::None, &body);
    Ok(page)
}

async fn read(
    d: &Dashboard,
    pool: &PoolRuntime,
    f: &Filters,
) -> Result<(Vec<AccessLogEntry>, Option<String>), ApiError> {
    let query = AccessLogQuery {
        before: pagination::numeric_cursor(given(&f.cursor))?,
        since: millis("since", &f.since)?,
        until: millis("until", &f.until)?,
        outcome: given(&f.outcome).map(str::to_string),
        key_id: given(&f.key_id).map(str::to_string),
        limit: PAGE + 1,
    };
    let rows = d.store.query_access_log(&pool.name, &query).await?;
    Ok(pagination::split(rows, PAGE, |e| e.id.to_string()))
}

fn filters(pool: &PoolRuntime, f: &Filters, problems: &Problems) -> String {
    let v = |x: &Option<String>| given(x).unwrap_or("").to_string();
    format!(
        "<form method=\"get\" action=\"/dashboard/pools/{}/access-log\" class=\"filters\" \
         data-testid=\"log-filter\">\n{}{}{}{}{}<button type=\"submit\">Filter</button>\n</form>\n",
        url_segment(&pool.name),
        pages::form_error(problems),
        pages::input(
            "outcome",
            "Outcome (admitted, 401, 429, …)",
            "text",
            &v(&f.outcome),
            problems,
            ""
        ),
        pages::input("key_id", "Key id", "text", &v(&f.key_id), problems, ""),
        pages::input(
            "since",
            "Since (epoch ms)",
            "number",
            &v(&f.since),
            problems,
            " min=\"0\""
        ),
        pages::input(
            "until",
            "Until (epoch ms)",
            "number",
            &v(&f.until),
            problems,
            " min=\"0\""
        ),
    )
}

fn table(
    pool: &PoolRuntime,
    f: &Filters,
    (rows, next): &(Vec<AccessLogEntry>, Option<String>),
) -> String {
    let mut out = String::from("<h2 id=\"log-title\">Entries</h2>\n");
    if rows.is_empty() {
        out.push_str("<p>No entries.</p>\n");
        return out;
    }
    out.push_str(
        "<div class=\"scroll\" tabindex=\"0\" role=\"region\" aria-labelledby=\"log-title\">\n<table aria-labelledby=\"log-title\">\n<thead><tr>\
         <th scope=\"col\">At</th><th scope=\"col\">Key</th><th scope=\"col\">Client</th>\
         <th scope=\"col\">Route</th><th scope=\"col\">Outcome</th><th scope=\"col\">Reason</th>\
         <th scope=\"col\">Status</th><th scope=\"col\">Queued (ms)</th><th scope=\"col\">Upstream</th>\
         <th scope=\"col\">Upstream latency (ms)</th><th scope=\"col\">Count</th><th scope=\"col\">Request id</th>\
         </tr></thead>\n<tbody>\n",
    );
    let dash = || "—".to_string();
    for e in rows {
        let _ = writeln!(
            out,
            "<tr data-testid=\"log-row\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td data-testid=\"log-outcome\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td></tr>",
            time(Some(e.at)),
            esc(e.key_id.as_deref().unwrap_or("—")),
            esc(&e.client_addr),
            esc(&e.route),
            esc(&e.outcome),
            esc(e.reason.as_deref().unwrap_or("")),
            e.status,
            e.queued_ms,
            e.upstream_status.map_or_else(dash, |s| s.to_string()),
            e.upstream_latency_ms.map_or_else(dash, |s| s.to_string()),
            e.count,
            esc(e.request_id.as_deref().unwrap_or("")),
        );
    }
    out.push_str("</tbody>\n</table>\n</div>\n");
    if let Some(next) = next {
        let keep = |name: &str, v: &Option<String>| {
            given(v)
                .map(|v| format!("&amp;{name}={}", url_segment(v)))
                .unwrap_or_default()
        };
        let _ = writeln!(
            out,
            "<p><a href=\"/dashboard/pools/{}/access-log?cursor={}{}{}{}{}\" data-testid=\"next-page\">Older entries</a></p>",
            url_segment(&pool.name),
            url_segment(next),
            keep("outcome", &f.outcome),
            keep("key_id", &f.key_id),
            keep("since", &f.since),
            keep("until", &f.until),
        );
    }
    out
}
