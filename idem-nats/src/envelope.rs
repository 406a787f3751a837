//! Mapping between JetStream messages and idem envelopes. The envelope's properties travel as
//! headers: `Nats-Msg-Id` (JetStream's duplicate window), `Idem-Message-Id` where the two differ
//! (a retry copy), `Idem-Correlation-Id`, `Content-Type`, `Idem-Reply-To`, `Idem-Attempt` and
//! `Idem-Routing-Key` (a delivery's routing key, where it is not its subject); every other
//! header is the user's, as text. The names are core's vocabulary ([`IdemHeader::name`]).

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue as NatsValue};
use idem_core::transport::IdemHeader;
use idem_core::{model::Envelope, model::HeaderValue, model::Headers};
use std::str::FromStr;

/// JetStream's duplicate-window id.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// The envelope's message id, when it differs from [`MSG_ID_HEADER`].
pub const MESSAGE_ID_HEADER: &str = IdemHeader::MessageId.name();
/// The envelope's correlation id.
pub const CORRELATION_ID_HEADER: &str = IdemHeader::CorrelationId.name();
/// The envelope's content type.
pub const CONTENT_TYPE_HEADER: &str = IdemHeader::ContentType.name();
/// The queue a reply goes to.
pub const REPLY_TO_HEADER: &str = IdemHeader::ReplyTo.name();
/// Which attempt a retry copy is (1 for an original).
pub const ATTEMPT_HEADER: &str = IdemHeader::Attempt.name();
/// When a message's first attempt failed, in milliseconds since the Unix epoch: set on its
/// first retry copy, kept by the next, and passed to handlers as the user's headers are.
pub const FIRST_FAILURE_HEADER: &str = IdemHeader::FirstFailure.name();
/// When the message was first published, in milliseconds since the Unix epoch: set on the
/// copies idem publishes of it (retry copies, dead letters), so that they keep its time.
pub const PUBLISHED_HEADER: &str = IdemHeader::Published.name();
/// When a retry copy is due, in milliseconds since the Unix epoch.
pub(crate) const DUE_HEADER: &str = IdemHeader::Due.name();
/// Why a dead letter was dead-lettered: the reason code.
pub const REASON_HEADER: &str = IdemHeader::DeadLetterReason.name();
/// The reason's detail.
pub const REASON_DETAIL_HEADER: &str = IdemHeader::DeadLetterDetail.name();
/// The queue a dead letter came from.
pub const SOURCE_QUEUE_HEADER: &str = IdemHeader::SourceQueue.name();
/// The routing key a message was published with, where its subject is another (a partition of
/// an ordered handler's source: `<source>.p<i>`, published with the key that chose it).
pub const ROUTING_KEY_HEADER: &str = IdemHeader::RoutingKey.name();

/// Headers that carry the envelope's own properties, or JetStream's, not the user's.
const OWN: &[&str] = &[
    MESSAGE_ID_HEADER,
    CORRELATION_ID_HEADER,
    CONTENT_TYPE_HEADER,
    REPLY_TO_HEADER,
    ATTEMPT_HEADER,
    DUE_HEADER,
    ROUTING_KEY_HEADER,
    PUBLISHED_HEADER,
];

/// Whether header `name` carries an envelope property or JetStream's id, not the user's.
pub(crate) fn is_own(name: &str) -> bool {
    OWN.iter().any(|own| own.eq_ignore_ascii_case(name)) || name.eq_ignore_ascii_case(MSG_ID_HEADER)
}

/// The envelope of a JetStream message on `subject` with `headers` and `body`, delivered for
/// the `delivered`-th time, stored in its stream at `stored_ms` (its publish time unless a
/// header carries an earlier copy's).
pub(crate) fn envelope(
    subject: &str,
    headers: Option<&HeaderMap>,
    body: Vec<u8>,
    delivered: i64,
    stored_ms: Option<i64>,
) -> Envelope {
    let text = |name: &str| {
        headers
            .and_then(|h| h.get(name))
            .map(|v| v.as_str().to_owned())
    };
    let copy = text(ATTEMPT_HEADER);
    let attempt = copy
        .as_deref()
        .and_then(|a| a.parse::<u32>().ok())
        .unwrap_or(1)
        .max(1);
    let mut envelope = Envelope::new(body)
        .with_attempt(attempt)
        .with_routing_key(text(ROUTING_KEY_HEADER).unwrap_or_else(|| subject.to_owned()));
    // A retry copy's `Nats-Msg-Id` is its own; its message id, if it has one, is in
    // `Idem-Message-Id`.
    envelope.message_id = match copy {
        Some(_) => text(MESSAGE_ID_HEADER),
        None => text(MESSAGE_ID_HEADER).or_else(|| text(MSG_ID_HEADER)),
    };
    envelope.correlation_id = text(CORRELATION_ID_HEADER);
    envelope.content_type = text(CONTENT_TYPE_HEADER);
    envelope.reply_to = text(REPLY_TO_HEADER);
    envelope.redelivered = delivered > 1;
    envelope.published_at_ms = text(PUBLISHED_HEADER)
        .and_then(|ms| ms.trim().parse::<i64>().ok())
        .or(stored_ms)
        .filter(|ms| *ms > 0);
    let mut user = Headers::default();
    for (name, values) in headers.into_iter().flat_map(HeaderMap::iter) {
        let name: &str = name.as_ref();
        if is_own(name) {
            continue;
        }
        if let Some(value) = values.first() {
            user.insert(name, value.as_str());
        }
    }
    envelope.headers = user;
    envelope
}

/// The headers of `envelope`, as it goes out with JetStream id `msg_id`: its properties and the
/// user's headers (typed values as text, bytes as lossy UTF-8, names and values with what a
/// NATS header cannot hold replaced).
pub(crate) fn headers(envelope: &Envelope, msg_id: Option<&str>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in envelope.headers.iter() {
        let text = match value {
            HeaderValue::Str(s) => s.clone(),
            HeaderValue::Int(n) => n.to_string(),
            HeaderValue::Bool(b) => b.to_string(),
            HeaderValue::Float(f) => f.to_string(),
            HeaderValue::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
            other => format!("{other:?}"),
        };
        headers.insert(header_name(name), NatsValue::from_lossy(&text));
    }
    let mut set = |name: &'static str, value: Option<&str>| {
        if let Some(value) = value {
            headers.insert(HeaderName::from_static(name), NatsValue::from_lossy(value));
        }
    };
    set(MSG_ID_HEADER, msg_id);
    if msg_id != envelope.message_id.as_deref() {
        set(MESSAGE_ID_HEADER, envelope.message_id.as_deref());
    }
    set(CORRELATION_ID_HEADER, envelope.correlation_id.as_deref());
    set(CONTENT_TYPE_HEADER, envelope.content_type.as_deref());
    set(REPLY_TO_HEADER, envelope.reply_to.as_deref());
    set(ROUTING_KEY_HEADER, envelope.routing_key.as_deref());
    if envelope.attempt > 1 {
        set(ATTEMPT_HEADER, Some(&envelope.attempt.to_string()));
    }
    if let Some(ms) = envelope.published_at_ms {
        set(PUBLISHED_HEADER, Some(&ms.to_string()));
    }
    headers
}

/// `name` as a NATS header name: a character it cannot hold (`:`, control, non-ASCII) as `_`.
fn header_name(name: &str) -> HeaderName {
    let safe: String = name
        .chars()
        .map(|c| match c {
            '!'..='9' | ';'..='~' => c,
            _ => '_',
        })
        .collect();
    let safe = if safe.is_empty() {
        "_".to_owned()
    } else {
        safe
    };
    HeaderName::from_str(&safe).unwrap_or_else(|_| HeaderName::from_static("Idem-Header"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_envelope_goes_out_and_comes_back_as_it_was() {
        let sent = Envelope::new("body")
            .with_message_id("m-1")
            .with_correlation_id("c-1")
            .with_content_type("application/json")
            .with_reply_to("replies")
            .with_header("tenant", "acme")
            .with_header("weight", 3i64)
            .with_attempt(2);
        let headers = headers(&sent, Some("m-1.a2"));
        let got = envelope("orders", Some(&headers), b"body".to_vec(), 1, Some(9));
        assert_eq!(got.message_id.as_deref(), Some("m-1"));
        assert_eq!(got.correlation_id.as_deref(), Some("c-1"));
        assert_eq!(got.content_type.as_deref(), Some("application/json"));
        assert_eq!(got.reply_to.as_deref(), Some("replies"));
        assert_eq!(got.attempt, 2);
        assert_eq!(got.headers.get("tenant"), Some(&HeaderValue::from("acme")));
        assert_eq!(got.headers.get("weight"), Some(&HeaderValue::from("3")));
        assert_eq!(got.headers.len(), 2, "{:?}", got.headers);
        assert_eq!(got.routing_key.as_deref(), Some("orders"));
        let keyed = sent.with_routing_key("customer-7");
        let got = envelope(
            "orders.p1",
            Some(&super::headers(&keyed, None)),
            Vec::new(),
            1,
            None,
        );
        assert_eq!(got.routing_key.as_deref(), Some("customer-7"));
        assert!(!got.redelivered);
        assert!(envelope("orders", None, Vec::new(), 2, None).redelivered);
    }

    /// A message's publish time is the stream's, unless an earlier copy's travels in
    /// `Idem-Published` (a retry copy, a dead letter, a replay keep the original's).
    #[test]
    fn a_publish_time_is_the_streams_unless_a_copy_carries_the_original() {
        let original = envelope("q", None, Vec::new(), 1, Some(1_000));
        assert_eq!(original.published_at_ms, Some(1_000));
        let copy = envelope(
            "q",
            Some(&headers(&original, None)),
            Vec::new(),
            1,
            Some(5_000),
        );
        assert_eq!(copy.published_at_ms, Some(1_000));
        assert!(
            copy.headers.is_empty(),
            "not the user's: {:?}",
            copy.headers
        );
        assert_eq!(
            envelope("q", None, Vec::new(), 1, None).published_at_ms,
            None
        );
    }

    #[test]
    fn a_header_name_nats_cannot_hold_is_mended_not_a_panic() {
        let sent = Envelope::new("b").with_header("a:b é\n", "v\r\nw");
        let headers = headers(&sent, None);
        let got = envelope("q", Some(&headers), Vec::new(), 1, None);
        assert_eq!(got.headers.get("a_b___"), Some(&HeaderValue::from("v  w")));
    }
}
