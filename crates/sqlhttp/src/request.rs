//! What a caller asks: the JSON body (`SqlRequest`) and the `Neon-*` headers (`WireOptions`),
//! as Neon's HTTP driver sends them.
//!
//! Owns parsing and validation of both, and the conversion of JSON parameters to PostgreSQL's
//! text form. Must not touch a connection. Every rejection is an `InvalidInput` naming the field.
//!
//! Parameters follow Neon's proxy: `null` is SQL NULL, a string is sent as is, a number, boolean
//! or object as its JSON text, an array as a PostgreSQL array literal; all as text parameters
//! whose types the server infers from the statement. Numbers keep the exact digits the caller
//! wrote (the body is read with raw values, so `12345678901234567890` is not rounded to a double).

use std::collections::HashMap;

use serde_json::value::RawValue;

use crate::error::SqlHttpError;

/// Most parameters one statement can bind: the protocol counts them in 16 bits.
const MAX_PARAMS: usize = u16::MAX as usize;

/// One statement and its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub query: String,
    /// Text parameters; `None` is NULL.
    pub params: Vec<Option<String>>,
    /// The body's per-query `arrayMode`, which overrides `Neon-Array-Mode` (Neon honours it).
    pub array_mode: Option<bool>,
}

/// A request body: one statement, or a batch run as one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SqlRequest {
    Single(Query),
    Batch(Vec<Query>),
}

impl SqlRequest {
    /// Parses `{"query", "params"?, "arrayMode"?}` or `{"queries": [ … ]}`. A body with both
    /// `query` and `queries` is a single query, as in Neon. Unknown fields are ignored.
    pub fn from_slice(body: &[u8]) -> Result<SqlRequest, SqlHttpError> {
        let top: HashMap<String, Box<RawValue>> = serde_json::from_slice(body)
            .map_err(|e| SqlHttpError::invalid("body", format!("must be a JSON object: {e}")))?;
        if top.contains_key("query") {
            return Ok(SqlRequest::Single(parse_query(&top, "")?));
        }
        let Some(queries) = top.get("queries") else {
            return Err(SqlHttpError::invalid(
                "query",
                "the body needs a query string, or a queries array for a transaction",
            ));
        };
        let items: Vec<HashMap<String, Box<RawValue>>> = serde_json::from_str(queries.get())
            .map_err(|_| SqlHttpError::invalid("queries", "must be an array of query objects"))?;
        let mut batch = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            batch.push(parse_query(item, &format!("queries[{i}]."))?);
        }
        Ok(SqlRequest::Batch(batch))
    }

    /// The statements, in order.
    pub fn queries(&self) -> &[Query] {
        match self {
            SqlRequest::Single(q) => std::slice::from_ref(q),
            SqlRequest::Batch(qs) => qs,
        }
    }
}

fn parse_query(obj: &HashMap<String, Box<RawValue>>, prefix: &str) -> Result<Query, SqlHttpError> {
    let field = |name: &str| format!("{prefix}{name}");
    let query: String = obj
        .get("query")
        .and_then(|raw| serde_json::from_str(raw.get()).ok())
        .ok_or_else(|| SqlHttpError::invalid(field("query"), "must be a string"))?;
    if query.contains('\0') {
        return Err(SqlHttpError::invalid(
            field("query"),
            "must not contain a NUL character",
        ));
    }
    let params = match obj.get("params") {
        None => Vec::new(),
        Some(raw) if raw.get() == "null" => Vec::new(),
        Some(raw) => {
            let items: Vec<Box<RawValue>> = serde_json::from_str(raw.get())
                .map_err(|_| SqlHttpError::invalid(field("params"), "must be an array"))?;
            if items.len() > MAX_PARAMS {
                return Err(SqlHttpError::invalid(
                    field("params"),
                    format!("at most {MAX_PARAMS} parameters"),
                ));
            }
            let mut params = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let p = param_to_text(item)
                    .map_err(|m| SqlHttpError::invalid(field(&format!("params[{i}]")), m))?;
                params.push(p);
            }
            params
        }
    };
    let array_mode = match obj.get("arrayMode") {
        None => None,
        Some(raw) => match raw.get() {
            "true" => Some(true),
            "false" => Some(false),
            "null" => None,
            _ => {
                return Err(SqlHttpError::invalid(
                    field("arrayMode"),
                    "must be a boolean",
                ))
            }
        },
    };
    Ok(Query {
        query,
        params,
        array_mode,
    })
}

/// The text PostgreSQL receives for one JSON parameter (`None`: NULL).
fn param_to_text(raw: &RawValue) -> Result<Option<String>, String> {
    let text = raw.get().trim();
    match text.as_bytes().first() {
        Some(b'n') => Ok(None),
        Some(b'"') => {
            let s: String = serde_json::from_str(text).map_err(|e| e.to_string())?;
            check_nul(&s)?;
            Ok(Some(s))
        }
        Some(b'[') => {
            let mut out = String::new();
            write_pg_array(raw, &mut out)?;
            Ok(Some(out))
        }
        // Numbers, booleans and objects go as the JSON text the caller wrote: exact digits,
        // and valid input for json/jsonb columns.
        _ => {
            check_nul(text)?;
            Ok(Some(text.to_owned()))
        }
    }
}

fn check_nul(s: &str) -> Result<(), String> {
    if s.contains('\0') {
        Err("PostgreSQL text cannot contain a NUL character".into())
    } else {
        Ok(())
    }
}

/// Writes a JSON array as a PostgreSQL array literal: `[1, null, "a\"b", [2]]` becomes
/// `{1,NULL,"a\"b",{2}}`. Strings and objects are always quoted (so `"NULL"` stays a string);
/// PostgreSQL checks the element types.
fn write_pg_array(raw: &RawValue, out: &mut String) -> Result<(), String> {
    let items: Vec<Box<RawValue>> = serde_json::from_str(raw.get()).map_err(|e| e.to_string())?;
    out.push('{');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let text = item.get().trim();
        match text.as_bytes().first() {
            Some(b'n') => out.push_str("NULL"),
            Some(b'[') => write_pg_array(item, out)?,
            Some(b'"') => {
                let s: String = serde_json::from_str(text).map_err(|e| e.to_string())?;
                check_nul(&s)?;
                push_quoted(&s, out);
            }
            Some(b'{') => {
                check_nul(text)?;
                push_quoted(text, out);
            }
            _ => out.push_str(text),
        }
    }
    out.push('}');
    Ok(())
}

/// An array element in double quotes, with `"` and `\` escaped by a backslash (the array
/// input syntax; unlike JSON, control characters need no escape).
fn push_quoted(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
}

/// A batch's isolation level, from `Neon-Batch-Isolation-Level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsolationLevel {
    ReadUncommitted,
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl IsolationLevel {
    /// The header's spelling, as the driver sends it and Neon echoes it.
    pub fn header_value(self) -> &'static str {
        match self {
            IsolationLevel::ReadUncommitted => "ReadUncommitted",
            IsolationLevel::ReadCommitted => "ReadCommitted",
            IsolationLevel::RepeatableRead => "RepeatableRead",
            IsolationLevel::Serializable => "Serializable",
        }
    }

    fn sql(self) -> &'static str {
        match self {
            IsolationLevel::ReadUncommitted => "READ UNCOMMITTED",
            IsolationLevel::ReadCommitted => "READ COMMITTED",
            IsolationLevel::RepeatableRead => "REPEATABLE READ",
            IsolationLevel::Serializable => "SERIALIZABLE",
        }
    }
}

/// Request header names, as the driver sends them.
pub const ARRAY_MODE: &str = "neon-array-mode";
pub const RAW_TEXT_OUTPUT: &str = "neon-raw-text-output";
pub const BATCH_ISOLATION_LEVEL: &str = "neon-batch-isolation-level";
pub const BATCH_READ_ONLY: &str = "neon-batch-read-only";
pub const BATCH_DEFERRABLE: &str = "neon-batch-deferrable";

/// How to answer, from the `Neon-*` request headers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireOptions {
    /// `Neon-Array-Mode: true`: rows as arrays, else objects keyed by column name.
    pub array_mode: bool,
    /// `Neon-Raw-Text-Output: true`: every value as PostgreSQL's text (the driver parses them).
    pub raw_text_output: bool,
    /// `Neon-Batch-Isolation-Level` (batches only).
    pub isolation_level: Option<IsolationLevel>,
    /// `Neon-Batch-Read-Only: true` (batches only).
    pub read_only: bool,
    /// `Neon-Batch-Deferrable: true` (batches only).
    pub deferrable: bool,
}

impl WireOptions {
    /// Reads the `Neon-*` headers. As in Neon, a flag is on only when its value is exactly
    /// `true`; an unknown isolation level is refused.
    pub fn from_headers(headers: &http::HeaderMap) -> Result<WireOptions, SqlHttpError> {
        let flag = |name: &str| headers.get(name).is_some_and(|v| v.as_bytes() == b"true");
        let isolation_level =
            match headers.get(BATCH_ISOLATION_LEVEL) {
                None => None,
                Some(v) => Some(match v.as_bytes() {
                    b"ReadUncommitted" => IsolationLevel::ReadUncommitted,
                    b"ReadCommitted" => IsolationLevel::ReadCommitted,
                    b"RepeatableRead" => IsolationLevel::RepeatableRead,
                    b"Serializable" => IsolationLevel::Serializable,
                    _ => return Err(SqlHttpError::invalid(
                        "Neon-Batch-Isolation-Level",
                        "must be ReadUncommitted, ReadCommitted, RepeatableRead or Serializable",
                    )),
                }),
            };
        Ok(WireOptions {
            array_mode: flag(ARRAY_MODE),
            raw_text_output: flag(RAW_TEXT_OUTPUT),
            isolation_level,
            read_only: flag(BATCH_READ_ONLY),
            deferrable: flag(BATCH_DEFERRABLE),
        })
    }

    /// The `BEGIN` a batch starts with.
    pub(crate) fn begin_statement(&self) -> String {
        let mut sql = String::from("BEGIN");
        if let Some(level) = self.isolation_level {
            sql.push_str(" ISOLATION LEVEL ");
            sql.push_str(level.sql());
        }
        if self.read_only {
            sql.push_str(" READ ONLY");
        }
        if self.deferrable {
            sql.push_str(" DEFERRABLE");
        }
        sql
    }

    /// Headers Neon echoes on a batch's answer (the transaction settings it applied).
    pub fn batch_response_headers(&self) -> Vec<(&'static str, &'static str)> {
        let mut out = Vec::new();
        if self.read_only {
            out.push(("Neon-Batch-Read-Only", "true"));
        }
        if self.deferrable {
            out.push(("Neon-Batch-Deferrable", "true"));
        }
        if let Some(level) = self.isolation_level {
            out.push(("Neon-Batch-Isolation-Level", level.header_value()));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn single(body: &str) -> Query {
        match SqlRequest::from_slice(body.as_bytes()).unwrap() {
            SqlRequest::Single(q) => q,
            SqlRequest::Batch(_) => panic!("batch"),
        }
    }

    #[test]
    fn params_as_neon_sends_them() {
        let q = single(
            r#"{"query":"SELECT $1","params":[null,"a\"b",true,42,12345678901234567890123,1.5e3,{"k":[1]}]}"#,
        );
        assert_eq!(
            q.params,
            vec![
                None,
                Some("a\"b".into()),
                Some("true".into()),
                Some("42".into()),
                Some("12345678901234567890123".into()),
                Some("1.5e3".into()),
                Some(r#"{"k":[1]}"#.into()),
            ]
        );
    }

    #[test]
    fn arrays_become_array_literals() {
        let q = single(
            r#"{"query":"x","params":[[1,null,"NULL","a\"b\\c","line\nbreak",[2,3],{"o":1}]]}"#,
        );
        assert_eq!(
            q.params[0].as_deref(),
            Some("{1,NULL,\"NULL\",\"a\\\"b\\\\c\",\"line\nbreak\",{2,3},\"{\\\"o\\\":1}\"}")
        );
    }

    #[test]
    fn batch_and_field_names_in_errors() {
        let r = SqlRequest::from_slice(
            br#"{"queries":[{"query":"a"},{"query":"b","arrayMode":true}]}"#,
        )
        .unwrap();
        assert_eq!(r.queries().len(), 2);
        assert_eq!(r.queries()[1].array_mode, Some(true));

        let field = |body: &str| match SqlRequest::from_slice(body.as_bytes()) {
            Err(SqlHttpError::InvalidInput { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field("[1]"), "body");
        assert_eq!(field("{}"), "query");
        assert_eq!(field(r#"{"query":1}"#), "query");
        assert_eq!(field(r#"{"query":"x","params":{}}"#), "params");
        assert_eq!(field(r#"{"queries":{}}"#), "queries");
        assert_eq!(
            field(r#"{"queries":[{"query":"a"},{"params":[]}]}"#),
            "queries[1].query"
        );
        assert_eq!(field(r#"{"query":"x","params":["a\u0000"]}"#), "params[0]");
        assert_eq!(field(r#"{"query":"x","arrayMode":"yes"}"#), "arrayMode");
    }

    #[test]
    fn headers() {
        let mut h = http::HeaderMap::new();
        h.insert("Neon-Array-Mode", "true".parse().unwrap());
        h.insert("Neon-Raw-Text-Output", "TRUE".parse().unwrap());
        h.insert(
            "Neon-Batch-Isolation-Level",
            "Serializable".parse().unwrap(),
        );
        h.insert("Neon-Batch-Read-Only", "true".parse().unwrap());
        h.insert("Neon-Batch-Deferrable", "true".parse().unwrap());
        let o = WireOptions::from_headers(&h).unwrap();
        assert!(o.array_mode);
        assert!(!o.raw_text_output, "only exactly `true` counts, as in Neon");
        assert_eq!(
            o.begin_statement(),
            "BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY DEFERRABLE"
        );
        h.insert("Neon-Batch-Isolation-Level", "Snapshot".parse().unwrap());
        assert!(WireOptions::from_headers(&h).is_err());
    }
}
