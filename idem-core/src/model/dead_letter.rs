//! What is kept of a dead letter: why it was refused, by whom, for which key, so that an
//! operator reading the dead-letter queue finds the reason beside the message.

use super::envelope::Envelope;
use super::fingerprint::Fingerprint;
use std::time::Duration;

/// Why a message is dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// A stable code (`decode`, `missing-key`, `handler`, `conflict`, `retries-exhausted`, …).
    pub reason: String,
    /// A human-readable explanation.
    pub detail: String,
    /// The consumer that refused it.
    pub consumer: String,
    /// The dedup key, when one was read.
    pub key: Option<String>,
    /// Delivery attempts made.
    pub attempts: u32,
    /// Its record could not be written (the store refused it for good): a transport that can
    /// carries the reason and detail in the message's headers instead.
    pub unrecorded: bool,
}

impl DeadLetter {
    /// The same dead letter, marked as moved without its record ([`DeadLetter::unrecorded`]).
    pub fn unrecorded(mut self) -> Self {
        self.unrecorded = true;
        self
    }

    /// A dead letter of `consumer` with reason code `reason` and `detail`, after `attempts`
    /// deliveries, for the message with dedup key `key` (if one was read).
    pub fn new(
        reason: impl Into<String>,
        detail: impl Into<String>,
        consumer: impl Into<String>,
        key: Option<String>,
        attempts: u32,
    ) -> Self {
        Self {
            reason: reason.into(),
            detail: detail.into(),
            consumer: consumer.into(),
            key,
            attempts,
            unrecorded: false,
        }
    }
}

/// The record of one dead letter, written to the consumer's store (keyed by consumer and key)
/// before the message is moved to the dead-letter queue, so its reason is never lost and a
/// second dead-lettering of the same message overwrites rather than adds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterRecord {
    /// The consumer that refused it.
    pub consumer: String,
    /// The dedup key; for a message whose key could not be read, `message-id:<id>` or
    /// `sha256:<fingerprint>` (see [`DeadLetterRecord::new`]).
    pub key: String,
    /// Whether `key` is the message's dedup key (`false`: a stand-in).
    pub keyed: bool,
    /// The queue it was consumed from.
    pub queue: String,
    /// The reason code.
    pub reason: String,
    /// The explanation.
    pub detail: String,
    /// Delivery attempts made.
    pub attempts: u32,
    /// The message id, when it had one.
    pub message_id: Option<String>,
    /// The SHA-256 of its body: with the message id, what ties the record to the message in
    /// the dead-letter queue.
    pub fingerprint: Fingerprint,
    /// When its first attempt failed, in milliseconds since the Unix epoch, where its retry
    /// copies carried it ([`IdemHeader::FirstFailure`](crate::transport::IdemHeader)); `None`:
    /// the store takes the time it writes the record. A record written again for the same key
    /// keeps the earliest.
    pub first_failed_at_ms: Option<i64>,
    /// How long its consumer's inbox keeps a key's row: how long after the first failure the
    /// inbox can still tell whether a replay of it would be a duplicate. `None` where the
    /// consumer is not known to the writer.
    pub retention: Option<Duration>,
    /// The key this dead letter parks (an ordered handler that parks keys): written with the
    /// record, in its transaction.
    pub park: Option<super::parking::ParkKey>,
}

/// The longest message id a stand-in key is made of; a longer one gives way to the body's
/// fingerprint, so that every stand-in key fits every store's key column.
const MAX_ID_IN_KEY: usize = 128;

impl DeadLetterRecord {
    /// The record of `envelope`, consumed from `queue`, dead-lettered for `letter`. A message
    /// whose key was never read (it did not decode, or had no key) is recorded under
    /// `message-id:<its id>`, or `sha256:<its body's fingerprint>` when it has no short id.
    pub fn new(letter: &DeadLetter, envelope: &Envelope, queue: &str) -> Self {
        let fingerprint = Fingerprint::of(&envelope.body);
        Self::of_fingerprint(letter, envelope.message_id.clone(), fingerprint, queue)
    }

    /// As [`DeadLetterRecord::new`], for a message whose body is known only by its
    /// `fingerprint` (read as it passed, never held whole).
    pub fn of_fingerprint(
        letter: &DeadLetter,
        message_id: Option<String>,
        fingerprint: Fingerprint,
        queue: &str,
    ) -> Self {
        let (key, keyed) = match &letter.key {
            Some(key) => (key.clone(), true),
            None => (stand_in_key(message_id.as_deref(), &fingerprint), false),
        };
        Self {
            consumer: letter.consumer.clone(),
            key,
            keyed,
            queue: queue.to_owned(),
            reason: letter.reason.clone(),
            detail: letter.detail.clone(),
            attempts: letter.attempts,
            message_id,
            fingerprint,
            first_failed_at_ms: None,
            retention: None,
            park: None,
        }
    }

    /// The same record, with its failures' start ([`DeadLetterRecord::first_failed_at_ms`]) and
    /// its consumer's retention.
    pub fn with_history(mut self, first_failed_at_ms: Option<i64>, retention: Duration) -> Self {
        self.first_failed_at_ms = first_failed_at_ms;
        self.retention = Some(retention);
        self
    }

    /// The same record, parking `park`'s key behind it.
    pub fn parking(mut self, park: super::parking::ParkKey) -> Self {
        self.park = Some(park);
        self
    }
}

/// The key a keyless dead letter is recorded under.
pub fn stand_in_key(message_id: Option<&str>, fingerprint: &Fingerprint) -> String {
    match message_id {
        Some(id) if !id.is_empty() && id.len() <= MAX_ID_IN_KEY => format!("message-id:{id}"),
        _ => format!("sha256:{fingerprint}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(key: Option<&str>) -> DeadLetter {
        DeadLetter {
            reason: "decode".into(),
            detail: "not JSON".into(),
            consumer: "c".into(),
            key: key.map(str::to_owned),
            attempts: 2,
            unrecorded: false,
        }
    }

    #[test]
    fn a_keyless_dead_letter_stands_in_with_its_id_or_its_body() {
        let env = Envelope::new("x").with_message_id("m-1");
        let r = DeadLetterRecord::new(&letter(Some("k")), &env, "q");
        assert_eq!((r.key.as_str(), r.keyed, r.attempts), ("k", true, 2));
        let r = DeadLetterRecord::new(&letter(None), &env, "q");
        assert_eq!((r.key.as_str(), r.keyed), ("message-id:m-1", false));
        let long = Envelope::new("x").with_message_id("m".repeat(129));
        let r = DeadLetterRecord::new(&letter(None), &long, "q");
        assert_eq!(r.key, format!("sha256:{}", Fingerprint::of(b"x")));
        let r = DeadLetterRecord::new(&letter(None), &Envelope::new("x"), "q");
        assert!(r.key.starts_with("sha256:") && r.message_id.is_none());
    }
}
