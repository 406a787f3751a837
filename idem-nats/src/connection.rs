//! The connection a transport and everything it runs share: the client (opened on first use),
//! which queues are consuming, and the ordered handlers' sources with their partition counts.

use crate::acks::Acks;
use crate::config::NatsConfig;
use async_nats::jetstream::{self, Context};
use idem_core::transport::{Consuming, lane_of};
use idem_core::{transport::Partition, transport::TransportError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::OnceCell;

/// The environment variable the examples and tests read the server's URL from.
pub const URL_VARIABLE: &str = "NATS_URL";

/// Credentials a server URL carried in its user part.
#[derive(Debug, PartialEq, Eq)]
enum Credentials {
    /// `nats://token@host`.
    Token(String),
    /// `nats://user:password@host`.
    User(String, String),
}

/// The server URLs of `urls` (comma-separated), each on its own and without its user part, and
/// the credentials the first that had one carried (percent-decoded).
fn without_credentials(urls: &str) -> (Vec<String>, Option<Credentials>) {
    let mut credentials = None;
    let servers: Vec<String> = urls
        .split(',')
        .map(str::trim)
        .filter(|url| !url.is_empty())
        .map(|server| {
            let Ok(mut url) = url::Url::parse(server) else {
                return server.to_owned();
            };
            if url.username().is_empty() && url.password().is_none() {
                return server.to_owned();
            }
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8_lossy()
                    .into_owned()
            };
            let found = match url.password() {
                Some(password) => Credentials::User(decode(url.username()), decode(password)),
                None => Credentials::Token(decode(url.username())),
            };
            credentials.get_or_insert(found);
            let _ = url.set_username("");
            let _ = url.set_password(None);
            url.to_string()
        })
        .collect();
    (servers, credentials)
}

/// What a transport's consumers and publisher share (see the module).
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    pub(crate) config: NatsConfig,
    connection: Arc<OnceCell<async_nats::Client>>,
    /// The queues whose consumers are consuming.
    pub(crate) consuming: Consuming,
    /// Ordered handlers' sources and their partition counts, as declared or read from the
    /// server.
    partitioned: Arc<Mutex<HashMap<String, usize>>>,
    /// Exchanges the server recorded no partition count for, and when it was asked.
    unpartitioned: Arc<Mutex<HashMap<String, Instant>>>,
    /// Each consumed queue's acks, confirmed in bulk.
    acks: Arc<Mutex<HashMap<String, Arc<Acks>>>>,
}

/// How long a producer takes an exchange for one that is not partitioned before it asks the
/// server again.
const UNPARTITIONED_FOR: Duration = Duration::from_secs(10);

impl Shared {
    pub(crate) fn new(config: NatsConfig) -> Self {
        Self {
            config,
            connection: Arc::default(),
            consuming: Consuming::default(),
            partitioned: Arc::default(),
            unpartitioned: Arc::default(),
            acks: Arc::default(),
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
                    // Credentials go to the client as options, not in the URL, which its own
                    // logs print.
                    let (servers, credentials) = without_credentials(&config.url);
                    options = match credentials {
                        Some(Credentials::Token(token)) => options.token(token),
                        Some(Credentials::User(user, password)) => {
                            options.user_and_password(user, password)
                        }
                        None => options,
                    };
                    options.connect(servers.as_slice()).await.map_err(|e| {
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

    /// The acks of `queue`'s deliveries.
    pub(crate) fn acks(&self, queue: &str) -> Arc<Acks> {
        let mut acks = self.acks.lock().unwrap_or_else(|e| e.into_inner());
        acks.entry(queue.to_owned()).or_default().clone()
    }

    /// Resolves once every queue's acks sent so far are confirmed.
    pub(crate) async fn acks_confirmed(&self) {
        let all: Vec<Arc<Acks>> = {
            let acks = self.acks.lock().unwrap_or_else(|e| e.into_inner());
            acks.values().cloned().collect()
        };
        for acks in all {
            acks.confirmed().await;
        }
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

    /// The subject a message for `exchange` with `routing_key` goes to, with the partition
    /// count of an ordered handler's source read from the server (through `js`) when this
    /// process declared none: the same subject every producer computes.
    pub(crate) async fn route(
        &self,
        js: &Context,
        exchange: &str,
        routing_key: &str,
    ) -> Result<String, TransportError> {
        if exchange.is_empty() || self.known(exchange) {
            return Ok(self.subject(exchange, routing_key));
        }
        match crate::partitions::read(js, exchange).await? {
            Some(count) => {
                let mut partitioned = self.partitioned.lock().unwrap_or_else(|e| e.into_inner());
                partitioned.insert(exchange.to_owned(), count);
            }
            None => {
                let mut unpartitioned =
                    self.unpartitioned.lock().unwrap_or_else(|e| e.into_inner());
                unpartitioned.insert(exchange.to_owned(), Instant::now());
            }
        }
        Ok(self.subject(exchange, routing_key))
    }

    /// Whether `exchange`'s partitioning is known: declared, read, or read as none lately.
    fn known(&self, exchange: &str) -> bool {
        if self
            .partitioned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(exchange)
        {
            return true;
        }
        self.unpartitioned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(exchange)
            .is_some_and(|asked| asked.elapsed() < UNPARTITIONED_FOR)
    }

    /// Records that `partition`'s source is spread over its count of partitions.
    pub(crate) fn partitioned(&self, partition: &Partition) {
        let mut partitioned = self.partitioned.lock().unwrap_or_else(|e| e.into_inner());
        partitioned.insert(partition.source.clone(), partition.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_leave_the_urls() {
        assert_eq!(
            without_credentials("nats://s3cret@h:4222"),
            (
                vec!["nats://h:4222".to_owned()],
                Some(Credentials::Token("s3cret".into()))
            )
        );
        assert_eq!(
            without_credentials("nats://u:p%40s+s@a:4222, nats://u:p%40s+s@b:4223"),
            (
                vec!["nats://a:4222".to_owned(), "nats://b:4223".to_owned()],
                Some(Credentials::User("u".into(), "p@s+s".into()))
            )
        );
        assert_eq!(
            without_credentials("nats://127.0.0.1:4222"),
            (vec!["nats://127.0.0.1:4222".to_owned()], None)
        );
    }
}
