//! In-progress signals: while a delivery is unsettled, JetStream is told so every third of the
//! ack wait, so that a long handler is not redelivered while it runs. One ticker per queue
//! consumer speaks for all of its unsettled deliveries; a delivery is among them from the
//! moment it is pulled until its settlement is dropped, also after the consumer stopped.

use crate::connection::Shared;
use async_nats::Subject;
use idem_core::transport::StopSignal;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The unsettled deliveries of one queue consumer, by a number of their own.
#[derive(Clone, Default)]
pub(crate) struct Unsettled(Arc<Mutex<Deliveries>>);

#[derive(Default)]
struct Deliveries {
    next: u64,
    reply: HashMap<u64, Subject>,
}

impl Unsettled {
    /// Counts the delivery acked through `reply` among the unsettled until the guard drops
    /// (one without a reply subject cannot be told in progress).
    pub(crate) fn track(&self, reply: Option<Subject>) -> Tracked {
        let mut deliveries = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let id = deliveries.next;
        deliveries.next += 1;
        if let Some(reply) = reply {
            deliveries.reply.insert(id, reply);
        }
        Tracked {
            id,
            unsettled: self.clone(),
        }
    }

    /// How many deliveries are unsettled.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .reply
            .len()
    }

    /// Tells JetStream every `every` that each unsettled delivery is in progress, through the
    /// connection while it is open; until `stop` is raised and nothing is left unsettled (the
    /// handlers still running at shutdown are spoken for until they settle).
    pub(crate) async fn tell(self, shared: Shared, every: Duration, stop: StopSignal) {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            let replies: Vec<Subject> = self
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .reply
                .values()
                .cloned()
                .collect();
            if replies.is_empty() && *stop.borrow() {
                return;
            }
            let Some(client) = shared.opened() else {
                continue;
            };
            for reply in replies {
                if let Err(e) = client.publish(reply, "+WPI".into()).await {
                    tracing::debug!(error = %e, "an in-progress signal was not sent");
                }
            }
        }
    }
}

/// One delivery among the unsettled; dropped with its settlement.
pub(crate) struct Tracked {
    id: u64,
    unsettled: Unsettled,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.unsettled
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .reply
            .remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_is_unsettled_until_its_guard_drops() {
        let unsettled = Unsettled::default();
        let first = unsettled.track(Some(Subject::from("$JS.ACK.a")));
        let second = unsettled.track(Some(Subject::from("$JS.ACK.b")));
        assert_eq!(unsettled.len(), 2);
        drop(first);
        assert_eq!(unsettled.len(), 1);
        drop(second);
        assert_eq!(unsettled.len(), 0);
    }
}
