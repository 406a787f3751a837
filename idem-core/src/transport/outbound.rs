//! What the outbox needs from a transport: publishing one message and waiting for the broker's
//! confirm ([`Outbound`]).

use crate::future::BoxFuture;
use crate::model::{BoxError, Destination, Outgoing};

/// Publishes outbox messages. A message counts as sent only once the broker confirmed it; a
/// message no queue takes is an error ([`OutboundError::Unroutable`]), never a silent drop.
pub trait Outbound: Send + Sync {
    /// Publishes `message` (persistent, mandatory) and waits for the broker's confirm.
    fn publish<'a>(&'a self, message: &'a Outgoing) -> BoxFuture<'a, Result<(), OutboundError>>;

    /// Publishes `messages` in order and waits for their confirms: one result per message, in
    /// order. The default publishes one after another; a transport may send them all before
    /// it waits (the broker keeps their order on one channel).
    fn publish_all<'a>(
        &'a self,
        messages: &'a [Outgoing],
    ) -> BoxFuture<'a, Vec<Result<(), OutboundError>>> {
        Box::pin(async move {
            let mut results = Vec::with_capacity(messages.len());
            for message in messages {
                results.push(self.publish(message).await);
            }
            results
        })
    }

    /// As [`Outbound::publish_all`], calling `sent` once every message is on its way and
    /// before their confirms are awaited, so that the caller can start its next work while the
    /// broker confirms. The default calls it when [`Outbound::publish_all`] returns.
    fn publish_all_then<'a>(
        &'a self,
        messages: &'a [Outgoing],
        sent: Box<dyn FnOnce() + Send + 'a>,
    ) -> BoxFuture<'a, Vec<Result<(), OutboundError>>> {
        Box::pin(async move {
            let results = self.publish_all(messages).await;
            sent();
            results
        })
    }
}

/// A publish the broker did not confirm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboundError {
    /// No queue takes messages for the destination (RabbitMQ: none is bound, the broker
    /// returned the message; NATS: no stream holds the subject).
    #[error("the broker could not route the message to {destination}: no queue takes it")]
    Unroutable {
        /// Where the message was to go.
        destination: Destination,
    },
    /// The broker refused the message (nack).
    #[error("the broker refused the message")]
    Refused,
    /// The message cannot be carried as it is (a short field too long); nothing was sent.
    #[error(transparent)]
    Invalid(#[from] crate::model::OutgoingError),
    /// The broker refused a publish for what it was (a missing exchange, a body over its
    /// limit) in a way that names no message: it closed the channel, and the messages sent
    /// beside it failed with it (some may have arrived). Sent alone, the one at fault fails
    /// again.
    #[error("the broker refused a publish: {0}")]
    Rejected(String),
    /// Connecting or publishing failed.
    #[error("publish failed: {0}")]
    Broker(#[source] BoxError),
}

impl std::fmt::Debug for dyn Outbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Outbound")
    }
}
