//! Publishing with publisher confirms: a message counts as sent only once the broker has it.

use crate::answer::{lost, on_channel, unless_lost};
use crate::config::RabbitConfig;
use crate::connections::Connections;
use crate::envelope::properties;
use idem_core::{model::BoxError, model::Envelope};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{Channel, Confirmation, Connection, PublisherConfirm};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;
use tokio::time::{Instant, timeout_at};

mod many;

/// How often a publish waiting on a blocked connection looks again.
const BLOCKED_POLL: Duration = Duration::from_millis(50);

/// Every publish asks the broker to return a message no queue takes.
const MANDATORY: BasicPublishOptions = BasicPublishOptions {
    mandatory: true,
    immediate: false,
};

/// A publish the broker did not confirm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// Connecting or publishing failed.
    #[error("publish failed: {0}")]
    Broker(#[source] BoxError),
    /// The body could not be serialized.
    #[error("cannot serialize the message: {0}")]
    Serialize(#[from] serde_json::Error),
    /// The message cannot be carried as it is (a short field over 255 bytes); nothing was
    /// sent.
    #[error(transparent)]
    Invalid(#[from] idem_core::model::OutgoingError),
    /// The broker refused the message (nack).
    #[error("the broker refused the message")]
    Refused,
    /// The broker closed the channel over a publish (a missing exchange, a body over its
    /// limit: a soft AMQP error); every publish pending on the channel failed with it.
    #[error("the broker closed the channel: {0}")]
    Rejected(String),
    /// The broker did not take or confirm the message within
    /// [`RabbitConfig::publish_timeout`]; it may have it (its id tells the copies apart).
    #[error("the broker did not confirm the publish within {0:?}")]
    TimedOut(Duration),
    /// The broker blocked publishing (a resource alarm: memory or disk) for longer than
    /// [`RabbitConfig::publish_timeout`]; nothing was sent.
    #[error(
        "the broker blocks publishing (a memory or disk alarm) and did not lift it within {0:?}; nothing was sent"
    )]
    Blocked(Duration),
    /// No queue is bound for the message: the broker returned it (every publish is
    /// `mandatory`), so it was not silently dropped.
    #[error(
        "the broker could not route the message to `{exchange}` with routing key `{routing_key}`: no queue is bound"
    )]
    Unroutable {
        /// The exchange (`""`: the default exchange).
        exchange: String,
        /// The routing key (on the default exchange, the queue name).
        routing_key: String,
    },
}

/// What `basic.publish` takes for `message` to `exchange` with `routing_key`, or why a broker
/// cannot carry it (the short fields [`idem_core::model::check_outgoing`] checks, each as it is made).
fn prepared(
    exchange: &str,
    routing_key: &str,
    message: &Envelope,
) -> Result<(ShortString, ShortString, lapin::BasicProperties), PublishError> {
    // Each short field is checked as it is made (`short`): no `check_outgoing`, whose
    // destination would be one more allocation per publish.
    Ok((
        crate::envelope::short("exchange", exchange)?,
        crate::envelope::short("routing key", routing_key)?,
        properties(message)?,
    ))
}

/// Unconfirmed publishes whose connection was lost: the broker may or may not have them.
fn lost_unconfirmed() -> PublishError {
    PublishError::Broker(
        "the connection was lost before every publish was confirmed; publish them again".into(),
    )
}

/// A lapin error as a [`PublishError`] (no `From` impl: lapin stays out of the public API): a
/// channel the broker closed with a soft error is [`PublishError::Rejected`].
fn broker(error: lapin::Error) -> PublishError {
    if let lapin::ErrorKind::ProtocolError(amqp) = error.kind()
        && matches!(amqp.kind(), lapin::protocol::AMQPErrorKind::Soft(_))
    {
        return PublishError::Rejected(amqp.get_message().to_string());
    }
    PublishError::Broker(error.into())
}

/// Publishes messages and waits for the broker's confirm of each.
///
/// A message is an [`Envelope`]: its body, message id, correlation id, content type and
/// headers are sent (persistent, `mandatory`); `attempt` and `redelivered` are not.
///
/// When its connection is lost, the next publish connects again, to the brokers of its
/// [`RabbitConfig`] in failover order; a publish that was under way when the connection went
/// fails, and is the caller's to retry. Unconfirmed publishes are never silently lost: after a
/// lost connection, [`Publisher::wait_for_confirms`] fails for them before anything is
/// published on a new connection.
#[derive(Debug, Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: RabbitConfig,
    connections: Connections,
    /// The confirm-mode channel in use.
    channel: RwLock<Current>,
    /// Serializes reconnections.
    reconnecting: tokio::sync::Mutex<()>,
    /// Unconfirmed publishes were made on the current channel since the last
    /// [`Publisher::wait_for_confirms`].
    unconfirmed: AtomicBool,
    /// The confirms of the unconfirmed publishes not yet waited for, each with its channel.
    /// Kept here, not left to lapin's `Channel::wait_for_confirms`: that one awaits only the
    /// channel's last confirm, and never answers if another task publishes before that
    /// confirm arrives.
    confirms: Mutex<Vec<(Current, PublisherConfirm)>>,
    /// One waiter at a time: a waiter that comes while another awaits the confirms it took
    /// waits for those too.
    waiting: tokio::sync::Mutex<()>,
}

/// A confirm-mode channel and its connection.
#[derive(Debug, Clone)]
struct Current {
    connection: Arc<Connection>,
    channel: Channel,
    /// A publish on it timed out: it is being closed, and the next publish connects again.
    abandoned: Arc<AtomicBool>,
}

impl Current {
    /// Whether publishes may go on it.
    fn usable(&self) -> bool {
        self.channel.status().connected() && !self.abandoned.load(Ordering::SeqCst)
    }

    /// Waits, until `deadline`, while the broker blocks the connection (a resource alarm):
    /// nothing is queued on a connection the broker does not read.
    async fn unblocked(&self, deadline: Instant, limit: Duration) -> Result<(), PublishError> {
        while self.connection.status().blocked() {
            if Instant::now() >= deadline {
                return Err(PublishError::Blocked(limit));
            }
            tokio::time::sleep(BLOCKED_POLL.min(deadline - Instant::now())).await;
        }
        Ok(())
    }

    /// Gives the channel up after a publish on it timed out, or the broker closed it over a
    /// publish: its connection is closed in the background (dropping whatever lapin still
    /// buffers for it) and the next publish opens another.
    fn abandon(&self) {
        if self.abandoned.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::info!(
            "a publish timed out, or the broker closed its channel; closing its connection, the next publish connects again"
        );
        let connection = self.connection.clone();
        tokio::spawn(async move {
            let close = connection.close(320, ShortString::from("channel given up"));
            let _ = tokio::time::timeout(Duration::from_secs(5), close).await;
        });
    }
}

/// A confirm-mode channel on a new connection of `connections`.
async fn confirm_channel(
    config: &RabbitConfig,
    connections: &Connections,
) -> Result<Current, PublishError> {
    let connection = connections
        .open(config, "publisher")
        .await
        .map_err(broker)?;
    let channel = unless_lost(
        || connection.status().connected(),
        connection.create_channel(),
        lost,
    )
    .await
    .map_err(broker)?;
    on_channel(
        &channel,
        channel.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .map_err(broker)?;
    Ok(Current {
        connection,
        channel,
        abandoned: Arc::default(),
    })
}

impl Publisher {
    /// Connects to the broker of `config` (the first of its brokers that takes a connection)
    /// and opens a confirm-mode channel.
    pub async fn connect(config: &RabbitConfig) -> Result<Self, PublishError> {
        let connections = Connections::default();
        let channel = confirm_channel(config, &connections).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                config: config.clone(),
                connections,
                channel: RwLock::new(channel),
                reconnecting: tokio::sync::Mutex::new(()),
                unconfirmed: AtomicBool::new(false),
                confirms: Mutex::default(),
                waiting: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// When a call that starts now must be done.
    fn deadline(&self) -> Instant {
        Instant::now() + self.inner.config.publish_timeout
    }

    /// The channel in use, or a new one when its connection is gone and no unconfirmed
    /// publish is waiting to be reported; once the broker does not block it, until
    /// `deadline`.
    async fn channel(&self, deadline: Instant) -> Result<Current, PublishError> {
        let limit = self.inner.config.publish_timeout;
        let current = match timeout_at(deadline, self.usable_channel()).await {
            Ok(current) => current?,
            Err(_) => return Err(PublishError::TimedOut(limit)),
        };
        current.unblocked(deadline, limit).await?;
        Ok(current)
    }

    async fn usable_channel(&self) -> Result<Current, PublishError> {
        let current = self.current();
        if current.usable() {
            return Ok(current);
        }
        let _turn = self.inner.reconnecting.lock().await;
        let current = self.current();
        if current.usable() {
            return Ok(current); // another publish reconnected meanwhile
        }
        if self.inner.unconfirmed.load(Ordering::SeqCst) {
            return Err(PublishError::Broker(
                "the connection was lost with unconfirmed publishes; wait_for_confirms reports them before the publisher connects again".into(),
            ));
        }
        let channel = confirm_channel(&self.inner.config, &self.inner.connections).await?;
        *self
            .inner
            .channel
            .write()
            .unwrap_or_else(|e| e.into_inner()) = channel.clone();
        Ok(channel)
    }

    fn current(&self) -> Current {
        self.inner
            .channel
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Publishes `message` to `exchange` with `routing_key` (the queue name on the default
    /// exchange `""`; to an ordered handler's exchange, the partition key), persistent and
    /// mandatory, and waits for the confirm: a message no queue
    /// takes is [`PublishError::Unroutable`].
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Envelope,
    ) -> Result<(), PublishError> {
        let (exchange_name, routing, properties) = prepared(exchange, routing_key, message)?;
        let route = (exchange_name, routing);
        self.publish_confirmed(route, &message.body, properties)
            .await
    }

    /// Publishes a copy of a delivery (`body` with its own `properties`, as they came) to
    /// `queue` on the default exchange, mandatory, and waits for the confirm within the publish
    /// timeout: the retry copies and dead letters of settlements, on a connection other than the
    /// consumer's, so that an alarm blocking publishes never stops that connection's acks.
    pub(crate) async fn publish_copy(
        &self,
        queue: &str,
        body: &[u8],
        properties: lapin::BasicProperties,
    ) -> Result<(), PublishError> {
        let route = (
            ShortString::from(""),
            crate::envelope::short("queue", queue)?,
        );
        self.publish_confirmed(route, body, properties).await
    }

    /// Publishes `body` with `properties` to `route` (exchange, routing key), mandatory, and
    /// waits for the confirm, all within the publish timeout.
    async fn publish_confirmed(
        &self,
        (exchange, routing_key): (ShortString, ShortString),
        body: &[u8],
        properties: lapin::BasicProperties,
    ) -> Result<(), PublishError> {
        let deadline = self.deadline();
        let current = self.channel(deadline).await?;
        let channel = &current.channel;
        let publishing = on_channel(channel, async {
            channel
                .basic_publish(
                    exchange.clone(),
                    routing_key.clone(),
                    MANDATORY,
                    body,
                    properties,
                )
                .await?
                .await
        });
        let Ok(confirm) = timeout_at(deadline, publishing).await else {
            current.abandon();
            return Err(PublishError::TimedOut(self.inner.config.publish_timeout));
        };
        let confirm = match confirm.map_err(broker) {
            Ok(confirm) => confirm,
            Err(e @ PublishError::Rejected(_)) => {
                // The broker closed the channel: the next publish takes a fresh one.
                current.abandon();
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(PublishError::Unroutable {
                exchange: exchange.to_string(),
                routing_key: routing_key.to_string(),
            }),
            Confirmation::Nack(_) | Confirmation::NotRequested => Err(PublishError::Refused),
        }
    }

    /// Serializes `value` as JSON and publishes it to `queue` on the default exchange with the
    /// given message id and `content_type: application/json`, waiting for the confirm.
    pub async fn publish_json<T: serde::Serialize + ?Sized>(
        &self,
        queue: &str,
        message_id: &str,
        value: &T,
    ) -> Result<(), PublishError> {
        let message = Envelope::new(serde_json::to_vec(value)?)
            .with_message_id(message_id)
            .with_content_type("application/json");
        self.publish("", queue, &message).await
    }

    /// Publishes `message` to `queue` on the default exchange without waiting for the confirm;
    /// call [`Publisher::wait_for_confirms`] after a batch. Much faster for bulk loads.
    pub async fn publish_unconfirmed(
        &self,
        queue: &str,
        message: &Envelope,
    ) -> Result<(), PublishError> {
        self.publish_unconfirmed_to("", queue, message).await
    }

    /// Publishes `message` to `exchange` with `routing_key` without waiting for the confirm
    /// (to an ordered handler's exchange, the routing key is the partition key); call
    /// [`Publisher::wait_for_confirms`] after a batch.
    pub async fn publish_unconfirmed_to(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &Envelope,
    ) -> Result<(), PublishError> {
        let (exchange, routing_key, properties) = prepared(exchange, routing_key, message)?;
        let deadline = self.deadline();
        let current = self.channel(deadline).await?;
        self.inner.unconfirmed.store(true, Ordering::SeqCst);
        let channel = &current.channel;
        let publish =
            channel.basic_publish(exchange, routing_key, MANDATORY, &message.body, properties);
        let Ok(confirm) = timeout_at(deadline, on_channel(channel, publish)).await else {
            current.abandon();
            return Err(PublishError::TimedOut(self.inner.config.publish_timeout));
        };
        self.pending().push((current, confirm.map_err(broker)?));
        Ok(())
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Vec<(Current, PublisherConfirm)>> {
        self.inner
            .confirms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until every message published so far is confirmed; fails if any was refused or
    /// could not be routed.
    ///
    /// Safe to call from several tasks sharing the publisher: each call returns once every
    /// message published before it is confirmed; a refusal is reported to the call that
    /// awaited that message's confirm.
    pub async fn wait_for_confirms(&self) -> Result<(), PublishError> {
        let _turn = self.inner.waiting.lock().await;
        let confirms = std::mem::take(&mut *self.pending());
        // Reported either way: the next publish may connect again.
        let unconfirmed = self.inner.unconfirmed.swap(false, Ordering::SeqCst);
        let mut first_failure = None;
        let deadline = self.deadline();
        // Every confirm is awaited, also after a failure, until the deadline: none is left
        // behind unanswered.
        for (current, confirm) in confirms {
            let channel = &current.channel;
            let Ok(confirmed) = timeout_at(deadline, on_channel(channel, confirm)).await else {
                current.abandon();
                first_failure
                    .get_or_insert(PublishError::TimedOut(self.inner.config.publish_timeout));
                continue;
            };
            let failure = match confirmed {
                Ok(Confirmation::Ack(None)) => continue,
                Ok(Confirmation::Ack(Some(message))) => PublishError::Unroutable {
                    exchange: message.delivery.exchange.to_string(),
                    routing_key: message.delivery.routing_key.to_string(),
                },
                Ok(Confirmation::Nack(_) | Confirmation::NotRequested) => PublishError::Refused,
                Err(_) if !channel.status().connected() => lost_unconfirmed(),
                Err(e) => broker(e),
            };
            first_failure.get_or_insert(failure);
        }
        let current = self.current();
        if first_failure.is_none() && unconfirmed && !current.channel.status().connected() {
            first_failure = Some(lost_unconfirmed());
        }
        first_failure.map_or(Ok(()), Err)
    }
}
