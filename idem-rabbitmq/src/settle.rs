//! Settling a RabbitMQ delivery: this is where the ack is decided, always after the pipeline
//! returned (after the commit); [`crate::acks`] sends it, coalesced with its neighbours.

use crate::acks::{Acks, Op};
use crate::envelope::{ATTEMPT_HEADER, text, with_headers};
use crate::topology::{reasons_queue, retry_queue};
use idem_core::registry::BoxFuture;
use idem_core::{DeadLetter, Envelope, Settle, TransportError};
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, ShortString};
use lapin::{BasicProperties, Channel};
use std::sync::Arc;
use std::time::Duration;

/// One delivery's settlement handle: its tag and its channel's settlement task, its channel
/// (for the retry and reason publishes, confirmed) and its properties (kept on republished
/// copies). Dropped unsettled (an abandoned worker), it gives the delivery back.
pub(crate) struct RabbitSettle {
    pub(crate) tag: u64,
    pub(crate) acks: Acks,
    pub(crate) channel: Arc<Channel>,
    pub(crate) properties: BasicProperties,
    pub(crate) queue: Arc<str>,
    pub(crate) done: bool,
}

impl RabbitSettle {
    /// Hands `op` to the channel's settlement task, which sends it in tag order.
    fn settle(mut self: Box<Self>, op: Op) -> Result<(), TransportError> {
        self.done = true;
        if self.acks.send(self.tag, op) {
            Ok(())
        } else {
            Err(TransportError::Settle(
                "the delivery's channel is closed; the broker redelivers".to_owned(),
            ))
        }
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

impl Settle for RabbitSettle {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), TransportError>> {
        let settled = self.settle(Op::Ack);
        Box::pin(std::future::ready(settled))
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
                let _ = self.settle(Op::Requeue);
                return Err(e);
            }
            self.settle(Op::Ack)
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
            self.settle(Op::Reject)
        })
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), TransportError>> {
        let settled = self.settle(Op::Requeue);
        Box::pin(std::future::ready(settled))
    }
}

impl Drop for RabbitSettle {
    fn drop(&mut self) {
        if !self.done {
            self.acks.send(self.tag, Op::Requeue);
        }
    }
}
