//! [`RabbitTransport`]: the [`Transport`] the runtime uses with RabbitMQ.

use crate::config::RabbitConfig;
use crate::connections::Connections;
use crate::consume::Consumer;
use crate::dead_letters::RabbitDeadLetters;
use crate::outbound::RabbitOutbound;
use crate::topology;
use idem_core::{
    future::BoxFuture, transport::DeadLetterReader, transport::Delivery, transport::Outbound,
    transport::QueueSpec, transport::StopSignal, transport::Transport, transport::TransportError,
};
use std::sync::Arc;
use tokio::sync::mpsc;

/// RabbitMQ through lapin: one connection per consumed queue, reopened with backoff.
#[derive(Debug, Clone)]
pub struct RabbitTransport {
    config: RabbitConfig,
    connections: Connections,
    /// The retry copies and dead letters of settlements: a connection of their own (see
    /// `settle`), connected on first use.
    copies: Arc<RabbitOutbound>,
}

impl RabbitTransport {
    /// A transport with `config`. Nothing connects until the runtime starts.
    pub fn new(config: RabbitConfig) -> Self {
        Self {
            copies: Arc::new(RabbitOutbound::new(config.clone())),
            config,
            connections: Connections::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &RabbitConfig {
        &self.config
    }
}

impl Transport for RabbitTransport {
    fn declare<'a>(&'a self, queues: &'a [QueueSpec]) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(topology::declare_all(
            &self.connections,
            &self.config,
            queues,
        ))
    }

    fn consume(
        &self,
        queue: QueueSpec,
        prefetch: u16,
        mailbox: mpsc::Sender<Delivery>,
        stop: StopSignal,
    ) -> BoxFuture<'static, ()> {
        let consumer = Consumer {
            config: self.config.clone(),
            connections: self.connections.clone(),
            copies: self.copies.clone(),
            spec: queue,
            prefetch,
            mailbox,
            stop,
        };
        Box::pin(consumer.run())
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.connections.close_all())
    }

    /// A confirm-mode publisher of its own, connected on first use.
    fn outbound(&self) -> Option<Arc<dyn Outbound>> {
        Some(Arc::new(RabbitOutbound::new(self.config.clone())))
    }

    fn connected(&self, queue: &str) -> bool {
        self.connections.consuming.contains(queue)
    }

    fn message_ttl(&self, _queue: &str) -> Option<std::time::Duration> {
        self.config.message_ttl
    }

    /// `<queue>.dlq`, read with `basic.get` on a connection of its own.
    fn dead_letters<'a>(
        &'a self,
        queue: &'a str,
    ) -> BoxFuture<'a, Result<Box<dyn DeadLetterReader>, TransportError>> {
        Box::pin(async move {
            let reader = RabbitDeadLetters::open(&self.config, queue).await?;
            Ok(Box::new(reader) as Box<dyn DeadLetterReader>)
        })
    }
}
