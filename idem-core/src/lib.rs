//! The transport-neutral core of idem.
//!
//! ```
//! use idem_core::{model::Envelope, model::Outcome, model::StoredOutput};
//!
//! // A transport hands the runtime envelopes; the pipeline answers with an outcome.
//! let envelope = Envelope::new(r#"{"order_id":"o-1"}"#).with_message_id("o-1");
//! assert_eq!(envelope.message_id.as_deref(), Some("o-1"));
//! let outcome = Outcome::Duplicate { key: "o-1".into(), output: StoredOutput::encode(&42).unwrap() };
//! assert_eq!(outcome.label(), "duplicate");
//! assert_eq!(outcome.output().unwrap().decode::<i32>().unwrap(), 42);
//! ```
//!
//! Applications depend on `idem`, which re-exports what a handler author uses; this crate is
//! for implementing a transport or a store.
//!
//! A transport turns deliveries into [`Envelope`](crate::model::Envelope)s; the pipeline decodes each one, reads its
//! dedup key, claims the key in an [`InboxStore`](crate::store::InboxStore) transaction, runs the [`Handler`](crate::handler::Handler) in that
//! same transaction and commits; the resulting [`Outcome`](crate::model::Outcome) says whether to ack, retry or
//! dead-letter. Handlers are found through the [`registry`].
//!
//! The modules, in the order a delivery meets them:
//!
//! | module | holds |
//! |---|---|
//! | [`model`] | the envelope, dedup keys, fingerprints, outcomes, error classes, the handler's context |
//! | [`transport`] | the [`Transport`](crate::transport::Transport) and [`Settle`](crate::transport::Settle) contract, and the in-memory transport |
//! | [`handler`], [`registry`] | the [`Handler`](crate::handler::Handler) trait `#[idempotent]` implements, the trait of each [kind](crate::handler::kind), and the registrations |
//! | [`pipeline`] | the entry point every registered handler is, and the pipeline of each kind ([`Pipeline`](crate::pipeline::Pipeline)), chosen by the kind's type |
//! | [`outbox`] | the outbox as the runtime drives it: relay passes, the dispatch after a commit, the relay task |
//! | [`store`] | the store contract by role ([`InboxStore`](crate::store::InboxStore) and the optional ones) the SQL stores implement, and the set of stores |
//! | [`state`] | the shared values handlers ask for by type |
//! | [`runtime`] | the actor runtime: mailboxes, workers, settlement, the sweeper |
//! | [`telemetry`] | the delivery span and the metrics |
//!
//! Nothing here knows RabbitMQ or a particular SQL dialect: each store describes itself
//! ([`StoreKind`](crate::model::StoreKind)) and classifies its database's errors ([`InboxStore::classify`](crate::store::InboxStore::classify)). The one
//! mention of sqlx is `From<sqlx::Error> for HandlerError` (feature `sqlx`), which the orphan
//! rule keeps here; it wraps the error for the store to classify.

#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod fault;
pub mod future;
pub mod handler;
pub mod jitter;
pub mod model;
pub mod outbox;
pub mod pipeline;
pub mod registry;
pub mod runtime;
#[cfg(feature = "sqlx")]
mod sqlx_error;
pub mod state;
pub mod store;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;
