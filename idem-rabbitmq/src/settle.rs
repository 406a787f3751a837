//! Settling a channel's deliveries: this is where the ack is **sent**. Each delivery carries a
//! [`RabbitSettle`] (the runtime decides which settlement, in `idem-core/src/runtime/settle.rs`,
//! always after the commit); every settlement of one channel then goes through one task, in
//! order: rejects and requeues at once, acks coalesced into `basic.ack(multiple = true)` up to
//! the contiguous-commit watermark.
//!
//! Deliveries of one channel carry tags 1, 2, 3, … and are settled in any order (several
//! workers, several batches). An ack with `multiple = true` settles every outstanding tag up
//! to the one named, so it may only name a tag when every tag below it is settled too: the
//! [`Watermark`] tracks the lowest unsettled tag and acks only the contiguous settled prefix.
//! A delivery that is still in a transaction is never covered by an ack.
//!
//! A slow delivery holds the watermark back; the committed deliveries after it would keep the
//! broker's prefetch window full and starve the workers. So when more than `lag` committed
//! deliveries wait above the watermark, they are acked one by one (`multiple = false`), which
//! is always safe.

use crate::answer::on_channel;
use idem_core::transport::Watermark;
use idem_core::{
    future::BoxFuture, model::DeadLetter, model::Envelope, transport::Settle,
    transport::TransportError,
};
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::{BasicProperties, Channel};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// One delivery's settlement handle: its tag and its channel's settlement task, the publisher
/// of its copies (retries, dead letters with their reason: confirmed, within the publish
/// timeout, on a connection other than the consumer's, which a resource alarm would block acks
/// and all) and its properties (kept on the copies). Dropped unsettled (an abandoned worker),
/// it gives the delivery back.
pub(crate) struct RabbitSettle {
    pub(crate) tag: u64,
    pub(crate) acks: Acks,
    /// The delivery's channel: a copy is published only while it is open, since the delivery
    /// could not be acked after it and the broker would deliver it again beside the copy.
    pub(crate) channel: Arc<Channel>,
    pub(crate) copies: Arc<crate::outbound::RabbitOutbound>,
    pub(crate) properties: BasicProperties,
    pub(crate) queue: Arc<str>,
    pub(crate) done: bool,
}

impl RabbitSettle {
    /// Hands `op` to the channel's settlement task, which sends it in tag order.
    /// Whether the delivery can still be settled on its channel; `Err` (and the delivery left
    /// for the broker to redeliver) when its channel is gone.
    fn on_open_channel(&self) -> Result<(), TransportError> {
        match self.channel.status().connected() {
            true => Ok(()),
            false => Err(TransportError::Settle(
                "the delivery's channel is closed; the broker redelivers it, so no copy is published".into(),
            )),
        }
    }

    fn settle(mut self: Box<Self>, op: Op) -> Result<(), TransportError> {
        self.done = true;
        if self.acks.send(self.tag, op) {
            Ok(())
        } else {
            Err(TransportError::Settle(
                "the delivery's channel is closed; the broker redelivers".into(),
            ))
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
            if let Err(e) = self.on_open_channel() {
                let _ = self.settle(Op::Requeue);
                return Err(e);
            }
            if let Err(e) = self.publish_retry(envelope, delay).await {
                // Not acked either: the broker redelivers the original.
                let _ = self.settle(Op::Requeue);
                return Err(e);
            }
            self.settle(Op::Ack)
        })
    }

    /// Rejects the delivery so the broker moves it into `<queue>.dlq` (the runtime recorded
    /// its reason in the handler's store first): the move is the broker's, atomic, so the
    /// message lands there once even if this process dies at any point.
    fn dead_letter<'a>(
        self: Box<Self>,
        envelope: &'a Envelope,
        reason: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        #[cfg(feature = "fault-injection")]
        idem_core::fault::maybe_crash(idem_core::fault::Point::InDeadLetter);
        if !reason.unrecorded {
            return Box::pin(std::future::ready(self.settle(Op::Reject)));
        }
        // No record holds its reason: a copy carrying it in its headers goes to the
        // dead-letter queue, confirmed, and the delivery is acked. If that copy cannot be
        // published, the delivery is rejected as any other (moved without the headers).
        Box::pin(async move {
            if let Err(e) = self.on_open_channel() {
                let _ = self.settle(Op::Requeue);
                return Err(e);
            }
            match self.publish_dead_letter(envelope, reason).await {
                Ok(()) => self.settle(Op::Ack),
                Err(e) => {
                    tracing::warn!(queue = %self.queue, error = %e, "could not publish the dead letter with its reason; rejecting it without");
                    self.settle(Op::Reject)
                }
            }
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

/// What to do with one delivery tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Processed (committed) or a duplicate: ack, coalesced.
    Ack,
    /// Dead-letter: `basic.reject` without requeue (the broker moves it to the DLQ).
    Reject,
    /// Give back: `basic.nack` with requeue.
    Requeue,
}

/// Sends settlements to the channel's settlement task.
#[derive(Debug, Clone)]
pub(crate) struct Acks(mpsc::UnboundedSender<(u64, Op)>);

impl Acks {
    /// Queues `op` for `tag`; `false` when the channel's task has ended (the channel is gone,
    /// and the broker redelivers the message).
    pub(crate) fn send(&self, tag: u64, op: Op) -> bool {
        self.0.send((tag, op)).is_ok()
    }
}

/// Starts the settlement task of `channel`; at most `lag` committed deliveries wait for the
/// watermark before they are acked one by one. It ends, after sending what it was given, when
/// every [`Acks`] handle is dropped or the channel fails.
pub(crate) fn spawn(channel: Arc<Channel>, queue: Arc<str>, lag: usize) -> (Acks, JoinHandle<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (Acks(tx), tokio::spawn(run(channel, queue, lag, rx)))
}

async fn run(
    channel: Arc<Channel>,
    queue: Arc<str>,
    lag: usize,
    mut rx: mpsc::UnboundedReceiver<(u64, Op)>,
) {
    let mut watermark = Watermark::default();
    let mut ready = Vec::new();
    while rx.recv_many(&mut ready, 1024).await > 0 {
        for (tag, op) in ready.drain(..) {
            let sent = match op {
                Op::Ack => Ok(()),
                Op::Reject => {
                    let reject = channel.basic_reject(tag, BasicRejectOptions { requeue: false });
                    on_channel(&channel, reject).await
                }
                Op::Requeue => {
                    let requeue = BasicNackOptions {
                        requeue: true,
                        multiple: false,
                    };
                    on_channel(&channel, channel.basic_nack(tag, requeue)).await
                }
            };
            if let Err(e) = sent {
                tracing::warn!(queue = %queue, tag, error = %e, "settlement not sent; the broker redelivers");
                return;
            }
            watermark.settle(tag, op == Op::Ack);
        }
        if let Some(up_to) = watermark.advance()
            && let Err(e) = on_channel(
                &channel,
                channel.basic_ack(up_to, BasicAckOptions { multiple: true }),
            )
            .await
        {
            tracing::warn!(queue = %queue, up_to, error = %e, "ack not sent; the broker redelivers");
            return;
        }
        for tag in watermark.overflow(lag) {
            if let Err(e) = on_channel(
                &channel,
                channel.basic_ack(tag, BasicAckOptions { multiple: false }),
            )
            .await
            {
                tracing::warn!(queue = %queue, tag, error = %e, "ack not sent; the broker redelivers");
                return;
            }
        }
    }
    // Every delivery of the channel is settled: close it now, while its connection is open,
    // rather than leave it to close itself when dropped during the connection's shutdown.
    // (A closing channel is not connected: the close-ok is awaited for a bounded time instead.)
    if channel.status().connected() {
        let close = channel.close(200, lapin::types::ShortString::from("settled"));
        let _ = tokio::time::timeout(Duration::from_secs(5), close).await;
    }
}
