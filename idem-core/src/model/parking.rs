//! Parking a key behind its dead-lettered head: what an ordered handler does with a key's
//! later messages once one of its messages is dead-lettered ([`KeyPolicy`]), what its store
//! says of each delivery of a parked key ([`Parking`]), and what is kept of a parked key
//! ([`ParkKey`]) and of a message parked behind it ([`ParkedMessage`]).
//!
//! A parked key's later messages are stored in the handler's database, in their order, and
//! acked. An operator releases the key (`idem dlq replay --key`, `idem dlq skip --key`): the
//! key turns `releasing`, and its stored messages go back to the broker one at a time, each
//! published by the consumer that applied the one before it, marked with
//! [`IdemHeader::Released`](crate::transport::IdemHeader::Released) and the message's place;
//! the key is free once the last one settled.

use super::destination::Destination;
use super::envelope::{Envelope, HeaderValue};
use super::fingerprint::Fingerprint;
use super::outgoing::Outgoing;

/// What an ordered handler does with a key whose message was dead-lettered
/// (`RuntimeBuilder::key_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyPolicy {
    /// The key's later messages wait, stored in the handler's database, until an operator
    /// replays or skips the dead-lettered one (the default for ordered handlers).
    #[default]
    Park,
    /// The key moves on: its later messages are applied, and the dead letter waits in the
    /// DLQ alone (a replay applies it after them).
    Retire,
}

/// What the store says of a delivery of an ordered handler whose key may be parked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Parking {
    /// The key is not parked: run it.
    Run,
    /// A released message whose turn it is (its place among the key's parked messages): run
    /// it, then hand the release on to the next one.
    Released(i64),
    /// The key is parked (or releasing, and this is a new message): the message is stored
    /// behind the key's head, to be acked without running.
    Parked,
}

/// The key a dead letter parks: written with the dead letter's record, in its transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkKey {
    /// The order key (the routing key the message was published with).
    pub order_key: String,
    /// Where the handler's messages are published (the partitions' source): a released
    /// message is published there again, with its order key.
    pub source: String,
    /// The dead-lettered message's place among the key's parked messages, when it was one
    /// being released: that place is taken out, the DLQ holds it now.
    pub released: Option<i64>,
}

impl ParkKey {
    /// Parks `order_key`, whose messages are published to `source`.
    pub fn new(order_key: impl Into<String>, source: impl Into<String>) -> Self {
        Self {
            order_key: order_key.into(),
            source: source.into(),
            released: None,
        }
    }

    /// The same, for the dead letter of the released message at `seq`.
    pub fn released(mut self, seq: Option<i64>) -> Self {
        self.released = seq;
        self
    }
}

/// A message parked behind its key's head, to be published again when the key is released.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ParkedMessage {
    /// Its place among the key's parked messages: they are released in this order.
    pub seq: i64,
    /// The message as it was delivered.
    pub envelope: Envelope,
    /// When its key was last parked, in milliseconds since the Unix epoch: which release of
    /// the key a copy of it belongs to.
    pub parked_at_ms: i64,
}

impl ParkedMessage {
    /// The message with `seq` and `envelope`, of a key parked at `parked_at_ms`.
    pub fn new(seq: i64, envelope: Envelope, parked_at_ms: i64) -> Self {
        Self {
            seq,
            envelope,
            parked_at_ms,
        }
    }

    /// The copy that releases it: published to the handler's `source` with its `order_key`,
    /// marked ([`ParkedMessage::released_copy`]), and known to a broker's duplicate window as
    /// this release of this message of `consumer`'s key ([`Outgoing::copy_id`]): the same
    /// release sent again (a crash between its publish and its record) is one copy, a later
    /// release of the key (parked again since) another.
    pub fn release(&self, consumer: &str, order_key: &str, source: &str) -> Outgoing {
        let mut message = Outgoing::new(Destination::topic(source, order_key), Vec::new());
        message.envelope = self.released_copy();
        message.copy_id = Some(format!(
            "{consumer}/{order_key}@{}:{}.release",
            self.parked_at_ms, self.seq
        ));
        message
    }

    /// The copy to publish when its turn comes: the message, marked as the release of `seq`
    /// ([`released_seq`]).
    pub fn released_copy(&self) -> Envelope {
        let mut envelope = self.envelope.clone();
        envelope.headers.insert(
            crate::transport::IdemHeader::Released.name(),
            HeaderValue::Int(self.seq),
        );
        envelope.attempt = 1;
        envelope
    }
}

/// The place a released copy claims ([`IdemHeader::Released`](crate::transport::IdemHeader::Released),
/// under either of its names), where it holds one. A producer may write any header: the store
/// believes it only for the parked message at that place with the same body.
pub fn released_seq(envelope: &Envelope) -> Option<i64> {
    let header = crate::transport::IdemHeader::Released;
    let value = [Some(header.name()), header.amqp_name()]
        .into_iter()
        .flatten()
        .find_map(|name| {
            envelope
                .headers
                .iter()
                .find(|(key, _)| key.eq_ignore_ascii_case(name))
                .map(|(_, value)| value)
        })?;
    match value {
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
        let release = parked.release("c", "k", "src");
        assert_eq!(release.copy_id.as_deref(), Some("c/k@5:7.release"));
        assert_eq!(release.destination, Destination::topic("src", "k"));
        let copy = parked.released_copy();
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
}
