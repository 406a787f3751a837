//! The contiguous-settled prefix of a stream of deliveries numbered in the order they arrived
//! (RabbitMQ's delivery tags on a channel, a log's offsets, a stream's sequence numbers): the
//! highest number a cumulative acknowledgement may name, so that it never covers a delivery
//! still in its transaction. Any transport whose broker acknowledges "everything up to n"
//! settles through one.

use std::collections::BTreeMap;

/// The contiguous-settled prefix of deliveries numbered from 1 in arrival order.
///
/// A transport records each delivery as it settles ([`settle`](Self::settle)), then asks how far
/// a cumulative acknowledgement may reach ([`advance`](Self::advance)). A delivery still in its
/// transaction holds the watermark back; [`overflow`](Self::overflow) bounds how many committed
/// deliveries may wait behind it before they are acknowledged one by one.
///
/// ```
/// use idem_core::transport::Watermark;
///
/// let mut watermark = Watermark::default();
/// watermark.settle(2, true); // committed while 1 is still running
/// assert_eq!(watermark.advance(), None);
/// watermark.settle(1, true);
/// assert_eq!(watermark.advance(), Some(2)); // one acknowledgement covers 1 and 2
/// ```
#[derive(Debug)]
pub struct Watermark {
    /// The lowest tag not yet settled.
    next: u64,
    /// Settled tags above `next`, with whether each still needs an ack.
    settled: BTreeMap<u64, bool>,
    /// How many of `settled` still need an ack.
    waiting: usize,
}

/// Starts before number 1, with nothing settled.
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
    /// already rejected or requeued on its own. A tag below the watermark is ignored.
    pub fn settle(&mut self, tag: u64, needs_ack: bool) {
        if tag >= self.next && self.settled.insert(tag, needs_ack).is_none() && needs_ack {
            self.waiting += 1;
        }
    }

    /// Moves past the contiguous settled prefix and returns the highest tag in it that needs
    /// an ack, if any: `basic.ack(that, multiple = true)` then acks exactly the prefix's
    /// unacked tags (rejected and requeued ones are no longer outstanding).
    pub fn advance(&mut self) -> Option<u64> {
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
    pub fn overflow(&mut self, lag: usize) -> Vec<u64> {
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
