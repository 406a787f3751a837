//! The copies that release a parked key's messages (`crate::model::parking`): each marked with
//! [`IdemHeader::Released`] and its place, published to the handler's source with its order
//! key, under a copy id of its own.

use super::headers::IdemHeader;
use crate::model::{Destination, Envelope, Fingerprint, HeaderValue, Outgoing, ParkedMessage};
use std::sync::atomic::{AtomicU64, Ordering};

/// The message `parked` as it goes back when its turn comes: marked as the release of its
/// place ([`released_seq`]), as a first attempt.
pub fn released_copy(parked: &ParkedMessage) -> Envelope {
    let mut envelope = parked.envelope.clone();
    envelope
        .headers
        .insert(IdemHeader::Released.name(), HeaderValue::Int(parked.seq));
    envelope.attempt = 1;
    envelope
}

/// The copy that releases `parked`, a message of `consumer`'s `order_key`: published to the
/// handler's `source` with its order key, marked ([`released_copy`]). Each such publish has a
/// copy id of its own ([`Outgoing::copy_id`]), so that a broker's duplicate window never
/// swallows it: a copy that arrives before its turn is set aside, and only a later publish of
/// the same message releases it. A copy that arrives twice is one message to the inbox. A
/// message without a message id gets no copy id (a broker could take it for its id, and
/// nothing deduplicates it anyway).
pub fn release(parked: &ParkedMessage, consumer: &str, order_key: &str, source: &str) -> Outgoing {
    static PUBLISHES: AtomicU64 = AtomicU64::new(0);
    let mut message = Outgoing::new(Destination::topic(source, order_key), Vec::new());
    message.envelope = released_copy(parked);
    message.copy_id = parked.envelope.message_id.as_ref().map(|_| {
        let n = PUBLISHES.fetch_add(1, Ordering::Relaxed);
        format!(
            "{consumer}/{order_key}@{}:{}.release.{}-{n}",
            parked.parked_at_ms,
            parked.seq,
            crate::model::epoch_ms()
        )
    });
    message
}

/// The place a released copy claims ([`IdemHeader::Released`], under either of its names),
/// where it holds one. A producer may write any header: the store believes it only for the
/// parked message at that place with the same body ([`released_claim`]).
pub fn released_seq(envelope: &Envelope) -> Option<i64> {
    match super::headers::value_of(envelope, IdemHeader::Released)? {
        HeaderValue::Int(seq) => Some(*seq),
        HeaderValue::Str(text) => text.trim().parse().ok(),
        _ => None,
    }
}

/// What the store checks a released copy against: its claimed place and its body.
pub fn released_claim(envelope: &Envelope) -> Option<(i64, Fingerprint)> {
    released_seq(envelope).map(|seq| (seq, Fingerprint::of(&envelope.body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_copy_names_its_place_under_either_name() {
        let parked = ParkedMessage::new(7, Envelope::new("x").with_attempt(4), 5);
        let copy = released_copy(&parked);
        assert_eq!((released_seq(&copy), copy.attempt), (Some(7), 1));
        let mut amqp = Envelope::new("x");
        amqp.headers
            .insert("x-idem-released", HeaderValue::Str(" 9 ".into()));
        assert_eq!(released_seq(&amqp), Some(9));
        amqp.headers
            .insert("x-idem-released", HeaderValue::Bool(true));
        assert_eq!(released_seq(&amqp), None);
        assert_eq!(released_seq(&Envelope::new("x")), None);
    }

    #[test]
    fn each_publish_of_a_release_is_a_copy_of_its_own() {
        let parked = ParkedMessage::new(7, Envelope::new("x"), 5);
        let message = release(&parked, "c", "k", "src");
        assert_eq!(message.copy_id, None, "no message id, no copy id");
        assert_eq!(message.destination, Destination::topic("src", "k"));
        let named = ParkedMessage::new(7, Envelope::new("x").with_message_id("m"), 5);
        let (first, second) = (
            release(&named, "c", "k", "src").copy_id.unwrap(),
            release(&named, "c", "k", "src").copy_id.unwrap(),
        );
        assert!(first.starts_with("c/k@5:7.release."), "{first}");
        assert_ne!(first, second);
    }
}
