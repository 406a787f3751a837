//! What became of one delivery; the runtime turns it into ack, retry or dead letter.

use serde::de::DeserializeOwned;
use std::fmt;

/// The result of handling one delivery.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// First time this key was seen: the handler ran and its writes committed with the inbox
    /// row. Ack.
    Processed {
        /// The dedup key.
        key: String,
        /// The handler's result, as stored on the inbox row.
        output: StoredOutput,
    },
    /// The key was processed before with the same payload: nothing ran. Ack.
    Duplicate {
        /// The dedup key.
        key: String,
        /// The result stored when the key was first processed.
        output: StoredOutput,
    },
    /// The key was processed before with a different payload (the fingerprints differ): the
    /// producer reused an id. Nothing ran; dead-letter.
    Conflict {
        /// The dedup key.
        key: String,
    },
    /// The message can never succeed as it is: dead-letter it with the reason.
    Rejected(Rejection),
    /// A transient failure: nothing was committed; retry later.
    Retry(Transient),
    /// The store cannot write for now (read-only, full, restarting): nothing was committed and
    /// the message is not at fault. It is not settled: the runtime pauses the consumption of
    /// the store's handlers and tries it again, as the same attempt, once the store writes.
    Unavailable(Transient),
    /// A versioned message whose version is at or below the one applied to its entity: nothing
    /// ran, nothing was written. Ack.
    Stale(Stale),
    /// An ordered handler's message whose key is parked behind a dead-lettered message: it
    /// was stored behind it, in order, to run when an operator releases the key. Nothing ran.
    /// Ack.
    Parked {
        /// The order key.
        order_key: String,
    },
}

/// A stale message: its entity, its version and the version already applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stale {
    /// The dedup key.
    pub key: String,
    /// The entity it updates.
    pub entity: String,
    /// Its version.
    pub version: i64,
    /// The version applied to the entity, at or above `version`.
    pub applied: i64,
}

impl fmt::Display for Stale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "version {} of entity {:?} is at or below the applied version {}",
            self.version, self.entity, self.applied
        )
    }
}

impl Outcome {
    /// A short, stable label: `processed`, `duplicate`, `conflict`, `rejected`, `retry`,
    /// `stale`, `unavailable`, `parked`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Processed { .. } => "processed",
            Self::Duplicate { .. } => "duplicate",
            Self::Conflict { .. } => "conflict",
            Self::Rejected(_) => "rejected",
            Self::Retry(_) => "retry",
            Self::Stale(_) => "stale",
            Self::Unavailable(_) => "unavailable",
            Self::Parked { .. } => "parked",
        }
    }

    /// The dedup key, when one was read.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Processed { key, .. } | Self::Duplicate { key, .. } | Self::Conflict { key } => {
                Some(key)
            }
            Self::Rejected(r) => r.key.as_deref(),
            Self::Retry(t) | Self::Unavailable(t) => t.key.as_deref(),
            Self::Stale(s) => Some(&s.key),
            Self::Parked { .. } => None,
        }
    }

    /// The stored result for processed and duplicate outcomes.
    pub fn output(&self) -> Option<&StoredOutput> {
        match self {
            Self::Processed { output, .. } | Self::Duplicate { output, .. } => Some(output),
            _ => None,
        }
    }
}

/// A handler's result as JSON text, as stored on the inbox row and replayed to duplicates.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredOutput(String);

impl StoredOutput {
    /// The stored form of `()` and of rows that stored no result.
    pub fn null() -> Self {
        Self("null".to_owned())
    }

    /// Wraps JSON text read from storage.
    pub fn from_json(json: String) -> Self {
        Self(json)
    }

    /// Serializes a handler's result.
    pub fn encode<T: serde::Serialize + ?Sized>(value: &T) -> Result<Self, serde_json::Error> {
        serde_json::to_string(value).map(Self)
    }

    /// Decodes the stored result into the handler's result type.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.0)
    }

    /// The JSON text.
    pub fn as_json(&self) -> &str {
        &self.0
    }

    /// Whether the result is JSON `null` (a handler returning `()`); such results are not
    /// written to the inbox row at all.
    pub fn is_null(&self) -> bool {
        self.0 == "null"
    }
}

impl fmt::Debug for StoredOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoredOutput({})", self.0)
    }
}

/// Why a message was refused for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// What kind of refusal.
    pub reason: RejectReason,
    /// A human-readable explanation, for the dead-letter headers and the logs.
    pub message: String,
    /// The dedup key, when it was read before the refusal.
    pub key: Option<String>,
}

impl Rejection {
    /// A rejection with `reason` and `message`.
    pub fn new(reason: RejectReason, message: impl Into<String>, key: Option<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            key,
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.message)
    }
}

/// The kinds of permanent refusal, each with a stable code for a dead letter's reason header
/// ([`crate::transport::IdemHeader::DeadLetterReason`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectReason {
    /// The body does not decode into the handler's payload type.
    Decode,
    /// No usable dedup key.
    MissingKey,
    /// The handler returned a permanent error (or one classified as permanent).
    Handler,
    /// The handler's result could not be serialized for storage.
    Output,
    /// The inbox store failed permanently (for example, a missing table).
    Store,
    /// External mode: an earlier copy of this key failed permanently, so it is not run again.
    PreviouslyFailed,
    /// The message's handler started the poison limit's number of times on redeliveries and
    /// never settled: its consumers died (or lost their connection) while it ran each time.
    Poison,
    /// A versioned message without a usable entity or version.
    Version,
    /// A versioned message at or below the applied version, where the runtime dead-letters
    /// stale messages instead of acking them.
    Stale,
    /// A message published longer ago than its consumer's inbox keeps a key's row, whose key
    /// the inbox does not hold: a copy applied then may have been swept, so it is not applied
    /// as new.
    BeyondDedupWindow,
}

impl RejectReason {
    /// The stable code: `decode`, `missing-key`, `handler`, `output`, `store`,
    /// `previously-failed`, `poison`, `version`, `stale` or `beyond-dedup-window` (all in
    /// [`REASONS`](super::reasons::REASONS)).
    pub fn code(self) -> &'static str {
        match self {
            Self::Decode => "decode",
            Self::MissingKey => "missing-key",
            Self::Handler => "handler",
            Self::Output => "output",
            Self::Store => "store",
            Self::PreviouslyFailed => "previously-failed",
            Self::Poison => "poison",
            Self::Version => "version",
            Self::Stale => "stale",
            Self::BeyondDedupWindow => "beyond-dedup-window",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// A transient failure: nothing was committed, the message should be tried again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transient {
    /// What failed.
    pub message: String,
    /// The dedup key, when it was read before the failure.
    pub key: Option<String>,
}

impl fmt::Display for Transient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}
