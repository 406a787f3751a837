//! [`Puller`]: pulls a durable consumer's messages as the consumer's session asks for them, on
//! one reply subscription, and counts what it has asked for and not yet received.
//!
//! async-nats's own pull stream asks JetStream for more whenever half of what it asked for has
//! been read out of it, and holds what arrived in its own buffer until it is read: nobody tells
//! JetStream those messages are in progress, and a process whose handlers are busy has them
//! delivered again while it holds them. Here a message is handed over as soon as it arrives
//! (the session tracks it from then on: [`crate::progress`]), and the session asks for no more
//! than it has room for.

use async_nats::{Client, StatusCode, Subject, Subscriber};
use futures_util::StreamExt;
use std::time::Duration;
use tokio::time::Instant;

/// How long one pull request waits on the server for messages before it expires.
const EXPIRES: Duration = Duration::from_secs(30);
/// How often JetStream says it is there while a pull request waits with nothing to deliver.
const HEARTBEAT: Duration = Duration::from_secs(5);

/// Why pulling stopped: the session ends and the next starts afresh.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PullError {
    /// A request could not be sent, or the subscription could not be made.
    #[error("pulling from JetStream: {0}")]
    Client(String),
    /// JetStream answered with a status that ends pulling (the consumer was deleted, no
    /// server answers for it).
    #[error("JetStream ended the pull: {status} {description}")]
    Ended {
        status: StatusCode,
        description: String,
    },
    /// Neither a message nor a heartbeat came for two heartbeats while messages were asked
    /// for.
    #[error("JetStream missed two idle heartbeats")]
    MissedHeartbeat,
    /// The reply subscription ended.
    #[error("the pull subscription ended")]
    Closed,
}

/// Pulls one durable consumer's messages (see the module).
pub(crate) struct Puller {
    client: Client,
    /// `$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>`.
    next: Subject,
    inbox: Subject,
    replies: Subscriber,
    /// Messages asked for that have neither arrived nor expired.
    outstanding: usize,
    /// When JetStream last said anything on the reply subscription.
    heard: Instant,
}

impl Puller {
    /// A puller of durable `durable` on `stream`.
    pub(crate) async fn new(
        client: Client,
        stream: &str,
        durable: &str,
    ) -> Result<Self, PullError> {
        let inbox = Subject::from(client.new_inbox());
        let replies = client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| PullError::Client(e.to_string()))?;
        Ok(Self {
            next: Subject::from(format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}")),
            client,
            inbox,
            replies,
            outstanding: 0,
            heard: Instant::now(),
        })
    }

    /// Messages asked for that have neither arrived nor expired.
    pub(crate) fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Asks JetStream for `count` more messages.
    pub(crate) async fn ask(&mut self, count: usize) -> Result<(), PullError> {
        if count == 0 {
            return Ok(());
        }
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let request = format!(
            "{{\"batch\":{count},\"expires\":{},\"idle_heartbeat\":{}}}",
            nanos(EXPIRES),
            nanos(HEARTBEAT)
        );
        if self.outstanding == 0 {
            self.heard = Instant::now();
        }
        self.client
            .publish_with_reply(self.next.clone(), self.inbox.clone(), request.into())
            .await
            .map_err(|e| PullError::Client(e.to_string()))?;
        self.outstanding += count;
        Ok(())
    }

    /// The next message JetStream delivers; the server's status messages about the pull are
    /// taken into the count of what is outstanding, or end the pull.
    pub(crate) async fn next(&mut self) -> Result<async_nats::Message, PullError> {
        loop {
            let deadline = self.heard + 2 * HEARTBEAT;
            let received = if self.outstanding > 0 {
                match tokio::time::timeout_at(deadline, self.replies.next()).await {
                    Ok(received) => received,
                    Err(_) => return Err(PullError::MissedHeartbeat),
                }
            } else {
                self.replies.next().await
            };
            let message = received.ok_or(PullError::Closed)?;
            self.heard = Instant::now();
            // A stored message carries its ack subject, whatever status its header block
            // spells (a raw client can publish `NATS/1.0 503`); the server's own statuses
            // about the pull carry none.
            let delivered = message
                .reply
                .as_ref()
                .is_some_and(|reply| reply.starts_with(ACK_PREFIX));
            match message.status {
                _ if delivered => {
                    self.outstanding = self.outstanding.saturating_sub(1);
                    return Ok(message);
                }
                None | Some(StatusCode::OK) => {
                    self.outstanding = self.outstanding.saturating_sub(1);
                    return Ok(message);
                }
                Some(StatusCode::IDLE_HEARTBEAT) => {}
                // A request expired or was ended with messages it did not deliver, which the
                // status says (else the whole count is taken as gone, and asked for again).
                Some(
                    StatusCode::TIMEOUT | StatusCode::NOT_FOUND | StatusCode::REQUEST_TERMINATED,
                ) if !ends_pulling(message.description.as_deref()) => {
                    let undelivered = message
                        .headers
                        .as_ref()
                        .and_then(|headers| headers.get("Nats-Pending-Messages"))
                        .and_then(|value| value.as_str().parse::<usize>().ok());
                    self.outstanding = match undelivered {
                        Some(count) => self.outstanding.saturating_sub(count),
                        None => 0,
                    };
                }
                Some(status) => {
                    return Err(PullError::Ended {
                        status,
                        description: message.description.unwrap_or_default(),
                    });
                }
            }
        }
    }
}

/// The start of a delivery's ack subject (`$JS.ACK.<stream>.<consumer>.…`).
const ACK_PREFIX: &str = "$JS.ACK.";

/// Whether a 409's description says the consumer cannot be pulled from any more.
fn ends_pulling(description: Option<&str>) -> bool {
    let description = description.unwrap_or_default().to_ascii_lowercase();
    ["consumer deleted", "push based", "message size exceeds"]
        .iter()
        .any(|ending| description.contains(ending))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deleted_consumer_ends_pulling_and_an_expired_request_does_not() {
        assert!(ends_pulling(Some("Consumer Deleted")));
        assert!(ends_pulling(Some("Consumer is push based")));
        assert!(!ends_pulling(Some("Request Timeout")));
        assert!(!ends_pulling(Some("Exceeded MaxWaiting")));
        assert!(!ends_pulling(Some("Leadership Change")));
        assert!(!ends_pulling(None));
    }
}
