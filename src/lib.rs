#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

// What a handler author uses sits at the root; what a store, a transport or a test harness
// implements sits in the modules below.
pub use idem_core::registry;
pub use idem_core::runtime::shutdown_signal;
pub use idem_core::{
    model::Batch, model::BatchError, model::BatchOutput, model::BatchResult, model::BoxError,
    model::Context, model::Destination, model::Envelope, model::ErrorClass, model::HandlerError,
    model::HeaderValue, model::Headers, model::KeyPolicy, model::Outcome, model::Outgoing,
    model::RejectReason, model::Rejection, model::Stale, model::Transient, model::VersionValue,
    runtime::DEFAULT_POISON_LIMIT, runtime::DEFAULT_START_DEADLINE, runtime::DEFAULT_SWEEP_PAUSE,
    runtime::Health, runtime::MAX_PARTITIONS, runtime::Readiness, runtime::RetryPolicy,
    runtime::RetryPolicyError, runtime::Runtime, runtime::RuntimeBuilder, runtime::RuntimeError,
    runtime::Snapshot, runtime::Stats, transport::StopSignal,
};
pub mod telemetry;
pub use idem_macros::idempotent;

/// The sqlx idem is built on: name `idem::sqlx::Transaction` in handlers, so that the
/// transaction types always match the ones the stores open.
pub use sqlx;

/// The names most handlers and services need: `use idem::prelude::*;`.
pub mod prelude {
    pub use crate::sqlx::{self, Transaction};
    pub use crate::{
        Batch, BatchError, Context, Destination, HandlerError, Outcome, Outgoing, RejectReason,
        RetryPolicy, Runtime, idempotent,
    };
}

/// The transactional outbox: messages a handler stages in its transaction
/// ([`stage`](outbox::stage)), published once it commits.
pub mod outbox {
    pub use idem_core::model::outgoing::{reply, reply_message_id};
    pub use idem_core::model::{CAUSATION_HEADER, TRACEPARENT_HEADER};
    pub use idem_core::{
        model::MAX_SHORT_TEXT, model::Outgoing, model::OutgoingError, model::batch_message_id,
        model::check_outgoing, model::outbox_message_id,
    };
    pub use idem_sqlx::outbox::{stage, stage_all};
}

/// The store contract, by role ([`InboxStore`](store::InboxStore) and the optional
/// [`LeaseStore`](store::LeaseStore), [`DeadLetterStore`](store::DeadLetterStore),
/// [`SweepStore`](store::SweepStore), [`OutboxStore`](store::OutboxStore),
/// [`ParkingStore`](store::ParkingStore)), for implementing a store or driving one by hand.
pub mod store {
    pub use idem_core::outbox::{Dispatch, Relay, RelayFn};
    pub use idem_core::store::{
        Admission, DeadLetterStore, LeaseStore, LeasedRun, Leasing, OutboxStore, PROBE_CONSUMER,
        Pace, ParkingStore, Refusal, RuntimeStore, SETTLE_ATTEMPTS, SweepFn, SweepStore, Sweeper,
        owner_token, settle_lease,
    };
    pub use idem_core::{
        model::DeadLetterRecord, model::Fingerprint, model::KeyValue, model::MAX_KEY_LEN,
        model::ParkKey, model::ParkedMessage, model::Parking, model::StoreError,
        model::StoredOutput, outbox::OutboxSelect, outbox::RelayReport, store::Claim,
        store::ClaimRequest, store::DEFAULT_RETENTION, store::Ended, store::InboxStore,
        store::Lease, store::LeaseEnd, store::StoreKind, store::Stores, store::SweepReport,
        store::end_transaction,
    };
}

/// The transport contract, what a transport settles and routes through, which broker a URL
/// names, the kit a transport is built on (the consumer's life, the due-copy forwarder, idem's
/// headers, copy ids), and the in-memory transport.
pub mod transport {
    pub use idem_core::future::BoxFuture;
    pub use idem_core::transport::{
        BROKERS, Began, Broker, BrokerScheme, Consuming, CopyId, CopyPurpose, DeliveryOrigin,
        DueCopies, Ended, FORWARD_RETRY, IdemHeader, Session, Supervision, UnknownBroker,
        forward_due, headers, release, released_claim, released_copy, released_seq, supervise,
    };
    pub use idem_core::{
        model::DeadLetter, transport::DeadLetterLog, transport::DeadLetterReader,
        transport::Delivery, transport::Demand, transport::Gathering, transport::HeldLetter,
        transport::MemoryTransport, transport::Outbound, transport::OutboundError,
        transport::Partition, transport::PublishTime, transport::QueueSpec, transport::Settle,
        transport::StopSignal, transport::Transport, transport::TransportError, transport::Wants,
        transport::Watermark, transport::lane_of,
    };
}

/// The handler contract `#[idempotent]` implements (what every handler declares, and the trait
/// of its kind), and the entry points that run a handler over one delivery or a batch without
/// a runtime.
pub mod handler {
    pub use idem_core::{
        handler::BatchHandler, handler::DEFAULT_LEASE, handler::ExternalHandler, handler::Handler,
        handler::HandlerResult, handler::Mode, handler::TransactionalHandler, handler::kind,
        model::KeyError, model::KeySource, pipeline::DispatchError, pipeline::ErasedHandler,
        pipeline::HeldConnection, pipeline::Pipeline, pipeline::process, pipeline::process_batch,
        registry::Registration, registry::RegistryError, state::State, state::StateType,
    };
}

/// The SQL inbox stores (features `postgres`, `mysql`, `sqlite`).
pub mod sql {
    pub use idem_sqlx::*;
}

/// The RabbitMQ transport (feature `rabbitmq`).
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq {
    pub use idem_rabbitmq::*;
}

/// The NATS JetStream transport (feature `nats`).
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats {
    pub use idem_nats::*;
}

/// The `Idempotency-Key` layer for axum and tower, on the same inbox stores (feature `http`).
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http {
    pub use idem_http::*;
}

#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

/// Support for the code `#[idempotent]` generates. Not a public API.
#[doc(hidden)]
pub mod __private {
    pub use idem_core::model::context::extract_state;
    pub use idem_core::{
        handler::BatchHandler, handler::ExternalHandler, handler::Handler, handler::HandlerResult,
        handler::TransactionalHandler, handler::kind, model::Batch, model::BatchError,
        model::BatchOutput, model::BatchResult, model::Context, model::Envelope,
        model::HandlerError, model::KeyError, model::KeySource, model::VersionError,
        model::Versioned, model::field_key, model::version_value, model::versioned,
        registry::Registration, state::StateType, store::InboxStore,
    };
    /// The store types `store = ...` names.
    pub use idem_sqlx::stores;
    pub use inventory;
}

/// The book's chapters (`docs/src`), compiled as doctests so that every Rust block in them
/// builds and runs as the README's do.
#[cfg(doctest)]
mod book {
    #[doc = include_str!("../docs/src/tutorial.md")]
    struct Tutorial;
    #[doc = include_str!("../docs/src/concepts.md")]
    struct Concepts;
    #[doc = include_str!("../docs/src/example.md")]
    struct Example;
    #[doc = include_str!("../docs/src/guarantee.md")]
    struct Guarantee;
    #[doc = include_str!("../docs/src/handlers.md")]
    struct Handlers;
    #[doc = include_str!("../docs/src/runtime.md")]
    struct Runtime;
    #[doc = include_str!("../docs/src/stores.md")]
    struct Stores;
    #[doc = include_str!("../docs/src/adding-a-store.md")]
    struct AddingAStore;
    #[doc = include_str!("../docs/src/adding-a-transport.md")]
    struct AddingATransport;
    #[doc = include_str!("../docs/src/nats.md")]
    struct Nats;
    #[doc = include_str!("../docs/src/batches.md")]
    struct Batches;
    #[doc = include_str!("../docs/src/outbox.md")]
    struct Outbox;
    #[doc = include_str!("../docs/src/ordering.md")]
    struct Ordering;
    #[doc = include_str!("../docs/src/failures.md")]
    struct Failures;
    #[doc = include_str!("../docs/src/external.md")]
    struct External;
    #[doc = include_str!("../docs/src/http.md")]
    struct Http;
    #[doc = include_str!("../docs/src/operations.md")]
    struct Operations;
    #[doc = include_str!("../docs/src/observability.md")]
    struct Observability;
    #[doc = include_str!("../docs/src/testing.md")]
    struct Testing;
    #[doc = include_str!("../docs/src/rabbitmq.md")]
    struct Rabbitmq;
    #[doc = include_str!("../docs/src/troubleshooting.md")]
    struct Troubleshooting;
    #[doc = include_str!("../docs/src/contributing.md")]
    struct Contributing;
}
