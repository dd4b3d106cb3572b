//! The poll (and webhook) body of a job (SPEC §6): what callers and receivers see.

use std::collections::HashMap;

use base64::prelude::*;
use nthbouncer_store::jobs::status;
use nthbouncer_store::StoredJob;
use serde::Serialize;
use utoipa::ToSchema;

/// The poll (and webhook) body of a job.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobView {
    pub job_id: String,
    pub status: String,
    pub reason: String,
    pub created_at: u64,
    pub updated_at: u64,
    pub expires_at: u64,
    /// The `x-request-id` of the request the job was taken from: the one its upstream
    /// attempts carry (absent for jobs stored before request ids were recorded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<ResultView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookView>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResultView {
    pub status: u16,
    #[schema(value_type = Object)]
    pub headers: HashMap<String, String>,
    pub body: String,
    /// `utf8` or `base64`.
    pub body_encoding: &'static str,
    pub truncated: bool,
}

#[derive(Serialize, ToSchema)]
pub struct WebhookView {
    pub destinations: u32,
    pub delivered: u32,
    pub failed: u32,
}

impl JobView {
    pub fn of(job: &StoredJob, now: u64) -> JobView {
        let status = status::as_seen(&job.status, job.expires_at, now).to_string();
        let result = job.result.as_ref().map(|r| {
            let mut headers: HashMap<String, String> = HashMap::new();
            for (k, v) in &r.headers {
                headers
                    .entry(k.clone())
                    .and_modify(|e| {
                        e.push_str(", ");
                        e.push_str(v);
                    })
                    .or_insert_with(|| v.clone());
            }
            let (body, body_encoding) = match std::str::from_utf8(&r.body) {
                Ok(text) => (text.to_string(), "utf8"),
                Err(_) => (BASE64_STANDARD.encode(&r.body), "base64"),
            };
            ResultView {
                status: r.status,
                headers,
                body,
                body_encoding,
                truncated: r.truncated,
            }
        });
        JobView {
            job_id: job.id.clone(),
            status,
            reason: job.reason.clone(),
            created_at: job.created_at,
            updated_at: job.updated_at,
            expires_at: job.expires_at,
            request_id: job.request_id.clone(),
            result,
            error: job.error.clone().filter(|_| job.status == status::FAILED),
            webhook: (job.destinations > 0).then_some(WebhookView {
                destinations: job.destinations,
                delivered: job.delivered,
                failed: job.failed,
            }),
        }
    }
}
