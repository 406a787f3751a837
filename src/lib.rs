//! # idem
//!
//! RabbitMQ consumers that process every message **effectively exactly once**: at-least-once
//! delivery from the broker, plus the idempotent consumer (inbox) pattern on the consumer's
//! side. The dedup marker is written in the same database transaction as the handler's own
//! writes; a redelivered or duplicated message finds the marker and is skipped.
//!
//! ```no_run
//! #[derive(serde::Deserialize)]
//! struct OrderPlaced { order_id: String, customer: String, amount_cents: i64 }
//!
//! #[idem::idempotent(queue = "orders", key = "order.order_id", store = Postgres)]
//! async fn place_order(
//!     tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
//!     order: OrderPlaced,
//! ) -> Result<(), idem::HandlerError> {
//!     sqlx::query("INSERT INTO orders (order_id, customer, amount_cents) VALUES ($1, $2, $3)")
//!         .bind(&order.order_id).bind(&order.customer).bind(order.amount_cents)
//!         .execute(&mut **tx).await?;
//!     Ok(())
//! }
//! ```
//!
//! ## `#[idempotent(...)]`
//! - `store = Postgres | MySql | Sqlite` (required): which inbox the handler's transaction
//!   belongs to.
//! - `key = "..."`: the dedup key. `"message_id"` (the default) is the AMQP `message_id`;
//!   `"header:<name>"` an application header; `"cloudevents"` the CloudEvents `source` and `id`;
//!   `"<payload>.<field>"` a field of the decoded payload, checked by the compiler.
//! - `consumer = "..."`: the identity that scopes keys, so two handlers of one message each
//!   process it once. Defaults to the function's module path and name: **set it explicitly in
//!   production**, or moving the function to another module starts a fresh key space.
//! - `queue = "..."`: the queue the runtime consumes for this handler.
//! - `mode = "external"`: for work that cannot join a transaction (a payment API); the function
//!   takes `(payload, ctx)`, the key is leased `in_progress`, then settled. Default
//!   `"transactional"`.
//! - `lease = "30s"` (external mode) and `retention = "7d"` (how long its inbox rows are kept).
//!
//! The function must be `async fn name(tx: &mut sqlx::Transaction<'_, DB>, payload: T,
//! [ctx: &idem::Context<'_>]) -> Result<R, E>` with `T: DeserializeOwned`,
//! `R: Serialize + DeserializeOwned` and `E: Into<HandlerError>`. It stays callable as written.
//!
//! Every annotated function is registered; [`registry::handlers`] lists them and
//! [`Registration::invoke`] processes one delivery with the inbox stores in [`Stores`];
//! [`Runtime::builder`] consumes their queues.
//!
//! ## Features
//! `postgres`, `mysql` and `sqlite` (all on by default) enable the inbox stores
//! [`sql::PgInbox`], [`sql::MySqlInbox`] (MySQL and MariaDB) and [`sql::SqliteInbox`].
//! `rabbitmq` (on by default) the RabbitMQ transport; `http` (off by default) `idem::http`, the
//! `Idempotency-Key` layer for axum and tower (the crate `idem-http`).

pub use idem_core::{
    BoxError, Claim, ClaimRequest, Context, DEFAULT_LEASE, DEFAULT_POISON_LIMIT, DeadLetter,
    DeadLetterLog, DeadLetterRecord, Delivery, DispatchError, Envelope, ErasedHandler, ErrorClass,
    Fingerprint, Handler, HandlerError, HandlerResult, HeaderValue, Headers, Health, InboxStore,
    KeyError, KeySource, KeyValue, Lease, LeaseEnd, MAX_KEY_LEN, MemoryTransport, Mode, Outcome,
    QueueSpec, Readiness, Registration, RegistryError, RejectReason, Rejection, RetryPolicy,
    RetryPolicyError, Runtime, RuntimeBuilder, RuntimeError, Settle, Snapshot, Stats, StopSignal,
    StoreError, StoreKind, StoredOutput, Stores, SweepReport, Transient, Transport, TransportError,
    process, process_batch,
};
pub use idem_core::{registry, telemetry};
pub use idem_macros::idempotent;
pub use idem_sqlx::classify_sqlx;

/// The RabbitMQ transport (feature `rabbitmq`).
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq {
    pub use idem_rabbitmq::*;
}

/// The `Idempotency-Key` layer for axum and tower, on the same inbox stores (feature `http`).
#[cfg(feature = "http")]
pub mod http {
    pub use idem_http::*;
}

/// The SQL inbox stores.
pub mod sql {
    pub use idem_sqlx::*;
}

/// Support for the code `#[idempotent]` generates. Not a public API.
#[doc(hidden)]
pub mod __private {
    pub use idem_core::{
        Context, DEFAULT_LEASE, Envelope, Handler, HandlerError, HandlerResult, InboxStore,
        KeyError, KeySource, Mode, Registration, field_key,
    };
    /// The store types `store = ...` names.
    pub use idem_sqlx::stores;
    pub use inventory;
}

/// The README's code blocks, compiled by `cargo test` so the quick start stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
