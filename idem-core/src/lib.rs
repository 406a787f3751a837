//! The transport-neutral core of idem.
//!
//! A transport turns deliveries into [`Envelope`]s; the pipeline ([`process`]) decodes each
//! one, reads its dedup key, claims the key in an [`InboxStore`] transaction, runs the
//! [`Handler`] in that same transaction and commits; the resulting [`Outcome`] says whether
//! to ack, retry or dead-letter. Handlers are found through the [`registry`].
//!
//! Nothing here knows RabbitMQ or a particular SQL dialect.

pub mod batch;
pub mod context;
pub mod envelope;
pub mod error;
pub mod external;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod fingerprint;
pub mod handler;
pub mod key;
pub mod lease;
pub mod memory;
pub mod outcome;
pub mod pipeline;
pub mod registry;
pub mod retry;
pub mod runtime;
pub mod store;
pub mod stores;
pub mod telemetry;
pub mod transport;

pub use batch::process_batch;
pub use context::Context;
pub use envelope::{Envelope, HeaderValue, Headers};
pub use error::{
    BoxError, ErrorClass, HandlerError, StoreError, classify_mysql_number, classify_sqlx,
};
pub use fingerprint::Fingerprint;
pub use handler::{DEFAULT_LEASE, Handler, HandlerResult, Mode};
pub use key::{KeyError, KeySource, KeyValue, MAX_KEY_LEN, field_key};
pub use memory::MemoryTransport;
pub use outcome::{Outcome, RejectReason, Rejection, StoredOutput, Transient};
pub use pipeline::process;
pub use registry::{DispatchError, Registration, RegistryError};
pub use retry::{RetryPolicy, RetryPolicyError};
pub use runtime::{Runtime, RuntimeBuilder, RuntimeError, Snapshot, Stats};
pub use store::{
    Claim, ClaimRequest, DEFAULT_RETENTION, InboxStore, Lease, LeaseEnd, StoreKind, Stores,
    SweepReport,
};
pub use transport::{
    DeadLetter, Delivery, QueueSpec, Settle, StopSignal, Transport, TransportError,
};
