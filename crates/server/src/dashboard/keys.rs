//! A pool's Keys page: the keys (config and API ones), a form that makes one — its plaintext
//! shown once, on the answer to that POST, never again — and a revoke button on each key added
//! through the API. Both go through `Pools::create_key` and `Pools::revoke_key`, as the admin
//! API does.

use std::fmt::Write;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect};
use bytes::Bytes;
use serde::Deserialize;

use super::form::Problems;
use super::pages::{self, esc, time, url_segment, Flash};
use super::{pool_html, Answer, DashRef};
use crate::core::extract::Path;
use crate::core::ManagedBy;
use crate::pools::actions::MadeKey;
use crate::pools::registry::PoolRuntime;

#[derive(Deserialize, Default)]
pub struct Done {
    revoked: Option<String>,
}

/// `GET /dashboard/pools/{pool}/keys`.
pub async fn page(
    State(d): DashRef,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(q): Query<Done>,
) -> Answer {
    let (open, pool) = d.open_pool(&headers, &name)?;
    let flash = match q.revoked {
        Some(id) => Flash::Done(format!("Key {id} revoked.")),
        None => Flash::None,
    };
    let body = render(&pool, &open.csrf, None, "", &Problems::default());
    let page = pool_html(StatusCode::OK, &pool, "/keys", &open, flash, &body);
    Ok(page)
}

/// `POST /dashboard/pools/{pool}/keys`: makes a key (`label` optional) and shows it once.
pub async fn create(
    State(d): DashRef,
    headers: HeaderMap,
    Path(name): Path<String>,
    body: Bytes,
) -> Answer {
    let (open, form, pool) = d.post_pool(&headers, &body, &name)?;
    let label = form.optional("label");
    Ok(match d.pools.create_key(&pool.name, label, None).await {
        Ok(made) => {
            // Read again: the index now holds the new key.
            let pool = d.pools.get(&pool.name).unwrap_or(pool);
            let body = render(&pool, &open.csrf, Some(&made), "", &Problems::default());
            pool_html(
                StatusCode::CREATED,
                &pool,
                "/keys",
                &open,
                Flash::None,
                &body,
            )
        }
        Err(e) => {
            let problems = Problems::from_error(&e, &["label"]);
            let body = render(&pool, &open.csrf, None, form.text("label"), &problems);
            pool_html(e.status, &pool, "/keys", &open, Flash::None, &body)
        }
    })
}

/// `POST /dashboard/pools/{pool}/keys/{id}/revoke`.
pub async fn revoke(
    State(d): DashRef,
    headers: HeaderMap,
    Path((name, id)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let (open, _, pool) = d.post_pool(&headers, &body, &name)?;
    Ok(match d.pools.revoke_key(&pool.name, &id).await {
        Ok(()) => Redirect::to(&format!(
            "/dashboard/pools/{}/keys?revoked={}",
            url_segment(&pool.name),
            url_segment(&id)
        ))
        .into_response(),
        Err(e) => {
            let body = render(&pool, &open.csrf, None, "", &Problems::default());
            let flash = Flash::Failed(e.message.to_string());
            pool_html(e.status, &pool, "/keys", &open, flash, &body)
        }
    })
}

fn render(
    pool: &PoolRuntime,
    csrf: &str,
    made: Option<&MadeKey>,
    label: &str,
    problems: &Problems,
) -> String {
    let mut out = String::new();
    if let Some(made) = made {
        let _ = write!(
            out,
            "<section class=\"once\" aria-labelledby=\"new-key-title\" data-testid=\"new-key-panel\">\n\
             <h2 id=\"new-key-title\">New key {}</h2>\n\
             <p role=\"status\">Copy it now: it is stored hashed and will not be shown again.</p>\n\
             <p><code data-testid=\"new-key\">{}</code></p>\n</section>\n",
            esc(&made.stored.id),
            esc(&made.key)
        );
    }
    let name = url_segment(&pool.name);
    let _ = write!(
        out,
        "<h2 id=\"create-key-title\">Create a key</h2>\n{}\
         <form method=\"post\" action=\"/dashboard/pools/{name}/keys\" data-testid=\"create-key\" aria-labelledby=\"create-key-title\">\n{}{}\
         <button type=\"submit\">Create key</button>\n</form>\n",
        pages::form_error(problems),
        pages::csrf_field(csrf),
        pages::input("label", "Label (optional)", "text", label, problems, " maxlength=\"200\""),
    );
    out.push_str(&key_table(pool, csrf));
    out
}

fn key_table(pool: &PoolRuntime, csrf: &str) -> String {
    let index = pool.access.keys().load();
    let mut keys: Vec<_> = index.by_digest.values().collect();
    keys.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    let mut out = String::from(
        "<h2 id=\"keys-title\">Keys</h2>\n<div class=\"scroll\">\n<table aria-labelledby=\"keys-title\">\n\
         <thead><tr><th scope=\"col\">Id</th><th scope=\"col\">Label</th><th scope=\"col\">Created</th>\
         <th scope=\"col\">Expires</th><th scope=\"col\">State</th><th scope=\"col\">Managed by</th>\
         <th scope=\"col\"><span class=\"sr-only\">Actions</span></th></tr></thead>\n<tbody>\n",
    );
    let name = url_segment(&pool.name);
    for k in keys {
        let state = if k.revoked_at.is_some() || k.revoked {
            "revoked"
        } else {
            "active"
        };
        let action = if k.managed_by == ManagedBy::Api && state == "active" {
            format!(
                "<form method=\"post\" action=\"/dashboard/pools/{name}/keys/{}/revoke\">{}\
                 <button type=\"submit\" data-testid=\"revoke-key\">Revoke {}</button></form>",
                url_segment(&k.id),
                pages::csrf_field(csrf),
                esc(&k.id)
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "<tr data-testid=\"key-row\" data-key-id=\"{id}\"><th scope=\"row\"><code>{id}</code></th><td>{}</td><td>{}</td>\
             <td>{}</td><td data-testid=\"key-state\">{state}</td><td>{}</td><td>{action}</td></tr>",
            esc(k.label.as_deref().unwrap_or("—")),
            time(Some(k.created_at)),
            time(k.expires_at),
            k.managed_by.as_str(),
            id = esc(&k.id),
        );
    }
    out.push_str("</tbody>\n</table>\n</div>\n");
    out
}
