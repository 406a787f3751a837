//! The tool's side of RabbitMQ: a connection to the first broker that takes one, the channel
//! that reads a dead-letter queue, and [`Broker::answer`], which bounds every wait on the
//! broker (`--broker-timeout`): a broker that accepts the connection and then says nothing, or
//! blocks publishers under a resource alarm, fails the command with a message instead of
//! holding it forever.

use crate::args::Cli;
use crate::error::CliError;
use idem::sql::DeadLetterRow;
use idem::store::Fingerprint;
use idem::telemetry::redact_url;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::future::Future;
use std::time::Duration;

/// One dead letter, held unacknowledged on the reading channel.
pub(crate) struct Letter {
    pub(crate) tag: u64,
    pub(crate) properties: BasicProperties,
    pub(crate) body: Vec<u8>,
}

/// How a dead letter is named and traced back to its record.
impl Letter {
    pub(crate) fn message_id(&self) -> Option<&str> {
        self.properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
    }

    pub(crate) fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(&self.body)
    }

    /// `sha256:` and the first 12 hex digits of its body's fingerprint: its name when it has
    /// no message id.
    pub(crate) fn short_fingerprint(&self) -> String {
        format!("sha256:{}", &self.fingerprint().to_string()[..12])
    }

    /// Whether `id` names this letter: its message id, or `sha256:<prefix>` of its body.
    pub(crate) fn is(&self, id: &str) -> bool {
        match id.strip_prefix("sha256:") {
            Some(prefix) if !prefix.is_empty() => {
                self.fingerprint().to_string().starts_with(prefix)
            }
            _ => self.message_id() == Some(id),
        }
    }

    /// The queue it was dead-lettered from, as the broker recorded it.
    pub(crate) fn source(&self) -> Option<String> {
        match header(&self.properties, "x-first-death-queue")? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            _ => None,
        }
    }

    /// Its record among `records`: the one with its fingerprint and message id.
    pub(crate) fn record<'r>(&self, records: &'r [DeadLetterRow]) -> Option<&'r DeadLetterRow> {
        records
            .iter()
            .rev()
            .find(|r| r.describes(self.message_id(), &self.body))
    }
}

fn header<'p>(properties: &'p BasicProperties, name: &str) -> Option<&'p AMQPValue> {
    properties.headers().as_ref()?.inner().get(name)
}

/// The broker connection and the reading channel.
pub(crate) struct Broker {
    pub(crate) connection: Connection,
    pub(crate) channel: Channel,
    pub(crate) dlq: String,
    /// How long any one answer of the broker may take.
    pub(crate) timeout: Duration,
}

/// Waits at most `timeout` for the broker's answer to `what`.
async fn within<T>(
    timeout: Duration,
    what: &str,
    op: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<Result<T, lapin::Error>, CliError> {
    tokio::time::timeout(timeout, op)
        .await
        .map_err(|_| CliError::NoAnswer(no_answer(what, timeout)))
}

/// What the tool says when the broker did not answer `what` within `timeout`.
fn no_answer(what: &str, timeout: Duration) -> String {
    format!(
        "{what}: no answer within {timeout:?} (--broker-timeout); the broker may be blocked by a resource alarm, or not be RabbitMQ"
    )
}

/// A connection to the first broker of `urls` (comma-separated, in failover order) that takes
/// one within `timeout`.
async fn connect_first(
    urls: &str,
    tls: OwnedTLSConfig,
    timeout: Duration,
) -> Result<Connection, CliError> {
    let mut failed = None;
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let runtime = lapin::runtime::default_runtime()
            .map_err(|e| CliError::Broker(format!("cannot start a connection: {e}")))?;
        let properties = ConnectionProperties::default();
        let connecting = Connection::connect_with_config(url, properties, tls.clone(), runtime);
        let why = match tokio::time::timeout(timeout, connecting).await {
            Ok(Ok(connection)) => return Ok(connection),
            Ok(Err(e)) => e.to_string(),
            Err(_) => no_answer("connecting", timeout),
        };
        failed = Some(format!("{}: {why}", redact_url(url)));
    }
    Err(CliError::Broker(format!(
        "cannot reach {}",
        failed.unwrap_or_else(|| "any broker: AMQP_URL is empty".to_owned())
    )))
}

impl Broker {
    /// Connects to the first broker that answers and opens the channel that reads `queue`'s
    /// dead-letter queue.
    pub(crate) async fn open(cli: &Cli, queue: &str) -> Result<Self, CliError> {
        let cert_chain = match &cli.amqp_tls_ca {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .map_err(|e| CliError::Usage(format!("AMQP_TLS_CA {}: {e}", path.display())))?,
            ),
            None => None,
        };
        let tls = OwnedTLSConfig {
            identity: None,
            cert_chain,
        };
        let timeout = cli.broker_timeout;
        let connection = connect_first(&cli.amqp_url, tls, timeout).await?;
        let what = "opening a channel";
        let channel = within(timeout, what, connection.create_channel())
            .await
            .and_then(|opened| opened.map_err(CliError::broker(what)));
        let channel = match channel {
            Ok(channel) => channel,
            Err(e) => {
                close_within(&connection, timeout).await;
                return Err(e);
            }
        };
        Ok(Self {
            connection,
            channel,
            dlq: idem::rabbitmq::dlq(queue),
            timeout,
        })
    }

    /// The broker's answer to `what`, within the timeout; its error said as `what` failing.
    pub(crate) async fn answer<T>(
        &self,
        what: &str,
        op: impl Future<Output = Result<T, lapin::Error>>,
    ) -> Result<T, CliError> {
        within(self.timeout, what, op)
            .await?
            .map_err(CliError::broker(what))
    }

    /// How many messages the DLQ holds now (it must exist).
    pub(crate) async fn count(&self) -> Result<u32, CliError> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declare = self.channel.queue_declare(
            ShortString::from(self.dlq.as_str()),
            passive,
            FieldTable::default(),
        );
        let declared = within(self.timeout, "reading the dead-letter queue", declare)
            .await?
            .map_err(|e| CliError::NotFound(format!("queue {}: {e}", self.dlq)))?;
        Ok(declared.message_count())
    }

    /// The next dead letter, held unacknowledged; `None` when the queue is empty.
    pub(crate) async fn next(&self) -> Result<Option<Letter>, CliError> {
        let get = self.channel.basic_get(
            ShortString::from(self.dlq.as_str()),
            BasicGetOptions { no_ack: false },
        );
        let got = self.answer("reading the dead-letter queue", get).await?;
        Ok(got.map(|message| Letter {
            tag: message.delivery.delivery_tag,
            properties: message.delivery.properties,
            body: message.delivery.data,
        }))
    }

    /// Up to `limit` dead letters, oldest first, all held; and how many the queue held.
    pub(crate) async fn read(&self, limit: u64) -> Result<(Vec<Letter>, u32), CliError> {
        let total = self.count().await?;
        let mut letters = Vec::new();
        while (letters.len() as u64) < u64::from(total).min(limit) {
            match self.next().await? {
                Some(letter) => letters.push(letter),
                None => break,
            }
        }
        Ok((letters, total))
    }

    /// Closes; every message still held goes back to the DLQ (the broker also gives them back
    /// when a close is not answered and the connection just ends).
    pub(crate) async fn close(self) {
        let closing = self.channel.close(200, ShortString::from("done"));
        let _ = tokio::time::timeout(self.timeout, closing).await;
        close_within(&self.connection, self.timeout).await;
    }
}

/// Closes `connection`, waiting for the broker's answer at most `timeout`.
async fn close_within(connection: &Connection, timeout: Duration) {
    let closing = connection.close(200, ShortString::from("done"));
    let _ = tokio::time::timeout(timeout, closing).await;
}
