//! A dashboard form as posted (`application/x-www-form-urlencoded`), and the problems an
//! answer of the shared validation (`ApiError`) puts next to its fields.

use bytes::Bytes;

use crate::core::error::ApiError;

/// The posted fields, in order.
#[derive(Default)]
pub struct Form(Vec<(String, String)>);

impl Form {
    /// The fields of `body`; a body that is no form has none (so its CSRF check fails).
    pub fn parse(body: &Bytes) -> Form {
        Form(serde_urlencoded::from_bytes(body).unwrap_or_default())
    }

    /// Field `name`, trimmed; empty when absent.
    pub fn text(&self, name: &str) -> &str {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map_or("", |(_, v)| v.trim())
    }

    /// Field `name`, trimmed, unless absent or empty.
    pub fn optional(&self, name: &str) -> Option<String> {
        Some(self.text(name))
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    }

    /// Whether checkbox `name` was ticked.
    pub fn checked(&self, name: &str) -> bool {
        self.0.iter().any(|(k, _)| k == name)
    }
}

/// What went wrong with a form: messages by field, and one for the form as a whole.
#[derive(Default)]
pub struct Problems {
    by_field: Vec<(String, String)>,
    pub general: Option<String>,
}

impl Problems {
    /// The message of `field`, if it has one.
    pub fn of(&self, field: &str) -> Option<&str> {
        self.by_field
            .iter()
            .find(|(f, _)| f == field)
            .map(|(_, m)| m.as_str())
    }

    /// A page's rows as read, or none and the read's refusal put next to `fields`: the
    /// status, the problems and the rows a filtered page shows.
    pub fn of_read<T: Default>(
        read: Result<T, ApiError>,
        fields: &[&str],
    ) -> (http::StatusCode, Problems, T) {
        match read {
            Ok(rows) => (http::StatusCode::OK, Problems::default(), rows),
            Err(e) => (e.status, Problems::from_error(&e, fields), T::default()),
        }
    }

    /// A refusal, its message put next to the form field it names: the API's field (say
    /// `concurrency.limit` or `deactivateAfter`) is matched to one of `fields` by its last
    /// segment, ignoring case and `_`; a refusal without such a field is the form's.
    pub fn from_error(e: &ApiError, fields: &[&str]) -> Problems {
        let squash = |s: &str| s.replace('_', "").to_ascii_lowercase();
        let named = e.field.as_deref().and_then(|f| {
            let last = squash(f.rsplit('.').next().unwrap_or(f));
            fields.iter().find(|name| squash(name) == last)
        });
        match named {
            Some(name) => Problems {
                by_field: vec![(name.to_string(), e.message.to_string())],
                general: None,
            },
            None => Problems {
                by_field: Vec::new(),
                general: Some(e.message.to_string()),
            },
        }
    }
}
