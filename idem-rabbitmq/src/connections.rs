//! The connections a transport (or publisher) opened, closed together at shutdown, and the
//! channels' settlement tasks, which shutdown lets finish first.

use crate::config::RabbitConfig;
use idem_core::transport::Consuming;
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{LongString, ShortString};
use lapin::{Connection, ConnectionProperties};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;

/// How long one broker of the list is given to take a connection before the next is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The connections opened so far, closed together at shutdown, and the channels' settlement
/// tasks, which shutdown lets finish first.
#[derive(Debug, Clone, Default)]
pub(crate) struct Connections {
    open: Arc<Mutex<Vec<Arc<Connection>>>>,
    settlers: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// The queues whose consumer is consuming now.
    pub(crate) consuming: Consuming,
}

/// A connection to the first broker of `config` that takes one, in failover order.
async fn connect_first(
    config: &RabbitConfig,
    properties: ConnectionProperties,
    tls: OwnedTLSConfig,
) -> Result<Connection, lapin::Error> {
    let count = config.urls.len();
    let mut failed: Option<lapin::Error> = None;
    for (tried, (index, url)) in config.brokers().enumerate() {
        let runtime = lapin::runtime::default_runtime()?;
        let connecting =
            Connection::connect_with_config(url, properties.clone(), tls.clone(), runtime);
        let error = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(Ok(connection)) => {
                config.worked(index);
                return Ok(connection);
            }
            Ok(Err(e)) => e,
            Err(_) => std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no connection within {CONNECT_TIMEOUT:?}"),
            )
            .into(),
        };
        if tried + 1 < count {
            tracing::warn!(
                broker = %idem_core::telemetry::redact_url(url),
                error = %error,
                "broker did not take the connection; trying the next"
            );
        }
        failed = Some(error);
    }
    Err(failed.unwrap_or_else(|| std::io::Error::other("no broker configured").into()))
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
        let tls = OwnedTLSConfig {
            identity: None,
            cert_chain: config.tls_ca.as_deref().map(str::to_owned),
        };
        let connection = Arc::new(connect_first(config, properties, tls).await?);
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

    /// Waits for every settlement task, then closes every connection.
    pub(crate) async fn close_all(&self) {
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
