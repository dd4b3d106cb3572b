//! The OpenAPI document of the API host (`/openapi.json`, SPEC §10). Each feature annotates its
//! own operations (`#[utoipa::path]`: parameters, bodies, the answers only it gives); this
//! module completes them with what holds for whole groups of routes, so no annotation can forget
//! it:
//! - every refusal's body is the one error shape, its `error` narrowed to the codes of that
//!   status (`ErrorCode::status`);
//! - the answers of the layers in front of the handlers: admin authentication (`401`), the pools
//!   guard (`401`, `403`, `404`, `413`, `429`), the body limit (`413`), the path extractor
//!   (`400`), the store (`503 store_unavailable`);
//! - the links from what one answer returns to the operations that take it (a created pool's
//!   name, a key's or a destination's id, a job id, a lock's slot id), which generated clients
//!   and a fuzzer's stateful phase follow.
//!
//! It owns the document only; the router (`app::router`) owns what is served, and a test there
//! holds the two to each other.

use std::sync::LazyLock;

use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use utoipa::OpenApi;

use crate::admin;
use crate::app::router;
use crate::core::error::ErrorCode;
use crate::jobs::routes as jobs_api;
use crate::webhooks::routes as webhooks_api;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "nthbouncer",
        description = "A self-hosted concurrency governor for upstream APIs. These are the API host's routes. \
            On a proxy pool's host (`{pool}.{pool_domain}`, a custom domain, or the pool's own listener) \
            every request is proxied to the pool's upstream after pool-key authentication and admission \
            (SPEC §4). On a database pool's host, `POST /sql` runs SQL on the pool's PostgreSQL in Neon's \
            SQL-over-HTTP wire format (the `@neondatabase/serverless` driver's; `400 sql_error` with \
            PostgreSQL's fields, `507 response_too_large`), and `GET|HEAD /jobs/{jobId}` polls the handles \
            of SQL taken as async jobs (SPEC §8).\n\n\
            Every refusal is JSON `{\"error\": code, \"message\": …, \"field\"?: …, \"requestId\": …}` \
            with a code of `ErrorCode`. Besides the answers listed per operation, any route answers \
            `405 method_not_allowed` to a method it does not take, an unknown path `404 not_found`, \
            and a connection past `server.max_connections` `503 overloaded`."
    ),
    paths(
        router::healthz,
        router::readyz,
        router::metrics,
        openapi_json,
        crate::lock::acquire,
        crate::lock::renew,
        crate::lock::release,
        admin::list_pools,
        admin::create_pool,
        admin::get_pool,
        admin::put_pool,
        admin::delete_pool,
        jobs_api::poll,
        jobs_api::list_jobs,
        jobs_api::get_job,
        webhooks_api::list_destinations,
        webhooks_api::create_destination,
        webhooks_api::patch_destination,
        webhooks_api::delete_destination,
        webhooks_api::rotate_secret,
        webhooks_api::list_deliveries,
        webhooks_api::redeliver,
        admin::create_key,
        admin::list_keys,
        admin::revoke_key,
        admin::pool_state,
        crate::dashboard::history::pool_history,
        admin::access_log,
        crate::cache::routes::purge,
        crate::app::reload::reload_route,
    ),
    components(schemas(
        nthbouncer_config::PoolSpec,
        admin::PoolView,
        admin::PoolList,
        crate::app::reload::Reloaded,
        crate::pools::reload::PoolChanges,
        admin::NewKey,
        admin::CreatedKey,
        crate::lock::AcquireBody,
        crate::lock::LockGrant,
        crate::lock::Renewed,
        crate::lock::ReleaseBody,
        crate::lock::Released,
        crate::jobs::Accepted,
        crate::jobs::JobView,
        crate::core::error::ErrorBody,
        crate::core::error::ErrorCode,
        jobs_api::JobPage,
        jobs_api::JobDetail,
        webhooks_api::DestinationView,
        webhooks_api::DestinationList,
        webhooks_api::NewDestination,
        webhooks_api::DestinationPatch,
        jobs_api::DeliveryView,
        webhooks_api::RotateSecret,
        webhooks_api::RotatedSecret,
        webhooks_api::AttemptView,
        webhooks_api::AttemptPage,
        webhooks_api::Redelivery,
        admin::KeyView,
        admin::KeyList,
        admin::Revoked,
        admin::PoolState,
        admin::TokenState,
        crate::dashboard::history::PoolHistory,
        crate::dashboard::history::HistorySecond,
        admin::AccessLogPage,
        admin::CacheState,
        crate::cache::routes::Purge,
        crate::cache::routes::Purged,
        nthbouncer_config::CacheSpec,
    ))
)]
struct ApiDoc;

/// `GET /openapi.json`: built once, it never changes while the process runs.
#[utoipa::path(get, path = "/openapi.json", tag = "ops",
    responses((status = 200, description = "this document (OpenAPI 3.1)", content_type = "application/json")))]
pub async fn openapi_json() -> Response {
    static DOC: LazyLock<String> = LazyLock::new(|| document().to_string());
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        DOC.as_str(),
    )
        .into_response()
}

/// The whole document: the annotated operations, completed (see the module docs).
pub fn document() -> Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_else(|_| json!({}));
    if let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) {
        for (path, item) in paths.iter_mut() {
            let Some(item) = item.as_object_mut() else {
                continue;
            };
            for op in item.values_mut() {
                if let Some(op) = op.as_object_mut() {
                    complete_operation(path, op);
                }
            }
            document_head_of_poll(path, item);
        }
    }
    for link in LINKS.iter() {
        add_link(&mut doc, link);
    }
    if let Some(schemas) = doc
        .pointer_mut("/components/schemas")
        .and_then(Value::as_object_mut)
    {
        for status in error_statuses() {
            schemas.insert(error_schema_name(status), error_schema(status));
        }
    }
    doc
}

/// Operations that read only what the process holds in memory (the registry, a pool's keys and
/// destinations, the governor): they never wait on the store, so never answer its `503`.
const IN_MEMORY: [&str; 6] = [
    "list_pools",
    "get_pool",
    "list_keys",
    "list_destinations",
    "pool_state",
    "pool_history",
];

fn complete_operation(path: &str, op: &mut Map<String, Value>) {
    let id = op
        .get("operationId")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let has_body = op.contains_key("requestBody");
    let has_path_params = path.contains('{');
    let Some(responses) = op.get_mut("responses").and_then(Value::as_object_mut) else {
        return;
    };
    let mut add = |status: u16, description: &str| {
        responses
            .entry(status.to_string())
            .or_insert_with(|| json!({ "description": description }));
    };
    if path.starts_with("/admin/") {
        add(401, "unauthorized: missing or wrong admin token");
    }
    if path.starts_with("/pools/") {
        // The pools guard, in front of every pool route on the API host (SPEC §2, §9).
        add(401, "unauthorized: missing or invalid pool credentials");
        add(
            403,
            "unauthorized: the client address is not in the allowlist",
        );
        add(404, "pool_not_found");
        add(
            413,
            "payload_too_large (a pool that signs requests reads the body)",
        );
        add(
            429,
            "too_many_requests: throttled after repeated failed authentication (Retry-After)",
        );
    }
    if has_body {
        add(413, "payload_too_large");
    }
    if has_path_params || has_body {
        add(400, "invalid");
    }
    if (path.starts_with("/admin/") || path.starts_with("/pools/"))
        && !IN_MEMORY.contains(&id.as_str())
    {
        add(
            503,
            "store_unavailable (or, on the lock routes, coordination_unavailable): retry later",
        );
    }
    for (status, response) in responses.iter_mut() {
        let Ok(status) = status.parse::<u16>() else {
            continue;
        };
        if status < 400 {
            continue;
        }
        if let Some(response) = response.as_object_mut() {
            response.entry("content").or_insert_with(|| {
                json!({ "application/json": { "schema": {
                    "$ref": format!("#/components/schemas/{}", error_schema_name(status))
                } } })
            });
        }
    }
}

/// `HEAD /pools/{pool}/jobs/{jobId}` is served as GET without a body.
fn document_head_of_poll(path: &str, item: &mut Map<String, Value>) {
    if path != "/pools/{pool}/jobs/{jobId}" {
        return;
    }
    let Some(mut head) = item.get("get").cloned() else {
        return;
    };
    if let Some(op) = head.as_object_mut() {
        op.insert("operationId".into(), json!("poll_head"));
        op.insert(
            "summary".into(),
            json!("The job's status as headers only (the GET without a body)."),
        );
        if let Some(responses) = op.get_mut("responses").and_then(Value::as_object_mut) {
            for response in responses.values_mut() {
                if let Some(r) = response.as_object_mut() {
                    r.remove("content");
                }
            }
        }
    }
    item.insert("head".into(), head);
}

fn error_statuses() -> Vec<u16> {
    let mut statuses: Vec<u16> = ErrorCode::ALL
        .iter()
        .map(|c| c.status().as_u16())
        .chain([403])
        .collect();
    statuses.sort_unstable();
    statuses.dedup();
    statuses
}

fn error_schema_name(status: u16) -> String {
    format!("Error{status}")
}

/// The error body with `error` narrowed to the codes answered with `status` (`403` is
/// `unauthorized` answered to an address outside an IP allowlist).
fn error_schema(status: u16) -> Value {
    let codes: Vec<&str> = ErrorCode::ALL
        .iter()
        .filter(|c| {
            c.status().as_u16() == status || (status == 403 && **c == ErrorCode::Unauthorized)
        })
        .map(|c| c.as_str())
        .collect();
    json!({
        "description": format!("An error answered with status {status}."),
        "allOf": [
            { "$ref": "#/components/schemas/ErrorBody" },
            { "type": "object", "properties": { "error": { "type": "string", "enum": codes } } }
        ]
    })
}

/// A link from an answer to the next operation (OpenAPI `links`).
struct Link {
    from: &'static str,
    status: &'static str,
    to: &'static str,
    params: &'static [(&'static str, &'static str)],
    /// The answer's body sent back whole as the request body (GET → PUT of a pool).
    body: Option<&'static str>,
}

const fn link(
    from: &'static str,
    status: &'static str,
    to: &'static str,
    params: &'static [(&'static str, &'static str)],
) -> Link {
    Link {
        from,
        status,
        to,
        params,
        body: None,
    }
}

/// A pool's name as a created pool's answer gives it, and as the first of a listed page does.
const CREATED_POOL: &[(&str, &str)] = &[("pool", "$response.body#/name")];
const LISTED_POOL: &[(&str, &str)] = &[("pool", "$response.body#/items/0/name")];
/// Operations that take only the pool's name, reached from a created and a listed pool.
const POOL_OPERATIONS: [&str; 10] = [
    "get_pool",
    "delete_pool",
    "list_keys",
    "create_key",
    "pool_state",
    "pool_history",
    "access_log",
    "list_jobs",
    "list_destinations",
    "create_destination",
];
const SAME_POOL: (&str, &str) = ("pool", "$request.path.pool");

/// The links. schemathesis 3.39 follows, per target operation, one link of each source status
/// (its rules are named by target and status; a second link overwrites the first), so each
/// operation here has at most one incoming link per status: the one most worth following.
static LINKS: LazyLock<Vec<Link>> = LazyLock::new(|| {
    let mut links = Vec::new();
    for to in POOL_OPERATIONS {
        links.push(link("create_pool", "201", to, CREATED_POOL));
        // The first listed pool is mostly the config-owned one: deleting it is a `409` the
        // unit phase already sees, and would crowd out the links worth following.
        if to != "delete_pool" {
            links.push(link("list_pools", "200", to, LISTED_POOL));
        }
    }
    links.push(link("list_pools", "200", "acquire", LISTED_POOL));
    // GET → PUT: what a GET answers, sent back unchanged, is a valid PUT that changes nothing.
    links.push(Link {
        body: Some("$response.body"),
        ..link("get_pool", "200", "put_pool", CREATED_POOL)
    });
    links.push(link("create_pool", "201", "put_pool", CREATED_POOL));
    // Keys.
    const KEY: &[(&str, &str)] = &[SAME_POOL, ("id", "$response.body#/id")];
    const LISTED_KEY: &[(&str, &str)] = &[SAME_POOL, ("id", "$response.body#/items/0/id")];
    links.push(link("create_key", "201", "revoke_key", KEY));
    links.push(link("list_keys", "200", "revoke_key", LISTED_KEY));
    // Webhook destinations.
    const DEST: &[(&str, &str)] = &[SAME_POOL, ("id", "$response.body#/id")];
    const LISTED_DEST: &[(&str, &str)] = &[SAME_POOL, ("id", "$response.body#/items/0/id")];
    for to in ["patch_destination", "delete_destination", "rotate_secret"] {
        links.push(link("create_destination", "201", to, DEST));
        links.push(link("list_destinations", "200", to, LISTED_DEST));
    }
    links.push(link(
        "create_destination",
        "201",
        "list_deliveries",
        &[SAME_POOL, ("destinationId", "$response.body#/id")],
    ));
    // Jobs.
    const LISTED_JOB: &[(&str, &str)] = &[SAME_POOL, ("jobId", "$response.body#/items/0/jobId")];
    for to in ["get_job", "redeliver", "poll", "list_deliveries"] {
        links.push(link("list_jobs", "200", to, LISTED_JOB));
    }
    // Locks.
    const SLOT: &[(&str, &str)] = &[SAME_POOL, ("slotId", "$response.body#/slotId")];
    links.push(link("acquire", "200", "renew", SLOT));
    links.push(link("acquire", "200", "release", SLOT));
    links
});

fn add_link(doc: &mut Value, link: &Link) {
    let Some(response) = find_operation(doc, link.from)
        .and_then(|op| op.pointer_mut(&format!("/responses/{}", link.status)))
        .and_then(Value::as_object_mut)
    else {
        return;
    };
    let mut def = json!({
        "operationId": link.to,
        "parameters": link.params.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<Map<_, _>>(),
    });
    if let (Some(body), Some(def)) = (link.body, def.as_object_mut()) {
        def.insert("requestBody".into(), json!(body));
        // Sent as it was answered, not merged into a generated body.
        def.insert("x-schemathesis".into(), json!({ "merge_body": false }));
    }
    if let Some(links) = response
        .entry("links")
        .or_insert_with(|| json!({}))
        .as_object_mut()
    {
        links.insert(link.to.to_string(), def);
    }
}

fn find_operation<'a>(doc: &'a mut Value, id: &str) -> Option<&'a mut Value> {
    doc.get_mut("paths")?
        .as_object_mut()?
        .values_mut()
        .filter_map(Value::as_object_mut)
        .flat_map(|item| item.values_mut())
        .find(|op| op.get("operationId").and_then(Value::as_str) == Some(id))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn every_link_joins_documented_operations_and_parameters() {
        let doc = document();
        let mut ops = std::collections::BTreeMap::new();
        for item in doc["paths"].as_object().unwrap().values() {
            for op in item.as_object().unwrap().values() {
                let names: Vec<String> = op["parameters"]
                    .as_array()
                    .map(|ps| {
                        ps.iter()
                            .map(|p| p["name"].as_str().unwrap().to_string())
                            .collect()
                    })
                    .unwrap_or_default();
                ops.insert(op["operationId"].as_str().unwrap().to_string(), names);
            }
        }
        for link in LINKS.iter() {
            let from = ops
                .get(link.from)
                .unwrap_or_else(|| panic!("{}", link.from));
            let to = ops.get(link.to).unwrap_or_else(|| panic!("{}", link.to));
            for (name, expr) in link.params {
                assert!(to.contains(&name.to_string()), "{} has no {name}", link.to);
                if let Some(p) = expr.strip_prefix("$request.path.") {
                    assert!(from.contains(&p.to_string()), "{} has no {p}", link.from);
                }
            }
        }
    }

    /// schemathesis keeps one incoming link per target and source status (see `LINKS`).
    #[test]
    fn no_two_links_reach_an_operation_from_the_same_status() {
        let mut seen = std::collections::BTreeSet::new();
        for link in LINKS.iter() {
            assert!(
                seen.insert((link.to, link.status)),
                "a second {} link into {}",
                link.status,
                link.to
            );
        }
    }

    #[test]
    fn every_refusal_has_the_error_body_with_codes_of_its_status() {
        let doc = document();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                for (status, response) in op["responses"].as_object().unwrap() {
                    let status: u16 = status.parse().unwrap();
                    if status < 400 || method == "head" {
                        continue;
                    }
                    let reference = response["content"]["application/json"]["schema"]["$ref"]
                        .as_str()
                        .unwrap_or_else(|| panic!("{method} {path} {status}: no error body"));
                    let name = reference.rsplit('/').next().unwrap();
                    let codes = &doc["components"]["schemas"][name]["allOf"][1]["properties"]
                        ["error"]["enum"];
                    assert!(
                        !codes.as_array().unwrap().is_empty(),
                        "{method} {path} {status}: no code has that status"
                    );
                }
            }
        }
        let not_found = &doc["components"]["schemas"]["Error404"]["allOf"][1];
        assert!(
            not_found.to_string().contains("pool_not_found"),
            "{not_found}"
        );
    }
}
