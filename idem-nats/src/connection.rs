//! The connection a transport and everything it runs share: the client (opened on first use),
//! which queues are consuming, and the ordered handlers' sources with their partition counts.

use crate::config::NatsConfig;
use async_nats::jetstream::{self, Context};
use idem_core::transport::lane_of;
use idem_core::{Partition, TransportError};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use tokio::sync::OnceCell;

/// The environment variable the examples and tests read the server's URL from.
pub const URL_VARIABLE: &str = "NATS_URL";

/// What a transport's consumers and publisher share (see the module).
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    pub(crate) config: NatsConfig,
    connection: Arc<OnceCell<async_nats::Client>>,
    consuming: Arc<Mutex<HashSet<String>>>,
    /// Ordered handlers' sources and their partition counts, as declared.
    partitioned: Arc<Mutex<HashMap<String, usize>>>,
}

impl Shared {
    pub(crate) fn new(config: NatsConfig) -> Self {
        Self {
            config,
            connection: Arc::default(),
            consuming: Arc::default(),
            partitioned: Arc::default(),
        }
    }

    /// The connection, opened on first use; a failed attempt is tried again next time.
    pub(crate) async fn client(&self) -> Result<async_nats::Client, TransportError> {
        let config = &self.config;
        let client =
            self.connection
                .get_or_try_init(|| async {
                    let mut options = async_nats::ConnectOptions::new()
                        .name(&config.name)
                        .connection_timeout(config.connect_timeout);
                    for root in &config.tls_roots {
                        options = options.add_root_certificates(root.clone());
                    }
                    options.connect(config.url.as_str()).await.map_err(|e| {
                        TransportError::Connection {
                            broker: config.redacted_url(),
                            url_variable: URL_VARIABLE,
                            source: e.into(),
                        }
                    })
                })
                .await?;
        Ok(client.clone())
    }

    /// The connection when it was opened.
    pub(crate) fn opened(&self) -> Option<&async_nats::Client> {
        self.connection.get()
    }

    /// The JetStream context of the connection.
    pub(crate) async fn jetstream(&self) -> Result<Context, TransportError> {
        Ok(jetstream::new(self.client().await?))
    }

    /// See [`crate::NatsTransport::subject`].
    pub(crate) fn subject(&self, exchange: &str, routing_key: &str) -> String {
        if exchange.is_empty() {
            return routing_key.to_owned();
        }
        let partitions = self
            .partitioned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(exchange)
            .copied();
        match partitions {
            Some(count) => Partition::queue_name(exchange, lane_of(Some(routing_key), count)),
            None => format!("{exchange}.{routing_key}"),
        }
    }

    /// Records that `partition`'s source is spread over its count of partitions.
    pub(crate) fn partitioned(&self, partition: &Partition) {
        let mut partitioned = self.partitioned.lock().unwrap_or_else(|e| e.into_inner());
        partitioned.insert(partition.source.clone(), partition.count);
    }

    pub(crate) fn set_consuming(&self, queue: &str, consuming: bool) {
        let mut set = self.consuming.lock().unwrap_or_else(|e| e.into_inner());
        match consuming {
            true => set.insert(queue.to_owned()),
            false => set.remove(queue),
        };
    }

    pub(crate) fn is_consuming(&self, queue: &str) -> bool {
        let set = self.consuming.lock().unwrap_or_else(|e| e.into_inner());
        set.contains(queue)
    }
}
