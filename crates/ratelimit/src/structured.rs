//! A lenient reader for the subset of RFC 8941 structured fields the IETF rate-limit drafts use.
//!
//! It reads a field as comma-separated members, each either a dictionary member
//! (`limit=100;w=60`) or a list item (`"default";r=50;t=30`, `100;w=60`), with parameters.
//! Unlike a strict RFC 8941 parser, which must drop the whole field on any error, a malformed
//! member is skipped and the rest kept: one odd member from an origin should not blind the
//! governor. It also tolerates whitespace around `;` and `=`. Bare items are kept as text;
//! callers convert the few they need. Byte sequences, booleans and inner lists are recognised
//! only so they can be stepped over.

use crate::number::{parse_scaled_ceil, parse_uint};

/// One bare item, as much of it as rate-limit parsing needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Bare<'a> {
    /// An integer or decimal, sign included, not yet validated (`50`, `-1`, `1.5`).
    Number(&'a str),
    /// A token (`default`) or a string with escapes resolved (`"default"`): both name policies.
    Text(String),
    /// A boolean, byte sequence, or the implicit `true` of a value-less key.
    Other,
}

impl Bare<'_> {
    /// The value as a non-negative integer.
    pub(crate) fn uint(&self) -> Option<u64> {
        match self {
            Bare::Number(text) => parse_uint(text),
            _ => None,
        }
    }

    /// The value as non-negative seconds (fractions tolerated), in milliseconds rounded up.
    pub(crate) fn seconds_ms(&self) -> Option<u64> {
        match self {
            Bare::Number(text) => parse_scaled_ceil(text, 1_000),
            _ => None,
        }
    }

    /// The value as a policy name or other textual value.
    pub(crate) fn text(&self) -> Option<&str> {
        match self {
            Bare::Text(text) => Some(text),
            _ => None,
        }
    }
}

/// One member of a list or dictionary field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Member<'a> {
    /// The dictionary key when the member was written `key=value`; `None` for list items.
    pub(crate) key: Option<&'a str>,
    pub(crate) value: Bare<'a>,
    pub(crate) params: Vec<(&'a str, Bare<'a>)>,
}

impl<'a> Member<'a> {
    /// The parameter named `name` (ASCII case-insensitive); the last one wins, as RFC 8941 has
    /// later duplicates overwrite earlier ones.
    pub(crate) fn param(&self, name: &str) -> Option<&Bare<'a>> {
        self.params
            .iter()
            .rev()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value)
    }
}

/// The dictionary member `key` among `members`, last one winning as in RFC 8941.
pub(crate) fn dict_get<'m, 'a>(members: &'m [Member<'a>], key: &str) -> Option<&'m Member<'a>> {
    members
        .iter()
        .rev()
        .find(|m| m.key.is_some_and(|k| k.eq_ignore_ascii_case(key)))
}

/// Reads every well-formed member of one field line.
pub(crate) fn members(field: &str) -> Vec<Member<'_>> {
    let mut cursor = Cursor {
        text: field,
        pos: 0,
    };
    let mut out = Vec::new();
    loop {
        cursor.skip_whitespace();
        if cursor.at_end() {
            break;
        }
        let start = cursor.pos;
        match cursor.member() {
            Some(member) if cursor.at_member_end() => out.push(member),
            _ => {
                // Re-scan from the member's start so a quote that opened a broken string is
                // still paired up, instead of from wherever the error was noticed.
                cursor.pos = start;
                cursor.skip_to_next_member();
            }
        }
        // Either at the end or on the comma that ends this member; stepping over it guarantees
        // progress, so the loop always terminates.
        cursor.bump();
    }
    out
}

struct Cursor<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn bump(&mut self) {
        if self.pos < self.text.len() {
            self.pos += 1;
        }
    }

    fn at_end(&self) -> bool {
        self.pos >= self.text.len()
    }

    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.bump();
        }
    }

    /// After trailing whitespace, is the member over (end of field or a comma)?
    fn at_member_end(&mut self) -> bool {
        self.skip_whitespace();
        matches!(self.peek(), None | Some(b','))
    }

    /// Consumes bytes while `accept` holds and returns them. The predicates only accept ASCII,
    /// so the slice boundaries always fall on character boundaries.
    fn take_while(&mut self, accept: impl Fn(u8) -> bool) -> &'a str {
        let start = self.pos;
        while self.peek().is_some_and(&accept) {
            self.bump();
        }
        self.text.get(start..self.pos).unwrap_or("")
    }

    /// Steps to the next top-level comma (or the end), stepping over quoted strings whole so a
    /// comma inside one does not split a member.
    fn skip_to_next_member(&mut self) {
        while let Some(b) = self.peek() {
            match b {
                b',' => return,
                b'"' => {
                    self.bump();
                    while let Some(c) = self.peek() {
                        self.bump();
                        match c {
                            b'\\' => self.bump(),
                            b'"' => break,
                            _ => {}
                        }
                    }
                }
                _ => self.bump(),
            }
        }
    }

    fn member(&mut self) -> Option<Member<'a>> {
        let (key, value) = if self.peek().is_some_and(is_token_start) {
            let ident = self.take_while(is_token_char);
            let after_ident = self.pos;
            self.skip_whitespace();
            if self.peek() == Some(b'=') {
                self.bump();
                self.skip_whitespace();
                (Some(ident), self.bare()?)
            } else {
                self.pos = after_ident;
                (None, Bare::Text(ident.to_owned()))
            }
        } else {
            (None, self.bare()?)
        };
        let params = self.params()?;
        Some(Member { key, value, params })
    }

    fn params(&mut self) -> Option<Vec<(&'a str, Bare<'a>)>> {
        let mut params = Vec::new();
        loop {
            let before = self.pos;
            self.skip_whitespace();
            if self.peek() != Some(b';') {
                self.pos = before;
                return Some(params);
            }
            self.bump();
            self.skip_whitespace();
            let key = self.take_while(is_key_char);
            if key.is_empty() {
                return None;
            }
            let after_key = self.pos;
            self.skip_whitespace();
            let value = if self.peek() == Some(b'=') {
                self.bump();
                self.skip_whitespace();
                self.bare()?
            } else {
                self.pos = after_key;
                Bare::Other
            };
            params.push((key, value));
        }
    }

    fn bare(&mut self) -> Option<Bare<'a>> {
        match self.peek()? {
            b'"' => self.string(),
            b'-' | b'.' | b'0'..=b'9' => {
                let start = self.pos;
                if self.peek() == Some(b'-') {
                    self.bump();
                }
                self.take_while(|b| b.is_ascii_digit() || b == b'.');
                Some(Bare::Number(self.text.get(start..self.pos)?))
            }
            b'?' => {
                self.bump();
                matches!(self.peek(), Some(b'0' | b'1')).then(|| self.bump())?;
                Some(Bare::Other)
            }
            b':' => {
                self.bump();
                self.take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='));
                (self.peek() == Some(b':')).then(|| self.bump())?;
                Some(Bare::Other)
            }
            b if is_token_start(b) => Some(Bare::Text(self.take_while(is_token_char).to_owned())),
            // Inner lists and anything else are not used by any rate-limit draft.
            _ => None,
        }
    }

    fn string(&mut self) -> Option<Bare<'a>> {
        self.bump(); // opening quote
        let mut out = String::new();
        loop {
            match self.peek()? {
                b'"' => {
                    self.bump();
                    return Some(Bare::Text(out));
                }
                b'\\' => {
                    self.bump();
                    let escaped = self.peek().filter(|c| matches!(c, b'"' | b'\\'))?;
                    out.push(char::from(escaped));
                    self.bump();
                }
                c if (0x20..0x7f).contains(&c) => {
                    out.push(char::from(c));
                    self.bump();
                }
                // RFC 8941 strings are printable ASCII only.
                _ => return None,
            }
        }
    }
}

fn is_token_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'*'
}

/// RFC 9110 `tchar`, plus `:` and `/` which RFC 8941 tokens also allow.
fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&b)
}

/// RFC 8941 key characters; upper case is tolerated and matched case-insensitively.
fn is_key_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Bare<'static> {
        Bare::Text(s.to_owned())
    }

    #[test]
    fn dictionary_members() {
        let m = members("limit=100, remaining=50, reset=30");
        assert_eq!(m.len(), 3);
        assert_eq!(
            dict_get(&m, "remaining").map(|m| m.value.uint()),
            Some(Some(50))
        );
        assert_eq!(
            dict_get(&m, "RESET").map(|m| m.value.seconds_ms()),
            Some(Some(30_000))
        );
    }

    #[test]
    fn list_items_with_parameters() {
        let m = members(r#""default";r=50;t=30, burst; r=0 ;t=1.5,100;w=60"#);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].value, text("default"));
        assert_eq!(m[0].param("r").and_then(Bare::uint), Some(50));
        assert_eq!(m[1].value, text("burst"));
        assert_eq!(m[1].param("t").and_then(Bare::seconds_ms), Some(1_500));
        assert_eq!(m[2].value, Bare::Number("100"));
        assert_eq!(m[2].param("w").and_then(Bare::uint), Some(60));
    }

    #[test]
    fn strings_keep_escapes_and_commas() {
        let m = members(r#""a,\"b\"";q=1, "c""#);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].value, text(r#"a,"b""#));
        assert_eq!(m[1].value, text("c"));
    }

    #[test]
    fn malformed_members_are_skipped_not_fatal() {
        for broken in [
            "(a b);x=1",
            r#""bad\q";r=2"#,
            "\"non-ascii é\"",
            "7;=3",
            ";r=4",
            "é=1",
            "a b",
            "x=",
            "y=?",
            "z=:abc",
            "w;r=(1)",
        ] {
            let field = format!("{broken}, last;r=5");
            let m = members(&field);
            let names: Vec<_> = m.iter().filter_map(|m| m.value.text()).collect();
            assert_eq!(names, vec!["last"], "{broken:?}");
        }
        // An unterminated string swallows the rest of the line, as it would for any reader.
        assert!(members(r#""open, last;r=5"#).is_empty());
        let m = members("?1;a, :aGk=:, x;p=?0, y=:zz:, z");
        assert_eq!(m.len(), 5);
        assert!(members("").is_empty());
        assert!(members(" , ,, ").is_empty());
    }

    #[test]
    fn last_duplicate_wins() {
        let m = members("limit=1, limit=2;w=1;w=9");
        let limit = dict_get(&m, "limit");
        assert_eq!(limit.map(|m| m.value.uint()), Some(Some(2)));
        assert_eq!(
            limit.and_then(|m| m.param("w")).and_then(Bare::uint),
            Some(9)
        );
    }
}
