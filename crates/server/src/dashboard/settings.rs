//! Pool settings from the dashboard: the "Create a pool" form on the pool list and a pool's
//! Concurrency page. Both build the admin API's JSON body and hand it to the same parser
//! (`core::extract::parse_json`) and the same operations (`Pools::create_pool`,
//! `Pools::update_pool`), so the dashboard refuses exactly what the API refuses, with the
//! message next to the field it names; a change applies live (the gate is reconfigured).

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect};
use bytes::Bytes;
use nthbouncer_config::PoolSpec;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::form::{Form, Problems};
use super::pages::{self, Flash, NewPoolForm};
use super::{html, pool_html, row_of, rows, Answer, DashRef, Dashboard};
use crate::core::error::ApiError;
use crate::core::extract::{parse_json, Path};
use crate::core::ManagedBy;
use crate::pools::registry::PoolRuntime;

/// The Concurrency form's number fields (`[pools.concurrency]` keys) and their labels.
const NUMBERS: [(&str, &str); 9] = [
    ("limit", "Concurrency limit"),
    ("min_limit", "Lowest learned limit"),
    ("queue_size", "Queue size"),
    ("queue_timeout_ms", "Queue timeout (ms)"),
    ("rpm", "Requests per minute (0 = none)"),
    ("request_timeout_ms", "Request timeout (ms)"),
    ("lease_term_ms", "Lease term (ms)"),
    ("renew_interval_ms", "Renew interval (ms)"),
    ("max_pause_ms", "Longest pause (ms)"),
];
/// Its checkboxes.
const FLAGS: [(&str, &str); 2] = [
    ("adaptive", "Learn the limit from throttles (adaptive)"),
    ("fair_share", "Fair share across keys"),
];
const PROXY_WAIT: (&str, &str) = ("proxy_wait", "Proxy requests without a wait budget");
const PROXY_WAIT_OPTIONS: [(&str, &str); 2] = [
    ("open", "wait up to the queue timeout (open)"),
    ("fail_fast", "fail at once (fail_fast)"),
];
const CREATE_FIELDS: [&str; 4] = ["name", "kind", "upstream", "limit"];

/// A number as typed: a JSON number when it is one, else the text (which the parser refuses,
/// naming the field).
fn number(raw: &str) -> Value {
    raw.parse::<u64>()
        .map_or_else(|_| Value::String(raw.to_string()), Value::from)
}

/// `POST /dashboard/pools`: creates a pool from the form's name, kind, upstream and limit.
pub async fn create(State(d): DashRef, headers: HeaderMap, body: Bytes) -> Answer {
    let (open, form) = d.post(&headers, &body)?;
    let body = json!({
        "name": form.text("name"),
        "kind": form.text("kind"),
        "upstream": form.text("upstream"),
        "concurrency": { "limit": number(form.text("limit")) },
    });
    let created = match parse_json::<PoolSpec>(&Bytes::from(body.to_string())) {
        Ok(spec) => d.pools.create_pool(spec).await,
        Err(e) => Err(e),
    };
    Ok(match created {
        Ok(pool) => Redirect::to(&format!(
            "/dashboard/pools/{}",
            pages::url_segment(&pool.name)
        ))
        .into_response(),
        Err(e) => {
            let typed = NewPoolForm {
                name: form.text("name").to_string(),
                kind: form.text("kind").to_string(),
                upstream: form.text("upstream").to_string(),
                limit: form.text("limit").to_string(),
                problems: Problems::from_error(&e, &CREATE_FIELDS),
            };
            html(
                e.status,
                pages::overview(&rows(&d).await, &open.csrf, &typed),
            )
        }
    })
}

#[derive(Deserialize, Default)]
pub struct Saved {
    saved: Option<String>,
}

/// `GET /dashboard/pools/{pool}/concurrency`: the settings form and the live state.
pub async fn page(
    State(d): DashRef,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(q): Query<Saved>,
) -> Answer {
    let (open, pool) = d.open_pool(&headers, &name)?;
    let flash = match q.saved {
        Some(_) => Flash::Done("Saved: the new settings apply now.".into()),
        None => Flash::None,
    };
    let values = current(&pool);
    let body = render(&pool, &open.csrf, &values, &Problems::default()).await;
    let page = pool_html(StatusCode::OK, &pool, "/concurrency", &open, flash, &body);
    Ok(page)
}

/// `POST /dashboard/pools/{pool}/concurrency`: applies the form through `Pools::update_pool`.
pub async fn save(
    State(d): DashRef,
    headers: HeaderMap,
    Path(name): Path<String>,
    body: Bytes,
) -> Answer {
    let (open, form, pool) = d.post_pool(&headers, &body, &name)?;
    Ok(match apply(&d, &pool, &form).await {
        Ok(()) => Redirect::to(&format!(
            "/dashboard/pools/{}/concurrency?saved=1",
            pages::url_segment(&pool.name)
        ))
        .into_response(),
        Err(e) => {
            // Only the number fields show a message of their own; the rest is the form's.
            let fields: Vec<&str> = NUMBERS.iter().map(|(f, _)| *f).collect();
            let problems = Problems::from_error(&e, &fields);
            let values = typed(&form);
            let body = render(&pool, &open.csrf, &values, &problems).await;
            pool_html(e.status, &pool, "/concurrency", &open, Flash::None, &body)
        }
    })
}

/// The pool's body as the admin API's GET shows it, its concurrency replaced by the form's,
/// parsed and applied as the admin API's PUT does.
async fn apply(d: &Dashboard, pool: &PoolRuntime, form: &Form) -> Result<(), ApiError> {
    let mut body =
        serde_json::to_value(pool.spec.masked()).map_err(|e| ApiError::internal(e.to_string()))?;
    let mut concurrency = Map::new();
    for (field, _) in NUMBERS {
        concurrency.insert(field.into(), number(form.text(field)));
    }
    for (field, _) in FLAGS {
        concurrency.insert(field.into(), Value::Bool(form.checked(field)));
    }
    concurrency.insert(PROXY_WAIT.0.into(), form.text(PROXY_WAIT.0).into());
    if let Some(obj) = body.as_object_mut() {
        obj.insert("concurrency".into(), Value::Object(concurrency));
    }
    let spec: PoolSpec = parse_json(&Bytes::from(body.to_string()))?;
    d.pools.update_pool(&pool.name, spec).await.map(|_| ())
}

/// The form's values: field name → text (checkboxes `"true"` or empty).
type Values = Vec<(&'static str, String)>;

fn current(pool: &PoolRuntime) -> Values {
    let c = serde_json::to_value(&pool.spec.concurrency).unwrap_or_default();
    let text = |field: &str| match c.get(field) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(true)) => "true".into(),
        Some(Value::Bool(false)) | None => String::new(),
        Some(v) => v.to_string(),
    };
    all_fields().map(|f| (f, text(f))).collect()
}

fn typed(form: &Form) -> Values {
    all_fields()
        .map(|f| {
            let v = if FLAGS.iter().any(|(flag, _)| *flag == f) {
                if form.checked(f) { "true" } else { "" }.to_string()
            } else {
                form.text(f).to_string()
            };
            (f, v)
        })
        .collect()
}

fn all_fields() -> impl Iterator<Item = &'static str> {
    NUMBERS
        .iter()
        .chain(FLAGS.iter())
        .map(|(f, _)| *f)
        .chain([PROXY_WAIT.0])
}

async fn render(
    pool: &Arc<PoolRuntime>,
    csrf: &str,
    values: &Values,
    problems: &Problems,
) -> String {
    let value = |f: &str| {
        values
            .iter()
            .find(|(k, _)| *k == f)
            .map_or("", |(_, v)| v.as_str())
    };
    let read_only = pool.managed_by == ManagedBy::Config;
    let disabled = if read_only { " disabled" } else { "" };
    let mut out = String::from("<h2 id=\"live-title\">Live state</h2>\n");
    out.push_str(&pages::live_table(&[row_of(pool).await], "live-title"));
    out.push_str("<h2 id=\"settings-title\">Settings</h2>\n");
    if read_only {
        out.push_str(
            "<p class=\"hint\" data-testid=\"read-only\">This pool is declared in the config \
             file, which owns its settings: they are shown read-only here. Edit the file and \
             reload to change them.</p>\n",
        );
    }
    out.push_str(&pages::form_error(problems));
    out.push_str(&format!(
        "<form method=\"post\" action=\"/dashboard/pools/{}/concurrency\" data-testid=\"concurrency-form\" aria-labelledby=\"settings-title\">\n",
        pages::url_segment(&pool.name)
    ));
    out.push_str(&pages::csrf_field(csrf));
    for (field, label) in NUMBERS {
        let extra = format!(" min=\"0\" required{disabled}");
        out.push_str(&pages::input(
            field,
            label,
            "number",
            value(field),
            problems,
            &extra,
        ));
    }
    for (field, label) in FLAGS {
        out.push_str(&pages::checkbox(
            field,
            label,
            value(field) == "true",
            disabled,
        ));
    }
    out.push_str(&pages::select(
        PROXY_WAIT.0,
        PROXY_WAIT.1,
        &PROXY_WAIT_OPTIONS,
        value(PROXY_WAIT.0),
        disabled,
    ));
    if !read_only {
        out.push_str("<button type=\"submit\">Save settings</button>\n");
    }
    out.push_str("</form>\n");
    out
}
