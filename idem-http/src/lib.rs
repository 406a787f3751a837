//! The `Idempotency-Key` HTTP header for axum and tower, on idem's inbox stores: a retried
//! `POST` runs once, and every retry gets the stored response.
//!
//! ```no_run
//! use axum::{Json, Router, http::StatusCode, routing::post};
//! use idem_http::{Idempotency, Tx};
//! use sqlx::Sqlite;
//!
//! #[derive(serde::Deserialize)]
//! struct NewPayment { customer: String, amount_cents: i64 }
//!
//! async fn create(mut tx: Tx<Sqlite>, Json(p): Json<NewPayment>) -> Result<StatusCode, StatusCode> {
//!     sqlx::query("INSERT INTO payments (customer, amount_cents) VALUES (?, ?)")
//!         .bind(&p.customer).bind(p.amount_cents)
//!         .execute(&mut **tx).await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(StatusCode::CREATED)
//! }
//!
//! # #[derive(Clone)] struct Principal(String);
//! # async fn app(pool: sqlx::SqlitePool) -> Result<Router, idem_http::ConfigError> {
//! let idempotent = Idempotency::transactional(idem_sqlx::SqliteInbox::new(pool), "payments.create")
//!     // The client's stable principal, as your authentication verified it (set here as a
//!     // request extension), never the raw token: a refreshed token is the same client.
//!     .identity(|parts| parts.extensions.get::<Principal>().map(|p| p.0.clone()))
//!     .layer()?;
//! Ok(Router::new().route("/payments", post(idempotent.handler(create))))
//! # }
//! ```
//!
//! What a request gets, following draft-ietf-httpapi-idempotency-key-header and Stripe:
//! - no `Idempotency-Key` (a structured-field string, or a bare token) → **400**, unless the
//!   route is [`Idempotency::optional`]; a malformed or too long key → 400;
//! - a key already recorded for this client and operation → the **stored response** (status,
//!   headers, body), marked `Idempotent-Replayed: true`; error responses are stored and replayed
//!   too once execution began;
//! - the same key with another method, path or body → **422**;
//! - the same key while its first request still runs → **409** with `Retry-After`.
//!
//! Keys are scoped by operation and client ([`Idempotency::identity`]) and stored in the inbox
//! table as consumer `http:<operation>`, key `<client digest>:<key>`, with the request's
//! fingerprint and the response as the row's stored result; they expire after
//! [`Idempotency::retention`] and are deleted by the inbox's sweeper. Two modes:
//! [`Idempotency::transactional`] (the handler writes in the request's [`Tx`]; its writes, the
//! key and the response commit together) and [`Idempotency::external`] (a lease, for handlers
//! that call other services). Metrics: [`telemetry::REQUESTS`].

#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod external;
mod flow;
mod handler;
mod inflight;
pub mod key;
mod keyed;
mod layer;
mod mode;
mod probes;
mod problem;
mod settings;
pub mod stored;
mod sweep;
pub mod telemetry;
mod transactional;
mod tx;

pub use config::{ConfigError, Idempotency};
pub use handler::{At, IdempotentHandler, WritesIn};
pub use layer::{IdempotencyLayer, IdempotencyService};
pub use mode::{External, Mode, Transactional};
pub use probes::probes;
pub use settings::{
    DEFAULT_KEY_RETENTION, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_RESPONSE_BYTES, IdentityFn,
};
pub use sweep::sweep_every;
pub use tx::{Execution, Tx, TxRejection};
