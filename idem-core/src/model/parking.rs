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
//! the key is free once the last one settled. The copies are made in
//! `crate::transport::released`.

use super::envelope::Envelope;

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
}
