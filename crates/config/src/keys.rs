//! Pool keys and their hashes: generation, format check, hashing.
//!
//! Keys look like `nb_live_` + 32 base62 chars + a 6-char base62 checksum (CRC-32 of the 32
//! chars). The checksum lets us refuse a mistyped or forged key before any lookup. Keys migrated
//! from elsewhere (16–256 printable ASCII chars, not starting with `nb_live_`) are accepted too.
//! Only `sha256:<hex>` hashes are ever stored.

use base64::prelude::*;
use rand::Rng;
use sha2::{Digest, Sha256};

pub const KEY_PREFIX: &str = "nb_live_";
const BODY_LEN: usize = 32;
const CHECKSUM_LEN: usize = 6;
const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// Why a presented key was refused before lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyFormatError {
    /// An `nb_live_` key of the wrong length or alphabet.
    Malformed,
    /// An `nb_live_` key whose checksum does not match.
    Checksum,
    /// Not an `nb_live_` key, and not 16–256 printable ASCII chars either.
    Legacy,
}

/// A key body's checksum: its CRC-32 in [`CHECKSUM_LEN`] base62 digits (ASCII). Bytes, not a
/// `String`: every request's key is checked, and the check needs no allocation.
fn checksum(body: &str) -> [u8; CHECKSUM_LEN] {
    let mut n = u64::from(crc32fast::hash(body.as_bytes()));
    let mut out = [b'0'; CHECKSUM_LEN];
    for slot in out.iter_mut().rev() {
        *slot = BASE62[(n % 62) as usize];
        n /= 62;
    }
    out
}

/// A fresh pool key.
pub fn generate_key() -> String {
    let mut rng = rand::thread_rng();
    let body: String = (0..BODY_LEN)
        .map(|_| char::from(BASE62[rng.gen_range(0..BASE62.len())]))
        .collect();
    let sum = checksum(&body);
    let sum: String = sum.iter().copied().map(char::from).collect();
    format!("{KEY_PREFIX}{body}{sum}")
}

/// Checks a presented key's shape (and checksum) without any lookup.
pub fn check_format(key: &str) -> Result<(), KeyFormatError> {
    if let Some(rest) = key.strip_prefix(KEY_PREFIX) {
        if rest.len() != BODY_LEN + CHECKSUM_LEN || !rest.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            return Err(KeyFormatError::Malformed);
        }
        let (body, sum) = rest.split_at(BODY_LEN);
        // Not secret-dependent: the checksum is derivable from the public body.
        if checksum(body) != sum.as_bytes() {
            return Err(KeyFormatError::Checksum);
        }
        return Ok(());
    }
    if (16..=256).contains(&key.len()) && key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        Ok(())
    } else {
        Err(KeyFormatError::Legacy)
    }
}

/// Raw SHA-256 digest of a key.
pub fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The stored form: lowercase hex SHA-256.
pub fn hash_hex(key: &str) -> String {
    hex::encode(digest(key))
}

/// Parses `sha256:<64 hex>` into a digest.
pub fn parse_hash(s: &str) -> Option<[u8; 32]> {
    let hex_part = s.strip_prefix("sha256:")?;
    let bytes = hex::decode(hex_part.to_ascii_lowercase()).ok()?;
    bytes.try_into().ok()
}

/// A public id for a key, derived from its hash (safe to show and log).
pub fn key_id_from_digest(digest: &[u8; 32]) -> String {
    format!("key_{}", hex::encode(&digest[..8]))
}

/// Fairness identity for the governor, derived from the key's digest.
pub fn fairness_id(digest: &[u8; 32]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(b)
}

/// A fresh webhook signing secret, `whsec_` + base64 of 24 random bytes.
pub fn generate_webhook_secret() -> String {
    let bytes: [u8; 24] = rand::random();
    format!("whsec_{}", BASE64_STANDARD.encode(bytes))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_pass_their_own_check() {
        for _ in 0..100 {
            let k = generate_key();
            assert_eq!(k.len(), KEY_PREFIX.len() + 38);
            assert_eq!(check_format(&k), Ok(()));
        }
    }

    #[test]
    fn a_flipped_character_fails_the_checksum() {
        let k = generate_key();
        let mut chars: Vec<char> = k.chars().collect();
        let i = KEY_PREFIX.len() + 3;
        chars[i] = if chars[i] == 'a' { 'b' } else { 'a' };
        let bad: String = chars.into_iter().collect();
        assert_eq!(check_format(&bad), Err(KeyFormatError::Checksum));
    }

    #[test]
    fn malformed_and_legacy_keys() {
        assert_eq!(
            check_format("nb_live_short"),
            Err(KeyFormatError::Malformed)
        );
        assert_eq!(check_format("short"), Err(KeyFormatError::Legacy));
        assert_eq!(check_format("legacy-key-0123456789"), Ok(()));
        assert_eq!(
            check_format("has space in it 0123"),
            Err(KeyFormatError::Legacy)
        );
    }

    #[test]
    fn hashes_round_trip() {
        let k = "legacy-key-0123456789";
        let h = format!("sha256:{}", hash_hex(k));
        assert_eq!(parse_hash(&h).unwrap(), digest(k));
        assert!(parse_hash("sha256:zz").is_none());
        assert!(parse_hash("md5:00").is_none());
    }

    #[test]
    fn webhook_secret_shape() {
        let s = generate_webhook_secret();
        assert!(s.starts_with("whsec_"));
        assert_eq!(s.len(), "whsec_".len() + 32);
    }
}
