//! What can go wrong between a JSON request and a JSON answer, and how each failure is told to
//! an HTTP caller: `SqlHttpError` knows its status and its JSON body.
//!
//! Owns the error taxonomy and PostgreSQL's error fields (`DbError`). Must not know the HTTP
//! server: it hands back a status number and a JSON object, and the server adds its own fields
//! (a request id) before sending them. No message built here may carry the upstream URL or
//! password: connection errors are described by the redacted target only.

use serde_json::{Map, Value};

/// SQLSTATE `53300 too_many_connections`: PostgreSQL refused a new connection because it is at
/// its limit. The gate learns from it as from an origin's 429.
pub const TOO_MANY_CONNECTIONS: &str = "53300";

/// An error PostgreSQL reported (an `ErrorResponse`), with every field it sent.
///
/// Field names follow Neon's answer (and node-postgres' `DatabaseError`). `position` and
/// `internal_position` are kept as text, as the protocol sends them and as Neon answers them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DbError {
    /// Localized severity (`ERROR`, `FATAL`, …).
    pub severity: Option<String>,
    /// Non-localized severity, when the server sends it (PostgreSQL 9.6+).
    pub severity_nonlocalized: Option<String>,
    /// SQLSTATE, e.g. `23505`.
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
    pub position: Option<String>,
    pub internal_position: Option<String>,
    pub internal_query: Option<String>,
    pub where_: Option<String>,
    pub schema: Option<String>,
    pub table: Option<String>,
    pub column: Option<String>,
    pub data_type: Option<String>,
    pub constraint: Option<String>,
    pub file: Option<String>,
    pub line: Option<String>,
    pub routine: Option<String>,
}

impl DbError {
    /// Builds the error from the `(type, value)` pairs of an `ErrorResponse`.
    pub(crate) fn from_fields<'a>(fields: impl IntoIterator<Item = (u8, &'a str)>) -> DbError {
        let mut e = DbError::default();
        for (kind, value) in fields {
            let v = Some(value.to_owned());
            match kind {
                b'S' => e.severity = v,
                b'V' => e.severity_nonlocalized = v,
                b'C' => e.code = value.to_owned(),
                b'M' => e.message = value.to_owned(),
                b'D' => e.detail = v,
                b'H' => e.hint = v,
                b'P' => e.position = v,
                b'p' => e.internal_position = v,
                b'q' => e.internal_query = v,
                b'W' => e.where_ = v,
                b's' => e.schema = v,
                b't' => e.table = v,
                b'c' => e.column = v,
                b'd' => e.data_type = v,
                b'n' => e.constraint = v,
                b'F' => e.file = v,
                b'L' => e.line = v,
                b'R' => e.routine = v,
                // Fields added by later protocol versions are skipped, as the protocol asks.
                _ => {}
            }
        }
        e
    }

    /// Whether the server ends the session after this error (`FATAL`, `PANIC`).
    pub(crate) fn is_fatal(&self) -> bool {
        let severity = self
            .severity_nonlocalized
            .as_deref()
            .or(self.severity.as_deref());
        matches!(severity, Some("FATAL" | "PANIC"))
    }

    /// Neon's error fields, each present (null when PostgreSQL did not send it), as the driver
    /// copies them onto its `NeonDbError`.
    fn neon_fields(&self, body: &mut Map<String, Value>) {
        let opt = |v: &Option<String>| v.clone().map_or(Value::Null, Value::String);
        body.insert("message".into(), Value::String(self.message.clone()));
        body.insert("code".into(), Value::String(self.code.clone()));
        body.insert("detail".into(), opt(&self.detail));
        body.insert("hint".into(), opt(&self.hint));
        body.insert("position".into(), opt(&self.position));
        body.insert("internalPosition".into(), opt(&self.internal_position));
        body.insert("internalQuery".into(), opt(&self.internal_query));
        body.insert("severity".into(), opt(&self.severity));
        body.insert("where".into(), opt(&self.where_));
        body.insert("schema".into(), opt(&self.schema));
        body.insert("table".into(), opt(&self.table));
        body.insert("column".into(), opt(&self.column));
        body.insert("dataType".into(), opt(&self.data_type));
        body.insert("constraint".into(), opt(&self.constraint));
        body.insert("file".into(), opt(&self.file));
        body.insert("line".into(), opt(&self.line));
        body.insert("routine".into(), opt(&self.routine));
    }
}

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (SQLSTATE {})", self.message, self.code)
    }
}

/// Everything `Database::execute` and the request parsers can fail with.
#[derive(Debug, thiserror::Error)]
pub enum SqlHttpError {
    /// The request body or a `Neon-*` header is malformed. `field` names the offending part
    /// (`query`, `queries[2].params`, `Neon-Batch-Isolation-Level`, …).
    #[error("{field}: {message}")]
    InvalidInput { field: String, message: String },

    /// PostgreSQL rejected a statement. Answered `400` with Neon's fields.
    #[error("{0}")]
    Sql(Box<DbError>),

    /// PostgreSQL refused a new connection with `53300 too_many_connections`: a throttle signal
    /// for the gate. No statement was sent, so a retry is safe.
    #[error("the database refused a new connection: {0}")]
    TooManyConnections(Box<DbError>),

    /// The answer grew past `max_response_bytes`; the query was cancelled on the server.
    #[error("response is too large (max is {max_bytes} bytes)")]
    ResponseTooLarge { max_bytes: usize },

    /// No connection could be opened (refused, unresolvable, TLS or authentication failure,
    /// timeout). No statement was sent, so a retry is safe. `message` names the redacted target.
    #[error("{message}")]
    Unreachable { message: String },

    /// The connection failed while a statement was in flight: the statement may or may not have
    /// run (a batch's transaction was rolled back by the server when the session ended).
    #[error("{message}")]
    ConnectionLost { message: String },

    /// The server said something this client did not expect.
    #[error("{message}")]
    Protocol { message: String },

    /// The connection URL or the limits are unusable. Raised by `Database::new` only.
    #[error("{message}")]
    Config { message: String },
}

impl SqlHttpError {
    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        SqlHttpError::InvalidInput {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The HTTP status the server answers with.
    pub fn status(&self) -> u16 {
        match self {
            SqlHttpError::InvalidInput { .. } | SqlHttpError::Sql(_) => 400,
            SqlHttpError::TooManyConnections(_) => 429,
            SqlHttpError::ResponseTooLarge { .. } => 507,
            SqlHttpError::Unreachable { .. }
            | SqlHttpError::ConnectionLost { .. }
            | SqlHttpError::Protocol { .. } => 502,
            SqlHttpError::Config { .. } => 500,
        }
    }

    /// The `error` code of the JSON body (SPEC §0 and §12).
    pub fn code(&self) -> &'static str {
        match self {
            SqlHttpError::InvalidInput { .. } => "invalid",
            SqlHttpError::Sql(_) => "sql_error",
            SqlHttpError::TooManyConnections(_) => "too_many_requests",
            SqlHttpError::ResponseTooLarge { .. } => "response_too_large",
            SqlHttpError::Unreachable { .. }
            | SqlHttpError::ConnectionLost { .. }
            | SqlHttpError::Protocol { .. } => "upstream_unreachable",
            SqlHttpError::Config { .. } => "internal",
        }
    }

    /// The JSON body: `{"error", "message", …}`; SQL errors carry every Neon field, invalid
    /// input names its `field`. A map, so the server can add `requestId` before sending it.
    pub fn body(&self) -> Map<String, Value> {
        let mut body = Map::new();
        body.insert("error".into(), Value::String(self.code().into()));
        match self {
            SqlHttpError::Sql(db) => db.neon_fields(&mut body),
            SqlHttpError::TooManyConnections(db) => {
                body.insert("message".into(), Value::String(self.to_string()));
                body.insert("code".into(), Value::String(db.code.clone()));
            }
            SqlHttpError::InvalidInput { field, message } => {
                body.insert("message".into(), Value::String(message.clone()));
                body.insert("field".into(), Value::String(field.clone()));
            }
            _ => {
                body.insert("message".into(), Value::String(self.to_string()));
            }
        }
        body
    }

    /// Whether PostgreSQL refused a connection for being at its limit (`53300`): the server
    /// reports it to the gate as a throttle, like an origin's 429.
    pub fn is_too_many_connections(&self) -> bool {
        matches!(self, SqlHttpError::TooManyConnections(_))
    }

    /// Whether no statement reached the server, so the whole request may be sent again.
    pub fn is_retry_safe(&self) -> bool {
        matches!(
            self,
            SqlHttpError::TooManyConnections(_) | SqlHttpError::Unreachable { .. }
        )
    }

    /// The PostgreSQL error behind this one, if any.
    pub fn db_error(&self) -> Option<&DbError> {
        match self {
            SqlHttpError::Sql(db) | SqlHttpError::TooManyConnections(db) => Some(db),
            _ => None,
        }
    }
}
