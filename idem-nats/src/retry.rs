//! The retry forwarder of one queue: it reads the queue's retry stream and, once a copy is due,
//! publishes it into the queue (confirmed, with the copy's own `Nats-Msg-Id`) and acks it; a
//! copy not yet due is given back with a delay until it is. An ack that is not confirmed is
//! logged, not fatal: the copy forwarded again carries the same id. One runs in each process that
//! consumes the queue; they share the retry stream's durable consumer.

use crate::envelope::DUE_HEADER;
use crate::names::Names;
use crate::settle::now_ms;
use crate::topology::RETRY_CONSUMER;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Context};
use futures_util::StreamExt;
use idem_core::model::BoxError;
use std::time::Duration;

/// Forwards `names`' due retry copies until the message stream fails.
pub(crate) async fn forward(js: Context, names: Names) -> Result<(), BoxError> {
    let stream = js.get_stream(&names.retry_stream).await?;
    let consumer: PullConsumer = stream.get_consumer(RETRY_CONSUMER).await?;
    let mut messages = consumer.messages().await?;
    while let Some(message) = messages.next().await {
        let message = message?;
        let mut headers = message.headers.clone().unwrap_or_default();
        let due = headers
            .get(DUE_HEADER)
            .and_then(|v| v.as_str().parse::<u64>().ok())
            .unwrap_or(0);
        let now = now_ms();
        if due > now {
            let wait = Duration::from_millis(due - now);
            message.ack_with(AckKind::Nak(Some(wait))).await?;
            continue;
        }
        headers.insert(DUE_HEADER, "");
        let published = async {
            js.publish_with_headers(names.subject.clone(), headers, message.payload.clone())
                .await?
                .await
        };
        match published.await {
            Ok(_) => {
                // An ack JetStream did not confirm leaves the copy to be forwarded again: under
                // the same `Nats-Msg-Id`, dropped within the duplicate window, else a duplicate
                // the inbox skips. Not a reason to end the queue's session.
                if let Err(e) =
                    crate::settle::confirm_ack(&js.client(), message.reply.as_ref()).await
                {
                    tracing::warn!(queue = %names.subject, error = %e, "a forwarded retry copy's ack was not confirmed; it may be forwarded again");
                }
            }
            Err(e) => {
                tracing::warn!(queue = %names.subject, error = %e, "a due retry copy was not published; it is tried again");
                message
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await?;
            }
        }
    }
    Err("the retry stream's messages ended".into())
}
