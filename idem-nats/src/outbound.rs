//! [`NatsOutbound`]: the outbox's publisher on JetStream. A message goes to the subject its
//! destination names, or to its partition of an ordered handler's source
//! ([`crate::NatsTransport::subject`]),
//! with `Nats-Msg-Id` = its message id, which for outbox messages is deterministic: a message
//! published again within the stream's duplicate window is dropped by JetStream itself, a
//! second line of defence before the consumer's inbox. A subject no stream holds is
//! [`OutboundError::Unroutable`].

use crate::connection::Shared;
use crate::envelope;
use async_nats::jetstream::Context;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use idem_core::{
    future::BoxFuture, model::Destination, model::Outgoing, transport::Outbound,
    transport::OutboundError,
};

/// How many messages [`NatsOutbound::publish_all`] has sent and not seen confirmed, at most.
const IN_FLIGHT: usize = 1024;

/// The outbox's publisher on a [`crate::NatsTransport`]'s connection.
pub(crate) struct NatsOutbound {
    shared: Shared,
}

impl NatsOutbound {
    pub(crate) fn new(shared: Shared) -> Self {
        Self { shared }
    }

    /// The subject of `message`, with an ordered handler's partition count as the server
    /// records it ([`crate::NatsTransport::route`]).
    async fn subject(&self, js: &Context, message: &Outgoing) -> Result<String, OutboundError> {
        let (topic, key) = message.destination.parts();
        self.shared
            .route(js, topic, key)
            .await
            .map_err(|e| OutboundError::Broker(e.into()))
    }
}

/// The headers of `message`: its envelope's, with `Nats-Msg-Id` = its copy id, else its
/// message id (which `Idem-Message-Id` then carries), and a
/// topic's key, which its subject does not spell (a partition's), so that the delivery's
/// routing key is the key it was published with, as on RabbitMQ.
fn headers(message: &Outgoing) -> async_nats::HeaderMap {
    let envelope = &message.envelope;
    let broker_id = message
        .copy_id
        .as_deref()
        .or(envelope.message_id.as_deref());
    let mut headers = envelope::headers(envelope, broker_id);
    if let Destination::Topic { topic, key } = &message.destination
        && !topic.is_empty()
    {
        headers.insert(
            envelope::ROUTING_KEY_HEADER,
            async_nats::header::HeaderValue::from_lossy(key),
        );
    }
    headers
}

fn failed(message: &Outgoing, e: async_nats::jetstream::context::PublishError) -> OutboundError {
    match e.kind() {
        PublishErrorKind::StreamNotFound => OutboundError::Unroutable {
            destination: message.destination.clone(),
        },
        _ => OutboundError::Broker(e.into()),
    }
}

impl Outbound for NatsOutbound {
    fn publish<'a>(&'a self, message: &'a Outgoing) -> BoxFuture<'a, Result<(), OutboundError>> {
        Box::pin(async move {
            let js = self
                .shared
                .jetstream()
                .await
                .map_err(|e| OutboundError::Broker(e.into()))?;
            let subject = self.subject(&js, message).await?;
            let headers = headers(message);
            let body = bytes::Bytes::copy_from_slice(&message.envelope.body);
            let ack = js
                .publish_with_headers(subject, headers, body)
                .await
                .map_err(|e| failed(message, e))?;
            ack.await.map(drop).map_err(|e| failed(message, e))
        })
    }

    /// Sends the messages in order, waiting for their confirms as it goes: at most
    /// [`IN_FLIGHT`] unconfirmed at a time, so that any number of messages finishes (the
    /// client's context refuses to send beyond the confirms it awaits).
    fn publish_all<'a>(
        &'a self,
        messages: &'a [Outgoing],
    ) -> BoxFuture<'a, Vec<Result<(), OutboundError>>> {
        Box::pin(async move {
            let js = match self.shared.jetstream().await {
                Ok(js) => js,
                Err(e) => {
                    let why = e.to_string();
                    return messages
                        .iter()
                        .map(|_| Err(OutboundError::Broker(why.clone().into())))
                        .collect();
                }
            };
            let mut results: Vec<Result<(), OutboundError>> = Vec::with_capacity(messages.len());
            let mut pending = std::collections::VecDeque::with_capacity(IN_FLIGHT);
            // Confirms are awaited oldest first, so `results` fills in the messages' order.
            async fn confirm(
                (message, sent): (&Outgoing, Result<PublishAckFuture, OutboundError>),
            ) -> Result<(), OutboundError> {
                sent?.await.map(drop).map_err(|e| failed(message, e))
            }
            for message in messages {
                if pending.len() == IN_FLIGHT
                    && let Some(oldest) = pending.pop_front()
                {
                    results.push(confirm(oldest).await);
                }
                let subject = match self.subject(&js, message).await {
                    Ok(subject) => subject,
                    Err(e) => {
                        pending.push_back((message, Err(e)));
                        continue;
                    }
                };
                let headers = headers(message);
                let body = bytes::Bytes::copy_from_slice(&message.envelope.body);
                let sent = js
                    .publish_with_headers(subject, headers, body)
                    .await
                    .map_err(|e| failed(message, e));
                pending.push_back((message, sent));
            }
            for sent in pending {
                results.push(confirm(sent).await);
            }
            results
        })
    }
}
