//! Where a call to an origin failed, and whether trying it again is safe.
//!
//! Only a failure to connect is safe to retry: the origin never saw the request. Once any byte
//! of a request may have reached it — a send that broke, a response head that never came, a
//! body cut short, a deadline passed — the origin may have acted on it, and a job records the
//! failure instead of sending the work twice.

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The phase of an upstream call that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// No connection to the origin could be made.
    Connect,
    /// The connection broke while the request was sent or before the response head came.
    Send,
    /// The request deadline passed before the response head.
    ResponseHead,
    /// The response body broke off or passed the deadline.
    Body,
}

/// An upstream call that failed, with its cause.
#[derive(Debug, thiserror::Error)]
#[error("{}", self.describe())]
pub struct UpstreamError {
    pub stage: Stage,
    #[source]
    pub source: Option<BoxError>,
}

impl UpstreamError {
    pub fn new(stage: Stage, source: impl Into<BoxError>) -> Self {
        UpstreamError {
            stage,
            source: Some(source.into()),
        }
    }

    pub fn deadline(stage: Stage) -> Self {
        UpstreamError {
            stage,
            source: None,
        }
    }

    /// From the client's error up to the response head.
    pub fn from_client(e: super::slot::CallError) -> Self {
        use super::direct::DirectError;
        use super::slot::CallError;
        let stage = match &e {
            CallError::Pooled(e) if e.is_connect() => Stage::Connect,
            CallError::Direct(DirectError::Connect(_)) => Stage::Connect,
            CallError::Pooled(_) | CallError::Direct(DirectError::Send(_)) => Stage::Send,
        };
        UpstreamError::new(stage, e)
    }

    /// The origin cannot have acted on the request.
    pub fn retry_safe(&self) -> bool {
        self.stage == Stage::Connect
    }

    /// The request deadline passed.
    pub fn timed_out(&self) -> bool {
        self.source.is_none()
    }

    /// Whether the cause chain holds an error of type `E` (a body limit, a signature refusal).
    pub fn caused_by<E: std::error::Error + 'static>(&self) -> Option<&E> {
        let mut cur: Option<&(dyn std::error::Error + 'static)> = self
            .source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static));
        while let Some(e) = cur {
            if let Some(found) = e.downcast_ref::<E>() {
                return Some(found);
            }
            cur = e.source();
        }
        None
    }

    fn describe(&self) -> String {
        let what = match (self.stage, self.timed_out()) {
            (Stage::Connect, _) => "cannot connect to the upstream",
            (Stage::Send, _) => "the upstream connection failed",
            (Stage::ResponseHead, _) => "the upstream did not answer within the request timeout",
            (Stage::Body, true) => "the upstream body did not end within the request timeout",
            (Stage::Body, false) => "the upstream body broke off",
        };
        match &self.source {
            Some(e) => format!("{what}: {}", chain(e.as_ref())),
            None => what.to_string(),
        }
    }
}

/// An error and its causes on one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_failed_connect_is_safe_to_retry() {
        let io = || std::io::Error::other("reset");
        assert!(UpstreamError::new(Stage::Connect, io()).retry_safe());
        for stage in [Stage::Send, Stage::ResponseHead, Stage::Body] {
            assert!(!UpstreamError::new(stage, io()).retry_safe());
            assert!(!UpstreamError::deadline(stage).retry_safe());
        }
        let e = UpstreamError::new(Stage::Body, io());
        assert!(e.caused_by::<std::io::Error>().is_some());
        assert!(e.to_string().contains("broke off: reset"), "{e}");
    }
}
