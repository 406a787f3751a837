//! One channel's settlements, sent in order by one task: rejects and requeues at once, acks
//! coalesced into `basic.ack(multiple = true)` up to the contiguous-commit watermark.
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

use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

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
                    channel
                        .basic_reject(tag, BasicRejectOptions { requeue: false })
                        .await
                }
                Op::Requeue => {
                    let requeue = BasicNackOptions {
                        requeue: true,
                        multiple: false,
                    };
                    channel.basic_nack(tag, requeue).await
                }
            };
            if let Err(e) = sent {
                tracing::warn!(queue = %queue, tag, error = %e, "settlement not sent; the broker redelivers");
                return;
            }
            watermark.settle(tag, op == Op::Ack);
        }
        if let Some(up_to) = watermark.advance()
            && let Err(e) = channel
                .basic_ack(up_to, BasicAckOptions { multiple: true })
                .await
        {
            tracing::warn!(queue = %queue, up_to, error = %e, "ack not sent; the broker redelivers");
            return;
        }
        for tag in watermark.overflow(lag) {
            if let Err(e) = channel
                .basic_ack(tag, BasicAckOptions { multiple: false })
                .await
            {
                tracing::warn!(queue = %queue, tag, error = %e, "ack not sent; the broker redelivers");
                return;
            }
        }
    }
    // Every delivery of the channel is settled: close it now, while its connection is open,
    // rather than leave it to close itself when dropped during the connection's shutdown.
    if channel.status().connected() {
        let _ = channel
            .close(200, lapin::types::ShortString::from("settled"))
            .await;
    }
}

/// The contiguous-settled prefix of a channel's delivery tags.
#[derive(Debug)]
pub(crate) struct Watermark {
    /// The lowest tag not yet settled.
    next: u64,
    /// Settled tags above `next`, with whether each still needs an ack.
    settled: BTreeMap<u64, bool>,
    /// How many of `settled` still need an ack.
    waiting: usize,
}

impl Default for Watermark {
    fn default() -> Self {
        Self {
            next: 1,
            settled: BTreeMap::new(),
            waiting: 0,
        }
    }
}

impl Watermark {
    /// Records that `tag` is settled: committed and waiting for its ack (`needs_ack`), or
    /// already rejected or requeued on its own.
    pub(crate) fn settle(&mut self, tag: u64, needs_ack: bool) {
        if tag >= self.next && self.settled.insert(tag, needs_ack).is_none() && needs_ack {
            self.waiting += 1;
        }
    }

    /// Moves past the contiguous settled prefix and returns the highest tag in it that needs
    /// an ack, if any: `basic.ack(that, multiple = true)` then acks exactly the prefix's
    /// unacked tags (rejected and requeued ones are no longer outstanding).
    pub(crate) fn advance(&mut self) -> Option<u64> {
        let mut ack = None;
        while let Some(needs_ack) = self.settled.remove(&self.next) {
            if needs_ack {
                ack = Some(self.next);
                self.waiting -= 1;
            }
            self.next += 1;
        }
        ack
    }

    /// When more than `lag` settled tags above the watermark still need an ack, returns them
    /// (to be acked one by one) and records them as acked.
    pub(crate) fn overflow(&mut self, lag: usize) -> Vec<u64> {
        if self.waiting <= lag {
            return Vec::new();
        }
        let mut tags = Vec::with_capacity(self.waiting);
        for (tag, needs_ack) in &mut self.settled {
            if *needs_ack {
                *needs_ack = false;
                tags.push(*tag);
            }
        }
        self.waiting = 0;
        tags
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_only_the_contiguous_settled_prefix() {
        let mut w = Watermark::default();
        // 2 and 3 commit while 1 is still in its transaction: nothing may be acked.
        w.settle(2, true);
        w.settle(3, true);
        assert_eq!(w.advance(), None);
        // 1 commits: 1..=3 go in one ack.
        w.settle(1, true);
        assert_eq!(w.advance(), Some(3));
        // 4 is rejected on its own, 6 commits, 5 is still running.
        w.settle(4, false);
        w.settle(6, true);
        assert_eq!(w.advance(), None);
        // 5 is requeued on its own: the ack names 6, the highest tag still outstanding.
        w.settle(5, false);
        assert_eq!(w.advance(), Some(6));
        // Only rejected tags: nothing to ack, but the watermark moves.
        w.settle(7, false);
        assert_eq!(w.advance(), None);
        w.settle(8, true);
        assert_eq!(w.advance(), Some(8));
        // A stale tag below the watermark is ignored.
        w.settle(3, true);
        assert_eq!(w.advance(), None);
    }

    #[test]
    fn a_long_lag_behind_a_slow_tag_is_acked_one_by_one() {
        let mut w = Watermark::default();
        for tag in 2..=4 {
            w.settle(tag, true);
        }
        assert_eq!(w.advance(), None);
        assert_eq!(w.overflow(3), Vec::<u64>::new(), "within the allowed lag");
        w.settle(5, true);
        assert_eq!(w.overflow(3), vec![2, 3, 4, 5]);
        assert_eq!(w.overflow(3), Vec::<u64>::new(), "each tag is acked once");
        // Tag 1 commits: it alone is still outstanding, and the multiple ack names it.
        w.settle(1, true);
        assert_eq!(w.advance(), Some(1));
        w.settle(6, true);
        assert_eq!(w.advance(), Some(6));
    }
}
