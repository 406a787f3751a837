//! The RabbitMQ transport of idem, on lapin.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_rabbitmq::{Publisher, QueueType, RabbitConfig, RabbitTransport};
//!
//! let config = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f").queue_type(QueueType::Quorum);
//! let publisher = Publisher::connect(&config).await?; // confirmed and mandatory publishes
//! publisher.publish_json("orders", "o-1", &serde_json::json!({"order_id": "o-1"})).await?;
//! let transport = RabbitTransport::new(config); // give it to idem's Runtime::builder()
//! # let _ = transport; Ok(()) }
//! ```
//!
//! Per handler queue `q` it declares:
//! - `q`: durable, its dead letters routed by the broker to `q.dlq`;
//! - `q.dlq`: durable; a dead-lettered message arrives there **once** (the broker moves it on
//!   `basic.reject`), with its id, body and properties, and RabbitMQ's `x-death` header. Why it
//!   was refused (reason, detail, consumer, key, attempts) is recorded in the handler's store
//!   before the reject, keyed by consumer and key (see `idem_sqlx::dead_letters`);
//! - `q.retry.<ms>ms`, one per retry delay: a message published there waits out the queue's
//!   TTL and is dead-lettered back into `q` (no head-of-line blocking between delays).
//!
//! Consumers reconnect with backoff when the connection or channel is lost; what was in flight
//! is redelivered by the broker and recognised by the inbox as a duplicate where it committed.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod answer;
mod config;
mod connections;
mod consume;
mod dead_letters;
mod envelope;
mod outbound;
mod publisher;
mod quarantine;
mod republish;
mod settle;
mod tls;
mod topology;
mod transport;
mod wire;

pub use config::{
    Binding, DEFAULT_MAX_BODY, DEFAULT_MAX_HEADERS, DEFAULT_PUBLISH_TIMEOUT, ExchangeKind,
    QueueType, RabbitConfig,
};
pub use envelope::{ATTEMPT_HEADER, REASON_DETAIL_HEADER, REASON_HEADER};
pub use publisher::{PublishError, Publisher};
pub use topology::{CONSISTENT_HASH, consistent_hash_available, dlq, retry_queue};
pub use transport::RabbitTransport;
