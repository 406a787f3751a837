//! The confirmed publishes of a settlement, on a channel in confirm mode: a retry copy to the
//! delay queue.

use crate::answer::on_channel;
use crate::envelope::{ATTEMPT_HEADER, with_headers};
use crate::settle::RabbitSettle;
use crate::topology::retry_queue;
use idem_core::{Envelope, TransportError};
use lapin::Confirmation;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, ShortString};
use lapin::{BasicProperties, Channel};
use std::time::Duration;

impl RabbitSettle {
    /// Publishes the next attempt of `envelope` to the delay queue for `delay`, keeping the
    /// delivery's properties, and waits for the broker's confirm.
    pub(crate) async fn publish_retry(
        &self,
        envelope: &Envelope,
        delay: Duration,
    ) -> Result<(), TransportError> {
        let next = i64::from(envelope.attempt.saturating_add(1));
        let properties = with_headers(
            &self.properties,
            &[(ATTEMPT_HEADER, AMQPValue::LongLongInt(next))],
        );
        let target = retry_queue(&self.queue, delay);
        publish_confirmed(&self.channel, &target, &envelope.body, properties).await
    }
}

/// Publishes through the default exchange on `channel` (in confirm mode, mandatory) and waits
/// for the broker's ack; a message no queue takes (its queue was deleted) is an error.
pub(crate) async fn publish_confirmed(
    channel: &Channel,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), TransportError> {
    let confirm = on_channel(channel, async {
        channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from(routing_key),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                body,
                properties,
            )
            .await?
            .await
    })
    .await
    .map_err(|e| TransportError::Settle(e.into()))?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(TransportError::Settle(
            format!("no queue {routing_key} to publish to").into(),
        )),
        Confirmation::Nack(_) | Confirmation::NotRequested => Err(TransportError::Settle(
            format!("the broker refused the publish to {routing_key}").into(),
        )),
    }
}
