//! [`Publisher::publish_many`]: many messages on one channel, every one sent before any
//! confirm is awaited, then judged one by one.

use super::{Current, MANDATORY, PublishError, Publisher, broker, prepared};
use crate::answer::on_channel;
use idem_core::model::Envelope;
use lapin::types::ShortString;
use lapin::{Channel, Confirmation, PublisherConfirm};
use tokio::time::{Instant, timeout_at};

impl Publisher {
    /// Publishes `messages` (exchange, routing key, message) in order, persistent and mandatory,
    /// without waiting between them, then waits for each one's confirm: one result per
    /// message, in order (a message no queue takes is [`PublishError::Unroutable`]). Every
    /// message is queued on the channel before any send is awaited; after a send fails, the
    /// messages behind it fail too (they may have gone out: their ids tell the copies).
    pub async fn publish_many(
        &self,
        messages: &[(&str, &str, &Envelope)],
    ) -> Vec<Result<(), PublishError>> {
        self.publish_many_then(messages, || {}).await
    }

    /// As [`Publisher::publish_many`], calling `sent` once the messages are sent (or a send
    /// failed), before their confirms are awaited.
    pub(crate) async fn publish_many_then(
        &self,
        messages: &[(&str, &str, &Envelope)],
        sent: impl FnOnce() + Send,
    ) -> Vec<Result<(), PublishError>> {
        // A message that cannot be carried fails as a send would: those before it go out,
        // those behind it do not.
        let mut prepared_all = Vec::with_capacity(messages.len());
        for (exchange, routing_key, message) in messages {
            match prepared(exchange, routing_key, message) {
                Ok(prepared) => prepared_all.push(prepared),
                Err(e) => {
                    let at = prepared_all.len();
                    let why = e.to_string();
                    let mut results = Box::pin(self.publish_many_then(&messages[..at], sent)).await;
                    results.push(Err(e));
                    results.extend((at + 1..messages.len()).map(|_| Err(not_sent(&why))));
                    return results;
                }
            }
        }
        let deadline = self.deadline();
        let current = match self.channel(deadline).await {
            Ok(current) => current,
            Err(e) => {
                sent();
                let why = e.to_string();
                let mut results = vec![Err(e)];
                results.extend((1..messages.len()).map(|_| Err(not_sent(&why))));
                results.truncate(messages.len());
                return results;
            }
        };
        let limit = self.inner.config.publish_timeout;
        let (confirms, failed) = send_all(&current, messages, prepared_all, deadline, limit).await;
        sent();
        let mut results = confirmed(&current, confirms, messages, deadline, limit).await;
        let why = failed.unwrap_or_else(|| "the channel closed".to_owned());
        while results.len() < messages.len() {
            results.push(Err(not_sent(&why)));
        }
        if results
            .iter()
            .any(|r| matches!(r, Err(PublishError::Rejected(_))))
        {
            // The broker closed the channel over one of them: the next publish takes a fresh one.
            current.abandon();
        }
        results
    }
}

/// A message not sent because one before it failed.
fn not_sent(why: &str) -> PublishError {
    PublishError::Broker(format!("not sent: an earlier publish failed ({why})").into())
}

/// Sends every message on the channel in order; the confirms of those sent, and why the rest
/// were not (a send failed or timed out, which abandons the channel).
async fn send_all(
    current: &Current,
    messages: &[(&str, &str, &Envelope)],
    prepared_all: Vec<(ShortString, ShortString, lapin::BasicProperties)>,
    deadline: Instant,
    limit: std::time::Duration,
) -> (Vec<PublisherConfirm>, Option<String>) {
    let channel: &Channel = &current.channel;
    // Every publish is queued before any is awaited: lapin queues a publish's frames (and
    // registers its confirm) on its first poll, so polling each once, in order, queues them
    // in order, and its I/O loop writes them together instead of one wake-up each.
    let mut publishes: Vec<_> = messages
        .iter()
        .zip(prepared_all)
        .map(|((_, _, message), (exchange, routing_key, properties))| {
            Box::pin(channel.basic_publish(
                exchange,
                routing_key,
                MANDATORY,
                &message.body,
                properties,
            ))
        })
        .collect();
    let mut queued = Vec::with_capacity(publishes.len());
    for publish in &mut publishes {
        let once = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::future::Future::poll(publish.as_mut(), cx))
        });
        queued.push(once.await);
    }
    let mut confirms = Vec::with_capacity(messages.len());
    for (publish, queued) in publishes.into_iter().zip(queued) {
        let sent = match queued {
            std::task::Poll::Ready(sent) => sent,
            std::task::Poll::Pending => {
                match timeout_at(deadline, on_channel(channel, publish)).await {
                    Ok(sent) => sent,
                    Err(_) => {
                        current.abandon();
                        return (confirms, Some(PublishError::TimedOut(limit).to_string()));
                    }
                }
            }
        };
        match sent {
            Ok(confirm) => confirms.push(confirm),
            Err(e) => return (confirms, Some(e.to_string())),
        }
    }
    (confirms, None)
}

/// The confirm of each message sent, in order, judged: confirmed, unroutable (returned),
/// refused (nacked), timed out (which abandons the channel) or failed.
async fn confirmed(
    current: &Current,
    confirms: Vec<PublisherConfirm>,
    messages: &[(&str, &str, &Envelope)],
    deadline: Instant,
    limit: std::time::Duration,
) -> Vec<Result<(), PublishError>> {
    let mut results = Vec::with_capacity(messages.len());
    for (confirm, (exchange, routing_key, _)) in confirms.into_iter().zip(messages) {
        let Ok(confirmed) = timeout_at(deadline, on_channel(&current.channel, confirm)).await
        else {
            current.abandon();
            results.push(Err(PublishError::TimedOut(limit)));
            continue;
        };
        results.push(match confirmed {
            Ok(Confirmation::Ack(None)) => Ok(()),
            Ok(Confirmation::Ack(Some(_))) => Err(PublishError::Unroutable {
                exchange: (*exchange).to_owned(),
                routing_key: (*routing_key).to_owned(),
            }),
            Ok(Confirmation::Nack(_) | Confirmation::NotRequested) => Err(PublishError::Refused),
            Err(e) => Err(broker(e)),
        });
    }
    results
}
