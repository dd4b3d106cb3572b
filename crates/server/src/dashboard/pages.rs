//! The dashboard's HTML, rendered on the server: plain, accessible markup (a language, labels,
//! table headers with scopes) that works without the script, which only refreshes numbers.

use std::fmt::Write;

use super::examples::Example;
use super::PoolRow;

/// Escapes text for HTML element content and quoted attribute values.
fn esc(text: &str) -> String {
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

fn page(title: &str, body: &str) -> String {
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

/// The header every signed-in page shares: the title and the logout form.
fn signed_in_header(csrf: &str) -> String {
    format!(
        "<header>\n<h1><a href=\"/dashboard\">nthbouncer</a></h1>\n\
         <form method=\"post\" action=\"/dashboard/logout\">\n\
         <input type=\"hidden\" name=\"csrf\" value=\"{}\">\n\
         <button type=\"submit\">Log out</button>\n</form>\n</header>\n",
        esc(csrf)
    )
}

/// A pool's Overview: its copy-paste Examples.
pub fn pool(
    name: &str,
    chart: &str,
    note: Option<&str>,
    examples: &[Example],
    csrf: &str,
) -> String {
    let mut body = signed_in_header(csrf);
    let _ = write!(
        body,
        "<main>\n<nav aria-label=\"Breadcrumb\"><a href=\"/dashboard\">Pools</a> › {}</nav>\n\
         <h2>Overview</h2>\n<section data-history=\"{}\">\n<h3>Activity</h3>\n{chart}\n</section>\n<h3>Examples</h3>\n\
         <p class=\"hint\">Replace <code>YOUR_POOL_KEY</code> with one of the pool's keys \
         (keys are stored hashed, so none can be shown here).</p>\n",
        esc(name),
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
            "<section>\n<h4>{}</h4>\n<pre tabindex=\"0\"><code>{}</code></pre>\n</section>",
            esc(e.title),
            esc(&e.shell)
        );
    }
    body.push_str("</main>");
    page(&format!("{name} · Overview"), &body)
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

fn number(n: Option<u32>) -> String {
    n.map_or_else(|| "—".into(), |n| n.to_string())
}

/// An epoch-ms time: the script shows it in the reader's zone; without it, the raw value.
fn time(ms: Option<u64>) -> String {
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
        "<tr data-pool=\"{name}\">\n<th scope=\"row\"><a href=\"/dashboard/pools/{name}\">{name}</a></th>\n<td>{}</td>\n\
         <td data-field=\"load\">{} / {}</td>\n<td data-field=\"queued\">{}</td>\n\
         <td data-field=\"learnedLimit\">{}</td>\n<td data-field=\"learnedRpm\">{}</td>\n\
         <td data-field=\"lastThrottle\">{throttle}</td>\n<td data-field=\"pausedUntil\">{}</td>\n</tr>\n",
        p.kind,
        p.in_flight,
        p.effective_limit,
        p.queued,
        number(p.learned_limit),
        number(p.learned_rpm),
        time(p.paused_until.or(p.paced_until)),
    )
}

/// The pool list with live state, and the logout form (with the session's CSRF token).
pub fn overview(rows: &[PoolRow], csrf: &str) -> String {
    let mut body = signed_in_header(csrf);
    body.push_str(
        "<main>\n<h2 id=\"pools-title\">Pools</h2>\n\
         <p class=\"hint\" id=\"refreshed\" aria-live=\"polite\">Live: refreshed every 2 seconds.</p>\n",
    );
    if rows.is_empty() {
        body.push_str("<p>No pools yet.</p>\n");
    } else {
        body.push_str(
            "<div class=\"scroll\">\n<table aria-labelledby=\"pools-title\">\n<thead>\n<tr>\
             <th scope=\"col\">Pool</th><th scope=\"col\">Kind</th>\
             <th scope=\"col\">In flight / limit</th><th scope=\"col\">Queued</th>\
             <th scope=\"col\">Learned limit</th><th scope=\"col\">Learned RPM</th>\
             <th scope=\"col\">Last throttle</th><th scope=\"col\">Paused until</th></tr>\n\
             </thead>\n<tbody>\n",
        );
        for r in rows {
            body.push_str(&row(r));
        }
        body.push_str("</tbody>\n</table>\n</div>\n");
    }
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
