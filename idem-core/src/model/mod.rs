//! The message model: what a delivery is ([`Envelope`]), how it is identified ([`KeySource`],
//! [`Fingerprint`]), what became of it ([`Outcome`]), how failures are classified
//! ([`HandlerError`], [`StoreError`]) and what a handler may know about it ([`Context`]) and what is kept of a dead letter
//! ([`DeadLetterRecord`]).

pub mod batch;
pub mod clock;
pub mod context;
pub mod dead_letter;
pub mod destination;
pub mod envelope;
pub mod error;
pub mod fingerprint;
pub mod key;
pub mod outcome;
pub mod outgoing;
pub mod parking;
pub(crate) mod propagation;
pub mod reasons;
pub mod store_kind;
pub mod version;

pub use batch::{Batch, BatchError, BatchOutput, BatchResult};
pub use clock::epoch_ms;
pub use context::Context;
pub use dead_letter::{DeadLetter, DeadLetterRecord, stand_in_key};
pub use destination::Destination;
pub use envelope::{Envelope, HeaderValue, Headers};
pub use error::{BoxError, ErrorClass, HandlerError, StoreError};
pub use fingerprint::Fingerprint;
pub use key::{KeyError, KeySource, KeyValue, MAX_KEY_LEN, field_key};
pub use outcome::{Outcome, RejectReason, Rejection, Stale, StoredOutput, Transient};
pub use outgoing::{
    CAUSATION_HEADER, MAX_SHORT_TEXT, Outgoing, OutgoingError, TRACEPARENT_HEADER,
    batch_message_id, check_outgoing, outbox_message_id,
};
pub use parking::{KeyPolicy, ParkKey, ParkedMessage, Parking};
pub use store_kind::StoreKind;
pub use version::{VersionError, VersionValue, Versioned, version_value, versioned};
