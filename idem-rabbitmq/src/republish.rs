//! The confirmed publishes of a settlement, on the delivery's own channel (in confirm mode): a
//! retry copy to the delay queue, and the record of why a message is dead-lettered.

use crate::envelope::{ATTEMPT_HEADER, text, with_headers};
use crate::settle::RabbitSettle;
use crate::topology::{reasons_queue, retry_queue};
use idem_core::{DeadLetter, Envelope, TransportError};
use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, ShortString};
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
        self.publish_confirmed(&target, &envelope.body, properties)
            .await
    }

    /// Records why `envelope` is dead-lettered in `<queue>.dlq.reasons`: `x-idem-*` headers,
    /// the message and correlation ids, and a one-line body; waits for the broker's confirm.
    pub(crate) async fn publish_reason(
        &self,
        envelope: &Envelope,
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
            ("x-idem-queue", text(&self.queue)),
        ];
        if let Some(key) = &reason.key {
            headers.push(("x-idem-key", text(key)));
        }
        let mut record =
            BasicProperties::default().with_content_type(ShortString::from("text/plain"));
        if let Some(id) = &envelope.message_id {
            record = record.with_message_id(ShortString::from(id.as_str()));
        }
        if let Some(id) = &envelope.correlation_id {
            record = record.with_correlation_id(ShortString::from(id.as_str()));
        }
        let record = with_headers(&record, &headers);
        let line = format!("{}: {}", reason.reason, reason.detail);
        self.publish_confirmed(&reasons_queue(&self.queue), line.as_bytes(), record)
            .await
    }

    /// Publishes on the delivery's channel (in confirm mode) and waits for the broker's ack.
    async fn publish_confirmed(
        &self,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), TransportError> {
        let confirm = self
            .channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from(routing_key),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .map_err(|e| TransportError::Settle(format!("publish to {routing_key} failed: {e}")))?
            .await
            .map_err(|e| {
                TransportError::Settle(format!("publish to {routing_key} unconfirmed: {e}"))
            })?;
        if confirm.is_ack() {
            Ok(())
        } else {
            Err(TransportError::Settle(format!(
                "the broker refused the publish to {routing_key}"
            )))
        }
    }
}
