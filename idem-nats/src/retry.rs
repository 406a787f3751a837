//! The retry forwarder of one queue, on JetStream: core's [`forward_due`] over the queue's
//! retry stream. A copy's due time is its `Idem-Due` header; one not yet due is given back
//! with a delayed negative ack; a due one is published into the queue (confirmed, with the
//! copy's own `Nats-Msg-Id`) and then acked with a confirmed ack. One forwarder runs in each
//! process that consumes the queue; they share the retry stream's durable consumer.

use crate::envelope::DUE_HEADER;
use crate::names::Names;
use crate::settle::now_ms;
use crate::topology::RETRY_CONSUMER;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::Stream;
use async_nats::jetstream::{AckKind, Context, Message};
use futures_util::StreamExt;
use idem_core::future::BoxFuture;
use idem_core::model::BoxError;
use idem_core::transport::{DueCopies, forward_due};
use std::time::Duration;

/// Forwards `names`' due retry copies until the retry stream's messages fail.
pub(crate) async fn forward(js: Context, names: Names) -> Result<(), BoxError> {
    let stream = js.get_stream(&names.retry_stream).await?;
    let consumer: PullConsumer = stream.get_consumer(RETRY_CONSUMER).await?;
    let messages = consumer.messages().await?;
    let queue = names.subject.clone();
    let copies = RetryStream {
        js,
        names,
        messages,
    };
    Err(forward_due(copies, &queue, now_ms).await)
}

/// A queue's retry stream, read through its durable consumer.
struct RetryStream {
    js: Context,
    names: Names,
    messages: Stream,
}

impl DueCopies for RetryStream {
    type Copy = Message;
    type Error = BoxError;

    fn next(&mut self) -> BoxFuture<'_, Result<Message, BoxError>> {
        Box::pin(async move {
            match self.messages.next().await {
                Some(message) => Ok(message?),
                None => Err("the retry stream's messages ended".into()),
            }
        })
    }

    fn due(&self, copy: &Message) -> u64 {
        copy.headers
            .as_ref()
            .and_then(|headers| headers.get(DUE_HEADER))
            .and_then(|due| due.as_str().parse::<u64>().ok())
            .unwrap_or(0)
    }

    fn postpone(&mut self, copy: Message, delay: Duration) -> BoxFuture<'_, Result<(), BoxError>> {
        Box::pin(async move { copy.ack_with(AckKind::Nak(Some(delay))).await })
    }

    /// Publishes the copy into the queue with its headers as they are (its `Nats-Msg-Id`
    /// among them), and the due time cleared.
    fn forward<'a>(&'a mut self, copy: &'a Message) -> BoxFuture<'a, Result<(), BoxError>> {
        Box::pin(async move {
            let mut headers = copy.headers.clone().unwrap_or_default();
            headers.insert(DUE_HEADER, "");
            let subject = self.names.subject.clone();
            self.js
                .publish_with_headers(subject, headers, copy.payload.clone())
                .await?
                .await?;
            Ok(())
        })
    }

    fn remove(&mut self, copy: Message) -> BoxFuture<'_, Result<(), BoxError>> {
        Box::pin(
            async move { crate::acks::confirm_ack(&self.js.client(), copy.reply.as_ref()).await },
        )
    }
}
