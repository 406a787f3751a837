//! The confirmed publishes of a settlement, on a channel in confirm mode: a retry copy to the
//! delay queue, and the record of why a message is dead-lettered.

use crate::envelope::{ATTEMPT_HEADER, text, with_headers};
use crate::settle::RabbitSettle;
use crate::topology::{reasons_queue, retry_queue};
use idem_core::{DeadLetter, Envelope, TransportError};
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

    /// Records why `envelope` is dead-lettered (see [`publish_reason`]).
    pub(crate) async fn publish_reason(
        &self,
        envelope: &Envelope,
        reason: &DeadLetter,
    ) -> Result<(), TransportError> {
        let record = Record {
            message_id: envelope.message_id.as_deref(),
            correlation_id: envelope.correlation_id.as_deref(),
            extra: Vec::new(),
        };
        publish_reason(&self.channel, &self.queue, &record, reason).await
    }
}

/// What a dead-letter record says of the message besides the reason.
pub(crate) struct Record<'a> {
    pub(crate) message_id: Option<&'a str>,
    pub(crate) correlation_id: Option<&'a str>,
    /// More headers.
    pub(crate) extra: Vec<(&'static str, AMQPValue)>,
}

/// Records why a message of `queue` is dead-lettered in `<queue>.dlq.reasons`: `x-idem-*`
/// headers, the message and correlation ids, and a one-line body; waits for the broker's
/// confirm.
pub(crate) async fn publish_reason(
    channel: &Channel,
    queue: &str,
    record: &Record<'_>,
    reason: &DeadLetter,
) -> Result<(), TransportError> {
    let mut headers = vec![
        ("x-idem-reason", text(&reason.reason)),
        ("x-idem-detail", text(&reason.detail)),
        ("x-idem-consumer", text(&reason.consumer)),
        (
            "x-idem-attempts",
            AMQPValue::LongLongInt(i64::from(reason.attempts)),
        ),
        ("x-idem-queue", text(queue)),
    ];
    if let Some(key) = &reason.key {
        headers.push(("x-idem-key", text(key)));
    }
    headers.extend(record.extra.iter().cloned());
    let mut properties =
        BasicProperties::default().with_content_type(ShortString::from("text/plain"));
    if let Some(id) = record.message_id {
        properties = properties.with_message_id(ShortString::from(id));
    }
    if let Some(id) = record.correlation_id {
        properties = properties.with_correlation_id(ShortString::from(id));
    }
    let properties = with_headers(&properties, &headers);
    let line = format!("{}: {}", reason.reason, reason.detail);
    publish_confirmed(channel, &reasons_queue(queue), line.as_bytes(), properties).await
}

/// Publishes through the default exchange on `channel` (in confirm mode, mandatory) and waits
/// for the broker's ack; a message no queue takes (its queue was deleted) is an error.
pub(crate) async fn publish_confirmed(
    channel: &Channel,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), TransportError> {
    let confirm = channel
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
        .await
        .map_err(|e| TransportError::Settle(format!("publish to {routing_key} failed: {e}")))?
        .await
        .map_err(|e| {
            TransportError::Settle(format!("publish to {routing_key} unconfirmed: {e}"))
        })?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(TransportError::Settle(format!(
            "no queue {routing_key} to publish to"
        ))),
        Confirmation::Nack(_) | Confirmation::NotRequested => Err(TransportError::Settle(format!(
            "the broker refused the publish to {routing_key}"
        ))),
    }
}
