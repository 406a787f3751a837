//! Publishing with publisher confirms: a message counts as sent only once the broker has it.

use crate::config::RabbitConfig;
use crate::connections::Connections;
use crate::envelope::properties;
use idem_core::{BoxError, Envelope};
use lapin::Channel;
use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;

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
    /// The broker refused the message (nack).
    #[error("the broker refused the message")]
    Refused,
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

/// A lapin error as a [`PublishError`] (no `From` impl: lapin stays out of the public API).
fn broker(error: lapin::Error) -> PublishError {
    PublishError::Broker(error.into())
}

/// Publishes messages and waits for the broker's confirm of each.
///
/// A message is an [`Envelope`]: its body, message id, correlation id, content type and
/// headers are sent (persistent, `mandatory`); `attempt` and `redelivered` are not.
#[derive(Debug, Clone)]
pub struct Publisher {
    channel: Channel,
    _connections: Connections,
}

impl Publisher {
    /// Connects to the broker of `config` and opens a confirm-mode channel.
    pub async fn connect(config: &RabbitConfig) -> Result<Self, PublishError> {
        let connections = Connections::default();
        let connection = connections
            .open(config, "publisher")
            .await
            .map_err(broker)?;
        let channel = connection.create_channel().await.map_err(broker)?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker)?;
        Ok(Self {
            channel,
            _connections: connections,
        })
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
        let confirm = self
            .channel
            .basic_publish(
                ShortString::from(exchange),
                ShortString::from(routing_key),
                MANDATORY,
                &message.body,
                properties(message),
            )
            .await
            .map_err(broker)?
            .await
            .map_err(broker)?;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(PublishError::Unroutable {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
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
        self.channel
            .basic_publish(
                ShortString::from(exchange),
                ShortString::from(routing_key),
                MANDATORY,
                &message.body,
                properties(message),
            )
            .await
            .map_err(broker)?;
        Ok(())
    }

    /// Waits until every message published so far is confirmed; fails if any was refused or
    /// could not be routed.
    pub async fn wait_for_confirms(&self) -> Result<(), PublishError> {
        let returned = self.channel.wait_for_confirms().await.map_err(broker)?;
        match returned.first() {
            None => Ok(()),
            Some(message) => Err(PublishError::Unroutable {
                exchange: message.delivery.exchange.to_string(),
                routing_key: message.delivery.routing_key.to_string(),
            }),
        }
    }
}
