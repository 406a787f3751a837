//! The outbox's publisher on RabbitMQ: a [`Publisher`] (confirms, `mandatory`) connected on
//! first use.

use crate::config::RabbitConfig;
use crate::publisher::{PublishError, Publisher};
use idem_core::{
    future::BoxFuture, model::Destination, model::Outgoing, transport::Outbound,
    transport::OutboundError,
};
use tokio::sync::OnceCell;

/// Publishes outbox messages through one confirm-mode connection of the transport's brokers.
#[derive(Debug)]
pub(crate) struct RabbitOutbound {
    config: RabbitConfig,
    publisher: OnceCell<Publisher>,
}

impl RabbitOutbound {
    /// A publisher for `config`'s brokers; nothing connects before the first message.
    pub(crate) fn new(config: RabbitConfig) -> Self {
        Self {
            config,
            publisher: OnceCell::new(),
        }
    }
}

impl RabbitOutbound {
    /// Publishes a settlement's copy of a delivery to `queue` (see [`Publisher::publish_copy`]).
    pub(crate) async fn publish_copy(
        &self,
        queue: &str,
        body: &[u8],
        properties: lapin::BasicProperties,
    ) -> Result<(), PublishError> {
        let publisher = self
            .publisher
            .get_or_try_init(|| Publisher::connect(&self.config))
            .await?;
        publisher.publish_copy(queue, body, properties).await
    }

    /// The publisher, connected on first use.
    async fn publisher(&self) -> Result<&Publisher, OutboundError> {
        self.publisher
            .get_or_try_init(|| Publisher::connect(&self.config))
            .await
            .map_err(outbound)
    }
}

impl Outbound for RabbitOutbound {
    fn publish<'a>(&'a self, message: &'a Outgoing) -> BoxFuture<'a, Result<(), OutboundError>> {
        Box::pin(async move {
            let (exchange, routing_key) = message.destination.parts();
            self.publisher()
                .await?
                .publish(exchange, routing_key, &message.envelope)
                .await
                .map_err(outbound)
        })
    }

    /// Sends them all, then waits for their confirms (`Publisher::publish_many`).
    fn publish_all<'a>(
        &'a self,
        messages: &'a [Outgoing],
    ) -> BoxFuture<'a, Vec<Result<(), OutboundError>>> {
        self.publish_all_then(messages, Box::new(|| {}))
    }

    /// Sends them all, says so, then waits for their confirms.
    fn publish_all_then<'a>(
        &'a self,
        messages: &'a [Outgoing],
        sent: Box<dyn FnOnce() + Send + 'a>,
    ) -> BoxFuture<'a, Vec<Result<(), OutboundError>>> {
        Box::pin(async move {
            let publisher = match self.publisher().await {
                Ok(publisher) => publisher,
                Err(e) => {
                    sent();
                    let why = e.to_string();
                    return messages
                        .iter()
                        .map(|_| Err(OutboundError::Broker(why.clone().into())))
                        .collect();
                }
            };
            let batch: Vec<_> = messages
                .iter()
                .map(|m| {
                    let (exchange, routing_key) = m.destination.parts();
                    (exchange, routing_key, &m.envelope)
                })
                .collect();
            let results = publisher.publish_many_then(&batch, sent).await;
            results.into_iter().map(|r| r.map_err(outbound)).collect()
        })
    }
}

/// A [`PublishError`] as the outbox sees it.
fn outbound(error: PublishError) -> OutboundError {
    match error {
        PublishError::Unroutable {
            exchange,
            routing_key,
        } => OutboundError::Unroutable {
            destination: Destination::from_parts(exchange, routing_key),
        },
        PublishError::Refused => OutboundError::Refused,
        PublishError::Rejected(why) => OutboundError::Rejected(why),
        PublishError::Invalid(e) => OutboundError::Invalid(e),
        other => OutboundError::Broker(other.into()),
    }
}
