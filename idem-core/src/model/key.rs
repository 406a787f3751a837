//! Dedup keys: where a handler's key comes from, and how it is read.

use super::envelope::Envelope;
use std::borrow::Cow;
use std::fmt;

/// The longest key idem stores, in bytes. Longer keys are rejected, never truncated
/// (truncation could merge two different messages into one key).
pub const MAX_KEY_LEN: usize = 512;

/// Where a handler's dedup key comes from, as written in `#[idempotent(key = "...")]`.
///
/// Never the delivery tag, the redelivered flag or a receive time: those change between
/// deliveries of one message and would defeat deduplication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeySource {
    /// The message id property (`key = "message_id"`, the default).
    MessageId,
    /// An application header (`key = "header:x-idempotency-key"`).
    Header(&'static str),
    /// A field of the typed payload (`key = "order.order_id"`), read by the generated code.
    Field(&'static str),
    /// CloudEvents `source` and `id` (`key = "cloudevents"`), from the `cloudEvents:*`
    /// (AMQP binding) or `ce-*` headers.
    CloudEvents,
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MessageId => f.write_str("message_id"),
            Self::Header(name) => write!(f, "header:{name}"),
            Self::Field(path) => f.write_str(path),
            Self::CloudEvents => f.write_str("cloudevents"),
        }
    }
}

/// Why no usable key could be read from a message. Always a permanent error: redelivering the
/// same message cannot make its key appear.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The source holds no value.
    #[error("missing dedup key: {what} (key = \"{spec}\")")]
    Missing {
        /// The configured source.
        spec: KeySource,
        /// What was looked for.
        what: Cow<'static, str>,
    },
    /// The source holds an empty value.
    #[error("empty dedup key (key = \"{spec}\")")]
    Empty {
        /// The configured source.
        spec: KeySource,
    },
    /// The value is longer than [`MAX_KEY_LEN`].
    #[error("dedup key is {len} bytes, longer than the {MAX_KEY_LEN} allowed (key = \"{spec}\")")]
    TooLong {
        /// The configured source.
        spec: KeySource,
        /// The key's length in bytes.
        len: usize,
    },
}

impl KeySource {
    /// Reads the key from the envelope for the sources that live there.
    ///
    /// [`KeySource::Field`] keys live in the decoded payload and are read by the code that
    /// `#[idempotent]` generates (see [`field_key`]); asking the envelope for one is an error.
    pub fn from_envelope(self, envelope: &Envelope) -> Result<String, KeyError> {
        match self {
            Self::MessageId => match envelope.message_id.as_deref() {
                Some(id) => checked(self, Cow::Borrowed(id)),
                None => Err(self.missing("the message has no message_id property")),
            },
            Self::Header(name) => match envelope.headers.get(name) {
                Some(value) => match value.as_text() {
                    Some(text) => checked(self, text),
                    None => Err(self.missing(format!("header `{name}` is not text or an integer"))),
                },
                None => Err(self.missing(format!("the message has no `{name}` header"))),
            },
            Self::CloudEvents => {
                let source = cloud_event_attribute(envelope, "source")
                    .ok_or_else(|| self.missing("the message has no CloudEvents `source`"))?;
                let id = cloud_event_attribute(envelope, "id")
                    .ok_or_else(|| self.missing("the message has no CloudEvents `id`"))?;
                if source.is_empty() || id.is_empty() {
                    return Err(KeyError::Empty { spec: self });
                }
                // A CloudEvents source is a URI-reference and holds no space, so the first
                // space separates the two parts unambiguously.
                checked(self, Cow::Owned(format!("{source} {id}")))
            }
            Self::Field(path) => Err(self.missing(format!(
                "payload field `{path}` is read by the generated handler, not from the envelope"
            ))),
        }
    }

    fn missing(self, what: impl Into<Cow<'static, str>>) -> KeyError {
        KeyError::Missing {
            spec: self,
            what: what.into(),
        }
    }
}

/// Reads a CloudEvents attribute from the AMQP binding's `cloudEvents:` headers (or the
/// `cloudEvents_` spelling some JMS bridges use) or the `ce-` headers of other bindings.
fn cloud_event_attribute<'e>(envelope: &'e Envelope, attribute: &str) -> Option<Cow<'e, str>> {
    ["cloudEvents:", "cloudEvents_", "ce-", "ce_"]
        .iter()
        .find_map(|prefix| envelope.headers.get(&format!("{prefix}{attribute}")))
        .and_then(|value| value.as_text())
}

/// A value that can serve as a dedup key: text and integers, and `Option`s of them
/// (`None` is a missing key).
pub trait KeyValue {
    /// The key text, or `None` when the value is absent.
    fn key_text(&self) -> Option<Cow<'_, str>>;
}

impl KeyValue for str {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self))
    }
}

impl KeyValue for String {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self))
    }
}

impl KeyValue for Cow<'_, str> {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self))
    }
}

impl<T: KeyValue + ?Sized> KeyValue for &T {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        (**self).key_text()
    }
}

impl<T: KeyValue + ?Sized> KeyValue for Box<T> {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        (**self).key_text()
    }
}

impl<T: KeyValue> KeyValue for Option<T> {
    fn key_text(&self) -> Option<Cow<'_, str>> {
        self.as_ref().and_then(KeyValue::key_text)
    }
}

macro_rules! integer_keys {
    ($($t:ty),*) => {$(
        impl KeyValue for $t {
            fn key_text(&self) -> Option<Cow<'_, str>> {
                Some(Cow::Owned(self.to_string()))
            }
        }
    )*};
}
integer_keys!(
    i8, i16, i32, i64, i128, isize, u8, u16, u32, u64, u128, usize
);

/// Reads a payload-field key; called by the code `#[idempotent(key = "payload.field")]`
/// generates, with `source` naming the field for error messages.
pub fn field_key<V: KeyValue + ?Sized>(value: &V, source: KeySource) -> Result<String, KeyError> {
    match value.key_text() {
        Some(text) => checked(source, text),
        None => Err(source.missing(format!("payload field `{source}` is empty (None)"))),
    }
}

fn checked(source: KeySource, key: Cow<'_, str>) -> Result<String, KeyError> {
    if key.is_empty() {
        Err(KeyError::Empty { spec: source })
    } else if key.len() > MAX_KEY_LEN {
        Err(KeyError::TooLong {
            spec: source,
            len: key.len(),
        })
    } else {
        Ok(key.into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_id_key() {
        let env = Envelope::new("{}").with_message_id("m-1");
        assert_eq!(
            KeySource::MessageId.from_envelope(&env).as_deref(),
            Ok("m-1")
        );
        let err = KeySource::MessageId
            .from_envelope(&Envelope::new("{}"))
            .unwrap_err();
        assert!(err.to_string().contains("no message_id"), "{err}");
        let empty = Envelope::new("{}").with_message_id("");
        assert_eq!(
            KeySource::MessageId.from_envelope(&empty),
            Err(KeyError::Empty {
                spec: KeySource::MessageId
            })
        );
    }

    #[test]
    fn header_key_accepts_text_and_integers_only() {
        let source = KeySource::Header("x-idempotency-key");
        let env = Envelope::new("{}").with_header("x-idempotency-key", "abc");
        assert_eq!(source.from_envelope(&env).as_deref(), Ok("abc"));
        let env = Envelope::new("{}").with_header("x-idempotency-key", 42_i64);
        assert_eq!(source.from_envelope(&env).as_deref(), Ok("42"));
        let env = Envelope::new("{}").with_header("x-idempotency-key", true);
        assert!(source.from_envelope(&env).is_err());
        let err = source.from_envelope(&Envelope::new("{}")).unwrap_err();
        assert!(
            err.to_string().contains("`x-idempotency-key` header"),
            "{err}"
        );
    }

    #[test]
    fn cloudevents_key_from_either_binding() {
        let amqp = Envelope::new("{}")
            .with_header("cloudEvents:source", "/orders")
            .with_header("cloudEvents:id", "42");
        let kafka_style = Envelope::new("{}")
            .with_header("ce-source", "/orders")
            .with_header("ce-id", "42");
        let k1 = KeySource::CloudEvents.from_envelope(&amqp);
        assert_eq!(k1.as_deref(), Ok("/orders 42"));
        assert_eq!(KeySource::CloudEvents.from_envelope(&kafka_style), k1);
        let no_id = Envelope::new("{}").with_header("ce-source", "/orders");
        let err = KeySource::CloudEvents.from_envelope(&no_id).unwrap_err();
        assert!(err.to_string().contains("CloudEvents `id`"), "{err}");
    }

    #[test]
    fn field_keys_and_limits() {
        let source = KeySource::Field("order.order_id");
        assert_eq!(field_key("o-1", source).as_deref(), Ok("o-1"));
        assert_eq!(field_key(&7_u64, source).as_deref(), Ok("7"));
        assert!(matches!(
            field_key(&None::<String>, source),
            Err(KeyError::Missing { .. })
        ));
        assert_eq!(field_key("", source), Err(KeyError::Empty { spec: source }));
        let long = "x".repeat(MAX_KEY_LEN + 1);
        assert!(matches!(
            field_key(&long, source),
            Err(KeyError::TooLong { .. })
        ));
        let err = source.from_envelope(&Envelope::new("{}")).unwrap_err();
        assert!(err.to_string().contains("order.order_id"), "{err}");
    }
}
