//! Keyset pagination shared by the admin lists (access log, jobs, delivery attempts): the store
//! is asked for one row more than the page holds; if it comes back, the page is full and its
//! last row is where the next page starts (`next`). Owns the page-size and cursor rules only;
//! what a cursor means is the store's business.

use crate::core::error::ApiError;

/// The page size asked for, clamped to `1..=max`; 100 when absent.
pub fn page_size(requested: Option<u32>, max: u32) -> u32 {
    requested.unwrap_or(100).clamp(1, max)
}

/// A cursor that is a previous page's numeric `next` (row ids of append-only tables).
pub fn numeric_cursor(cursor: Option<&str>) -> Result<Option<u64>, ApiError> {
    cursor
        .map(|c| {
            c.parse::<u64>()
                .map_err(|_| ApiError::invalid("cursor", "cursor must be a previous page's next"))
        })
        .transpose()
}

/// Cuts `rows` (fetched with `limit + 1`) to the page and names the next page's cursor.
pub fn split<T>(
    mut rows: Vec<T>,
    limit: u32,
    cursor_of: impl Fn(&T) -> String,
) -> (Vec<T>, Option<String>) {
    if rows.len() > limit as usize {
        rows.truncate(limit as usize);
        let next = rows.last().map(cursor_of);
        (rows, next)
    } else {
        (rows, None)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_full_page_names_its_last_row_as_next() {
        assert_eq!(
            split(vec![5, 4, 3], 2, |r| r.to_string()),
            (vec![5, 4], Some("4".into()))
        );
        assert_eq!(split(vec![5, 4], 2, |r| r.to_string()), (vec![5, 4], None));
        assert_eq!(
            split(Vec::<u8>::new(), 2, |r| r.to_string()),
            (vec![], None)
        );
    }

    #[test]
    fn sizes_and_cursors() {
        assert_eq!(page_size(None, 500), 100);
        assert_eq!(page_size(Some(0), 500), 1);
        assert_eq!(page_size(Some(9999), 500), 500);
        assert_eq!(numeric_cursor(Some("42")).unwrap(), Some(42));
        assert_eq!(numeric_cursor(None).unwrap(), None);
        assert_eq!(
            numeric_cursor(Some("x")).unwrap_err().code,
            crate::core::error::ErrorCode::Invalid
        );
    }
}
