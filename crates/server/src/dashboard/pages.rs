//! The dashboard's HTML, rendered on the server: plain, accessible markup (a language, labels,
//! table headers with scopes) that works without the script, which only refreshes numbers.
//!
//! # Markup contract (for browser tests; keep it stable)
//!
//! Every page has one `<h1>`; every input a `<label for>` (input `id` = `f-{name}`,
//! `data-testid` = `field-{name}`); a refused field gets `<p id="f-{name}-error"
//! data-testid="error-{name}">`, a refusal not about a field `data-testid="form-error"`
//! (`role="alert"`); a done action `data-testid="notice"` (`role="status"`). Every POST carries
//! the hidden `csrf` field; buttons are `<button>`s with their action as text.
//!
//! | Route | What | Form fields / hooks |
//! |---|---|---|
//! | `GET /dashboard/login`, `POST` | log in | `token`; wrong → 401 |
//! | `POST /dashboard/logout` | log out | button `data-testid="logout"` (every signed-in page) |
//! | `GET /dashboard` | pool list, live every 2 s | rows `data-testid="pool-row"` `data-pool="{name}"`; cells `in-flight`, `limit`, `queued`, `learned-limit`, `learned-rpm`, `last-throttle`, `paused-until` |
//! | `POST /dashboard/pools` | create a pool | form `create-pool`: `name`, `kind` (`proxy`/`database`), `upstream`, `limit` → 303 to the pool |
//! | `GET /dashboard/pools/{pool}` | Overview | chart `#history-chart`, examples `<h3>` + `<pre><code>` |
//! | `GET/POST …/{pool}/concurrency` | settings, live state row (as above) | form `concurrency-form`: `limit`, `min_limit`, `queue_size`, `queue_timeout_ms`, `rpm`, `request_timeout_ms`, `lease_term_ms`, `renew_interval_ms`, `max_pause_ms`, checkboxes `adaptive`, `fair_share`, select `proxy_wait`; saved → 303 `?saved=1`; config pool → `read-only`, no submit |
//! | `GET/POST …/{pool}/keys` | keys | form `create-key`: `label` → 201 with `data-testid="new-key"` (once); rows `key-row` (`data-key-id`), `key-state`; button `revoke-key` posts `…/keys/{id}/revoke` → 303 `?revoked={id}` |
//! | `GET/POST …/{pool}/webhooks` | destinations, attempts | form `add-destination`: `url`, `deactivate_after` → 201 with `new-secret` (once); rows `destination-row` (`data-destination-id`), `destination-state` (`active`/`inactive`), `destination-secret` (masked); button `toggle-destination` ("Deactivate"/"Re-enable") posts `…/webhooks/{id}/active` (`active=true|false`) → 303 `?done=enabled|disabled`; button `rotate-secret` posts `…/webhooks/{id}/rotate` → 200 with `new-secret`; rows `attempt-row` with `attempt-status`, `attempt-latency`, button `redeliver` |
//! | `POST …/{pool}/jobs/{job}/redeliver` | redeliver | `back=webhooks` → 303 to Webhooks `?done=redelivered`, else to the job `?redelivered=1` |
//! | `GET …/{pool}/jobs?status=&cursor=` | jobs | filter `job-filter` (select `status`); rows `job-row` (`data-job-id`), `job-status`; `next-page` |
//! | `GET …/{pool}/jobs/{job}` | one job | `job-id`, `job-status`, `job-error`, section `job-result` with `job-result-status`, `job-result-body`; rows `job-event`, `delivery-row`; button `redeliver` once terminal |
//! | `GET …/{pool}/access-log?outcome=&key_id=&since=&until=&cursor=` | access log | filter `log-filter`; rows `log-row`, `log-outcome`; `next-page` |
//!
//! A missing session redirects (303) to `/dashboard/login`; a POST without the session's CSRF
//! token answers 403; an unknown pool 404.

use std::fmt::Write;

use super::examples::Example;
use super::form::Problems;
use super::PoolRow;

/// Escapes text for HTML element content and quoted attribute values.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

pub fn page(title: &str, body: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{} · nthbouncer</title>\n\
         <link rel=\"stylesheet\" href=\"/dashboard/assets/dashboard.css\">\n\
         <script src=\"/dashboard/assets/dashboard.js\" defer></script>\n</head>\n\
         <body>\n{body}\n</body>\n</html>\n",
        esc(title)
    )
}

/// The login form, with `error` above it after a wrong token.
pub fn login(error: Option<&str>) -> String {
    let error = error
        .map(|e| format!("<p class=\"error\" role=\"alert\">{}</p>\n", esc(e)))
        .unwrap_or_default();
    page(
        "Log in",
        &format!(
            "<main class=\"narrow\">\n<h1>nthbouncer dashboard</h1>\n{error}\
             <form method=\"post\" action=\"/dashboard/login\">\n\
             <label for=\"token\">Admin token</label>\n\
             <input id=\"token\" name=\"token\" type=\"password\" autocomplete=\"current-password\" required autofocus>\n\
             <button type=\"submit\">Log in</button>\n</form>\n</main>"
        ),
    )
}

/// The answer to a dashboard POST without its session's CSRF token.
pub fn forbidden() -> String {
    page(
        "Forbidden",
        "<main class=\"narrow\">\n<h1>Forbidden</h1>\n\
         <p role=\"alert\">This form was missing its session's CSRF token, or had a wrong one. \
         Reload the dashboard and try again.</p>\n<p><a href=\"/dashboard\">Back to the dashboard</a></p>\n</main>",
    )
}

/// The header every signed-in page shares: the product's name and the logout form.
fn signed_in_header(csrf: &str) -> String {
    format!(
        "<header>\n<a class=\"brand\" href=\"/dashboard\">nthbouncer</a>\n\
         <form method=\"post\" action=\"/dashboard/logout\">\n{}\
         <button type=\"submit\" data-testid=\"logout\">Log out</button>\n</form>\n</header>\n",
        csrf_field(csrf)
    )
}

/// The hidden field every dashboard POST carries.
pub fn csrf_field(csrf: &str) -> String {
    format!(
        "<input type=\"hidden\" name=\"csrf\" value=\"{}\">\n",
        esc(csrf)
    )
}

/// A pool's pages: path segment (after `/dashboard/pools/{pool}`) and name.
const TABS: [(&str, &str); 6] = [
    ("", "Overview"),
    ("/concurrency", "Concurrency"),
    ("/keys", "Keys"),
    ("/webhooks", "Webhooks"),
    ("/jobs", "Jobs"),
    ("/access-log", "Access log"),
];

/// A page of pool `pool`: the header, a breadcrumb, the `<h1>`, the pool's tabs (the current
/// one marked), a notice (`role="status"`) or an error (`role="alert"`), then `body`.
pub fn pool_page(pool: &str, tab: &str, csrf: &str, flash: &Flash, body: &str) -> String {
    let name = esc(pool);
    let label = TABS
        .iter()
        .find(|(path, _)| *path == tab)
        .map_or("Overview", |(_, l)| l);
    let mut out = signed_in_header(csrf);
    let _ = write!(
        out,
        "<main>\n<nav aria-label=\"Breadcrumb\"><a href=\"/dashboard\">Pools</a> › {name}</nav>\n\
         <h1>{name} · {label}</h1>\n<nav aria-label=\"Pool pages\" class=\"tabs\"><ul>"
    );
    for (path, l) in TABS {
        let current = if path == tab {
            " aria-current=\"page\""
        } else {
            ""
        };
        let _ = write!(
            out,
            "<li><a href=\"/dashboard/pools/{}{path}\"{current}>{l}</a></li>",
            url_segment(pool)
        );
    }
    out.push_str("</ul></nav>\n");
    out.push_str(&flash.html());
    out.push_str(body);
    out.push_str("\n</main>");
    page(&format!("{pool} · {label}"), &out)
}

/// A one-line message above a page's content.
#[derive(Default)]
pub enum Flash {
    #[default]
    None,
    /// Something done: `role="status"`.
    Done(String),
    /// Something refused: `role="alert"`.
    Failed(String),
}

impl Flash {
    fn html(&self) -> String {
        match self {
            Flash::None => String::new(),
            Flash::Done(m) => format!(
                "<p class=\"notice\" role=\"status\" data-testid=\"notice\">{}</p>\n",
                esc(m)
            ),
            Flash::Failed(m) => format!(
                "<p class=\"error\" role=\"alert\" data-testid=\"error\">{}</p>\n",
                esc(m)
            ),
        }
    }
}

/// `text` as one path segment (pool names, ids): percent-encoded past the unreserved set.
pub fn url_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// One labelled input: `<label for>`, the input (`id` `f-{name}`, `data-testid`
/// `field-{name}`) and, when `problems` has one for it, the message tied to it by
/// `aria-describedby`.
pub fn input(
    name: &str,
    label: &str,
    kind: &str,
    value: &str,
    problems: &Problems,
    extra: &str,
) -> String {
    let (described, invalid, message) = match problems.of(name) {
        Some(m) => (
            format!(" aria-describedby=\"f-{name}-error\""),
            " aria-invalid=\"true\"",
            format!(
                "<p class=\"error\" id=\"f-{name}-error\" data-testid=\"error-{name}\">{}</p>\n",
                esc(m)
            ),
        ),
        None => (String::new(), "", String::new()),
    };
    format!(
        "<div class=\"field\">\n<label for=\"f-{name}\">{}</label>\n\
         <input id=\"f-{name}\" name=\"{name}\" type=\"{kind}\" value=\"{}\" \
         data-testid=\"field-{name}\"{described}{invalid}{extra}>\n{message}</div>\n",
        esc(label),
        esc(value)
    )
}

/// A labelled checkbox (`value="true"`, sent only when ticked).
pub fn checkbox(name: &str, label: &str, checked: bool, extra: &str) -> String {
    let checked = if checked { " checked" } else { "" };
    format!(
        "<div class=\"field check\">\n<input id=\"f-{name}\" name=\"{name}\" type=\"checkbox\" \
         value=\"true\" data-testid=\"field-{name}\"{checked}{extra}>\n\
         <label for=\"f-{name}\">{}</label>\n</div>\n",
        esc(label)
    )
}

/// A labelled `<select>` of `options` (value, text), `selected` chosen.
pub fn select(
    name: &str,
    label: &str,
    options: &[(&str, &str)],
    selected: &str,
    extra: &str,
) -> String {
    let mut out = format!(
        "<div class=\"field\">\n<label for=\"f-{name}\">{}</label>\n\
         <select id=\"f-{name}\" name=\"{name}\" data-testid=\"field-{name}\"{extra}>",
        esc(label)
    );
    for (value, text) in options {
        let mark = if *value == selected { " selected" } else { "" };
        let _ = write!(
            out,
            "<option value=\"{}\"{mark}>{}</option>",
            esc(value),
            esc(text)
        );
    }
    out.push_str("</select>\n</div>\n");
    out
}

/// The form's own error (one not about a field), if any.
pub fn form_error(problems: &Problems) -> String {
    problems
        .general
        .as_deref()
        .map(|m| {
            format!(
                "<p class=\"error\" role=\"alert\" data-testid=\"form-error\">{}</p>\n",
                esc(m)
            )
        })
        .unwrap_or_default()
}

/// A page for an answer that is not a form's: `title` and `message`, a way back.
pub fn failure(title: &str, message: &str) -> String {
    page(
        title,
        &format!(
            "<main class=\"narrow\">\n<h1>{}</h1>\n<p role=\"alert\">{}</p>\n\
             <p><a href=\"/dashboard\">Back to the dashboard</a></p>\n</main>",
            esc(title),
            esc(message)
        ),
    )
}

/// A pool's Overview: its chart and its copy-paste Examples.
pub fn pool(
    name: &str,
    chart: &str,
    note: Option<&str>,
    examples: &[Example],
    csrf: &str,
) -> String {
    let mut body = format!(
        "<section data-history=\"{}\">\n<h2>Activity</h2>\n{chart}\n</section>\n<h2>Examples</h2>\n\
         <p class=\"hint\">Replace <code>YOUR_POOL_KEY</code> with one of the pool's keys \
         (keys are stored hashed, so none can be shown here).</p>\n",
        esc(name)
    );
    if let Some(note) = note {
        let _ = writeln!(body, "<p class=\"hint\">{}</p>", esc(note));
    }
    // `tabindex`: a long example scrolls sideways on a narrow screen, and the keyboard must
    // reach it to scroll it (axe's scrollable-region-focusable).
    for e in examples {
        let _ = writeln!(
            body,
            "<section>\n<h3>{}</h3>\n<pre tabindex=\"0\"><code>{}</code></pre>\n</section>",
            esc(e.title),
            esc(&e.shell)
        );
    }
    pool_page(name, "", csrf, &Flash::None, &body)
}

/// The answer for a pool that does not exist (any more).
pub fn no_such_pool() -> String {
    page(
        "No such pool",
        "<main class=\"narrow\">\n<h1>No such pool</h1>\n\
         <p>There is no pool of that name (it may have been deleted).</p>\n\
         <p><a href=\"/dashboard\">Back to the pools</a></p>\n</main>",
    )
}

pub fn number(n: Option<u32>) -> String {
    n.map_or_else(|| "—".into(), |n| n.to_string())
}

/// An epoch-ms time: the script shows it in the reader's zone; without it, the raw value.
pub fn time(ms: Option<u64>) -> String {
    ms.map_or_else(
        || "—".into(),
        |ms| format!("<time data-ms=\"{ms}\">{ms}</time>"),
    )
}

fn row(p: &PoolRow) -> String {
    let name = esc(&p.name);
    let throttle = match (&p.last_throttle_at, &p.last_throttle_cause) {
        (Some(at), cause) => format!(
            "{} <span class=\"cause\">{}</span>",
            time(Some(*at)),
            esc(cause.as_deref().unwrap_or_default())
        ),
        _ => "—".into(),
    };
    format!(
        "<tr data-pool=\"{name}\" data-testid=\"pool-row\">\n<th scope=\"row\"><a href=\"/dashboard/pools/{}\">{name}</a></th>\n<td>{}</td>\n\
         <td data-field=\"load\"><span data-field=\"inFlight\" data-testid=\"in-flight\">{}</span> / \
         <span data-field=\"effectiveLimit\" data-testid=\"limit\">{}</span></td>\n\
         <td data-field=\"queued\" data-testid=\"queued\">{}</td>\n\
         <td data-field=\"learnedLimit\" data-testid=\"learned-limit\">{}</td>\n\
         <td data-field=\"learnedRpm\" data-testid=\"learned-rpm\">{}</td>\n\
         <td data-field=\"lastThrottle\" data-testid=\"last-throttle\">{throttle}</td>\n\
         <td data-field=\"pausedUntil\" data-testid=\"paused-until\">{}</td>\n</tr>\n",
        url_segment(&p.name),
        p.kind,
        p.in_flight,
        p.effective_limit,
        p.queued,
        number(p.learned_limit),
        number(p.learned_rpm),
        time(p.paused_until.or(p.paced_until)),
    )
}

/// The live-state table of `rows` (the script refreshes it every 2 s), labelled by `title_id`.
pub fn live_table(rows: &[PoolRow], title_id: &str) -> String {
    let mut out = format!(
        "<div class=\"scroll\">\n<table aria-labelledby=\"{title_id}\">\n<thead>\n<tr>\
         <th scope=\"col\">Pool</th><th scope=\"col\">Kind</th>\
         <th scope=\"col\">In flight / limit</th><th scope=\"col\">Queued</th>\
         <th scope=\"col\">Learned limit</th><th scope=\"col\">Learned RPM</th>\
         <th scope=\"col\">Last throttle</th><th scope=\"col\">Paused until</th></tr>\n\
         </thead>\n<tbody>\n"
    );
    for r in rows {
        out.push_str(&row(r));
    }
    out.push_str("</tbody>\n</table>\n</div>\n");
    out
}

/// What the "Create a pool" form shows: the values typed and what was wrong with them.
#[derive(Default)]
pub struct NewPoolForm {
    pub name: String,
    pub kind: String,
    pub upstream: String,
    pub limit: String,
    pub problems: Problems,
}

/// The pool list with live state, the "Create a pool" form and the logout form.
pub fn overview(rows: &[PoolRow], csrf: &str, form: &NewPoolForm) -> String {
    let mut body = signed_in_header(csrf);
    body.push_str(
        "<main>\n<h1 id=\"pools-title\">Pools</h1>\n\
         <p class=\"hint\" id=\"refreshed\" aria-live=\"polite\">Live: refreshed every 2 seconds.</p>\n",
    );
    if rows.is_empty() {
        body.push_str("<p>No pools yet.</p>\n");
    } else {
        body.push_str(&live_table(rows, "pools-title"));
    }
    let p = &form.problems;
    let limit = if form.limit.is_empty() {
        "10"
    } else {
        &form.limit
    };
    let _ = write!(
        body,
        "<section aria-labelledby=\"create-title\">\n<h2 id=\"create-title\">Create a pool</h2>\n{}\
         <form method=\"post\" action=\"/dashboard/pools\" data-testid=\"create-pool\">\n{}{}{}{}{}\
         <button type=\"submit\">Create pool</button>\n</form>\n</section>\n",
        form_error(p),
        csrf_field(csrf),
        input("name", "Name", "text", &form.name, p, " required"),
        select(
            "kind",
            "Kind",
            &[("proxy", "Proxy (HTTP origin)"), ("database", "Database (PostgreSQL)")],
            &form.kind,
            ""
        ),
        input("upstream", "Upstream URL", "text", &form.upstream, p, " required"),
        input("limit", "Concurrency limit", "number", limit, p, " min=\"1\""),
    );
    body.push_str("</main>");
    page("Pools", &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
        assert!(login(Some("<script>")).contains("&lt;script&gt;"));
    }
}
