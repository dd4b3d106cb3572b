//! The sandbox's HTTP surface: the router, the middleware that enforces the
//! hidden limits and latency on governed endpoints, and the endpoint handlers.
//!
//! Governed endpoints (`/v1/chat/completions`, `/echo`, `/stream`,
//! `/status/{code}`) are counted, limited and delayed; `/healthz` and unknown
//! paths are not, so health probes never eat into the limits.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{OriginalUri, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Extension, Json, Router};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::{error_response, INVALID_REQUEST, NOT_FOUND, RATE_LIMIT};
use crate::headers::{
    apply_rate, apply_retry_after, apply_token_rate, go_duration, RETRY_AFTER_MS,
};
use crate::sse::{sse_response, GuardSlot};
use crate::state::{Refusal, RefusalKind, Sandbox};
use crate::tokens::TokenView;

/// `/stream` defaults and bounds; the bounds keep one request from tying up
/// the sandbox indefinitely.
const DEFAULT_CHUNKS: u64 = 5;
const DEFAULT_INTERVAL_MS: u64 = 100;
const MAX_CHUNKS: u64 = 10_000;
const MAX_INTERVAL_MS: u64 = 60_000;

/// How much of the prompt the chat answer echoes back.
const ECHO_SNIPPET_CHARS: usize = 80;

impl Sandbox {
    /// The sandbox as an axum router, ready to serve or embed in-process.
    pub fn router(self: &Arc<Self>) -> Router {
        let governed = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/messages", post(crate::messages::messages))
            .route("/echo", any(echo))
            .route("/echo/{*rest}", any(echo))
            .route("/stream", get(stream))
            .route("/status/{code}", any(status))
            // Set before the layer so 405s on governed paths are JSON too.
            .method_not_allowed_fallback(method_not_allowed)
            .route_layer(middleware::from_fn_with_state(Arc::clone(self), govern));
        Router::new()
            .route("/healthz", get(healthz))
            .method_not_allowed_fallback(method_not_allowed)
            .merge(governed)
            .fallback(not_found)
            .with_state(Arc::clone(self))
    }
}

/// Admits or refuses a governed request, holds it for the configured latency,
/// and stamps the answer with rate headers and the stats counters.
async fn govern(State(sandbox): State<Arc<Sandbox>>, mut req: Request, next: Next) -> Response {
    let admission = match sandbox.admit() {
        Ok(admission) => admission,
        Err(refusal) => {
            tracing::debug!(
                kind = ?refusal.kind,
                retry_after = ?refusal.retry_after,
                "sandbox refused request"
            );
            sandbox.record_status(StatusCode::TOO_MANY_REQUESTS.as_u16());
            return refusal_response(&sandbox, &refusal);
        }
    };
    let slot = GuardSlot::new(admission.guard);
    req.extensions_mut().insert(slot.clone());

    let latency = sandbox.latency();
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let mut resp = next.run(req).await;

    // Unless a stream took the slot along with its body, release it now,
    // before the answer is written: a client that has its answer then sees
    // the slot free. If the client hangs up first, this future is dropped and
    // the slot goes with it.
    drop(slot.take());
    if let Some(rate) = admission.rate {
        apply_rate(resp.headers_mut(), &rate);
    }
    sandbox.record_status(resp.status().as_u16());
    resp
}

fn refusal_response(sandbox: &Sandbox, refusal: &Refusal) -> Response {
    let message = match refusal.kind {
        // Deliberately vague: the concurrency limit is hidden.
        RefusalKind::Concurrency => format!(
            "Too many concurrent requests. Please try again in {}.",
            go_duration(refusal.retry_after)
        ),
        RefusalKind::Rpm { used } if sandbox.config().announce => format!(
            "Rate limit reached for requests per minute: Limit {}, Used {used}, \
             Requested 1. Please try again in {}.",
            sandbox.config().rpm,
            go_duration(refusal.retry_after)
        ),
        RefusalKind::Rpm { .. } => format!(
            "Rate limit reached for requests per minute. Please try again in {}.",
            go_duration(refusal.retry_after)
        ),
    };
    let mut resp = error_response(StatusCode::TOO_MANY_REQUESTS, RATE_LIMIT, message);
    apply_retry_after(resp.headers_mut(), refusal.retry_after);
    if let Some(rate) = refusal.rate {
        apply_rate(resp.headers_mut(), &rate);
    }
    resp
}

async fn healthz() -> &'static str {
    "ok"
}

async fn not_found(method: Method, OriginalUri(uri): OriginalUri) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        NOT_FOUND,
        format!("no route for {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, OriginalUri(uri): OriginalUri) -> Response {
    error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        INVALID_REQUEST,
        format!("method {method} is not allowed on {}", uri.path()),
    )
}

fn bad_query(rejection: &QueryRejection, expected: &str) -> Response {
    error_response(
        StatusCode::BAD_REQUEST,
        INVALID_REQUEST,
        format!("bad query string ({expected}): {}", rejection.body_text()),
    )
}

fn body_error(rejection: &BytesRejection) -> Response {
    error_response(rejection.status(), INVALID_REQUEST, rejection.body_text())
}

/// `POST /v1/chat/completions`: an OpenAI-shaped answer that echoes the model
/// and a snippet of the last message; `"stream": true` gets SSE chunks, and with
/// `"stream_options": {"include_usage": true}` a last chunk carrying the usage.
async fn chat_completions(
    State(sandbox): State<Arc<Sandbox>>,
    slot: Option<Extension<GuardSlot>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => return body_error(&rejection),
    };
    let request: Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(err) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                INVALID_REQUEST,
                format!("request body is not valid JSON: {err}"),
            )
        }
    };
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("sandbox-model")
        .to_owned();
    let charged = match charge_tokens(&sandbox, &request) {
        Ok(charged) => charged,
        Err(refused) => return refused,
    };
    let prompt = last_message_text(&request);
    let reply = format!("Sandbox reply to: {}", snippet(&prompt, ECHO_SNIPPET_CHARS));
    let id = format!("chatcmpl-sandbox-{}", sandbox.next_id());
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());

    let completion_tokens = rough_tokens(&reply);
    let prompt_tokens = match &charged {
        // Under a token limit, usage is what the limit counted.
        Some((prompt_words, _, _)) => *prompt_words,
        None => rough_tokens(&prompt),
    };
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });

    if request.get("stream").and_then(Value::as_bool) == Some(true) {
        let mut events = chat_chunks(&id, created, &model, &reply);
        // OpenAI's `stream_options.include_usage`: one last chunk, without choices, carries
        // the usage.
        let include_usage = request
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            == Some(true);
        if include_usage {
            events.push(
                json!({
                    "id": id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                })
                .to_string(),
            );
        }
        let guard = slot.and_then(|Extension(slot)| slot.take());
        let mut resp = sse_response(events, Duration::ZERO, guard);
        if let (Some((_, cap, view)), Some(bucket)) = (charged, &sandbox.tokens) {
            bucket.give_back(cap.saturating_sub(completion_tokens));
            apply_token_rate(resp.headers_mut(), &view);
        }
        return resp;
    }

    let mut resp = Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": reply },
            "finish_reason": "stop",
        }],
        "usage": usage,
    }))
    .into_response();
    if let (Some((_, cap, view)), Some(bucket)) = (charged, &sandbox.tokens) {
        bucket.give_back(cap.saturating_sub(completion_tokens));
        apply_token_rate(resp.headers_mut(), &view);
    }
    resp
}

/// Charges a chat completion against the hidden token limit, if one is set: `Ok(None)`
/// without one, `Ok(Some((prompt words, max_tokens, headers)))` when charged, else the 429.
#[allow(clippy::result_large_err)]
fn charge_tokens(
    sandbox: &Sandbox,
    request: &Value,
) -> Result<Option<(u64, u64, TokenView)>, Response> {
    let Some(bucket) = &sandbox.tokens else {
        return Ok(None);
    };
    let words = crate::tokens::prompt_words(request);
    let cap = crate::tokens::max_tokens(request);
    match bucket.charge(words.saturating_add(cap)) {
        Ok(view) => Ok(Some((words, cap, view))),
        Err((wait, view)) => {
            let message = format!(
                "Rate limit reached for tokens per minute: Limit {}, Remaining {}, Requested {}. \
                 Please try again in {}.",
                view.limit,
                view.remaining,
                words.saturating_add(cap),
                go_duration(wait)
            );
            let mut resp = error_response(StatusCode::TOO_MANY_REQUESTS, RATE_LIMIT, message);
            apply_retry_after(resp.headers_mut(), wait);
            apply_token_rate(resp.headers_mut(), &view);
            Err(resp)
        }
    }
}

/// The text of the last message, whether `content` is a string or an array
/// of `{"type":"text","text":...}` parts. Empty if there is none.
fn last_message_text(request: &Value) -> String {
    let Some(content) = request
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|messages| messages.last())
        .and_then(|message| message.get("content"))
    else {
        return String::new();
    };
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// At most `max` characters of `text`, with an ellipsis if cut.
fn snippet(text: &str, max: usize) -> String {
    let mut chars = text.chars();
    let head: String = chars.by_ref().take(max).collect();
    if chars.next().is_some() {
        format!("{head}...")
    } else {
        head
    }
}

/// The usual "about four characters a token" estimate; good enough for a
/// believable `usage` block.
fn rough_tokens(text: &str) -> u64 {
    u64::try_from(text.chars().count().div_ceil(4)).unwrap_or(u64::MAX)
}

/// OpenAI-style `chat.completion.chunk` events: role, one per word, stop.
fn chat_chunks(id: &str, created: u64, model: &str, reply: &str) -> Vec<String> {
    let chunk = |delta: Value, finish: Value| {
        json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
        })
        .to_string()
    };
    let mut events = vec![chunk(
        json!({ "role": "assistant", "content": "" }),
        Value::Null,
    )];
    let words: Vec<&str> = reply.split(' ').collect();
    let last = words.len().saturating_sub(1);
    for (i, word) in words.iter().enumerate() {
        let text = if i == last {
            (*word).to_owned()
        } else {
            format!("{word} ")
        };
        events.push(chunk(json!({ "content": text }), Value::Null));
    }
    events.push(chunk(json!({}), json!("stop")));
    events
}

/// `/echo` and `/echo/*rest`, any method: reflects exactly what arrived, so
/// tests can check what a gateway forwarded.
async fn echo(
    method: Method,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => return body_error(&rejection),
    };
    let mut header_map = Map::new();
    for name in headers.keys() {
        // Every value, in arrival order: repeated headers are part of what
        // the gateway forwarded.
        let values = headers
            .get_all(name)
            .iter()
            .map(|v| Value::String(String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .collect();
        header_map.insert(name.as_str().to_owned(), Value::Array(values));
    }
    Json(json!({
        "method": method.as_str(),
        "path": uri.path(),
        "query": uri.query(),
        "headers": header_map,
        "body": String::from_utf8_lossy(&body),
        "body_len": body.len(),
    }))
    .into_response()
}

#[derive(Debug, Deserialize)]
struct StreamParams {
    chunks: Option<u64>,
    interval_ms: Option<u64>,
}

/// `GET /stream?chunks=N&interval_ms=M`: N SSE events M ms apart, then
/// `[DONE]`. The request stays in flight until the stream ends or is dropped.
async fn stream(
    slot: Option<Extension<GuardSlot>>,
    params: Result<Query<StreamParams>, QueryRejection>,
) -> Response {
    let params = match params {
        Ok(Query(params)) => params,
        Err(rejection) => {
            return bad_query(
                &rejection,
                "chunks and interval_ms must be non-negative integers",
            )
        }
    };
    let chunks = params.chunks.unwrap_or(DEFAULT_CHUNKS);
    let interval_ms = params.interval_ms.unwrap_or(DEFAULT_INTERVAL_MS);
    if chunks > MAX_CHUNKS || interval_ms > MAX_INTERVAL_MS {
        return error_response(
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST,
            format!(
                "chunks must be at most {MAX_CHUNKS} and interval_ms at most {MAX_INTERVAL_MS}"
            ),
        );
    }
    let events = (0..chunks)
        .map(|index| {
            json!({ "index": index, "chunks": chunks, "text": format!("chunk {index}") })
                .to_string()
        })
        .collect();
    let guard = slot.and_then(|Extension(slot)| slot.take());
    sse_response(events, Duration::from_millis(interval_ms), guard)
}

#[derive(Debug, Deserialize)]
struct StatusParams {
    retry_after: Option<u64>,
    retry_after_ms: Option<u64>,
}

/// `/status/{code}`: answers with the requested status (200..=599), plus
/// `Retry-After` / `retry-after-ms` when `?retry_after=S` / `?retry_after_ms=M`.
async fn status(
    code: Result<Path<String>, PathRejection>,
    params: Result<Query<StatusParams>, QueryRejection>,
) -> Response {
    let code = code
        .ok()
        .and_then(|Path(code)| code.parse::<u16>().ok())
        .filter(|code| (200..=599).contains(code))
        .and_then(|code| StatusCode::from_u16(code).ok());
    let Some(code) = code else {
        return error_response(
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST,
            "status code must be an integer from 200 to 599",
        );
    };
    let params = match params {
        Ok(Query(params)) => params,
        Err(rejection) => {
            return bad_query(
                &rejection,
                "retry_after and retry_after_ms must be non-negative integers",
            )
        }
    };

    let mut resp = if code == StatusCode::NO_CONTENT || code == StatusCode::NOT_MODIFIED {
        // These statuses must not carry a body.
        (code, Body::empty()).into_response()
    } else if code.is_client_error() || code.is_server_error() {
        let kind = match code.as_u16() {
            429 => RATE_LIMIT,
            500..=599 => "api_error",
            _ => INVALID_REQUEST,
        };
        error_response(
            code,
            kind,
            format!("sandbox answered {} as requested", code.as_u16()),
        )
    } else {
        (code, Json(json!({ "status": code.as_u16() }))).into_response()
    };
    if let Some(secs) = params.retry_after {
        resp.headers_mut()
            .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(secs));
    }
    if let Some(ms) = params.retry_after_ms {
        resp.headers_mut()
            .insert(RETRY_AFTER_MS, HeaderValue::from(ms));
    }
    resp
}
