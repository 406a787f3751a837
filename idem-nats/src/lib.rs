//! The NATS JetStream transport of idem, on async-nats.
//!
//! ```no_run
//! use idem_nats::{NatsConfig, NatsTransport};
//!
//! let transport = NatsTransport::new(NatsConfig::new("nats://127.0.0.1:4222"));
//! // give it to idem's Runtime::builder().transport(...)
//! # let _ = transport;
//! ```
//!
//! Per handler queue `q` it declares:
//! - the stream `IDEM_q` holding the subject `q` (work-queue retention: a message is gone once
//!   acked), and the handler's durable pull consumer on it (explicit acks, no delivery limit:
//!   idem's poison limit decides);
//! - the stream `IDEM_q_RETRY` (subject `q.retry`), where a retried message's copy waits with
//!   the next attempt and its due time until the queue's retry forwarder publishes it into `q`;
//! - the stream `IDEM_q_DLQ` (subject `q.dlq`), where dead letters are kept with their reason
//!   in headers (`Idem-Dead-Letter-Reason`, `-Detail`, `Idem-Source-Queue`), after the runtime
//!   recorded them in the handler's store.
//!
//! A delivery is acked only after the handler's transaction committed: a plain ack, with the
//! queue's acks confirmed in bulk behind it (one confirmed ack at a time for all sent before
//! it; the transport's close waits for the last). Producers publish to `q` with `Nats-Msg-Id` = the message id; the
//! outbox does so with its deterministic ids, so JetStream's duplicate window drops a copy
//! before the inbox has to.
//!
//! A message whose headers async-nats cannot parse (the server stores them as sent; the client
//! drops its connection on them) is dead-lettered by idem itself with reason `unparsable`, after
//! the one connection cut it causes: each session, and each reconnect during one, reads the
//! deliveries its consumer has out by sequence and takes out those the client would refuse.
//!
//! An ordered handler's partitions are queues of their own, each with one message in flight
//! at a time; the transport routes a key to its partition. `idem dlq` reads `q.dlq`. The
//! consumer pulls whether or not a batch is gathering (the book's NATS chapter says why), and
//! `idem-bench --broker nats` measures it against handwritten async-nats + sqlx consumers.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod acks;
mod config;
mod connection;
mod consume;
mod dead_letters;
mod envelope;
mod names;
mod outbound;
mod partitions;
mod progress;
mod pull;
mod quarantine;
mod retry;
mod settle;
mod topology;
mod transport;

pub use config::{DEFAULT_ACK_WAIT, NatsConfig};
pub use connection::URL_VARIABLE;
pub use envelope::{
    ATTEMPT_HEADER, CONTENT_TYPE_HEADER, CORRELATION_ID_HEADER, MESSAGE_ID_HEADER, MSG_ID_HEADER,
    REASON_DETAIL_HEADER, REASON_HEADER, REPLY_TO_HEADER, SOURCE_QUEUE_HEADER,
};
pub use topology::DEAD_LETTER_DUPLICATE_WINDOW;
pub use transport::NatsTransport;
