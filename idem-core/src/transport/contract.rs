//! The contract between the runtime and a message transport (RabbitMQ, the in-memory one).
//!
//! It speaks of deliveries, their settlement, ordered lanes and outbound publishing, not of a
//! broker's topology: a transport turns broker deliveries into [`Delivery`] values in a
//! handler's mailbox (that is where a delivery enters); the runtime decides each one's
//! settlement (`runtime/settle.rs`) and sends it exactly once through its [`Settle`]: ack,
//! retry after a delay, dead-letter or release. How a broker does each (delay queues or a
//! negative ack with a delay, a dead-letter exchange or a dead-letter stream) is the
//! transport's own.

use super::dead_letters::DeadLetterReader;
use super::demand::Demand;
use super::error::TransportError;
use super::outbound::Outbound;
use crate::future::BoxFuture;
use crate::model::{DeadLetter, DeadLetterRecord, Envelope, StoreError};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// One delivery: the message and the means to settle it.
pub struct Delivery {
    /// The message.
    pub envelope: Envelope,
    /// How to settle it; consumed by the settlement.
    pub settle: Box<dyn Settle>,
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("envelope", &self.envelope)
            .finish_non_exhaustive()
    }
}

/// Settles one delivery. Exactly one method is called, once.
pub trait Settle: Send + Sync {
    /// The message is done with (processed or a duplicate): remove it from the queue.
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), TransportError>>;

    /// Deliver the message again after `delay`, as attempt `envelope.attempt + 1` (RabbitMQ:
    /// through a delay queue; a broker with delayed redelivery: a negative ack with `delay`).
    fn retry<'a>(
        self: Box<Self>,
        envelope: &'a Envelope,
        delay: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Move the message to its dead letters (a queue, a stream), once, keeping its id, body and
    /// properties.
    fn dead_letter<'a>(
        self: Box<Self>,
        envelope: &'a Envelope,
        reason: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Give the message back unprocessed (shutdown): it is delivered again, now or later.
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), TransportError>>;
}

/// What one handler needs from the transport.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct QueueSpec {
    /// The queue to consume.
    pub queue: String,
    /// The consumer identity, for consumer tags and logs.
    pub consumer: String,
    /// The distinct delays the retry policy uses, shortest first, for a transport that prepares
    /// them ahead (RabbitMQ declares one delay queue each); others may ignore them.
    pub retry_delays: Vec<Duration>,
    /// Where the transport records the dead letters it refuses on its own (see
    /// [`DeadLetterLog`]); the runtime sets it to the handler's store.
    pub dead_letters: DeadLetterLog,
    /// Set when the queue is one partition of an ordered handler: the transport routes the
    /// messages published to the partition's source by partition key to the partitions, and
    /// lets one consumer at a time (across processes) consume each.
    pub partition: Option<Partition>,
    /// When the handler's workers want deliveries (batch mode: while a batch gathers); the
    /// runtime sets it. A transport reads the broker only while they are wanted.
    pub demand: Demand,
}

/// One partition queue of an ordered handler (see `RuntimeBuilder::ordered`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Partition {
    /// Where producers publish the handler's messages, each with its partition key (RabbitMQ:
    /// an exchange, the key as routing key).
    pub source: String,
    /// This partition, from 0.
    pub index: usize,
    /// How many partitions the source has.
    pub count: usize,
}

impl Partition {
    /// Partition `index` of `count` behind `source`.
    pub fn new(source: impl Into<String>, index: usize, count: usize) -> Self {
        Self {
            source: source.into(),
            index,
            count,
        }
    }

    /// The queue of partition `index` behind `source`: `<source>.p<index>`.
    pub fn queue_name(source: &str, index: usize) -> String {
        format!("{source}.p{index}")
    }
}

impl QueueSpec {
    /// The spec of `queue`, consumed for the handler with consumer identity `consumer`; the
    /// other fields at their defaults.
    pub fn new(queue: impl Into<String>, consumer: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            consumer: consumer.into(),
            ..Self::default()
        }
    }

    /// The specs of an ordered handler's `count` partition queues behind `source`
    /// (`<source>.p0` …, no retry queues), for a producer that declares them before it
    /// publishes.
    pub fn partitions(source: &str, consumer: &str, count: usize) -> Vec<Self> {
        (0..count)
            .map(|index| Self {
                partition: Some(Partition::new(source, index, count)),
                ..Self::new(Partition::queue_name(source, index), consumer)
            })
            .collect()
    }
}

type RecordFn =
    dyn Fn(DeadLetterRecord) -> BoxFuture<'static, Result<(), StoreError>> + Send + Sync;

/// Where a transport records why it dead-letters a delivery no handler saw (too large, or
/// unparsable by its client library): the store of the queue's handler. A transport records
/// first and moves the message only once the record is written; a failed record leaves the
/// message in its queue.
#[derive(Clone, Default)]
pub struct DeadLetterLog(Option<Arc<RecordFn>>);

impl DeadLetterLog {
    /// A log that records through `record`.
    pub fn new(
        record: impl Fn(DeadLetterRecord) -> BoxFuture<'static, Result<(), StoreError>>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self(Some(Arc::new(record)))
    }

    /// Records `record`; a log made with [`Default`] keeps nothing and succeeds.
    pub fn record(&self, record: DeadLetterRecord) -> BoxFuture<'static, Result<(), StoreError>> {
        match &self.0 {
            Some(record_fn) => record_fn(record),
            None => Box::pin(std::future::ready(Ok(()))),
        }
    }
}

impl fmt::Debug for DeadLetterLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "DeadLetterLog(store)"
        } else {
            "DeadLetterLog(none)"
        })
    }
}

/// Raised to `true` when consumers must stop taking new deliveries.
pub type StopSignal = watch::Receiver<bool>;

/// A message transport.
pub trait Transport: Send + Sync + 'static {
    /// Declares what `queues` need on the broker (RabbitMQ: queues, dead-letter and retry
    /// queues; a log-based broker: streams and durable consumers), again after each reconnect
    /// as well. Existing topology with other arguments is an error saying which argument
    /// differs.
    fn declare<'a>(&'a self, queues: &'a [QueueSpec]) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Consumes `queue` into `mailbox` with at most `prefetch` unsettled deliveries, until `stop`
    /// is raised. Connection losses are retried with backoff inside; only `stop` ends it.
    /// `prefetch` is the runtime's own bound on a consumer's unsettled deliveries (its mailbox
    /// holds that many), whatever the broker's flow control is called (RabbitMQ's QoS,
    /// JetStream's `max_ack_pending`).
    fn consume(
        &self,
        queue: QueueSpec,
        prefetch: u16,
        mailbox: mpsc::Sender<Delivery>,
        stop: StopSignal,
    ) -> BoxFuture<'static, ()>;

    /// Closes connections; deliveries still unsettled go back to their queues.
    fn close(&self) -> BoxFuture<'_, ()>;

    /// Whether the consumer of `queue` is connected and consuming (default `true`: a transport
    /// with nothing to lose, as the in-memory one).
    fn connected(&self, queue: &str) -> bool {
        let _ = queue;
        true
    }

    /// What publishes the messages handlers stage in the outbox (default `None`: a
    /// transport that cannot publish; staged messages then wait in the outbox).
    fn outbound(&self) -> Option<Arc<dyn Outbound>> {
        None
    }

    /// The message TTL `queue` is declared with, if any: a message may wait that long before
    /// it is delivered, so the runtime refuses a retention shorter than it.
    fn message_ttl(&self, queue: &str) -> Option<Duration> {
        let _ = queue;
        None
    }

    /// A reader of `queue`'s dead letters for operators (`idem dlq`), on a connection of its
    /// own (default: [`TransportError::Unsupported`], a transport whose dead letters an
    /// operator cannot read through it).
    fn dead_letters<'a>(
        &'a self,
        queue: &'a str,
    ) -> BoxFuture<'a, Result<Box<dyn DeadLetterReader>, TransportError>> {
        let _ = queue;
        Box::pin(std::future::ready(Err(TransportError::Unsupported(
            "reading dead letters",
        ))))
    }
}
