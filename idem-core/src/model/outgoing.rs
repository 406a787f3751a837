//! A message a handler publishes through the outbox ([`Outgoing`]), the id it gets
//! ([`outbox_message_id`]) and the headers that tie it to the message that caused it.

use super::destination::Destination;
use super::envelope::{Envelope, HeaderValue, Headers};
use super::outcome::StoredOutput;
use serde::Serialize;

/// The header naming the message whose processing published this one (its message id).
pub const CAUSATION_HEADER: &str = "causation_id";

/// The W3C trace context header, copied from the incoming message when it has one.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// The namespace of outbox message ids (a UUIDv5 namespace of idem's own).
const NAMESPACE: uuid::Uuid = uuid::Uuid::from_u128(0x6d1c_44e2_8f0b_4b6e_9a57_2f3c_1d0e_a7b9);

/// A message to publish once the transaction that staged it commits: where it goes, and the
/// message (body, message id, correlation id, content type, headers).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Outgoing {
    /// Where it goes.
    pub destination: Destination,
    /// The message.
    pub envelope: Envelope,
    /// When the relay may publish it, in milliseconds since the Unix epoch
    /// ([`Outgoing::deliver_at`]); `None`: as soon as its transaction commits.
    pub deliver_at_ms: Option<i64>,
    /// The id a broker with a duplicate window (JetStream's `Nats-Msg-Id`) knows this copy by,
    /// where that is not its message id: a message idem publishes again (a parked key's
    /// release) names the one release it makes, so that the window never swallows it
    /// ([`crate::transport::CopyId`]). `None`: its message id.
    pub copy_id: Option<String>,
}

impl Outgoing {
    /// `body` to `destination`, no properties.
    pub fn new(destination: Destination, body: impl Into<Vec<u8>>) -> Self {
        Self {
            destination,
            deliver_at_ms: None,
            envelope: Envelope::new(body),
            copy_id: None,
        }
    }

    /// `value` as JSON (`content_type: application/json`) to `destination`.
    pub fn json<T: Serialize + ?Sized>(
        destination: Destination,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        let mut message = Self::new(destination, serde_json::to_vec(value)?);
        message.envelope.content_type = Some("application/json".to_owned());
        Ok(message)
    }

    /// `value` as JSON straight to `queue` ([`Destination::Queue`]).
    pub fn to_queue<T: Serialize + ?Sized>(
        queue: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Self::json(Destination::queue(queue), value)
    }

    /// `value` as JSON to `topic`, routed by `key` ([`Destination::Topic`]).
    pub fn to_topic<T: Serialize + ?Sized>(
        topic: impl Into<String>,
        key: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Self::json(Destination::topic(topic, key), value)
    }

    /// Sets the message id (staged by a handler, a message without one gets
    /// [`outbox_message_id`]).
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.envelope.message_id = Some(id.into());
        self
    }

    /// Sets the correlation id.
    pub fn with_correlation_id(mut self, id: impl Into<String>) -> Self {
        self.envelope.correlation_id = Some(id.into());
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<HeaderValue>) -> Self {
        self.envelope.headers.insert(name, value);
        self
    }

    /// Published no earlier than `at` (a scheduled send): staged in the outbox as any message,
    /// and published by the outbox relay once `at` has come (within the relay's interval and
    /// the age it waits for, 2.5 s by default), never before. It is published as of `at`, and
    /// survives restarts as any staged row. A time already past publishes it as soon as it
    /// commits.
    pub fn deliver_at(mut self, at: std::time::SystemTime) -> Self {
        let ms = at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        self.deliver_at_ms = Some(ms);
        self
    }

    /// Published no earlier than `delay` from now ([`Outgoing::deliver_at`]).
    pub fn deliver_after(self, delay: std::time::Duration) -> Self {
        self.deliver_at(std::time::SystemTime::now() + delay)
    }

    /// When it is due, if it is scheduled for a time after `now_ms`.
    pub fn scheduled_after(&self, now_ms: i64) -> Option<i64> {
        self.deliver_at_ms.filter(|at| *at > now_ms)
    }

    /// The message id, once set.
    pub fn message_id(&self) -> Option<&str> {
        self.envelope.message_id.as_deref()
    }
}

/// The longest text a broker carries in a short field (AMQP's short strings: a destination's
/// topic and key or queue, the message id, the correlation id, the content type, the reply-to
/// queue and every header name), in bytes.
pub const MAX_SHORT_TEXT: usize = 255;

/// An outgoing message a broker cannot carry as it is: refused where it is made (staged,
/// replied, published), never sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the outgoing message's {field} is {len} bytes long; a broker carries at most {MAX_SHORT_TEXT}"
)]
pub struct OutgoingError {
    /// What is too long (`topic`, `key`, `queue`, `message id`, `header name "…"`, …).
    pub field: String,
    /// Its length in bytes.
    pub len: usize,
}

/// Checks that a message to `destination` with `envelope`'s properties fits a broker's short
/// fields ([`MAX_SHORT_TEXT`]).
pub fn check_outgoing(destination: &Destination, envelope: &Envelope) -> Result<(), OutgoingError> {
    let short = |field: &str, text: Option<&str>| match text {
        Some(text) if text.len() > MAX_SHORT_TEXT => Err(OutgoingError {
            field: field.to_owned(),
            len: text.len(),
        }),
        _ => Ok(()),
    };
    match destination {
        Destination::Queue(name) => short("queue", Some(name))?,
        Destination::Topic { topic, key } => {
            short("topic", Some(topic))?;
            short("key", Some(key))?;
        }
    }
    short("message id", envelope.message_id.as_deref())?;
    short("correlation id", envelope.correlation_id.as_deref())?;
    short("content type", envelope.content_type.as_deref())?;
    short("reply-to queue", envelope.reply_to.as_deref())?;
    for (name, _) in envelope.headers.iter() {
        let shown: String = name.chars().take(32).collect();
        short(&format!("header name \"{shown}…\""), Some(name))?;
    }
    Ok(())
}

impl Outgoing {
    /// Checks that a broker can carry this message ([`check_outgoing`]).
    pub fn check(&self) -> Result<(), OutgoingError> {
        check_outgoing(&self.destination, &self.envelope)
    }
}

/// The reply to `request` (processed by `consumer` under `key`) carrying `output`, when the
/// request names a `reply_to` queue: sent straight to that queue, as JSON, with
/// the request's correlation id (else its message id) and the id [`reply_message_id`], the
/// same for a duplicate of the request, which gets the stored result.
pub fn reply(
    request: &Envelope,
    consumer: &str,
    key: &str,
    output: &StoredOutput,
) -> Option<Outgoing> {
    let queue = request.reply_to.as_deref()?;
    let mut reply = Outgoing::new(
        Destination::queue(queue),
        output.as_json().as_bytes().to_vec(),
    );
    let envelope = &mut reply.envelope;
    envelope.content_type = Some("application/json".to_owned());
    envelope.message_id = Some(reply_message_id(consumer, key));
    envelope.correlation_id = request
        .correlation_id
        .clone()
        .or_else(|| request.message_id.clone());
    if let Some(cause) = &request.message_id {
        envelope.headers.insert(CAUSATION_HEADER, cause.as_str());
    }
    if let Some(trace) = request.headers.get(TRACEPARENT_HEADER) {
        envelope.headers.insert(TRACEPARENT_HEADER, trace.clone());
    }
    Some(reply)
}

/// The id of the reply to key `key` of `consumer`: a UUIDv5 apart from every
/// [`outbox_message_id`].
pub fn reply_message_id(consumer: &str, key: &str) -> String {
    let name = format!("reply\x1f{consumer}\x1f{key}");
    uuid::Uuid::new_v5(&NAMESPACE, name.as_bytes()).to_string()
}

/// The namespace of the ids a batch handler's own context stamps (a UUIDv5 namespace of idem's
/// own, apart from [`NAMESPACE`]).
const BATCH_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x2b7e_9f41_06d3_4c8a_b1e5_93a0_5c7d_e214);

/// The id of the `ordinal`-th message (from 0) a batch handler staged through the batch's own
/// context, whose first message has key `key`: like [`outbox_message_id`], in a namespace of
/// its own, so that it never equals an id the batch's messages' contexts stamp.
pub fn batch_message_id(consumer: &str, key: &str, ordinal: u32) -> String {
    uuid::Uuid::new_v5(&BATCH_NAMESPACE, &message_name(consumer, key, ordinal)).to_string()
}

/// The id of the `ordinal`-th message (from 0) staged while `consumer` processed key `key`: a
/// UUIDv5 of the three, so a run repeated after a rollback, or a message published again after
/// a crash, carries the same id, and the next idem consumer deduplicates it.
pub fn outbox_message_id(consumer: &str, key: &str, ordinal: u32) -> String {
    uuid::Uuid::new_v5(&NAMESPACE, &message_name(consumer, key, ordinal)).to_string()
}

/// The name a staged message's id is derived from.
fn message_name(consumer: &str, key: &str, ordinal: u32) -> Vec<u8> {
    let mut name = Vec::with_capacity(consumer.len() + key.len() + 16);
    name.extend_from_slice(consumer.as_bytes());
    name.push(0x1f);
    name.extend_from_slice(key.as_bytes());
    name.push(0x1f);
    name.extend_from_slice(ordinal.to_string().as_bytes());
    name
}

/// The headers as JSON text, for an outbox row: text as strings, integers, booleans and
/// floats as JSON numbers and booleans, bytes as `{"bytes": [..]}`.
pub fn headers_to_json(headers: &Headers) -> String {
    let map: serde_json::Map<String, serde_json::Value> = headers
        .iter()
        .map(|(name, value)| {
            let value = match value {
                HeaderValue::Str(s) => serde_json::Value::from(s.as_str()),
                HeaderValue::Int(i) => serde_json::Value::from(*i),
                HeaderValue::Bool(b) => serde_json::Value::from(*b),
                HeaderValue::Float(f) => serde_json::Value::from(*f),
                HeaderValue::Bytes(b) => serde_json::json!({ "bytes": b }),
            };
            (name.to_owned(), value)
        })
        .collect();
    serde_json::Value::Object(map).to_string()
}

/// The headers of an outbox row, as [`headers_to_json`] wrote them; a value of another shape
/// is left out.
pub fn headers_from_json(text: &str) -> Result<Headers, serde_json::Error> {
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)?;
    let mut headers = Headers::default();
    for (name, value) in map {
        let value = match value {
            serde_json::Value::String(s) => HeaderValue::Str(s),
            serde_json::Value::Bool(b) => HeaderValue::Bool(b),
            serde_json::Value::Number(n) => match n.as_i64() {
                Some(i) => HeaderValue::Int(i),
                None => HeaderValue::Float(n.as_f64().unwrap_or_default()),
            },
            serde_json::Value::Object(o) => match o.get("bytes") {
                Some(bytes) => HeaderValue::Bytes(serde_json::from_value(bytes.clone())?),
                None => continue,
            },
            _ => continue,
        };
        headers.insert(name, value);
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_no_broker_can_carry_is_named_by_its_field() {
        let long = "x".repeat(MAX_SHORT_TEXT + 1);
        let fits = "x".repeat(MAX_SHORT_TEXT);
        assert!(
            Outgoing::new(Destination::topic(fits.as_str(), fits.as_str()), "b")
                .check()
                .is_ok()
        );
        let cases = [
            (
                Outgoing::new(Destination::topic(long.as_str(), "k"), "b"),
                "topic",
            ),
            (
                Outgoing::new(Destination::topic("t", long.as_str()), "b"),
                "key",
            ),
            (
                Outgoing::new(Destination::queue(long.as_str()), "b"),
                "queue",
            ),
            (
                Outgoing::new(Destination::queue("q"), "b").with_message_id(long.as_str()),
                "message id",
            ),
            (
                Outgoing::new(Destination::queue("q"), "b").with_correlation_id(long.as_str()),
                "correlation id",
            ),
            (
                Outgoing::new(Destination::queue("q"), "b").with_header(long.as_str(), 1),
                "header name",
            ),
        ];
        for (message, field) in cases {
            let error = message.check().unwrap_err();
            assert!(error.field.starts_with(field), "{error}");
            assert_eq!(error.len, MAX_SHORT_TEXT + 1);
        }
        let mut envelope = Envelope::new(b"b".to_vec());
        envelope.content_type = Some(long.clone());
        assert_eq!(
            check_outgoing(&Destination::queue("q"), &envelope)
                .unwrap_err()
                .field,
            "content type"
        );
        envelope.content_type = None;
        envelope.reply_to = Some(long);
        assert_eq!(
            check_outgoing(&Destination::queue("q"), &envelope)
                .unwrap_err()
                .field,
            "reply-to queue"
        );
    }

    #[test]
    fn ids_are_derived_from_consumer_key_and_ordinal() {
        let id = outbox_message_id("orders", "o-1", 0);
        assert_eq!(id, outbox_message_id("orders", "o-1", 0));
        assert_eq!(uuid::Uuid::parse_str(&id).unwrap().get_version_num(), 5);
        assert_ne!(id, outbox_message_id("orders", "o-1", 1));
        assert_ne!(id, outbox_message_id("orders", "o-2", 0));
        assert_ne!(id, outbox_message_id("billing", "o-1", 0));
        // The separator keeps ("a", "b\x1f0") and ("a\x1fb", "0") apart only up to that byte,
        // which keys and consumers do not hold in practice; different splits still differ here.
        assert_ne!(
            outbox_message_id("ab", "c", 0),
            outbox_message_id("a", "bc", 0)
        );
    }

    #[test]
    fn headers_round_trip_through_json() {
        let mut headers = Headers::default();
        headers.insert("s", "text");
        headers.insert("i", -7i64);
        headers.insert("b", true);
        headers.insert("f", HeaderValue::Float(1.5));
        headers.insert("raw", vec![0u8, 255]);
        let back = headers_from_json(&headers_to_json(&headers)).unwrap();
        assert_eq!(back, headers);
    }
}
