//! The confirmed publishes of a settlement, on a channel in confirm mode: a retry copy to the
//! delay queue, and a dead letter whose record could not be written, with its reason.

use crate::answer::on_channel;
use crate::envelope::{ATTEMPT_HEADER, REASON_DETAIL_HEADER, REASON_HEADER, with_headers};
use crate::settle::RabbitSettle;
use crate::topology::{dlq, retry_queue};
use idem_core::{DeadLetter, Envelope, TransportError};
use lapin::Confirmation;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, LongString, ShortString};
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

    /// Publishes `envelope` to the dead-letter queue with `reason`'s code and detail in its
    /// headers (the detail cut to [`MAX_DETAIL`] bytes), keeping the delivery's properties,
    /// and waits for the broker's confirm.
    pub(crate) async fn publish_dead_letter(
        &self,
        envelope: &Envelope,
        reason: &DeadLetter,
    ) -> Result<(), TransportError> {
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()));
        let mut cut = reason.detail.len().min(MAX_DETAIL);
        while !reason.detail.is_char_boundary(cut) {
            cut -= 1;
        }
        let properties = with_headers(
            &self.properties,
            &[
                (REASON_HEADER, text(&reason.reason)),
                (REASON_DETAIL_HEADER, text(&reason.detail[..cut])),
            ],
        );
        publish_confirmed(&self.channel, &dlq(&self.queue), &envelope.body, properties).await
    }
}

/// The most bytes of a reason's detail carried in a header.
const MAX_DETAIL: usize = 1024;

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
