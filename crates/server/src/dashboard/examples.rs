//! A pool's copy-paste Examples (the Overview page): lock acquire, renew and release, a
//! proxied call (a SQL query on a database pool), an async call and its poll, and a call signed
//! for `access.hmac` (SPEC §9), filled with the pool's own host (or listener) and the API host's
//! public URL. The key is a placeholder: keys
//! are stored hashed, so the dashboard never has one to show.

use nthbouncer_config::PoolKind;

use crate::core::live::ServerSettings;
use crate::pools::registry::PoolRuntime;

/// Written in every example where the pool key goes.
pub const KEY_PLACEHOLDER: &str = "YOUR_POOL_KEY";
/// The shell variable the signed example reads the pool's HMAC secret from.
pub const HMAC_SECRET_VAR: &str = "HMAC_SECRET";

/// One example: what it does and the shell lines to paste.
pub struct Example {
    pub title: &'static str,
    pub shell: String,
}

/// Where the pool's callers send their requests: its own listener when it has one, else
/// `{pool}.{pool_domain}` with the public URL's scheme and port.
pub fn pool_base(pool: &PoolRuntime, live: &ServerSettings) -> String {
    if let Some(listen) = &pool.spec.listen {
        return format!("http://{listen}");
    }
    let (scheme, rest) = live
        .public_url
        .split_once("://")
        .unwrap_or(("http", live.public_url.as_str()));
    let authority = rest.split('/').next().unwrap_or_default();
    // A port is what follows the last colon after any IPv6 bracket.
    let port = authority
        .rsplit_once(':')
        .filter(|(_, p)| !p.contains(']') && p.chars().all(|c| c.is_ascii_digit()))
        .map(|(_, p)| format!(":{p}"))
        .unwrap_or_default();
    format!("{scheme}://{}{}{port}", pool.name, live.pool_suffix)
}

pub fn for_pool(pool: &PoolRuntime, live: &ServerSettings) -> Vec<Example> {
    let api = format!("{}/pools/{}", live.public_url, pool.name);
    let base = pool_base(pool, live);
    let key = format!("-H \"X-Nthpool-Key: {KEY_PLACEHOLDER}\"");
    let call = match pool.spec.kind {
        PoolKind::Proxy => Example {
            title: "A proxied call",
            shell: format!("curl -s {base}/v1/models {key}"),
        },
        PoolKind::Database => Example {
            title: "A SQL query",
            shell: format!(
                "curl -s {base}/sql {key} \\\n     -d '{{\"query\":\"SELECT $1::int + 1 AS n\",\"params\":[41]}}'"
            ),
        },
    };
    let async_path = match pool.spec.kind {
        PoolKind::Proxy => format!("{base}/v1/models"),
        PoolKind::Database => format!("{base}/sql"),
    };
    let signed = signed_call(pool, &base, &key);
    vec![
        Example {
            title: "Lock: acquire a slot (wait up to 5 s)",
            shell: format!(
                "curl -s -X POST {api}/lock/acquire {key} -d '{{\"waitMs\":5000}}'\n\
                 # → {{\"slotId\":\"…\",\"leaseDeadline\":…,\"termMs\":…,\"renewIntervalMs\":…}}"
            ),
        },
        Example {
            title: "Lock: renew it while you work",
            shell: format!("curl -s -X POST {api}/lock/$SLOT/renew {key}"),
        },
        Example {
            title: "Lock: release it with the origin's answer",
            shell: format!(
                "curl -s -X POST {api}/lock/$SLOT/release {key} -d '{{\"status\":200}}'"
            ),
        },
        call,
        Example {
            title: "An async call and its poll",
            shell: format!(
                "curl -s {async_path} {key} -H 'X-Nthpool-Async: 1'\n\
                 # → 202 {{\"jobId\":\"job_…\",\"pollUrl\":\"{api}/jobs/job_…\",…}}\n\
                 curl -s {api}/jobs/$JOB_ID {key}"
            ),
        },
        signed,
    ]
}

/// A POST signed per SPEC §9: `v1=HMAC-SHA256(secret, "v1\n{METHOD}\n{host}\n{path?query}\n
/// {timestamp}\n{nonce}\n{hex sha256(body)}")`, with `openssl` and `sha256sum`.
fn signed_call(pool: &PoolRuntime, base: &str, key: &str) -> Example {
    let host = base.split_once("://").map_or(base, |(_, rest)| rest);
    let (path, body) = match pool.spec.kind {
        PoolKind::Proxy => ("/v1/chat/completions", r#"{"model":"m","messages":[]}"#),
        PoolKind::Database => ("/sql", r#"{"query":"SELECT 1 AS n","params":[]}"#),
    };
    Example {
        title: "A signed call (access.hmac)",
        shell: format!(
            "BODY='{body}'\n\
             TS=$(date +%s); NONCE=$(openssl rand -hex 16)\n\
             HASH=$(printf '%s' \"$BODY\" | sha256sum | cut -d' ' -f1)\n\
             SIG=$(printf 'v1\\nPOST\\n%s\\n%s\\n%s\\n%s\\n%s' '{host}' '{path}' \"$TS\" \"$NONCE\" \"$HASH\" \\\n  \
             | openssl dgst -sha256 -hmac \"${HMAC_SECRET_VAR}\" -hex | sed 's/^.* //')\n\
             curl -s -X POST {base}{path} {key} -H 'Content-Type: application/json' \\\n  \
             -H \"X-Nthpool-Timestamp: $TS\" -H \"X-Nthpool-Nonce: $NONCE\" \\\n  \
             -H \"X-Nthpool-Signature: v1=$SIG\" --data-binary \"$BODY\""
        ),
    }
}
