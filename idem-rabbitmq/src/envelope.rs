//! Mapping between lapin deliveries and idem envelopes.

use idem_core::transport::IdemHeader;
use idem_core::{model::Envelope, model::HeaderValue, model::Headers, model::OutgoingError};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

/// The header idem sets on a retried copy: which attempt it is.
pub const ATTEMPT_HEADER: &str = amqp(IdemHeader::Attempt);
/// The header idem sets on a message's first retry copy: when its first attempt failed.
pub const FIRST_FAILURE_HEADER: &str = amqp(IdemHeader::FirstFailure);

/// The header of a dead letter moved without its record (the store refused it for good): the
/// reason code (`decode`, `conflict`, …).
pub const REASON_HEADER: &str = amqp(IdemHeader::DeadLetterReason);

/// Beside [`REASON_HEADER`]: the reason's detail, at most 1 KiB.
pub const REASON_DETAIL_HEADER: &str = amqp(IdemHeader::DeadLetterDetail);

/// `header`'s name in an AMQP header table, in core's vocabulary ([`IdemHeader::amqp_name`]).
const fn amqp(header: IdemHeader) -> &'static str {
    match header.amqp_name() {
        Some(name) => name,
        None => panic!("AMQP carries this header in a field of its own"),
    }
}

/// Builds the envelope of a delivery. The attempt is the retry copy's (from
/// [`ATTEMPT_HEADER`], 1 for an original): a redelivery of the same copy (its consumer died or
/// lost its connection, or gave it back) is the same attempt, so it does not use up the retry
/// policy's attempts; handler runs that never settle are the poison limit's to count.
pub(crate) fn envelope(properties: &BasicProperties, body: Vec<u8>, redelivered: bool) -> Envelope {
    let headers = properties
        .headers()
        .as_ref()
        .map(headers)
        .unwrap_or_default();
    let int = |name: &str| match headers.get(name) {
        Some(HeaderValue::Int(n)) => u32::try_from(*n).ok(),
        _ => None,
    };
    let attempt = int(ATTEMPT_HEADER).unwrap_or(1).max(1);
    let mut envelope = Envelope::new(body).with_attempt(attempt);
    envelope.message_id = properties.message_id().as_ref().map(ToString::to_string);
    envelope.correlation_id = properties
        .correlation_id()
        .as_ref()
        .map(ToString::to_string);
    envelope.content_type = properties.content_type().as_ref().map(ToString::to_string);
    envelope.reply_to = properties.reply_to().as_ref().map(ToString::to_string);
    envelope.headers = headers;
    envelope.redelivered = redelivered;
    envelope.published_at_ms = published_at_ms(properties);
    envelope
}

/// When the message was published, from AMQP's `timestamp` (seconds since the Unix epoch, as
/// the producer wrote it), in milliseconds; none for 0 (no time) or one past any real clock.
pub(crate) fn published_at_ms(properties: &BasicProperties) -> Option<i64> {
    let seconds = (*properties.timestamp())?;
    let ms = i64::try_from(seconds).ok()?.checked_mul(1000)?;
    (ms > 0).then_some(ms)
}

/// `text` as an AMQP short string, or what is wrong with it: over
/// [`MAX_SHORT_TEXT`](idem_core::model::MAX_SHORT_TEXT) bytes
/// (lapin's `ShortString::from` would panic on it).
pub(crate) fn short(field: &str, text: &str) -> Result<ShortString, OutgoingError> {
    ShortString::try_new(text).map_err(|_| OutgoingError {
        field: field.to_owned(),
        len: text.len(),
    })
}

/// The AMQP properties of an outgoing message: its message id, correlation id, content type,
/// reply-to queue and headers (text as long strings, integers as 64-bit, bytes as byte arrays),
/// persistent; a short field over [`MAX_SHORT_TEXT`](idem_core::model::MAX_SHORT_TEXT) bytes is an
/// error, never a panic.
pub(crate) fn properties(message: &Envelope) -> Result<BasicProperties, OutgoingError> {
    let mut properties = BasicProperties::default().with_delivery_mode(2);
    if let Some(id) = &message.message_id {
        properties = properties.with_message_id(short("message id", id)?);
    }
    if let Some(id) = &message.correlation_id {
        properties = properties.with_correlation_id(short("correlation id", id)?);
    }
    if let Some(content_type) = &message.content_type {
        properties = properties.with_content_type(short("content type", content_type)?);
    }
    if let Some(queue) = &message.reply_to {
        properties = properties.with_reply_to(short("reply-to queue", queue)?);
    }
    if let Some(ms) = message.published_at_ms.filter(|ms| *ms > 0) {
        properties = properties.with_timestamp(u64::try_from(ms / 1000).unwrap_or(0));
    }
    if !message.headers.is_empty() {
        let mut table = FieldTable::default();
        for (name, value) in message.headers.iter() {
            let value = match value {
                HeaderValue::Str(s) => AMQPValue::LongString(s.as_bytes().to_vec().into()),
                HeaderValue::Int(n) => AMQPValue::LongLongInt(*n),
                HeaderValue::Bool(b) => AMQPValue::Boolean(*b),
                HeaderValue::Float(f) => AMQPValue::Double(*f),
                HeaderValue::Bytes(b) => AMQPValue::ByteArray(b.clone().into()),
                _ => continue,
            };
            table.insert(short("header name", name)?, value);
        }
        properties = properties.with_headers(table);
    }
    Ok(properties)
}

/// About how many bytes `table` takes on the wire (names, type tags, lengths and values).
pub(crate) fn table_size(table: &FieldTable) -> usize {
    4 + table
        .inner()
        .iter()
        .map(|(name, value)| 1 + name.as_str().len() + value_size(value))
        .sum::<usize>()
}

fn value_size(value: &AMQPValue) -> usize {
    1 + match value {
        AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        AMQPValue::FieldTable(t) => table_size(t),
        AMQPValue::FieldArray(a) => 4 + a.as_slice().iter().map(value_size).sum::<usize>(),
        _ => 8,
    }
}

/// Converts AMQP headers; values idem has no use for (tables, arrays, decimals, timestamps)
/// are left out of the envelope (they stay on the message when it is republished).
fn headers(table: &FieldTable) -> Headers {
    let mut headers = Headers::default();
    for (name, value) in table {
        let value = match value {
            AMQPValue::LongString(s) => match std::str::from_utf8(s.as_bytes()) {
                Ok(text) => HeaderValue::Str(text.to_owned()),
                Err(_) => HeaderValue::Bytes(s.as_bytes().to_vec()),
            },
            AMQPValue::ShortString(s) => HeaderValue::Str(s.to_string()),
            AMQPValue::Boolean(b) => HeaderValue::Bool(*b),
            AMQPValue::ShortShortInt(n) => HeaderValue::Int(i64::from(*n)),
            AMQPValue::ShortShortUInt(n) => HeaderValue::Int(i64::from(*n)),
            AMQPValue::ShortInt(n) => HeaderValue::Int(i64::from(*n)),
            AMQPValue::ShortUInt(n) => HeaderValue::Int(i64::from(*n)),
            AMQPValue::LongInt(n) => HeaderValue::Int(i64::from(*n)),
            AMQPValue::LongUInt(n) => HeaderValue::Int(i64::from(*n)),
            AMQPValue::LongLongInt(n) => HeaderValue::Int(*n),
            AMQPValue::Float(f) => HeaderValue::Float(f64::from(*f)),
            AMQPValue::Double(f) => HeaderValue::Float(*f),
            AMQPValue::ByteArray(b) => HeaderValue::Bytes(b.as_slice().to_vec()),
            _ => continue,
        };
        headers.insert(name.to_string(), value);
    }
    headers
}

/// The properties of a delivery with `header` set, for republishing it (persistent).
pub(crate) fn with_headers(
    properties: &BasicProperties,
    set: &[(&str, AMQPValue)],
) -> BasicProperties {
    let mut table = properties.headers().clone().unwrap_or_default();
    for (name, value) in set {
        table.insert(ShortString::from(*name), value.clone());
    }
    properties.clone().with_headers(table).with_delivery_mode(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_table_is_measured_as_it_travels() {
        let mut table = FieldTable::default();
        assert_eq!(table_size(&table), 4);
        table.insert(
            ShortString::from("ab"),
            AMQPValue::LongString(b"xyz".to_vec().into()),
        );
        let mut inner = FieldTable::default();
        inner.insert(ShortString::from("n"), AMQPValue::LongLongInt(1));
        table.insert(ShortString::from("t"), AMQPValue::FieldTable(inner));
        // "ab": 1 + 2 + (1 + 4 + 3); "t": 1 + 1 + (1 + 4 + (1 + 1 + 1 + 8)).
        assert_eq!(table_size(&table), 4 + 11 + 18);
    }

    /// Every short field over 255 bytes is an error, never lapin's panic; 255 bytes fit.
    #[test]
    fn properties_too_long_for_amqp_are_an_error() {
        let long = "x".repeat(256);
        let fits = "x".repeat(255);
        let message = |set: &dyn Fn(&mut Envelope, &str)| {
            let mut envelope = Envelope::new(b"{}".to_vec());
            set(&mut envelope, &long);
            let failed = properties(&envelope).unwrap_err();
            set(&mut envelope, &fits);
            assert!(properties(&envelope).is_ok());
            failed.field
        };
        assert_eq!(
            message(&|e, t| e.message_id = Some(t.to_owned())),
            "message id"
        );
        assert_eq!(
            message(&|e, t| e.correlation_id = Some(t.to_owned())),
            "correlation id"
        );
        assert_eq!(
            message(&|e, t| e.content_type = Some(t.to_owned())),
            "content type"
        );
        assert_eq!(
            message(&|e, t| e.reply_to = Some(t.to_owned())),
            "reply-to queue"
        );
        let mut named = Envelope::new(b"{}".to_vec());
        named.headers.insert(long.as_str(), 1);
        assert_eq!(properties(&named).unwrap_err().field, "header name");
    }

    #[test]
    fn attempts_and_properties() {
        let mut table = FieldTable::default();
        let text = AMQPValue::LongString(lapin::types::LongString::from(b"k-1".to_vec()));
        table.insert(ShortString::from("x-idempotency-key"), text);
        table.insert(ShortString::from(ATTEMPT_HEADER), AMQPValue::LongLongInt(3));
        let props = BasicProperties::default()
            .with_message_id(ShortString::from("m-1"))
            .with_correlation_id(ShortString::from("c-1"))
            .with_headers(table);
        let env = envelope(&props, b"{}".to_vec(), false);
        assert_eq!(env.message_id.as_deref(), Some("m-1"));
        assert_eq!(env.correlation_id.as_deref(), Some("c-1"));
        assert_eq!(
            env.headers.get("x-idempotency-key"),
            Some(&HeaderValue::Str("k-1".into()))
        );
        assert_eq!(env.attempt, 3);
        // A redelivery is the same attempt, also when a quorum queue counts it.
        assert_eq!(
            envelope(&BasicProperties::default(), vec![], true).attempt,
            1
        );
        let mut counted = FieldTable::default();
        counted.insert(
            ShortString::from("x-delivery-count"),
            AMQPValue::LongLongInt(2),
        );
        let given_back = BasicProperties::default().with_headers(counted);
        assert_eq!(envelope(&given_back, vec![], true).attempt, 1);
        assert_eq!(
            envelope(&BasicProperties::default(), vec![], false).attempt,
            1
        );
        let republished = with_headers(&props, &[(ATTEMPT_HEADER, AMQPValue::LongLongInt(4))]);
        assert_eq!(envelope(&republished, vec![], false).attempt, 4);
        assert_eq!(
            republished
                .message_id()
                .as_ref()
                .map(ToString::to_string)
                .as_deref(),
            Some("m-1")
        );
    }

    /// AMQP's `timestamp` is seconds: read as milliseconds, written back as seconds; 0 and a
    /// time no clock reaches are no time.
    #[test]
    fn a_publish_time_travels_in_the_timestamp() {
        let at = |seconds| BasicProperties::default().with_timestamp(seconds);
        assert_eq!(published_at_ms(&at(1_800_000_000)), Some(1_800_000_000_000));
        assert_eq!(published_at_ms(&at(0)), None);
        assert_eq!(published_at_ms(&at(u64::MAX)), None);
        assert_eq!(published_at_ms(&BasicProperties::default()), None);
        let envelope = Envelope::new(b"{}".to_vec()).with_published_at_ms(1_800_000_000_999);
        assert_eq!(
            *properties(&envelope).unwrap().timestamp(),
            Some(1_800_000_000)
        );
        assert_eq!(
            *properties(&Envelope::new(b"{}".to_vec()))
                .unwrap()
                .timestamp(),
            None
        );
    }
}
