//! The outbox's publisher on RabbitMQ: a [`Publisher`] (confirms, `mandatory`) connected on
//! first use.

use crate::config::RabbitConfig;
use crate::publisher::{PublishError, Publisher};
use idem_core::{BoxFuture, Outbound, OutboundError, Outgoing};
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

impl Outbound for RabbitOutbound {
    fn publish<'a>(&'a self, message: &'a Outgoing) -> BoxFuture<'a, Result<(), OutboundError>> {
        Box::pin(async move {
            let publisher = self
                .publisher
                .get_or_try_init(|| Publisher::connect(&self.config))
                .await
                .map_err(outbound)?;
            publisher
                .publish(&message.exchange, &message.routing_key, &message.envelope)
                .await
                .map_err(outbound)
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
            exchange,
            routing_key,
        },
        PublishError::Refused => OutboundError::Refused,
        other => OutboundError::Broker(other.into()),
    }
}
