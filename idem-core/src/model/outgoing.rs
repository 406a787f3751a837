//! A message a handler publishes through the outbox ([`Outgoing`]), the id it gets
//! ([`outbox_message_id`]) and the headers that tie it to the message that caused it.

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
    /// The exchange (`""`: the default exchange, where the routing key names the queue).
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The message.
    pub envelope: Envelope,
}

impl Outgoing {
    /// `body` to `exchange` with `routing_key`, no properties.
    pub fn new(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        body: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            envelope: Envelope::new(body),
        }
    }

    /// `value` as JSON (`content_type: application/json`) to `exchange` with `routing_key`.
    pub fn json<T: Serialize + ?Sized>(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        let mut message = Self::new(exchange, routing_key, serde_json::to_vec(value)?);
        message.envelope.content_type = Some("application/json".to_owned());
        Ok(message)
    }

    /// `value` as JSON to `queue`, through the default exchange.
    pub fn to_queue<T: Serialize + ?Sized>(
        queue: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Self::json("", queue, value)
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

    /// The message id, once set.
    pub fn message_id(&self) -> Option<&str> {
        self.envelope.message_id.as_deref()
    }
}

/// The reply to `request` (processed by `consumer` under `key`) carrying `output`, when the
/// request names a `reply_to` queue: sent there through the default exchange, as JSON, with
/// the request's correlation id (else its message id) and the id [`reply_message_id`], the
/// same for a duplicate of the request, which gets the stored result.
pub fn reply(
    request: &Envelope,
    consumer: &str,
    key: &str,
    output: &StoredOutput,
) -> Option<Outgoing> {
    let queue = request.reply_to.as_deref()?;
    let mut reply = Outgoing::new("", queue, output.as_json().as_bytes().to_vec());
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

/// The id of the `ordinal`-th message (from 0) staged while `consumer` processed key `key`: a
/// UUIDv5 of the three, so a run repeated after a rollback, or a message published again after
/// a crash, carries the same id, and the next idem consumer deduplicates it.
pub fn outbox_message_id(consumer: &str, key: &str, ordinal: u32) -> String {
    let mut name = Vec::with_capacity(consumer.len() + key.len() + 16);
    name.extend_from_slice(consumer.as_bytes());
    name.push(0x1f);
    name.extend_from_slice(key.as_bytes());
    name.push(0x1f);
    name.extend_from_slice(ordinal.to_string().as_bytes());
    uuid::Uuid::new_v5(&NAMESPACE, &name).to_string()
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
