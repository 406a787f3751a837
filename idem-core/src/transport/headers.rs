//! idem's own headers, by what they carry ([`IdemHeader`]): one vocabulary for every transport.
//!
//! A broker whose messages carry only headers (NATS JetStream, and Kafka) spells each as
//! [`IdemHeader::name`]. AMQP carries the envelope's properties (message id, correlation id,
//! content type, reply-to, routing key) in fields of its own, and spells the rest as
//! [`IdemHeader::amqp_name`], the names RabbitMQ deployments already hold in their queues.
//! Headers that are not idem's are the user's and travel as they are.

use crate::model::{Envelope, HeaderValue};

/// One of idem's own headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdemHeader {
    /// The envelope's message id, where the broker's own id is another (a retry copy's).
    MessageId,
    /// The envelope's correlation id.
    CorrelationId,
    /// The envelope's content type.
    ContentType,
    /// The queue a reply goes to.
    ReplyTo,
    /// Which attempt a retry copy is (1 for an original).
    Attempt,
    /// When a retry copy is due, in milliseconds since the Unix epoch.
    Due,
    /// Why a dead letter was dead-lettered: the reason code (`decode`, `conflict`, …).
    DeadLetterReason,
    /// The reason's detail, at most 1 KiB.
    DeadLetterDetail,
    /// The queue a dead letter came from.
    SourceQueue,
    /// The routing key a message was published with, where its address does not spell it.
    RoutingKey,
    /// When the message's first attempt failed, in milliseconds since the Unix epoch: set on
    /// its first retry copy and kept on the next, so that a dead letter's record says when its
    /// failures began ([`first_failure`]).
    FirstFailure,
    /// When the message was first published, in milliseconds since the Unix epoch
    /// ([`Envelope::published_at_ms`]); AMQP carries it in its `timestamp` property.
    Published,
    /// A parked message published again by its key's release: its place among the key's
    /// parked messages ([`crate::model::ParkedMessage`]).
    Released,
}

impl IdemHeader {
    /// Every header of the vocabulary.
    pub const ALL: [Self; 13] = [
        Self::MessageId,
        Self::CorrelationId,
        Self::ContentType,
        Self::ReplyTo,
        Self::Attempt,
        Self::Due,
        Self::DeadLetterReason,
        Self::DeadLetterDetail,
        Self::SourceQueue,
        Self::RoutingKey,
        Self::FirstFailure,
        Self::Published,
        Self::Released,
    ];

    /// Its name on a broker whose messages carry only headers.
    pub const fn name(self) -> &'static str {
        match self {
            Self::MessageId => "Idem-Message-Id",
            Self::CorrelationId => "Idem-Correlation-Id",
            Self::ContentType => "Content-Type",
            Self::ReplyTo => "Idem-Reply-To",
            Self::Attempt => "Idem-Attempt",
            Self::Due => "Idem-Due",
            Self::DeadLetterReason => "Idem-Dead-Letter-Reason",
            Self::DeadLetterDetail => "Idem-Dead-Letter-Detail",
            Self::SourceQueue => "Idem-Source-Queue",
            Self::RoutingKey => "Idem-Routing-Key",
            Self::FirstFailure => "Idem-First-Failure",
            Self::Published => "Idem-Published",
            Self::Released => "Idem-Released",
        }
    }

    /// Its name in an AMQP header table; `None` where AMQP carries it otherwise (a property of
    /// the message, the queue it is dead-lettered from, a delay queue's expiry).
    pub const fn amqp_name(self) -> Option<&'static str> {
        match self {
            Self::Attempt => Some("x-idem-attempt"),
            Self::DeadLetterReason => Some("x-idem-dead-letter-reason"),
            Self::DeadLetterDetail => Some("x-idem-dead-letter-detail"),
            Self::FirstFailure => Some("x-idem-first-failure"),
            Self::Released => Some("x-idem-released"),
            Self::MessageId
            | Self::CorrelationId
            | Self::ContentType
            | Self::ReplyTo
            | Self::Due
            | Self::SourceQueue
            | Self::RoutingKey
            | Self::Published => None,
        }
    }

    /// The header `name` spells, on any broker (names compare without case).
    pub fn of_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|header| {
            header.name().eq_ignore_ascii_case(name)
                || header
                    .amqp_name()
                    .is_some_and(|amqp| amqp.eq_ignore_ascii_case(name))
        })
    }
}

pub use crate::model::epoch_ms;

/// When `envelope`'s first attempt failed ([`IdemHeader::FirstFailure`], under either of its
/// names), in milliseconds since the Unix epoch: `None` for a first attempt, or where the
/// header holds no time at or before `now_ms` (a producer may write any header).
pub fn first_failure(envelope: &Envelope, now_ms: i64) -> Option<i64> {
    let at = match value_of(envelope, IdemHeader::FirstFailure)? {
        HeaderValue::Int(ms) => *ms,
        HeaderValue::Str(text) => text.trim().parse().ok()?,
        _ => return None,
    };
    (0..=now_ms).contains(&at).then_some(at)
}

/// The value of idem's `header` on `envelope`, under either of its names (compared without
/// case).
pub fn value_of(envelope: &Envelope, header: IdemHeader) -> Option<&HeaderValue> {
    [Some(header.name()), header.amqp_name()]
        .into_iter()
        .flatten()
        .find_map(|name| {
            envelope
                .headers
                .iter()
                .find(|(key, _)| key.eq_ignore_ascii_case(name))
                .map(|(_, value)| value)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_failure_is_read_under_either_name_and_only_as_a_past_time() {
        let mut envelope = Envelope::new("x");
        assert_eq!(first_failure(&envelope, 1_000), None);
        envelope
            .headers
            .insert("x-idem-first-failure", HeaderValue::Int(900));
        assert_eq!(first_failure(&envelope, 1_000), Some(900));
        assert_eq!(first_failure(&envelope, 800), None, "a time to come");
        let mut nats = Envelope::new("x");
        nats.headers
            .insert("Idem-First-Failure", HeaderValue::Str(" 700 ".into()));
        assert_eq!(first_failure(&nats, 1_000), Some(700));
        for wrong in [
            HeaderValue::Str("soon".into()),
            HeaderValue::Int(-1),
            HeaderValue::Bool(true),
        ] {
            nats.headers.insert("Idem-First-Failure", wrong);
            assert_eq!(first_failure(&nats, 1_000), None);
        }
    }

    #[test]
    fn every_name_reads_back_as_its_header_and_no_two_share_one() {
        let mut names = Vec::new();
        for header in IdemHeader::ALL {
            for name in [Some(header.name()), header.amqp_name()]
                .into_iter()
                .flatten()
            {
                assert_eq!(IdemHeader::of_name(name), Some(header), "{name}");
                assert_eq!(
                    IdemHeader::of_name(&name.to_ascii_lowercase()),
                    Some(header)
                );
                names.push(name.to_ascii_lowercase());
            }
        }
        let count = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), count, "two headers share a name");
        assert_eq!(IdemHeader::of_name("x-tenant"), None);
    }
}
