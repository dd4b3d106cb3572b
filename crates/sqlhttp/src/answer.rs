//! The answer as Neon gives it, encoded while the rows arrive.
//!
//! Owns the JSON layout (`{"rowAsArray","fields","rows","command","rowCount"}`, and
//! `{"results":[…]}` for a batch), the conversion of PostgreSQL's text values to JSON, and the
//! byte count the response cap is checked against. Must not touch the connection: `conn` feeds
//! it row descriptions and data rows and stops when it says the answer is too large.
//!
//! Values follow Neon's proxy. With raw text output every value is PostgreSQL's text (the
//! driver parses it by `dataTypeID`). Otherwise: bool → true/false; int2/int4 → numbers;
//! float4/float8 → numbers when finite, else the text (`NaN`, `Infinity`), since JSON has no
//! such numbers; json/jsonb → the JSON itself; arrays → JSON arrays whose elements follow the
//! same rules; everything else (int8 and numeric included, which a double would round) → text.

use bytes::Bytes;
use fallible_iterator::FallibleIterator;
use postgres_protocol::message::backend::{DataRowBody, RowDescriptionBody};

/// Type OIDs whose text becomes something other than a JSON string.
const BOOL: u32 = 16;
const INT2: u32 = 21;
const INT4: u32 = 23;
const FLOAT4: u32 = 700;
const FLOAT8: u32 = 701;
const JSON: u32 = 114;
const JSONB: u32 = 3802;
const BOX: u32 = 603;

/// A finished answer: the JSON body, ready to send.
#[derive(Debug, Clone)]
pub struct Answer {
    body: Bytes,
    rows: u64,
}

impl Answer {
    /// The JSON body (`application/json`).
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    pub fn into_body(self) -> Bytes {
        self.body
    }

    /// Rows returned, over every statement (for the access log).
    pub fn rows(&self) -> u64 {
        self.rows
    }
}

/// The answer grew past the cap.
#[derive(Debug)]
pub(crate) struct TooLarge;

/// Builds one answer. For a batch it wraps each statement's result in `{"results":[…]}`.
pub(crate) struct AnswerWriter {
    out: Vec<u8>,
    max_bytes: usize,
    batch: bool,
    statements: usize,
    rows: u64,
}

impl AnswerWriter {
    pub(crate) fn new(batch: bool, max_bytes: usize) -> AnswerWriter {
        let mut out = Vec::with_capacity(256);
        if batch {
            out.extend_from_slice(b"{\"results\":[");
        }
        AnswerWriter {
            out,
            max_bytes,
            batch,
            statements: 0,
            rows: 0,
        }
    }

    /// Starts one statement's result.
    pub(crate) fn statement(&mut self, array_mode: bool, raw_text: bool) -> StatementWriter<'_> {
        if self.statements > 0 {
            self.out.push(b',');
        }
        self.statements += 1;
        StatementWriter {
            answer: self,
            array_mode,
            raw_text,
            columns: Vec::new(),
            described: false,
            rows: 0,
        }
    }

    pub(crate) fn finish(mut self) -> Answer {
        if self.batch {
            self.out.extend_from_slice(b"]}");
        }
        Answer {
            body: Bytes::from(self.out),
            rows: self.rows,
        }
    }
}

struct Column {
    /// The name, already as a JSON string (object mode repeats it on every row).
    name_json: Vec<u8>,
    type_oid: u32,
}

/// One statement's result being written. Dropped without `finish`, it leaves its partial
/// output in place: the caller answers with an error instead, so that output is never sent.
pub(crate) struct StatementWriter<'a> {
    answer: &'a mut AnswerWriter,
    array_mode: bool,
    raw_text: bool,
    columns: Vec<Column>,
    described: bool,
    rows: u64,
}

impl StatementWriter<'_> {
    /// The statement's `RowDescription`: writes `rowAsArray` and `fields`, opens `rows`.
    pub(crate) fn describe(&mut self, fields: Option<&RowDescriptionBody>) -> std::io::Result<()> {
        if self.described {
            return Ok(());
        }
        self.described = true;
        let out = &mut self.answer.out;
        out.extend_from_slice(b"{\"rowAsArray\":");
        out.extend_from_slice(if self.array_mode { b"true" } else { b"false" });
        out.extend_from_slice(b",\"fields\":[");
        if let Some(fields) = fields {
            let mut it = fields.fields();
            let mut first = true;
            while let Some(f) = it.next()? {
                if !first {
                    out.push(b',');
                }
                first = false;
                let mut name_json = Vec::with_capacity(f.name().len() + 2);
                write_json_str(&mut name_json, f.name());
                out.extend_from_slice(b"{\"name\":");
                out.extend_from_slice(&name_json);
                // Field order as Neon writes it.
                let meta = format!(
                    ",\"dataTypeID\":{},\"tableID\":{},\"columnID\":{},\"dataTypeSize\":{},\"dataTypeModifier\":{},\"format\":\"text\"}}",
                    f.type_oid(),
                    f.table_oid(),
                    f.column_id(),
                    f.type_size(),
                    f.type_modifier()
                );
                out.extend_from_slice(meta.as_bytes());
                self.columns.push(Column {
                    name_json,
                    type_oid: f.type_oid(),
                });
            }
        }
        out.extend_from_slice(b"],\"rows\":[");
        Ok(())
    }

    /// One `DataRow`. Fails once the whole answer is past the cap.
    pub(crate) fn row(&mut self, row: &DataRowBody) -> Result<(), RowError> {
        if !self.described {
            // A DataRow always follows a RowDescription; tolerate its absence anyway.
            self.describe(None).map_err(RowError::Decode)?;
        }
        let out = &mut self.answer.out;
        if self.rows > 0 {
            out.push(b',');
        }
        out.push(if self.array_mode { b'[' } else { b'{' });
        let buf = row.buffer();
        let mut ranges = row.ranges();
        let mut i = 0;
        while let Some(range) = ranges.next().map_err(RowError::Decode)? {
            if i > 0 {
                out.push(b',');
            }
            let column = self.columns.get(i);
            if !self.array_mode {
                match column {
                    Some(c) => out.extend_from_slice(&c.name_json),
                    None => write_json_str(out, &format!("?column{i}?")),
                }
                out.push(b':');
            }
            match range {
                None => out.extend_from_slice(b"null"),
                Some(r) => {
                    let bytes = buf.get(r).unwrap_or_default();
                    let text = String::from_utf8_lossy(bytes);
                    if self.raw_text {
                        write_json_str(out, &text);
                    } else {
                        write_value(out, &text, column.map_or(0, |c| c.type_oid));
                    }
                }
            }
            i += 1;
        }
        out.push(if self.array_mode { b']' } else { b'}' });
        self.rows += 1;
        if self.answer.out.len() > self.answer.max_bytes {
            return Err(RowError::TooLarge(TooLarge));
        }
        Ok(())
    }

    /// Closes the result with `command` and `rowCount` from the command tag (`None`: an empty
    /// query, which has none).
    pub(crate) fn finish(mut self, tag: Option<&str>) -> Result<(), TooLarge> {
        if !self.described {
            // No RowDescription (NoData): DDL, or DML without RETURNING.
            let _ = self.describe(None);
        }
        let (command, count) = split_command_tag(tag.unwrap_or(""));
        let out = &mut self.answer.out;
        out.extend_from_slice(b"],\"command\":");
        write_json_str(out, command);
        out.extend_from_slice(b",\"rowCount\":");
        match count {
            Some(n) => out.extend_from_slice(n.to_string().as_bytes()),
            None => out.extend_from_slice(b"null"),
        }
        out.push(b'}');
        self.answer.rows += self.rows;
        if self.answer.out.len() > self.answer.max_bytes {
            return Err(TooLarge);
        }
        Ok(())
    }
}

#[derive(Debug)]
pub(crate) enum RowError {
    TooLarge(TooLarge),
    Decode(std::io::Error),
}

/// `("SELECT", Some(3))` from `SELECT 3`; `INSERT oid rows` counts its rows; tags without a
/// count (`CREATE TABLE`, `BEGIN`) give their first word and `None`, as Neon answers them.
pub(crate) fn split_command_tag(tag: &str) -> (&str, Option<i64>) {
    let Some((command, rest)) = tag.split_once(' ') else {
        return (tag, None);
    };
    let count = if command == "INSERT" {
        rest.split_once(' ').and_then(|(_oid, n)| n.parse().ok())
    } else {
        rest.parse().ok()
    };
    (command, count)
}

/// One non-NULL value in typed-JSON mode.
fn write_value(out: &mut Vec<u8>, text: &str, type_oid: u32) {
    if let Some((elem, delim)) = array_element(type_oid) {
        let mark = out.len();
        if write_array(out, text, elem, delim).is_none() {
            // Not the array text we expected: send it as PostgreSQL printed it.
            out.truncate(mark);
            write_json_str(out, text);
        }
        return;
    }
    write_scalar(out, text, type_oid);
}

fn write_scalar(out: &mut Vec<u8>, text: &str, type_oid: u32) {
    match type_oid {
        BOOL => out.extend_from_slice(if text == "t" { b"true" } else { b"false" }),
        INT2 | INT4 if text.parse::<i32>().is_ok() => out.extend_from_slice(text.as_bytes()),
        FLOAT4 | FLOAT8 => {
            // serde_json refuses non-finite numbers, which keeps NaN and ±Infinity as text.
            match text
                .parse::<f64>()
                .ok()
                .and_then(serde_json::Number::from_f64)
            {
                Some(n) => out.extend_from_slice(n.to_string().as_bytes()),
                None => write_json_str(out, text),
            }
        }
        JSON | JSONB if is_json(text) => out.extend_from_slice(text.trim().as_bytes()),
        _ => write_json_str(out, text),
    }
}

fn is_json(text: &str) -> bool {
    serde_json::from_str::<&serde_json::value::RawValue>(text).is_ok()
}

/// Writes PostgreSQL's array text (`{1,NULL,"a b",{2}}`, maybe preceded by bounds such as
/// `[0:1]=`) as a JSON array. `None` when the text is not an array literal.
fn write_array(out: &mut Vec<u8>, text: &str, elem: u32, delim: char) -> Option<()> {
    let mut s = text.trim_start();
    if s.starts_with('[') {
        // Explicit bounds have no JSON form; the elements do.
        s = s.split_once('=')?.1.trim_start();
    }
    let rest = write_array_level(out, s, elem, delim)?;
    rest.trim().is_empty().then_some(())
}

/// One `{…}` level; returns the text after its closing brace.
fn write_array_level<'a>(out: &mut Vec<u8>, s: &'a str, elem: u32, delim: char) -> Option<&'a str> {
    let mut s = s.strip_prefix('{')?.trim_start();
    out.push(b'[');
    if let Some(rest) = s.strip_prefix('}') {
        out.push(b']');
        return Some(rest);
    }
    let mut first = true;
    loop {
        if !first {
            out.push(b',');
        }
        first = false;
        s = s.trim_start();
        if s.starts_with('{') {
            s = write_array_level(out, s, elem, delim)?;
        } else if let Some(quoted) = s.strip_prefix('"') {
            let (value, rest) = unquote(quoted)?;
            write_scalar(out, &value, elem);
            s = rest;
        } else {
            let end = s.find([delim, '}'])?;
            let item = s[..end].trim_end();
            if item == "NULL" {
                out.extend_from_slice(b"null");
            } else {
                write_scalar(out, item, elem);
            }
            s = &s[end..];
        }
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix(delim) {
            s = rest;
            continue;
        }
        let rest = s.strip_prefix('}')?;
        out.push(b']');
        return Some(rest);
    }
}

/// Reads a quoted array element (after its opening quote): backslash escapes the next
/// character. Returns the element and the text after the closing quote.
fn unquote(s: &str) -> Option<(String, &str)> {
    let mut value = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => value.push(chars.next()?.1),
            '"' => return Some((value, &s[i + 1..])),
            _ => value.push(c),
        }
    }
    None
}

/// The element type and delimiter of the built-in array types. Arrays of user-defined types
/// are not listed (their OIDs differ per database) and are answered as text.
fn array_element(type_oid: u32) -> Option<(u32, char)> {
    let elem = match type_oid {
        1000 => BOOL,
        1001 => 17, // bytea
        1002 => 18, // char
        1003 => 19, // name
        1005 => INT2,
        1007 => INT4,
        1016 => 20, // int8
        1009 => 25, // text
        1028 => 26, // oid
        1010 => 27, // tid
        1011 => 28, // xid
        1012 => 29, // cid
        199 => JSON,
        143 => 142,  // xml
        1017 => 600, // point
        1018 => 601, // lseg
        1019 => 602, // path
        1020 => BOX,
        1027 => 604, // polygon
        629 => 628,  // line
        719 => 718,  // circle
        651 => 650,  // cidr
        1041 => 869, // inet
        1040 => 829, // macaddr
        775 => 774,  // macaddr8
        1021 => FLOAT4,
        1022 => FLOAT8,
        791 => 790,   // money
        1014 => 1042, // bpchar
        1015 => 1043, // varchar
        1182 => 1082, // date
        1183 => 1083, // time
        1115 => 1114, // timestamp
        1185 => 1184, // timestamptz
        1187 => 1186, // interval
        1270 => 1266, // timetz
        1561 => 1560, // bit
        1563 => 1562, // varbit
        1231 => 1700, // numeric
        2951 => 2950, // uuid
        3807 => JSONB,
        2201 => 1790, // refcursor
        1008 => 24,   // regproc
        2207 => 2202, // regprocedure
        2210 => 2205, // regclass
        2211 => 2206, // regtype
        3643 => 3614, // tsvector
        3645 => 3615, // tsquery
        3221 => 3220, // pg_lsn
        3905 => 3904, // int4range
        3907 => 3906, // numrange
        3909 => 3908, // tsrange
        3911 => 3910, // tstzrange
        3913 => 3912, // daterange
        3927 => 3926, // int8range
        271 => 5069,  // xid8
        4073 => 4072, // jsonpath
        _ => return None,
    };
    // Of the built-in types only box separates its array elements with a semicolon.
    Some((elem, if elem == BOX { ';' } else { ',' }))
}

/// Appends `s` as a JSON string.
pub(crate) fn write_json_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let mut plain_from = 0;
    for (i, b) in s.bytes().enumerate() {
        let escape: Option<&[u8]> = match b {
            b'"' => Some(b"\\\""),
            b'\\' => Some(b"\\\\"),
            b'\n' => Some(b"\\n"),
            b'\r' => Some(b"\\r"),
            b'\t' => Some(b"\\t"),
            0x00..=0x1f => None,
            _ => continue,
        };
        out.extend_from_slice(&s.as_bytes()[plain_from..i]);
        plain_from = i + 1;
        match escape {
            Some(e) => out.extend_from_slice(e),
            None => out.extend_from_slice(format!("\\u{b:04x}").as_bytes()),
        }
    }
    out.extend_from_slice(&s.as_bytes()[plain_from..]);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn value(text: &str, oid: u32) -> serde_json::Value {
        let mut out = Vec::new();
        write_value(&mut out, text, oid);
        serde_json::from_slice(&out).unwrap()
    }

    #[test]
    fn scalars() {
        use serde_json::json;
        assert_eq!(value("t", BOOL), json!(true));
        assert_eq!(value("-32768", INT2), json!(-32768));
        assert_eq!(value("9007199254740993", 20), json!("9007199254740993"));
        assert_eq!(value("1.5", FLOAT8), json!(1.5));
        assert_eq!(value("1e+300", FLOAT8), json!(1e300));
        assert_eq!(value("NaN", FLOAT4), json!("NaN"));
        assert_eq!(value("-Infinity", FLOAT8), json!("-Infinity"));
        assert_eq!(value(r#"{"a": [1, 2.50]}"#, JSONB), json!({"a": [1, 2.50]}));
        assert_eq!(value("12.3400", 1700), json!("12.3400"));
    }

    #[test]
    fn arrays() {
        use serde_json::json;
        assert_eq!(value("{1,NULL,3}", 1007), json!([1, null, 3]));
        assert_eq!(
            value("{{t,f},{f,t}}", 1000),
            json!([[true, false], [false, true]])
        );
        assert_eq!(
            value(r#"{"a b","NULL",NULL,"q\"\\",""}"#, 1009),
            json!(["a b", "NULL", null, "q\"\\", ""])
        );
        assert_eq!(value("{}", 1007), json!([]));
        assert_eq!(value("[0:1]={7,8}", 1007), json!([7, 8]));
        assert_eq!(value("{NaN,1.5}", 1022), json!(["NaN", 1.5]));
        assert_eq!(
            value(r#"{"{\"k\": 1}",null}"#, 3807),
            json!([{"k": 1}, null])
        );
        assert_eq!(
            value("{(1,1),(0,0);(2,2),(1,1)}", 1020),
            json!(["(1,1),(0,0)", "(2,2),(1,1)"])
        );
        // Not an array literal: kept as text rather than failing the answer.
        assert_eq!(value("{1,2", 1007), json!("{1,2"));
    }

    #[test]
    fn command_tags() {
        assert_eq!(split_command_tag("SELECT 3"), ("SELECT", Some(3)));
        assert_eq!(split_command_tag("INSERT 0 2"), ("INSERT", Some(2)));
        assert_eq!(split_command_tag("CREATE TABLE"), ("CREATE", None));
        assert_eq!(split_command_tag("BEGIN"), ("BEGIN", None));
        assert_eq!(split_command_tag(""), ("", None));
    }

    #[test]
    fn json_strings() {
        let mut out = Vec::new();
        write_json_str(&mut out, "a\"b\\c\n\u{1}é");
        let back: String = serde_json::from_slice(&out).unwrap();
        assert_eq!(back, "a\"b\\c\n\u{1}é");
    }
}
