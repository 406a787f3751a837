//! [`RabbitTransport`]: the [`Transport`] the runtime uses with RabbitMQ.

use crate::config::RabbitConfig;
use crate::connections::Connections;
use crate::consume::Consumer;
use crate::topology;
use idem_core::{BoxFuture, Delivery, QueueSpec, StopSignal, Transport, TransportError};
use lapin::types::ShortString;
use tokio::sync::mpsc;

/// RabbitMQ through lapin: one connection per consumed queue, reopened with backoff.
#[derive(Debug, Clone)]
pub struct RabbitTransport {
    config: RabbitConfig,
    connections: Connections,
}

impl RabbitTransport {
    /// A transport with `config`. Nothing connects until the runtime starts.
    pub fn new(config: RabbitConfig) -> Self {
        Self {
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
        Box::pin(async move {
            let connection = self.connections.open(&self.config, "topology").await.map_err(|e| {
                TransportError::Connection(format!(
                    "cannot reach RabbitMQ at {}: {e}; start it with `rabbitmq-server -detached` or set AMQP_URL",
                    self.config.redacted_url()
                ))
            })?;
            let result = async {
                for spec in queues {
                    topology::declare(&connection, &self.config, spec).await?;
                }
                Ok(())
            }
            .await;
            let _ = connection
                .close(200, ShortString::from("topology declared"))
                .await;
            result
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
            config: self.config.clone(),
            connections: self.connections.clone(),
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

    fn message_ttl(&self, _queue: &str) -> Option<std::time::Duration> {
        self.config.message_ttl
    }
}
