//! Settling a RabbitMQ delivery: this is where the ack is sent, always after the pipeline
//! returned (after the commit).

use crate::envelope::{ATTEMPT_HEADER, text, with_headers};
use crate::topology::{reasons_queue, retry_queue};
use idem_core::registry::BoxFuture;
use idem_core::{DeadLetter, Envelope, Settle, TransportError};
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicPublishOptions, BasicRejectOptions};
use lapin::types::{AMQPValue, ShortString};
use lapin::{Acker, BasicProperties, Channel};
use std::sync::Arc;
use std::time::Duration;

/// One delivery's settlement handle: its acker, its channel (for the retry and reason
/// publishes, confirmed) and its properties (kept on republished copies).
pub(crate) struct RabbitSettle {
    pub(crate) acker: Acker,
    pub(crate) channel: Channel,
    pub(crate) properties: BasicProperties,
    pub(crate) queue: Arc<str>,
}

fn settled(what: &str, result: lapin::Result<bool>) -> Result<(), TransportError> {
    match result {
        Ok(true) => Ok(()),
        Ok(false) => Err(TransportError::Settle(format!(
            "{what} not sent: the channel was closed"
        ))),
        Err(e) => Err(TransportError::Settle(format!("{what} failed: {e}"))),
    }
}

impl RabbitSettle {
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

impl Settle for RabbitSettle {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move { settled("ack", self.acker.ack(BasicAckOptions::default()).await) })
    }

    /// Publishes the copy to the delay queue, confirmed, then acks the original. A crash in
    /// between leaves two copies; the inbox makes the second a duplicate.
    fn retry<'a>(
        self: Box<Self>,
        envelope: &'a Envelope,
        delay: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let next = i64::from(envelope.attempt.saturating_add(1));
            let properties = with_headers(
                &self.properties,
                &[(ATTEMPT_HEADER, AMQPValue::LongLongInt(next))],
            );
            let target = retry_queue(&self.queue, delay);
            if let Err(e) = self
                .publish_confirmed(&target, &envelope.body, properties)
                .await
            {
                // Not acked either: the broker redelivers the original.
                let _ = self
                    .acker
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await;
                return Err(e);
            }
            settled("ack", self.acker.ack(BasicAckOptions::default()).await)
        })
    }

    /// Records the reason in `<queue>.dlq.reasons` (confirmed), then rejects the delivery so the
    /// broker moves it into `<queue>.dlq`: the move is the broker's, atomic, so the message
    /// lands there once even if this process dies at any point.
    fn dead_letter<'a>(
        self: Box<Self>,
        envelope: &'a Envelope,
        reason: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
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
            if let Err(e) = self
                .publish_confirmed(&reasons_queue(&self.queue), line.as_bytes(), record)
                .await
            {
                tracing::warn!(error = %e, "could not record the dead-letter reason; dead-lettering anyway");
            }
            #[cfg(feature = "fault-injection")]
            idem_core::fault::maybe_crash(idem_core::fault::Point::InDeadLetter);
            settled(
                "reject",
                self.acker
                    .reject(BasicRejectOptions { requeue: false })
                    .await,
            )
        })
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move {
            settled(
                "nack",
                self.acker
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await,
            )
        })
    }
}
