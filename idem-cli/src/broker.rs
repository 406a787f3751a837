//! The tool's side of the broker: the transport's reader of a queue's dead letters
//! ([`idem::transport::DeadLetterReader`]) on RabbitMQ or NATS, opened with the tool's settings, and
//! [`Broker::answer`], which bounds every wait on the broker (`--broker-timeout`): a broker
//! that accepts the connection and then says nothing, or blocks publishers under a resource
//! alarm, fails the command with a message instead of holding it forever.

use crate::args::Cli;
use crate::error::CliError;
use idem::Outgoing;
use idem::nats::{NatsConfig, NatsTransport};
use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use idem::sql::DeadLetterRow;
use idem::store::Fingerprint;
use idem::telemetry::redact_url;
use idem::transport::{Broker as BrokerKind, DeadLetterReader, HeldLetter, Transport};
use std::future::Future;
use std::time::Duration;

/// How a dead letter is named and traced back to its record.
pub(crate) trait Named {
    /// The fingerprint of its body.
    fn fingerprint(&self) -> Fingerprint;
    /// `sha256:` and the first 12 hex digits of its body's fingerprint: its name when it has
    /// no message id.
    fn short_fingerprint(&self) -> String;
    /// Its message id, else its short fingerprint.
    fn id(&self) -> String;
    /// Whether `id` names it: its message id, or `sha256:<prefix>` of its body.
    fn is(&self, id: &str) -> bool;
    /// Its record among `records`: the one with its fingerprint and message id.
    fn record<'r>(&self, records: &'r [DeadLetterRow]) -> Option<&'r DeadLetterRow>;
}

impl Named for HeldLetter {
    fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(&self.body)
    }

    fn short_fingerprint(&self) -> String {
        format!("sha256:{}", &self.fingerprint().to_string()[..12])
    }

    fn id(&self) -> String {
        self.message_id
            .clone()
            .unwrap_or_else(|| self.short_fingerprint())
    }

    fn is(&self, id: &str) -> bool {
        match id.strip_prefix("sha256:") {
            Some(prefix) if !prefix.is_empty() => {
                self.fingerprint().to_string().starts_with(prefix)
            }
            _ => self.message_id.as_deref() == Some(id),
        }
    }

    fn record<'r>(&self, records: &'r [DeadLetterRow]) -> Option<&'r DeadLetterRow> {
        records
            .iter()
            .rev()
            .find(|r| r.describes(self.message_id.as_deref(), &self.body))
    }
}

/// The broker the tool's settings name, and its URL: `--nats-url` when given, else
/// `--amqp-url`; its scheme names the broker ([`BrokerKind::of_url`]).
pub(crate) fn kind(cli: &Cli) -> Result<(BrokerKind, &str), CliError> {
    let url = cli.nats_url.as_deref().unwrap_or(&cli.amqp_url);
    let broker = BrokerKind::of_url(url).map_err(|e| {
        CliError::Usage(format!("{e} (--amqp-url, AMQP_URL; --nats-url, NATS_URL)"))
    })?;
    Ok((broker, url))
}

/// A queue's dead letters, read through the transport, each wait bounded; and the
/// transport's publisher, for a parked key's release.
pub(crate) struct Broker {
    pub(crate) reader: Box<dyn DeadLetterReader>,
    /// How long any one answer of the broker may take.
    pub(crate) timeout: Duration,
    /// The transport, kept for its publisher ([`Broker::publish`]).
    transport: Box<dyn Transport>,
}

/// What the tool says when the broker did not answer `what` within `timeout`.
fn no_answer(what: &str, timeout: Duration) -> String {
    format!(
        "{what}: no answer within {timeout:?} (--broker-timeout); the broker may be blocked by a resource alarm, or not be the broker the URL says"
    )
}

impl Broker {
    /// Connects to the first broker of `--amqp-url` that takes a connection and opens the
    /// reader of `queue`'s dead letters.
    pub(crate) async fn open(cli: &Cli, queue: &str) -> Result<Self, CliError> {
        let (broker, url) = kind(cli)?;
        let transport: Box<dyn Transport> = match broker {
            BrokerKind::Nats => Box::new(NatsTransport::new(
                NatsConfig::new(url).connection_name("idem-cli"),
            )),
            BrokerKind::RabbitMq => {
                let mut config =
                    RabbitConfig::new(cli.amqp_url.as_str()).connection_name("idem-cli");
                if let Some(path) = &cli.amqp_tls_ca {
                    let pem = std::fs::read_to_string(path).map_err(|e| {
                        CliError::Usage(format!("AMQP_TLS_CA {}: {e}", path.display()))
                    })?;
                    config = config.tls_ca_pem(pem);
                }
                Box::new(RabbitTransport::new(config))
            }
            other => {
                return Err(CliError::Usage(format!(
                    "this tool has no transport for {}",
                    other.scheme().name
                )));
            }
        };
        let timeout = cli.broker_timeout;
        let brokers: Vec<String> = url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(redact_url)
            .collect();
        let what = format!("connecting to {}", brokers.join(", "));
        let reader = tokio::time::timeout(timeout, transport.dead_letters(queue))
            .await
            .map_err(|_| CliError::NoAnswer(no_answer(&what, timeout)))?
            .map_err(|e| CliError::Broker(e.to_string()))?;
        Ok(Self {
            reader,
            timeout,
            transport,
        })
    }

    /// Publishes `message` through the transport (confirmed, mandatory), within the timeout.
    pub(crate) async fn publish(&self, message: &Outgoing) -> Result<(), CliError> {
        let outbound = self.transport.outbound().ok_or_else(|| {
            CliError::Broker("this transport cannot publish a released message".to_owned())
        })?;
        self.answer("publishing a released message", outbound.publish(message))
            .await
    }

    /// The broker's answer to `what`, within the timeout; its error said as `what` failing.
    pub(crate) async fn answer<T, E: std::fmt::Display>(
        &self,
        what: &str,
        op: impl Future<Output = Result<T, E>>,
    ) -> Result<T, CliError> {
        tokio::time::timeout(self.timeout, op)
            .await
            .map_err(|_| CliError::NoAnswer(no_answer(what, self.timeout)))?
            .map_err(|e| CliError::Broker(format!("{what}: {e}")))
    }

    /// How many dead letters there are now (the DLQ must exist).
    pub(crate) async fn count(&self) -> Result<u64, CliError> {
        let counted = tokio::time::timeout(self.timeout, self.reader.count())
            .await
            .map_err(|_| {
                CliError::NoAnswer(no_answer("reading the dead-letter queue", self.timeout))
            })?;
        counted.map_err(|e| CliError::NotFound(e.to_string()))
    }

    /// The next dead letter, held; `None` when every one has been read.
    pub(crate) async fn next(&self) -> Result<Option<HeldLetter>, CliError> {
        self.answer("reading the dead-letter queue", self.reader.next())
            .await
    }

    /// Up to `limit` dead letters, oldest first, all held; and how many there were.
    pub(crate) async fn read(&self, limit: u64) -> Result<(Vec<HeldLetter>, u64), CliError> {
        let total = self.count().await?;
        let mut letters = Vec::new();
        while (letters.len() as u64) < total.min(limit) {
            match self.next().await? {
                Some(letter) => letters.push(letter),
                None => break,
            }
        }
        Ok((letters, total))
    }

    /// Closes; every letter still held goes back (the broker also gives them back when a
    /// close is not answered and the connection just ends).
    pub(crate) async fn close(self) {
        let _ = tokio::time::timeout(self.timeout, self.reader.close()).await;
        let _ = tokio::time::timeout(self.timeout, self.transport.close()).await;
    }
}
