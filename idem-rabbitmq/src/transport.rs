//! [`RabbitTransport`]: the [`Transport`] the runtime uses with RabbitMQ.

use crate::config::RabbitConfig;
use crate::{consume, topology};
use idem_core::registry::BoxFuture;
use idem_core::{Delivery, QueueSpec, StopSignal, Transport, TransportError};
use lapin::types::{LongString, ShortString};
use lapin::{Connection, ConnectionProperties};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// RabbitMQ through lapin: one connection per consumed queue, reopened with backoff.
#[derive(Debug, Clone)]
pub struct RabbitTransport {
    config: RabbitConfig,
    connections: Connections,
}

/// The connections opened so far, closed together at shutdown, and the channels' settlement
/// tasks, which shutdown lets finish first.
#[derive(Debug, Clone, Default)]
pub(crate) struct Connections {
    open: Arc<Mutex<Vec<Arc<Connection>>>>,
    settlers: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Connections {
    /// Opens a connection named after `purpose` and keeps it for [`Connections::close_all`].
    pub(crate) async fn open(
        &self,
        config: &RabbitConfig,
        purpose: &str,
    ) -> Result<Arc<Connection>, lapin::Error> {
        let name = format!("{}:{purpose}", config.name);
        let properties = ConnectionProperties::default()
            .with_connection_name(LongString::from(name.into_bytes()));
        let connection = Arc::new(Connection::connect(&config.url, properties).await?);
        let mut all = self.open.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|c| c.status().connected());
        all.push(connection.clone());
        Ok(connection)
    }

    /// Keeps a channel's settlement task, so that closing waits for its last acks.
    pub(crate) fn track(&self, settler: JoinHandle<()>) {
        let mut all = self.settlers.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|task| !task.is_finished());
        all.push(settler);
    }

    async fn close_all(&self) {
        let settlers: Vec<JoinHandle<()>> =
            std::mem::take(&mut *self.settlers.lock().unwrap_or_else(|e| e.into_inner()));
        for settler in settlers {
            // Ends once every delivery of its channel is settled or dropped.
            let _ = settler.await;
        }
        let all: Vec<Arc<Connection>> =
            std::mem::take(&mut *self.open.lock().unwrap_or_else(|e| e.into_inner()));
        for connection in all {
            let _ = connection
                .close(200, ShortString::from("idem shutting down"))
                .await;
        }
    }
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
        Box::pin(consume::run(
            self.config.clone(),
            self.connections.clone(),
            queue,
            prefetch,
            mailbox,
            stop,
        ))
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.connections.close_all())
    }

    fn message_ttl(&self, _queue: &str) -> Option<std::time::Duration> {
        self.config.message_ttl
    }
}
