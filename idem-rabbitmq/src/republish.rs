//! The confirmed publishes of a settlement, on a channel in confirm mode: a retry copy to the
//! delay queue, and a dead letter whose record could not be written, with its reason.

use crate::envelope::{
    ATTEMPT_HEADER, FIRST_FAILURE_HEADER, REASON_DETAIL_HEADER, REASON_HEADER, with_headers,
};
use crate::settle::RabbitSettle;
use crate::topology::{dlq, retry_queue};
use idem_core::transport::headers;
use idem_core::{model::DeadLetter, model::Envelope, transport::TransportError};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, LongString};
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
        let mut set = vec![(ATTEMPT_HEADER, AMQPValue::LongLongInt(next))];
        // The first failure's time, on the first retry copy; the next copies keep it.
        if headers::first_failure(envelope, headers::epoch_ms()).is_none() {
            set.push((
                FIRST_FAILURE_HEADER,
                AMQPValue::LongLongInt(headers::epoch_ms()),
            ));
        }
        let properties = with_headers(&self.properties, &set);
        let target = retry_queue(&self.queue, delay);
        self.publish_copy(&target, &envelope.body, properties).await
    }

    /// Publishes `envelope` to the dead-letter queue with `reason`'s code and detail in its
    /// headers (the detail cut to [`MAX_DETAIL`] bytes), keeping the delivery's properties,
    /// and waits for the broker's confirm. As the broker's own dead-lettering does, the copy
    /// drops the delivery's `expiration` (it would otherwise expire in the DLQ, with no record
    /// anywhere), and `x-first-death-queue` names the queue it was consumed from, whatever a
    /// producer put there.
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
            &without_expiration(&self.properties),
            &[
                (REASON_HEADER, text(&reason.reason)),
                (REASON_DETAIL_HEADER, text(&reason.detail[..cut])),
                (FIRST_DEATH_QUEUE, text(&self.queue)),
            ],
        );
        self.publish_copy(&dlq(&self.queue), &envelope.body, properties)
            .await
    }

    /// Publishes a copy of this delivery to `queue` (see `Publisher::publish_copy`).
    async fn publish_copy(
        &self,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), TransportError> {
        self.copies
            .publish_copy(queue, body, properties)
            .await
            .map_err(|e| TransportError::Settle(format!("publishing to {queue}: {e}").into()))
    }
}

/// The most bytes of a reason's detail carried in a header.
const MAX_DETAIL: usize = 1024;

/// The header in which the broker's dead-lettering names the queue a message died in.
const FIRST_DEATH_QUEUE: &str = "x-first-death-queue";

/// `properties` without an `expiration`.
fn without_expiration(properties: &BasicProperties) -> BasicProperties {
    let mut kept = BasicProperties::default();
    if let Some(v) = properties.content_type() {
        kept = kept.with_content_type(v.clone());
    }
    if let Some(v) = properties.content_encoding() {
        kept = kept.with_content_encoding(v.clone());
    }
    if let Some(v) = properties.headers() {
        kept = kept.with_headers(v.clone());
    }
    if let Some(v) = properties.delivery_mode() {
        kept = kept.with_delivery_mode(*v);
    }
    if let Some(v) = properties.priority() {
        kept = kept.with_priority(*v);
    }
    if let Some(v) = properties.correlation_id() {
        kept = kept.with_correlation_id(v.clone());
    }
    if let Some(v) = properties.reply_to() {
        kept = kept.with_reply_to(v.clone());
    }
    if let Some(v) = properties.message_id() {
        kept = kept.with_message_id(v.clone());
    }
    if let Some(v) = properties.timestamp() {
        kept = kept.with_timestamp(*v);
    }
    if let Some(v) = properties.kind() {
        kept = kept.with_type(v.clone());
    }
    if let Some(v) = properties.user_id() {
        kept = kept.with_user_id(v.clone());
    }
    if let Some(v) = properties.app_id() {
        kept = kept.with_app_id(v.clone());
    }
    if let Some(v) = properties.cluster_id() {
        kept = kept.with_cluster_id(v.clone());
    }
    kept
}
