//! [`NatsTransport`]: the [`Transport`] the runtime uses with NATS JetStream.

use crate::config::NatsConfig;
use crate::connection::Shared;
use crate::consume::Consumer;
use crate::dead_letters::NatsDeadLetters;
use crate::names;
use crate::outbound::NatsOutbound;
use crate::topology;
use idem_core::{
    future::BoxFuture, model::Destination, model::Envelope, transport::DeadLetterReader,
    transport::Delivery, transport::Outbound, transport::OutboundError, transport::QueueSpec,
    transport::StopSignal, transport::Transport, transport::TransportError,
};
use std::sync::Arc;
use tokio::sync::mpsc;

/// NATS JetStream through async-nats: one connection per process, which the client reconnects;
/// per handler queue a work-queue stream, a durable pull consumer and a retry forwarder.
#[derive(Debug, Clone)]
pub struct NatsTransport {
    shared: Shared,
}

impl NatsTransport {
    /// A transport with `config`. Nothing connects until the runtime starts.
    pub fn new(config: NatsConfig) -> Self {
        Self {
            shared: Shared::new(config),
        }
    }

    /// The settings.
    pub fn config(&self) -> &NatsConfig {
        &self.shared.config
    }

    /// The subject a message for `destination` goes to: a queue's own subject; for a topic,
    /// the partition of its key (an ordered handler's source this transport declared, as
    /// `<topic>.p<lane_of(key)>`), else `<topic>.<key>`.
    ///
    /// A process that declared no partitions of the topic computes `<topic>.<key>` here;
    /// [`NatsTransport::route`] asks the server for the count.
    pub fn subject(&self, destination: &Destination) -> String {
        let (topic, key) = destination.parts();
        self.shared.subject(topic, key)
    }

    /// The subject a message for `destination` goes to, as [`NatsTransport::subject`], with an
    /// ordered handler's partition count read from the server when this process declared
    /// none: every producer routes a key to the partition its consumers read (the outbox
    /// routes this way).
    pub async fn route(&self, destination: &Destination) -> Result<String, TransportError> {
        let js = self.shared.jetstream().await?;
        let (topic, key) = destination.parts();
        self.shared.route(&js, topic, key).await
    }

    /// Publishes `envelope` to `subject` ([`NatsTransport::subject`] names a queue's or a
    /// partition's) and waits for JetStream's confirm, with `Nats-Msg-Id` = `msg_id`, else the
    /// envelope's message id; whether JetStream dropped it as a duplicate of a message with
    /// that id it took within its duplicate window. A producer that publishes copies of one
    /// message on purpose gives each its own `msg_id`; the envelope's message id travels
    /// beside it.
    pub async fn publish(
        &self,
        subject: &str,
        envelope: &Envelope,
        msg_id: Option<&str>,
    ) -> Result<bool, OutboundError> {
        let js = self
            .shared
            .jetstream()
            .await
            .map_err(|e| OutboundError::Broker(e.into()))?;
        let msg_id = msg_id.or(envelope.message_id.as_deref());
        let headers = crate::envelope::headers(envelope, msg_id);
        let body = bytes::Bytes::copy_from_slice(&envelope.body);
        let unroutable = || OutboundError::Unroutable {
            destination: Destination::queue(subject),
        };
        let failed = |e: async_nats::jetstream::context::PublishError| match e.kind() {
            async_nats::jetstream::context::PublishErrorKind::StreamNotFound => unroutable(),
            _ => OutboundError::Broker(e.into()),
        };
        let ack = js
            .publish_with_headers(subject.to_owned(), headers, body)
            .await
            .map_err(failed)?
            .await
            .map_err(failed)?;
        Ok(ack.duplicate)
    }

    /// Deletes `queue`'s streams (its messages, retry copies and dead letters, with their
    /// consumers) and returns how many messages they held; a stream that does not exist counts
    /// none. For demos and tests that start afresh.
    pub async fn delete_queue(&self, queue: &str) -> Result<u64, TransportError> {
        let names = names::of(queue)?;
        let js = self.shared.jetstream().await?;
        let mut removed = 0;
        for stream in [&names.stream, &names.retry_stream, &names.dlq_stream] {
            let Ok(mut found) = js.get_stream(stream).await else {
                continue;
            };
            let held = found.info().await.map_or(0, |info| info.state.messages);
            js.delete_stream(stream)
                .await
                .map_err(|e| TransportError::Topology {
                    queue: stream.clone(),
                    action: "deleting the stream",
                    source: e.into(),
                })?;
            removed += held;
        }
        Ok(removed)
    }
}

impl NatsTransport {
    /// Deletes the partition count the server records for the ordered handler's source
    /// `source` ([`NatsTransport::route`]), once its partitions' queues are deleted
    /// ([`NatsTransport::delete_queue`]); whether there was one. For demos and tests that start
    /// afresh, and to change a source's count.
    pub async fn delete_source(&self, source: &str) -> Result<bool, TransportError> {
        let js = self.shared.jetstream().await?;
        crate::partitions::delete(&js, source).await
    }
}

impl Transport for NatsTransport {
    fn declare<'a>(&'a self, queues: &'a [QueueSpec]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let js = self.shared.jetstream().await?;
            for spec in queues {
                topology::declare(&js, spec, &self.shared.config).await?;
                if let Some(partition) = &spec.partition {
                    self.shared.partitioned(partition);
                }
            }
            Ok(())
        })
    }

    fn consume(
        &self,
        queue: QueueSpec,
        prefetch: u16,
        mailbox: mpsc::Sender<Delivery>,
        stop: StopSignal,
    ) -> BoxFuture<'static, ()> {
        let consumer = Consumer {
            shared: self.shared.clone(),
            acks: self.shared.acks(&queue.queue),
            spec: queue,
            prefetch,
            mailbox,
            stop,
            unsettled: Default::default(),
            reading: Default::default(),
        };
        Box::pin(consumer.run())
    }

    /// Waits until JetStream confirmed the acks sent (they are confirmed in bulk) and flushes what the
    /// connection has buffered; unsettled deliveries are redelivered by JetStream once their
    /// ack wait ends.
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.shared.acks_confirmed().await;
            if let Some(client) = self.shared.opened() {
                let _ = client.flush().await;
            }
        })
    }

    /// Whether `queue` has a consuming session and the connection is up now.
    fn connected(&self, queue: &str) -> bool {
        let up = self
            .shared
            .opened()
            .is_some_and(|c| c.connection_state() == async_nats::connection::State::Connected);
        up && self.shared.consuming.contains(queue)
    }

    /// `q.dlq`'s stream, read by sequence; nothing is held while it is read.
    fn dead_letters<'a>(
        &'a self,
        queue: &'a str,
    ) -> BoxFuture<'a, Result<Box<dyn DeadLetterReader>, TransportError>> {
        Box::pin(async move {
            let names = names::of(queue)?;
            let js = self.shared.jetstream().await?;
            Ok(Box::new(NatsDeadLetters::new(js, names)) as Box<dyn DeadLetterReader>)
        })
    }

    /// Publishes through this transport's connection, each message confirmed by JetStream.
    fn outbound(&self) -> Option<Arc<dyn Outbound>> {
        Some(Arc::new(NatsOutbound::new(self.shared.clone())))
    }
}
