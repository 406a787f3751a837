//! Payload fingerprints: what tells a duplicate from a conflicting reuse of a key.

use sha2::{Digest, Sha256};
use std::fmt;

/// The SHA-256 of a message body, stored on the inbox row.
///
/// A redelivery with the same key and the same fingerprint is a duplicate; the same key with
/// another fingerprint is a conflict (the producer reused an id for different content).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprints a message body.
    pub fn of(body: &[u8]) -> Self {
        Self(Sha256::digest(body).into())
    }

    /// A SHA-256 digest computed elsewhere (of several parts, as an HTTP request's method,
    /// path and body).
    pub fn of_digest(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    /// A fingerprint read back from storage; `None` unless `bytes` is 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// The 32 digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_body_same_fingerprint_and_round_trip() {
        let a = Fingerprint::of(b"{\"a\":1}");
        assert_eq!(a, Fingerprint::of(b"{\"a\":1}"));
        assert_ne!(a, Fingerprint::of(b"{\"a\":2}"));
        assert_eq!(Fingerprint::from_slice(a.as_bytes()), Some(a));
        assert_eq!(Fingerprint::from_slice(&[0; 31]), None);
        assert_eq!(
            Fingerprint::of(b"").to_string(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
