//! A pool's Jobs page (filtered by status, paginated) and one job's page: its status, its
//! result (status, headers, body), its history and its deliveries, with a redeliver button once
//! it ended. Read from the job store as the admin API's job routes read it.

use std::fmt::Write;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use base64::prelude::*;
use nthbouncer_store::jobs::status;
use nthbouncer_store::StoredJob;
use serde::Deserialize;

use super::form::Problems;
use super::pages::{self, esc, time, url_segment, Flash};
use super::{html, pool_html, Answer, DashRef, Dashboard};
use crate::core::error::ApiError;
use crate::core::extract::Path;
use crate::core::pagination;
use crate::pools::actions::{job_not_found, valid_job_id};
use crate::pools::registry::PoolRuntime;

/// Jobs per page.
const PAGE: u32 = 50;

#[derive(Deserialize, Default)]
pub struct Params {
    status: Option<String>,
    cursor: Option<String>,
}

/// `GET /dashboard/pools/{pool}/jobs?status=&cursor=`.
pub async fn list(
    State(d): DashRef,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(q): Query<Params>,
) -> Answer {
    let (open, pool) = d.open_pool(&headers, &name)?;
    let wanted = q.status.as_deref().filter(|s| !s.is_empty());
    let read = read(&d, &pool, wanted, q.cursor.as_deref()).await;
    let (status, problems, page) = Problems::of_read(read, &["status"]);
    let body = render(&d, &pool, wanted.unwrap_or(""), &problems, &page);
    let page = pool_html(status, &pool, "/jobs", &open, Flash::None, &body);
    Ok(page)
}

async fn read(
    d: &Dashboard,
    pool: &PoolRuntime,
    wanted: Option<&str>,
    cursor: Option<&str>,
) -> Result<(Vec<StoredJob>, Option<String>), ApiError> {
    if let Some(s) = wanted {
        if !status::ALL.contains(&s) {
            return Err(ApiError::invalid(
                "status",
                format!("status must be one of {}", status::ALL.join(", ")),
            ));
        }
    }
    let rows = d
        .jobs
        .list_jobs(&pool.name, wanted, cursor, PAGE + 1)
        .await?;
    Ok(pagination::split(rows, PAGE, |j| j.id.clone()))
}

fn seen_status(job: &StoredJob, now: u64) -> &str {
    status::as_seen(&job.status, job.expires_at, now)
}

fn render(
    d: &Dashboard,
    pool: &PoolRuntime,
    wanted: &str,
    problems: &Problems,
    (jobs, next): &(Vec<StoredJob>, Option<String>),
) -> String {
    let name = url_segment(&pool.name);
    let mut options = vec![("", "any")];
    options.extend(status::ALL.iter().map(|s| (*s, *s)));
    let mut out = format!(
        "<form method=\"get\" action=\"/dashboard/pools/{name}/jobs\" class=\"filters\" \
         data-testid=\"job-filter\">\n{}{}<button type=\"submit\">Filter</button>\n</form>\n",
        pages::select("status", "Status", &options, wanted, ""),
        problems
            .of("status")
            .map(|m| format!(
                "<p class=\"error\" role=\"alert\" data-testid=\"error-status\">{}</p>\n",
                esc(m)
            ))
            .unwrap_or_default(),
    );
    out.push_str("<h2 id=\"jobs-title\">Jobs</h2>\n");
    if jobs.is_empty() {
        out.push_str("<p>No jobs.</p>\n");
        return out;
    }
    out.push_str(
        "<div class=\"scroll\">\n<table aria-labelledby=\"jobs-title\">\n<thead><tr>\
         <th scope=\"col\">Job</th><th scope=\"col\">Status</th><th scope=\"col\">Reason</th>\
         <th scope=\"col\">Created</th><th scope=\"col\">Updated</th><th scope=\"col\">Attempts</th>\
         </tr></thead>\n<tbody>\n",
    );
    let now = d.clock.now_ms();
    for j in jobs {
        let _ = writeln!(
            out,
            "<tr data-testid=\"job-row\" data-job-id=\"{id}\"><th scope=\"row\">\
             <a href=\"/dashboard/pools/{name}/jobs/{}\">{id}</a></th>\
             <td data-testid=\"job-status\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            url_segment(&j.id),
            esc(seen_status(j, now)),
            esc(&j.reason),
            time(Some(j.created_at)),
            time(Some(j.updated_at)),
            j.attempt,
            id = esc(&j.id),
        );
    }
    out.push_str("</tbody>\n</table>\n</div>\n");
    if let Some(next) = next {
        let _ = writeln!(
            out,
            "<p><a href=\"/dashboard/pools/{name}/jobs?status={}&amp;cursor={}\" data-testid=\"next-page\">Older jobs</a></p>",
            url_segment(wanted),
            url_segment(next)
        );
    }
    out
}

#[derive(Deserialize, Default)]
pub struct JobParams {
    redelivered: Option<String>,
}

/// `GET /dashboard/pools/{pool}/jobs/{job}`: one job, its result and history.
pub async fn one(
    State(d): DashRef,
    headers: HeaderMap,
    Path((name, job_id)): Path<(String, String)>,
    Query(q): Query<JobParams>,
) -> Answer {
    let (open, pool) = d.open_pool(&headers, &name)?;
    Ok(match job_body(&d, &pool, &job_id, &open.csrf).await {
        Ok(body) => {
            let flash = match q.redelivered {
                Some(_) => Flash::Done("Redelivery queued.".into()),
                None => Flash::None,
            };
            pool_html(StatusCode::OK, &pool, "/jobs", &open, flash, &body)
        }
        Err(e) => html(e.status, pages::failure("Job", &e.message)),
    })
}

async fn job_body(
    d: &Dashboard,
    pool: &PoolRuntime,
    job_id: &str,
    csrf: &str,
) -> Result<String, ApiError> {
    if !valid_job_id(job_id) {
        return Err(job_not_found());
    }
    let job = d
        .jobs
        .get_job(&pool.name, job_id)
        .await?
        .ok_or_else(job_not_found)?;
    let history = d.jobs.job_events(&job.id).await?;
    let deliveries = d.jobs.job_deliveries(&job.id).await?;
    let now = d.clock.now_ms();
    let shown = seen_status(&job, now);
    let mut out = format!(
        "<h2>Job <code data-testid=\"job-id\">{}</code></h2>\n<dl class=\"facts\">\
         <dt>Status</dt><dd data-testid=\"job-status\">{}</dd><dt>Reason</dt><dd>{}</dd>\
         <dt>Created</dt><dd>{}</dd><dt>Updated</dt><dd>{}</dd><dt>Expires</dt><dd>{}</dd>\
         <dt>Request id</dt><dd>{}</dd></dl>\n",
        esc(&job.id),
        esc(shown),
        esc(&job.reason),
        time(Some(job.created_at)),
        time(Some(job.updated_at)),
        time(Some(job.expires_at)),
        esc(job.request_id.as_deref().unwrap_or("—")),
    );
    if let Some(error) = job
        .error
        .as_deref()
        .filter(|_| job.status == status::FAILED)
    {
        let _ = writeln!(
            out,
            "<p class=\"error\" data-testid=\"job-error\">{}</p>",
            esc(error)
        );
    }
    out.push_str(&result(&job));
    out.push_str(&events(&history));
    out.push_str(&delivery_table(&deliveries));
    if status::is_terminal(shown) {
        let _ = writeln!(
            out,
            "<form method=\"post\" action=\"/dashboard/pools/{}/jobs/{}/redeliver\">{}\
             <button type=\"submit\" data-testid=\"redeliver\">Redeliver this job</button></form>",
            url_segment(&pool.name),
            url_segment(&job.id),
            pages::csrf_field(csrf)
        );
    }
    Ok(out)
}

fn result(job: &StoredJob) -> String {
    let Some(r) = &job.result else {
        return "<h3>Result</h3>\n<p data-testid=\"job-result\">No result yet.</p>\n".into();
    };
    let (body, encoding) = match std::str::from_utf8(&r.body) {
        Ok(text) => (text.to_string(), "utf8"),
        Err(_) => (BASE64_STANDARD.encode(&r.body), "base64"),
    };
    let mut headers = String::new();
    for (k, v) in &r.headers {
        let _ = write!(
            headers,
            "<tr><th scope=\"row\">{}</th><td>{}</td></tr>",
            esc(k),
            esc(v)
        );
    }
    format!(
        "<section data-testid=\"job-result\" aria-labelledby=\"result-title\">\n\
         <h3 id=\"result-title\">Result</h3>\n\
         <p>Status <strong data-testid=\"job-result-status\">{}</strong>; body {encoding}{}.</p>\n\
         <details><summary>Headers</summary><table>{headers}</table></details>\n\
         <pre tabindex=\"0\"><code data-testid=\"job-result-body\">{}</code></pre>\n</section>\n",
        r.status,
        if r.truncated { ", truncated" } else { "" },
        esc(&body)
    )
}

fn events(history: &[nthbouncer_store::JobEvent]) -> String {
    let mut out = String::from(
        "<h3 id=\"history-title\">History</h3>\n<div class=\"scroll\" tabindex=\"0\" role=\"region\" aria-labelledby=\"history-title\">\n<table aria-labelledby=\"history-title\">\n\
         <thead><tr><th scope=\"col\">At</th><th scope=\"col\">Status</th><th scope=\"col\">Attempt</th>\
         <th scope=\"col\">Detail</th></tr></thead>\n<tbody>\n",
    );
    for e in history {
        let _ = writeln!(
            out,
            "<tr data-testid=\"job-event\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            time(Some(e.at)),
            esc(&e.status),
            e.attempt,
            esc(e.detail.as_deref().unwrap_or(""))
        );
    }
    out.push_str("</tbody>\n</table>\n</div>\n");
    out
}

fn delivery_table(deliveries: &[nthbouncer_store::DeliveryState]) -> String {
    if deliveries.is_empty() {
        return "<h3>Deliveries</h3>\n<p>No webhook deliveries.</p>\n".into();
    }
    let mut out = String::from(
        "<h3 id=\"deliveries-title\">Deliveries</h3>\n<div class=\"scroll\" tabindex=\"0\" role=\"region\" aria-labelledby=\"deliveries-title\">\n<table aria-labelledby=\"deliveries-title\">\n\
         <thead><tr><th scope=\"col\">Destination</th><th scope=\"col\">Status</th><th scope=\"col\">Attempts</th>\
         <th scope=\"col\">Last status</th><th scope=\"col\">Last error</th><th scope=\"col\">Delivered</th></tr></thead>\n<tbody>\n",
    );
    for dl in deliveries {
        let _ = writeln!(
            out,
            "<tr data-testid=\"delivery-row\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&dl.destination_id),
            esc(&dl.status),
            dl.attempts,
            dl.last_status.map_or_else(|| "—".into(), |s| s.to_string()),
            esc(dl.last_error.as_deref().unwrap_or("")),
            time(dl.delivered_at),
        );
    }
    out.push_str("</tbody>\n</table>\n</div>\n");
    out
}
