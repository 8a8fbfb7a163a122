//! Session and file ids: 21 characters of `[A-Za-z0-9_-]`, the shape LibreChat accepts.

use rand::Rng;

/// Length of every id this broker hands out.
pub const ID_LEN: usize = 21;

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-";

/// A fresh random id with 126 bits of entropy, so ids cannot be guessed.
pub fn new_id() -> String {
    let mut rng = rand::rng();
    (0..ID_LEN)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// Whether `s` has the shape of an id (it may still be unknown).
pub fn is_valid_id(s: &str) -> bool {
    s.len() == ID_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_ids_are_valid_and_distinct() {
        let a = new_id();
        let b = new_id();
        assert!(is_valid_id(&a), "{a}");
        assert_ne!(a, b);
    }

    #[test]
    fn rejects_other_shapes() {
        assert!(!is_valid_id("short"));
        assert!(!is_valid_id("../../../../etc/passwd"));
        assert!(!is_valid_id("abcdefghijklmnopqrst/"));
        assert!(is_valid_id("abcdefghijklmnopqrs_-"));
    }
}
