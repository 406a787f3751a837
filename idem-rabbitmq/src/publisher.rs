//! Publishing with publisher confirms: a message counts as sent only once the broker has it.

use crate::config::RabbitConfig;
use crate::connections::Connections;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel};

/// A publish the broker did not confirm.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Connecting or publishing failed.
    #[error("publish failed: {0}")]
    Broker(#[from] lapin::Error),
    /// The broker refused the message (nack, or unroutable).
    #[error("the broker refused the message")]
    Refused,
}

/// Publishes messages and waits for the broker's confirm of each.
#[derive(Debug, Clone)]
pub struct Publisher {
    channel: Channel,
    _connections: Connections,
}

impl Publisher {
    /// Connects to the broker of `config` and opens a confirm-mode channel.
    pub async fn connect(config: &RabbitConfig) -> Result<Self, PublishError> {
        let connections = Connections::default();
        let connection = connections.open(config, "publisher").await?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self {
            channel,
            _connections: connections,
        })
    }

    /// Publishes `body` to `exchange` with `routing_key` (the queue name on the default exchange
    /// `""`), persistent, and waits for the confirm.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        let confirm = self
            .channel
            .basic_publish(
                ShortString::from(exchange),
                ShortString::from(routing_key),
                BasicPublishOptions::default(),
                body,
                properties.with_delivery_mode(2),
            )
            .await?
            .await?;
        if confirm.is_ack() {
            Ok(())
        } else {
            Err(PublishError::Refused)
        }
    }

    /// Publishes a JSON body to `queue` on the default exchange with the given message id.
    pub async fn publish_json(
        &self,
        queue: &str,
        message_id: &str,
        body: &[u8],
    ) -> Result<(), PublishError> {
        let properties = BasicProperties::default()
            .with_message_id(ShortString::from(message_id))
            .with_content_type(ShortString::from("application/json"));
        self.publish("", queue, body, properties).await
    }

    /// Publishes without waiting for the confirm; call [`Publisher::wait_for_confirms`] after
    /// a batch. Much faster for bulk loads.
    pub async fn publish_unconfirmed(
        &self,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        self.channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from(queue),
                BasicPublishOptions::default(),
                body,
                properties.with_delivery_mode(2),
            )
            .await?;
        Ok(())
    }

    /// Waits until every message published so far is confirmed; fails if any was refused.
    pub async fn wait_for_confirms(&self) -> Result<(), PublishError> {
        let returned = self.channel.wait_for_confirms().await?;
        if returned.is_empty() {
            Ok(())
        } else {
            Err(PublishError::Refused)
        }
    }
}
