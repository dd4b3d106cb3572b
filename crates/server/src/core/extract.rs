//! Reading request bodies on the API host: one size bound for the small JSON bodies of the
//! lock and pool routes, and JSON parsing whose errors name the offending field.

use bytes::Bytes;
use http::HeaderMap;

use crate::core::error::ApiError;

/// Largest body of a lock route (acquire, release) or of a signed API-host pool route.
pub const MAX_API_BODY_BYTES: usize = 64 * 1024;

/// Parses a JSON body, naming the offending field on failure.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            "body".to_string()
        } else {
            path
        };
        ApiError::invalid(field, format!("invalid JSON body: {}", e.inner()))
    })
}

/// A credential value as `(scheme, token)`: `Bearer abc` → `("Bearer", "abc")`. The one parser
/// of `Authorization`-style values (admin token, pool keys, JWTs).
pub fn scheme_and_token(value: &str) -> Option<(&str, &str)> {
    let (scheme, token) = value.trim().split_once(' ')?;
    Some((scheme, token.trim()))
}

/// The token of a `Bearer` value (scheme case-insensitive).
pub fn bearer(value: &str) -> Option<&str> {
    scheme_and_token(value)
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token)
}

/// The `Authorization` header's value, when it is text.
pub fn authorization(headers: &HeaderMap) -> Option<&str> {
    headers.get(http::header::AUTHORIZATION)?.to_str().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_parser_for_credential_values() {
        assert_eq!(bearer("Bearer  abc "), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("abc"), None);
        assert_eq!(scheme_and_token("Nthbouncer k"), Some(("Nthbouncer", "k")));
    }
}
