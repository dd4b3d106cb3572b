//! A pool's Webhooks page: its destinations (secret masked; deactivate or re-enable, rotate the
//! secret — the new one shown once, on the answer to that POST), a form to add one (its secret
//! shown once), and the delivery attempts, newest first, with status and latency, each with a
//! button that redelivers its job. Every change goes through the `Pools` operations the admin
//! API's webhook routes use (`pools::actions`).

use std::fmt::Write;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use bytes::Bytes;
use nthbouncer_store::{AttemptQuery, DeliveryAttempt};
use serde::Deserialize;

use super::form::Problems;
use super::pages::{self, esc, time, url_segment, Flash};
use super::{html, pool_html, session::Open, Answer, DashRef, Dashboard};
use crate::core::error::ApiError;
use crate::core::extract::Path;
use crate::core::pagination;
use crate::pools::actions::{DestinationChange, DEFAULT_DEACTIVATE_AFTER};
use crate::pools::registry::PoolRuntime;

/// Attempts per page.
const PAGE: u32 = 50;

#[derive(Deserialize, Default)]
pub struct Params {
    cursor: Option<String>,
    done: Option<String>,
}

/// What a POST answers with besides the page: a secret to show once, a message, the form.
#[derive(Default)]
struct Extra {
    secret: Option<(String, String)>,
    flash: Flash,
    url: String,
    problems: Problems,
}

/// `GET /dashboard/pools/{pool}/webhooks`.
pub async fn page(
    State(d): DashRef,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(q): Query<Params>,
) -> Answer {
    let (open, pool) = d.open_pool(&headers, &name)?;
    let flash = match q.done.as_deref() {
        Some("enabled") => Flash::Done("Destination re-enabled.".into()),
        Some("disabled") => Flash::Done("Destination deactivated.".into()),
        Some("redelivered") => Flash::Done("Redelivery queued.".into()),
        _ => Flash::None,
    };
    let extra = Extra {
        flash,
        ..Extra::default()
    };
    let cursor = q.cursor.as_deref();
    Ok(respond(&d, &pool, &open, cursor, StatusCode::OK, extra).await)
}

async fn respond(
    d: &Dashboard,
    pool: &PoolRuntime,
    open: &Open,
    cursor: Option<&str>,
    status: StatusCode,
    extra: Extra,
) -> Response {
    let attempts = match attempts(d, pool, cursor).await {
        Ok(page) => page,
        Err(e) => return html(e.status, pages::failure("Webhooks", &e.message)),
    };
    let mut body = String::new();
    if let Some((id, secret)) = &extra.secret {
        let _ = write!(
            body,
            "<section class=\"once\" aria-labelledby=\"secret-title\" data-testid=\"new-secret-panel\">\n\
             <h2 id=\"secret-title\">New secret of {}</h2>\n\
             <p role=\"status\">Copy it now: it will not be shown in full again.</p>\n\
             <p><code data-testid=\"new-secret\">{}</code></p>\n</section>\n",
            esc(id),
            esc(secret)
        );
    }
    body.push_str(&destinations(pool, &open.csrf));
    body.push_str(&add_form(pool, &open.csrf, &extra.url, &extra.problems));
    body.push_str(&attempt_table(pool, &open.csrf, &attempts));
    pool_html(status, pool, "/webhooks", open, extra.flash, &body)
}

async fn attempts(
    d: &Dashboard,
    pool: &PoolRuntime,
    cursor: Option<&str>,
) -> Result<(Vec<DeliveryAttempt>, Option<String>), ApiError> {
    let rows = d
        .jobs
        .list_attempts(&AttemptQuery {
            pool: pool.name.clone(),
            job_id: None,
            destination_id: None,
            before: pagination::numeric_cursor(cursor)?,
            limit: PAGE + 1,
        })
        .await?;
    Ok(pagination::split(rows, PAGE, |a| a.id.to_string()))
}

fn destinations(pool: &PoolRuntime, csrf: &str) -> String {
    let name = url_segment(&pool.name);
    let list = pool.destinations.load();
    let mut out = String::from("<h2 id=\"destinations-title\">Destinations</h2>\n");
    if list.is_empty() {
        out.push_str("<p>No destinations yet.</p>\n");
        return out;
    }
    out.push_str(
        "<div class=\"scroll\">\n<table aria-labelledby=\"destinations-title\">\n<thead><tr>\
         <th scope=\"col\">URL</th><th scope=\"col\">Secret</th><th scope=\"col\">State</th>\
         <th scope=\"col\">Failures in a row</th><th scope=\"col\">Deactivated at</th>\
         <th scope=\"col\">Managed by</th><th scope=\"col\"><span class=\"sr-only\">Actions</span></th>\
         </tr></thead>\n<tbody>\n",
    );
    for dest in list.iter() {
        let id = url_segment(&dest.id);
        let (next, button) = if dest.active {
            ("false", "Deactivate")
        } else {
            ("true", "Re-enable")
        };
        let mut actions = format!(
            "<form method=\"post\" action=\"/dashboard/pools/{name}/webhooks/{id}/active\">{}\
             <input type=\"hidden\" name=\"active\" value=\"{next}\">\
             <button type=\"submit\" data-testid=\"toggle-destination\">{button}</button></form>",
            pages::csrf_field(csrf)
        );
        if dest.managed_by == "api" {
            let _ = write!(
                actions,
                "<form method=\"post\" action=\"/dashboard/pools/{name}/webhooks/{id}/rotate\">{}\
                 <button type=\"submit\" data-testid=\"rotate-secret\">Rotate secret</button></form>",
                pages::csrf_field(csrf)
            );
        }
        let _ = writeln!(
            out,
            "<tr data-testid=\"destination-row\" data-destination-id=\"{}\"><th scope=\"row\">{}</th>\
             <td><code data-testid=\"destination-secret\">{}</code></td>\
             <td data-testid=\"destination-state\">{}</td><td>{} / {}</td><td>{}</td><td>{}</td>\
             <td class=\"actions\">{actions}</td></tr>",
            esc(&dest.id),
            esc(&dest.url),
            esc(&nthbouncer_config::mask(&dest.secret)),
            if dest.active { "active" } else { "inactive" },
            dest.consecutive_failures,
            dest.deactivate_after,
            time(dest.deactivated_at),
            esc(&dest.managed_by),
        );
    }
    out.push_str("</tbody>\n</table>\n</div>\n");
    out
}

fn add_form(pool: &PoolRuntime, csrf: &str, url: &str, problems: &Problems) -> String {
    let after = DEFAULT_DEACTIVATE_AFTER.to_string();
    format!(
        "<h2 id=\"add-destination-title\">Add a destination</h2>\n{}\
         <form method=\"post\" action=\"/dashboard/pools/{}/webhooks\" data-testid=\"add-destination\" \
         aria-labelledby=\"add-destination-title\">\n{}{}{}\
         <button type=\"submit\">Add destination</button>\n</form>\n",
        pages::form_error(problems),
        url_segment(&pool.name),
        pages::csrf_field(csrf),
        pages::input("url", "URL", "url", url, problems, " required"),
        pages::input(
            "deactivate_after",
            "Deactivate after this many failures in a row",
            "number",
            &after,
            problems,
            " min=\"1\""
        ),
    )
}

fn attempt_table(
    pool: &PoolRuntime,
    csrf: &str,
    (attempts, next): &(Vec<DeliveryAttempt>, Option<String>),
) -> String {
    let name = url_segment(&pool.name);
    let mut out = String::from("<h2 id=\"attempts-title\">Delivery attempts</h2>\n");
    if attempts.is_empty() {
        out.push_str("<p>No delivery attempts yet.</p>\n");
        return out;
    }
    out.push_str(
        "<div class=\"scroll\">\n<table aria-labelledby=\"attempts-title\">\n<thead><tr>\
         <th scope=\"col\">At</th><th scope=\"col\">Job</th><th scope=\"col\">Destination</th>\
         <th scope=\"col\">Attempt</th><th scope=\"col\">Status</th><th scope=\"col\">Latency (ms)</th>\
         <th scope=\"col\">Outcome</th><th scope=\"col\">Error</th>\
         <th scope=\"col\"><span class=\"sr-only\">Actions</span></th></tr></thead>\n<tbody>\n",
    );
    for a in attempts {
        let job = url_segment(&a.job_id);
        let manual = if a.manual { " (manual)" } else { "" };
        let _ = writeln!(
            out,
            "<tr data-testid=\"attempt-row\"><td>{}</td>\
             <th scope=\"row\"><a href=\"/dashboard/pools/{name}/jobs/{job}\">{}</a></th><td>{}</td>\
             <td>{}{manual}</td><td data-testid=\"attempt-status\">{}</td>\
             <td data-testid=\"attempt-latency\">{}</td><td>{}</td><td>{}</td>\
             <td><form method=\"post\" action=\"/dashboard/pools/{name}/jobs/{job}/redeliver\">{}\
             <input type=\"hidden\" name=\"back\" value=\"webhooks\">\
             <button type=\"submit\" data-testid=\"redeliver\">Redeliver {}</button></form></td></tr>",
            time(Some(a.at)),
            esc(&a.job_id),
            esc(&a.destination_id),
            a.attempt,
            a.status_code.map_or_else(|| "—".into(), |s| s.to_string()),
            a.latency_ms,
            esc(&a.outcome),
            esc(a.error.as_deref().unwrap_or("")),
            pages::csrf_field(csrf),
            esc(&a.job_id),
        );
    }
    out.push_str("</tbody>\n</table>\n</div>\n");
    if let Some(next) = next {
        let _ = writeln!(
            out,
            "<p><a href=\"/dashboard/pools/{name}/webhooks?cursor={}\" data-testid=\"next-page\">Older attempts</a></p>",
            url_segment(next)
        );
    }
    out
}

/// `POST /dashboard/pools/{pool}/webhooks`: adds a destination (`url`, `deactivate_after`)
/// and shows its secret once.
pub async fn create(
    State(d): DashRef,
    headers: HeaderMap,
    Path(name): Path<String>,
    body: Bytes,
) -> Answer {
    let (open, form, pool) = d.post_pool(&headers, &body, &name)?;
    let after = form.optional("deactivate_after");
    let url = form.text("url").to_string();
    let made = match after.as_deref().map(str::parse::<u32>).transpose() {
        Ok(n) => d.pools.create_destination(&pool.name, url, None, n).await,
        Err(_) => Err(ApiError::invalid(
            "deactivateAfter",
            "deactivateAfter must be a whole number of at least 1",
        )),
    };
    Ok(match made {
        Ok(dest) => {
            let pool = d.pools.get(&pool.name).unwrap_or(pool);
            let extra = Extra {
                secret: Some((dest.id, dest.secret)),
                ..Extra::default()
            };
            respond(&d, &pool, &open, None, StatusCode::CREATED, extra).await
        }
        Err(e) => {
            let extra = Extra {
                url: form.text("url").to_string(),
                problems: Problems::from_error(&e, &["url", "deactivate_after"]),
                ..Extra::default()
            };
            respond(&d, &pool, &open, None, e.status, extra).await
        }
    })
}

/// `POST /dashboard/pools/{pool}/webhooks/{id}/active`: `active=true` re-enables (and clears
/// the failure streak), `active=false` deactivates.
pub async fn set_active(
    State(d): DashRef,
    headers: HeaderMap,
    Path((name, id)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let (open, form, pool) = d.post_pool(&headers, &body, &name)?;
    let active = form.text("active") == "true";
    let change = DestinationChange {
        active: Some(active),
        ..DestinationChange::default()
    };
    let changed = d.pools.change_destination(&pool.name, &id, change).await;
    Ok(match changed {
        Ok(_) => Redirect::to(&format!(
            "/dashboard/pools/{}/webhooks?done={}",
            url_segment(&pool.name),
            if active { "enabled" } else { "disabled" }
        ))
        .into_response(),
        Err(e) => failed(&d, &pool, &open, e).await,
    })
}

/// `POST /dashboard/pools/{pool}/webhooks/{id}/rotate`: a new secret (shown once); the
/// previous one keeps signing for the default grace.
pub async fn rotate(
    State(d): DashRef,
    headers: HeaderMap,
    Path((name, id)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let (open, _, pool) = d.post_pool(&headers, &body, &name)?;
    let rotated = d.pools.rotate_destination_secret(&pool.name, &id, None);
    Ok(match rotated.await {
        Ok(rotated) => {
            let pool = d.pools.get(&pool.name).unwrap_or(pool);
            let until = rotated
                .previous_secret_expires_at
                .map(|_| " The previous secret keeps signing beside it for a day.")
                .unwrap_or_default();
            let extra = Extra {
                secret: Some((id, rotated.secret)),
                flash: Flash::Done(format!("Secret rotated.{until}")),
                ..Extra::default()
            };
            respond(&d, &pool, &open, None, StatusCode::OK, extra).await
        }
        Err(e) => failed(&d, &pool, &open, e).await,
    })
}

/// `POST /dashboard/pools/{pool}/jobs/{job}/redeliver`: a new delivery round; back to the
/// Webhooks page (`back=webhooks`) or the job's page.
pub async fn redeliver(
    State(d): DashRef,
    headers: HeaderMap,
    Path((name, job)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let (open, form, pool) = d.post_pool(&headers, &body, &name)?;
    let pool_path = format!("/dashboard/pools/{}", url_segment(&pool.name));
    Ok(match d.pools.redeliver(&pool.name, &job).await {
        Ok(_) if form.text("back") == "webhooks" => {
            Redirect::to(&format!("{pool_path}/webhooks?done=redelivered")).into_response()
        }
        Ok(_) => Redirect::to(&format!(
            "{pool_path}/jobs/{}?redelivered=1",
            url_segment(&job)
        ))
        .into_response(),
        Err(e) => failed(&d, &pool, &open, e).await,
    })
}

/// The Webhooks page with a refusal's message.
async fn failed(d: &Dashboard, pool: &PoolRuntime, open: &Open, e: ApiError) -> Response {
    let extra = Extra {
        flash: Flash::Failed(e.message.to_string()),
        ..Extra::default()
    };
    respond(d, pool, open, None, e.status, extra).await
}
