//! [`RabbitDeadLetters`]: a queue's dead-letter queue read for an operator, with `basic.get`
//! on a channel of its own: every letter read stays unacknowledged (held) until it is removed,
//! and goes back to the queue when the channel closes or the connection ends. Copies are
//! published back on a second channel, in confirm mode, with the letter's own properties.

use crate::config::RabbitConfig;
use crate::connections::Connections;
use crate::envelope::ATTEMPT_HEADER;
use crate::topology::dlq;
use idem_core::{
    future::BoxFuture, transport::DeadLetterReader, transport::HeldLetter,
    transport::OutboundError, transport::PublishTime, transport::TransportError,
};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Headers the broker adds when it dead-letters a message, and idem's attempt count: a copy
/// published back starts afresh without them.
const DROPPED_HEADERS: &[&str] = &[
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    ATTEMPT_HEADER,
];

/// One queue's dead letters, read for an operator (see the module).
pub(crate) struct RabbitDeadLetters {
    connection: Arc<Connection>,
    reader: Channel,
    publisher: Channel,
    name: String,
    /// The properties of each held letter, by delivery tag, for its copy.
    held: Mutex<HashMap<u64, BasicProperties>>,
}

fn broker_error(e: lapin::Error) -> TransportError {
    TransportError::Settle(e.into())
}

impl RabbitDeadLetters {
    /// Connects to the first broker of `config` that takes a connection and opens the reading
    /// and publishing channels for `queue`'s dead-letter queue.
    pub(crate) async fn open(config: &RabbitConfig, queue: &str) -> Result<Self, TransportError> {
        let name = dlq(queue);
        if crate::envelope::short("queue", &name).is_err() {
            return Err(TransportError::Topology {
                queue: queue.chars().take(64).collect(),
                action: "reading its dead letters",
                source: format!(
                    "`{}…` ({} bytes) is no queue name: RabbitMQ's are at most 255 bytes",
                    name.chars().take(32).collect::<String>(),
                    name.len()
                )
                .into(),
            });
        }
        let unreachable = |e: lapin::Error| TransportError::Connection {
            broker: config.redacted_url(),
            url_variable: "AMQP_URL",
            source: e.into(),
        };
        let connection = Connections::default()
            .open(config, "dead-letters")
            .await
            .map_err(unreachable)?;
        let channels = async {
            let reader = connection.create_channel().await?;
            let publisher = connection.create_channel().await?;
            publisher
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>((reader, publisher))
        };
        match channels.await {
            Ok((reader, publisher)) => Ok(Self {
                connection,
                reader,
                publisher,
                name,
                held: Mutex::default(),
            }),
            Err(e) => {
                let _ = connection.close(200, ShortString::from("done")).await;
                Err(unreachable(e))
            }
        }
    }

    fn properties(&self, tag: u64) -> Option<BasicProperties> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.get(&tag).cloned()
    }
}

impl DeadLetterReader for RabbitDeadLetters {
    fn name(&self) -> &str {
        &self.name
    }

    /// A passive declaration: the queue must exist.
    fn count(&self) -> BoxFuture<'_, Result<u64, TransportError>> {
        Box::pin(async move {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            let declared = self
                .reader
                .queue_declare(
                    ShortString::from(self.name.as_str()),
                    passive,
                    FieldTable::default(),
                )
                .await
                .map_err(|e| TransportError::Topology {
                    queue: self.name.clone(),
                    action: "reading the dead letters",
                    source: e.into(),
                })?;
            Ok(u64::from(declared.message_count()))
        })
    }

    fn next(&self) -> BoxFuture<'_, Result<Option<HeldLetter>, TransportError>> {
        Box::pin(async move {
            let got = self
                .reader
                .basic_get(
                    ShortString::from(self.name.as_str()),
                    BasicGetOptions { no_ack: false },
                )
                .await
                .map_err(broker_error)?;
            Ok(got.map(|message| {
                let delivery = message.delivery;
                let properties = delivery.properties;
                let letter = letter(delivery.delivery_tag, &properties, delivery.data);
                let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
                held.insert(letter.tag, properties);
                letter
            }))
        })
    }

    /// Published to the default exchange with `queue` as routing key, mandatory; its publish
    /// time in `timestamp`, kept or now.
    fn replay<'a>(
        &'a self,
        letter: &'a HeldLetter,
        queue: &'a str,
        time: PublishTime,
    ) -> BoxFuture<'a, Result<(), OutboundError>> {
        Box::pin(async move {
            let mut properties = self
                .properties(letter.tag)
                .ok_or_else(|| OutboundError::Broker("the letter is not held".into()))?;
            if time == PublishTime::Now {
                let now = idem_core::transport::headers::epoch_ms() / 1000;
                properties = properties.with_timestamp(u64::try_from(now).unwrap_or(0));
            }
            let routing_key = crate::envelope::short("queue", queue)?;
            let options = BasicPublishOptions {
                mandatory: true,
                immediate: false,
            };
            let confirm = self
                .publisher
                .basic_publish(
                    ShortString::from(""),
                    routing_key,
                    options,
                    &letter.body,
                    without_death(&properties),
                )
                .await
                .map_err(|e| OutboundError::Broker(e.into()))?
                .await
                .map_err(|e| OutboundError::Broker(e.into()))?;
            match confirm {
                Confirmation::Ack(None) => Ok(()),
                Confirmation::Ack(Some(_)) => Err(OutboundError::Unroutable {
                    destination: idem_core::model::Destination::queue(queue),
                }),
                Confirmation::Nack(_) | Confirmation::NotRequested => Err(OutboundError::Refused),
            }
        })
    }

    fn remove<'a>(&'a self, letter: &'a HeldLetter) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            self.reader
                .basic_ack(letter.tag, BasicAckOptions { multiple: false })
                .await
                .map_err(broker_error)?;
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            held.remove(&letter.tag);
            Ok(())
        })
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let _ = self.publisher.close(200, ShortString::from("done")).await;
            let _ = self.reader.close(200, ShortString::from("done")).await;
            let _ = self.connection.close(200, ShortString::from("done")).await;
        })
    }
}

/// The letter of a dead-lettered delivery: its properties as text.
fn letter(tag: u64, properties: &BasicProperties, body: Vec<u8>) -> HeldLetter {
    let text = |s: &Option<ShortString>| s.as_ref().map(|s| s.as_str().to_owned());
    let mut letter = HeldLetter::new(tag, body);
    letter.published_at_ms = crate::envelope::published_at_ms(properties);
    letter.message_id = text(properties.message_id());
    letter.correlation_id = text(properties.correlation_id());
    letter.content_type = text(properties.content_type());
    let table = properties.headers().as_ref();
    letter.source = table
        .and_then(|t| t.inner().get("x-first-death-queue"))
        .and_then(as_text);
    letter.headers = table
        .map(|t| {
            t.inner()
                .iter()
                .filter(|(name, _)| name.as_str() != "x-death")
                .map(|(name, value)| {
                    let value = as_text(value).unwrap_or_else(|| format!("{value:?}"));
                    (name.as_str().to_owned(), value)
                })
                .collect()
        })
        .unwrap_or_default();
    letter
}

/// A header's value, when it is text.
fn as_text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// `properties` without the broker's dead-lettering headers and idem's attempt count.
fn without_death(properties: &BasicProperties) -> BasicProperties {
    let Some(headers) = properties.headers() else {
        return properties.clone();
    };
    let mut kept = FieldTable::default();
    for (name, value) in headers.inner() {
        if !DROPPED_HEADERS.contains(&name.as_str()) {
            kept.insert(name.clone(), value.clone());
        }
    }
    properties.clone().with_headers(kept)
}
