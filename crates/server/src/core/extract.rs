//! Reading request bodies on the API host: one size bound for the small JSON bodies of the
//! lock and pool routes, and JSON parsing whose errors name the offending field.

use bytes::Bytes;

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
