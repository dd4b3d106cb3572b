//! `LockClient`: where the gateway is and who we are (base URL, pool, key, optional `Host`
//! override), and the three lock calls as HTTP requests with their answers sorted into
//! [`LockError`]s. Holding a slot (renewing, releasing on drop) is the guard's business.

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr;
use std::time::{Duration, Instant};

use http::header::{HeaderValue, HOST, RETRY_AFTER};
use http::{HeaderMap, StatusCode};
use reqwest::Url;
use serde::{Deserialize, Serialize};

use crate::error::LockError;
use crate::guard::{Grant, SlotGuard};
use crate::outcome::{now_ms, Outcome};

/// Slack added to the wait budget for the acquire call's own timeout, and the timeout of a
/// release: long enough for a loaded gateway, short enough that a dead one is noticed.
const CALL_MARGIN: Duration = Duration::from_secs(30);
/// Connect timeout of the default HTTP client.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest error body kept in [`LockError::Unexpected`].
const MAX_ERROR_BODY: usize = 1024;

/// A client of one pool's lock API. Cheap to clone; clones share the HTTP connection pool.
#[derive(Clone)]
pub struct LockClient {
    http: reqwest::Client,
    base: Url,
    pool: String,
    key: HeaderValue,
    host: Option<HeaderValue>,
}

impl fmt::Debug for LockClient {
    // By hand, so that the pool key never lands in a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockClient")
            .field("base", &self.base.as_str())
            .field("pool", &self.pool)
            .field("host", &self.host)
            .finish_non_exhaustive()
    }
}

/// Queue class of an acquire (`X-Nthpool-Priority` / the body's `priority`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Priority {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "high" => Ok(Priority::High),
            "normal" => Ok(Priority::Normal),
            "low" => Ok(Priority::Low),
            other => Err(format!(
                "unknown priority {other:?} (expected high, normal or low)"
            )),
        }
    }
}

/// How to acquire.
#[derive(Debug, Clone, Default)]
pub struct AcquireOptions {
    /// How long to wait in the queue for a slot (clamped by the gateway to the pool's queue
    /// timeout). `None` fails fast with [`LockError::NoSlot`] when no slot is free.
    pub wait: Option<Duration>,
    /// Queue class; `None` leaves the pool's default (`normal`).
    pub priority: Option<Priority>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct AcquireBody {
    #[serde(skip_serializing_if = "Option::is_none")]
    wait_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<Priority>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Renewed {
    lease_deadline: u64,
}

#[derive(Deserialize)]
struct Released {
    released: bool,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default)]
    error: String,
    #[serde(default)]
    message: String,
}

/// Why a renewal did not extend the lease.
pub(crate) enum RenewFailure {
    /// `404`: released or reclaimed; the slot is gone.
    NotFound,
    /// `409`: the lease reached `requestDeadline` and cannot be extended.
    Capped,
    /// Anything else (transport, 5xx, auth): worth another try while the lease lasts.
    Other(LockError),
}

impl LockClient {
    /// A client of pool `pool` on the gateway whose API host answers at `api_base_url`
    /// (`http://api.localhost:8080`, or `https://gateway.example/` behind a proxy; a path
    /// prefix is kept), authenticating with the pool key `key` (`X-Nthpool-Key`).
    ///
    /// Names under `localhost` resolve to 127.0.0.1 with the default HTTP client (RFC 6761),
    /// so the gateway's default `api.localhost` works without an `/etc/hosts` entry. To
    /// connect by IP instead, pass `http://127.0.0.1:8080` and name the API host with
    /// [`with_host`](Self::with_host).
    pub fn new(
        api_base_url: &str,
        pool: impl Into<String>,
        key: &str,
    ) -> Result<LockClient, LockError> {
        let base = Url::parse(api_base_url)
            .map_err(|e| LockError::Config(format!("API URL {api_base_url:?}: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.host_str().is_none() {
            return Err(LockError::Config(format!(
                "API URL {api_base_url:?}: must be an http:// or https:// URL with a host"
            )));
        }
        let pool = pool.into();
        if pool.is_empty() {
            return Err(LockError::Config("pool name is empty".into()));
        }
        let mut key = HeaderValue::from_str(key)
            .map_err(|_| LockError::Config("pool key is not a valid header value".into()))?;
        if key.is_empty() {
            return Err(LockError::Config("pool key is empty".into()));
        }
        key.set_sensitive(true);

        let mut builder = reqwest::Client::builder().connect_timeout(CONNECT_TIMEOUT);
        if let Some(host) = base.host_str() {
            if host == "localhost" || host.ends_with(".localhost") {
                // Port 0: the URL's own port is used.
                builder = builder.resolve(host, SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
            }
        }
        let http = builder
            .build()
            .map_err(|e| LockError::Config(format!("cannot build the HTTP client: {e}")))?;
        Ok(LockClient {
            http,
            base,
            pool,
            key,
            host: None,
        })
    }

    /// Sends `Host: host` on every call. The gateway routes by `Host`, so this is needed when
    /// the base URL names the gateway by IP or by a name other than its `api_host`.
    pub fn with_host(mut self, host: &str) -> Result<LockClient, LockError> {
        let value = HeaderValue::from_str(host)
            .ok()
            .filter(|v| !v.is_empty())
            .ok_or_else(|| LockError::Config(format!("host {host:?} is not a valid Host")))?;
        self.host = Some(value);
        Ok(self)
    }

    /// Uses `http` for every call (for custom TLS roots, proxies or timeouts). The default
    /// client's `localhost` resolution does not apply to it.
    #[must_use]
    pub fn with_http_client(mut self, http: reqwest::Client) -> LockClient {
        self.http = http;
        self
    }

    /// The pool this client acquires slots of.
    #[must_use]
    pub fn pool(&self) -> &str {
        &self.pool
    }

    /// Acquires a slot, waiting up to `wait` for one (`None`: fail fast).
    pub async fn acquire(&self, wait: Option<Duration>) -> Result<SlotGuard, LockError> {
        self.acquire_with(AcquireOptions {
            wait,
            priority: None,
        })
        .await
    }

    /// Acquires a slot. The returned guard renews the lease in the background until it is
    /// released or dropped.
    pub async fn acquire_with(&self, options: AcquireOptions) -> Result<SlotGuard, LockError> {
        let body = AcquireBody {
            wait_ms: options.wait.map(millis),
            priority: options.priority,
        };
        let timeout = options.wait.unwrap_or_default().saturating_add(CALL_MARGIN);
        let sent_at = Instant::now();
        let resp = self.post(&["acquire"], timeout).json(&body).send().await?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let text = resp.text().await?;
        let queued = header_u64(&headers, "x-nthpool-queued-ms").map(Duration::from_millis);
        match status {
            StatusCode::OK => {
                let mut grant: Grant =
                    serde_json::from_str(&text).map_err(|_| unexpected(status, &text))?;
                grant.read_headers(&headers);
                // The gateway stamped the lease no earlier than our request plus its time in
                // the queue: a lower bound of when the lease started, for the guard's own
                // estimate of when it runs out.
                let started = sent_at + queued.unwrap_or_default();
                Ok(SlotGuard::start(self.clone(), grant, started))
            }
            StatusCode::TOO_MANY_REQUESTS => Err(LockError::NoSlot {
                retry_after: headers
                    .get(RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| nthbouncer_ratelimit::parse_retry_after(v, now_ms()))
                    .map(Duration::from_millis),
            }),
            StatusCode::GATEWAY_TIMEOUT => Err(LockError::QueueTimeout { waited: queued }),
            _ => Err(error_for(status, &text)),
        }
    }

    /// One renewal of `slot_id`, giving up after `timeout`. Returns the new lease deadline.
    pub(crate) async fn renew(
        &self,
        slot_id: &str,
        timeout: Duration,
    ) -> Result<u64, RenewFailure> {
        let call = async {
            let resp = self.post(&[slot_id, "renew"], timeout).send().await?;
            let status = resp.status();
            let text = resp.text().await?;
            Ok::<_, reqwest::Error>((status, text))
        };
        let (status, text) = call
            .await
            .map_err(|e| RenewFailure::Other(LockError::Http(e)))?;
        match status {
            StatusCode::OK => serde_json::from_str::<Renewed>(&text)
                .map(|r| r.lease_deadline)
                .map_err(|_| RenewFailure::Other(unexpected(status, &text))),
            // Also `pool_not_found`: a deleted pool took its slots with it.
            StatusCode::NOT_FOUND => Err(RenewFailure::NotFound),
            StatusCode::CONFLICT => Err(RenewFailure::Capped),
            _ => Err(RenewFailure::Other(error_for(status, &text))),
        }
    }

    /// Releases `slot_id` with an optional outcome report. `Ok(false)`: it was already gone.
    pub(crate) async fn release(
        &self,
        slot_id: &str,
        outcome: Option<&Outcome>,
    ) -> Result<bool, LockError> {
        let mut req = self.post(&[slot_id, "release"], CALL_MARGIN);
        if let Some(outcome) = outcome {
            let body = outcome
                .to_body()
                .map_err(|e| LockError::Config(format!("outcome: {e}")))?;
            req = req
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(body);
        }
        let resp = req.send().await?;
        let status = resp.status();
        let text = resp.text().await?;
        match status {
            StatusCode::OK => serde_json::from_str::<Released>(&text)
                .map(|r| r.released)
                .map_err(|_| unexpected(status, &text)),
            _ => Err(error_for(status, &text)),
        }
    }

    /// A POST to `{base}/pools/{pool}/lock/{tail...}` with the key, the `Host` override and a
    /// timeout.
    fn post(&self, tail: &[&str], timeout: Duration) -> reqwest::RequestBuilder {
        let mut url = self.base.clone();
        // `new` accepted only http(s) URLs with a host, which always have path segments.
        if let Ok(mut segments) = url.path_segments_mut() {
            segments
                .pop_if_empty()
                .extend(["pools", self.pool.as_str(), "lock"])
                .extend(tail);
        }
        let mut req = self
            .http
            .post(url)
            .header("x-nthpool-key", self.key.clone())
            .timeout(timeout);
        if let Some(host) = &self.host {
            req = req.header(HOST, host.clone());
        }
        req
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn header_u64(headers: &HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

/// Sorts an error answer of any lock call.
fn error_for(status: StatusCode, text: &str) -> LockError {
    let body: Option<ErrorBody> = serde_json::from_str(text).ok();
    match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => LockError::Unauthorized {
            status: status.as_u16(),
            message: body
                .map(|b| b.message)
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| "unauthorized".into()),
        },
        StatusCode::NOT_FOUND if body.is_some_and(|b| b.error == "pool_not_found") => {
            LockError::PoolNotFound
        }
        _ => unexpected(status, text),
    }
}

fn unexpected(status: StatusCode, text: &str) -> LockError {
    let mut body = text.trim().to_owned();
    if body.len() > MAX_ERROR_BODY {
        let mut end = MAX_ERROR_BODY;
        while !body.is_char_boundary(end) {
            end -= 1;
        }
        body.truncate(end);
        body.push('…');
    }
    LockError::Unexpected {
        status: status.as_u16(),
        body,
    }
}
