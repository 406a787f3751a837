//! The `Idempotency-Key` header, the scope a key is stored under, and the request's fingerprint.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use http::HeaderValue;
use http::request::Parts;
use idem_core::model::Fingerprint;
use sha2::{Digest, Sha256};

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The longest key accepted unless [`crate::Idempotency::max_key_len`] says otherwise.
pub const DEFAULT_MAX_KEY_LEN: usize = 255;

/// Why a request's `Idempotency-Key` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The route requires a key and the request has none.
    #[error("this operation requires an Idempotency-Key header")]
    Missing,
    /// The header appears more than once.
    #[error("the Idempotency-Key header appears more than once")]
    Repeated,
    /// The value is not a structured-field string (nor a bare token of visible ASCII).
    #[error("the Idempotency-Key header is not a structured-field string: {0}")]
    Malformed(&'static str),
    /// The key is empty.
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// The key is longer than allowed.
    #[error("the Idempotency-Key is {len} characters long; at most {max} are accepted")]
    TooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// Reads the key from `parts`: `Ok(None)` when there is no header.
///
/// The value is a structured-field string (RFC 8941: `"..."` with `\"` and `\\` escapes, visible
/// ASCII and spaces). A bare value of visible ASCII without quotes, as many clients send, is
/// accepted as it is.
pub fn read(parts: &Parts, max_len: usize) -> Result<Option<String>, KeyError> {
    let mut values = parts.headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    let key = parse(value)?;
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > max_len {
        return Err(KeyError::TooLong {
            len: key.len(),
            max: max_len,
        });
    }
    Ok(Some(key))
}

/// Parses one header value.
fn parse(value: &HeaderValue) -> Result<String, KeyError> {
    let bytes = value.as_bytes();
    let Some(quoted) = bytes.strip_prefix(b"\"") else {
        return match bytes
            .iter()
            .all(|b| (0x21..=0x7e).contains(b) && *b != b'"')
        {
            true => Ok(String::from_utf8_lossy(bytes).into_owned()),
            false => Err(KeyError::Malformed("a bare key must be visible ASCII")),
        };
    };
    let mut key = String::with_capacity(quoted.len());
    let mut chars = quoted.iter();
    loop {
        match chars.next() {
            None => return Err(KeyError::Malformed("the closing quote is missing")),
            Some(b'"') => break,
            Some(b'\\') => match chars.next() {
                Some(c @ (b'"' | b'\\')) => key.push(char::from(*c)),
                _ => return Err(KeyError::Malformed("only \\\" and \\\\ are escapes")),
            },
            Some(c) if (0x20..=0x7e).contains(c) => key.push(char::from(*c)),
            Some(_) => return Err(KeyError::Malformed("a string holds visible ASCII only")),
        }
    }
    match chars.next() {
        None => Ok(key),
        Some(_) => Err(KeyError::Malformed("characters follow the closing quote")),
    }
}

/// Where a key is stored: the inbox's `(consumer, key)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    /// `http:<operation>`.
    pub consumer: String,
    /// `<client>:<key>`: the client is a digest of its identity (128 bits of its SHA-256 in
    /// base64url; never the identity itself, which may be a credential), or `-` for a shared
    /// key space.
    pub key: String,
}

impl Scope {
    /// The scope of `key` sent by `client` to `operation`.
    pub fn new(operation: &str, client: Option<&str>, key: &str) -> Self {
        let client = match client {
            Some(identity) => URL_SAFE_NO_PAD.encode(&Sha256::digest(identity.as_bytes())[..16]),
            None => "-".to_owned(),
        };
        Self {
            consumer: format!("http:{operation}"),
            key: format!("{client}:{key}"),
        }
    }
}

/// The fingerprint of a request: its method, path and query, and body. The same key sent with
/// any of them different is a mismatch (422).
pub fn fingerprint(parts: &Parts, body: &[u8]) -> Fingerprint {
    let path = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |p| p.as_str());
    let digest = Sha256::new()
        .chain_update(parts.method.as_str())
        .chain_update([0])
        .chain_update(path)
        .chain_update([0])
        .chain_update(body)
        .finalize();
    Fingerprint::of_digest(digest.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(values: &[&'static str]) -> Parts {
        let mut request = Request::post("/payments");
        for value in values {
            request = request.header(IDEMPOTENCY_KEY, *value);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn reads_structured_field_strings_and_bare_tokens() {
        assert_eq!(read(&parts(&[]), 255), Ok(None));
        assert_eq!(read(&parts(&["\"abc-1\""]), 255), Ok(Some("abc-1".into())));
        assert_eq!(
            read(&parts(&[r#""a \"b\" \\c""#]), 255),
            Ok(Some(r#"a "b" \c"#.into()))
        );
        assert_eq!(
            read(&parts(&["8e03978e-40d5"]), 255),
            Ok(Some("8e03978e-40d5".into()))
        );
    }

    #[test]
    fn refuses_what_is_not_a_key() {
        assert_eq!(read(&parts(&["\"\""]), 255), Err(KeyError::Empty));
        assert_eq!(
            read(&parts(&["\"a", "\"b\""]), 255),
            Err(KeyError::Repeated)
        );
        assert!(matches!(
            read(&parts(&["\"abc"]), 255),
            Err(KeyError::Malformed(_))
        ));
        assert!(matches!(
            read(&parts(&["\"abc\"x"]), 255),
            Err(KeyError::Malformed(_))
        ));
        assert!(matches!(
            read(&parts(&[r#""a\nb""#]), 255),
            Err(KeyError::Malformed(_))
        ));
        assert!(matches!(
            read(&parts(&["a b"]), 255),
            Err(KeyError::Malformed(_))
        ));
        assert_eq!(
            read(&parts(&["\"abcdef\""]), 5),
            Err(KeyError::TooLong { len: 6, max: 5 })
        );
    }

    #[test]
    fn scopes_keep_clients_apart_without_storing_identities() {
        let alice = Scope::new("payments", Some("token-alice"), "k");
        let bob = Scope::new("payments", Some("token-bob"), "k");
        assert_ne!(alice, bob);
        assert_eq!(alice.consumer, "http:payments");
        assert!(!alice.key.contains("token"));
        assert_eq!(Scope::new("payments", None, "k").key, "-:k");
    }

    #[test]
    fn fingerprints_cover_method_path_and_body() {
        let post = |uri: &str| Request::post(uri).body(()).unwrap().into_parts().0;
        let base = fingerprint(&post("/p?x=1"), b"{}");
        assert_eq!(base, fingerprint(&post("/p?x=1"), b"{}"));
        assert_ne!(base, fingerprint(&post("/p?x=2"), b"{}"));
        assert_ne!(base, fingerprint(&post("/p?x=1"), b"{ }"));
        let put = Request::put("/p?x=1").body(()).unwrap().into_parts().0;
        assert_ne!(base, fingerprint(&put, b"{}"));
    }
}
