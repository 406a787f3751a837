//! An in-memory transport with the broker's at-least-once behaviour, for tests and demos with
//! nothing installed: unsettled deliveries come back, duplicates and concurrent copies can be
//! injected, retries wait their delay, dead letters are kept for inspection.

use super::contract::{Delivery, Partition, QueueSpec, Settle, StopSignal, Transport};
use super::error::TransportError;
use super::headers::IdemHeader;
use super::outbound::{Outbound, OutboundError};
use crate::future::BoxFuture;
use crate::model::{DeadLetter, Envelope, Outgoing};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{Notify, mpsc};

/// An in-memory message broker.
#[derive(Clone, Default)]
pub struct MemoryTransport {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    queues: Mutex<HashMap<String, Queue>>,
    /// Ordered handlers' sources and their partition counts.
    partitioned: Mutex<HashMap<String, usize>>,
    changed: Notify,
}

#[derive(Default)]
struct Queue {
    ready: VecDeque<Envelope>,
    unacked: usize,
    acked: u64,
    dead: Vec<(Envelope, DeadLetter)>,
}

impl std::fmt::Debug for MemoryTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTransport").finish_non_exhaustive()
    }
}

impl MemoryTransport {
    /// An empty broker.
    pub fn new() -> Self {
        Self::default()
    }

    fn queues(&self) -> MutexGuard<'_, HashMap<String, Queue>> {
        // A poisoned lock only means a test panicked while holding it; the data is still usable.
        self.inner.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enqueues a message in `queue`; when `queue` names an ordered handler's exchange (once
    /// the runtime declared it), in the partition queue of the envelope's routing key.
    pub fn publish(&self, queue: &str, envelope: Envelope) {
        let partitions = self
            .inner
            .partitioned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
            .copied();
        let queue = match partitions {
            Some(count) => Partition::queue_name(
                queue,
                super::lanes::lane_of(envelope.routing_key.as_deref(), count),
            ),
            None => queue.to_owned(),
        };
        self.queues()
            .entry(queue)
            .or_default()
            .ready
            .push_back(envelope);
        self.inner.changed.notify_waiters();
    }

    /// Enqueues `copies` copies of a message back to back, so that several workers receive
    /// them at the same time.
    pub fn publish_copies(&self, queue: &str, envelope: &Envelope, copies: usize) {
        let mut queues = self.queues();
        let q = queues.entry(queue.to_owned()).or_default();
        q.ready
            .extend(std::iter::repeat_n(envelope, copies).cloned());
        drop(queues);
        self.inner.changed.notify_waiters();
    }

    /// Messages dead-lettered from `queue`, with their reasons.
    pub fn dead_letters(&self, queue: &str) -> Vec<(Envelope, DeadLetter)> {
        self.queues()
            .get(queue)
            .map(|q| q.dead.clone())
            .unwrap_or_default()
    }

    /// Whether `queue` was declared or published to.
    pub fn exists(&self, queue: &str) -> bool {
        self.queues().contains_key(queue)
    }

    /// How many deliveries of `queue` were acked.
    pub fn acked(&self, queue: &str) -> u64 {
        self.queues().get(queue).map_or(0, |q| q.acked)
    }

    /// Messages of `queue` waiting or delivered but not settled.
    pub fn pending(&self, queue: &str) -> usize {
        self.queues()
            .get(queue)
            .map_or(0, |q| q.ready.len() + q.unacked)
    }

    fn settle(&self, queue: &str, apply: impl FnOnce(&mut Queue)) {
        let mut queues = self.queues();
        let q = queues.entry(queue.to_owned()).or_default();
        q.unacked = q.unacked.saturating_sub(1);
        apply(q);
        drop(queues);
        self.inner.changed.notify_waiters();
    }

    /// Takes the next ready message if fewer than `prefetch` are unsettled.
    fn take(&self, queue: &str, prefetch: u16) -> Option<Envelope> {
        let mut queues = self.queues();
        let q = queues.entry(queue.to_owned()).or_default();
        if q.unacked >= usize::from(prefetch) {
            return None;
        }
        let envelope = q.ready.pop_front()?;
        q.unacked += 1;
        Some(envelope)
    }
}

impl Outbound for MemoryTransport {
    /// Enqueues the message in the queue it names, or in the ordered handler's source its
    /// topic names; a queue nobody declared or published to makes it unroutable, as
    /// `mandatory` does on a broker.
    fn publish<'a>(&'a self, message: &'a Outgoing) -> BoxFuture<'a, Result<(), OutboundError>> {
        let (topic, key) = message.destination.parts();
        let target = match topic {
            "" => key,
            topic => topic,
        };
        let known = self.exists(target)
            || self
                .inner
                .partitioned
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(target);
        let result = match known {
            true => {
                let mut envelope = message.envelope.clone();
                envelope.routing_key = Some(key.to_owned());
                self.publish(target, envelope);
                Ok(())
            }
            false => Err(OutboundError::Unroutable {
                destination: message.destination.clone(),
            }),
        };
        Box::pin(std::future::ready(result))
    }
}

impl Transport for MemoryTransport {
    fn outbound(&self) -> Option<Arc<dyn Outbound>> {
        Some(Arc::new(self.clone()))
    }

    fn declare<'a>(&'a self, queues: &'a [QueueSpec]) -> BoxFuture<'a, Result<(), TransportError>> {
        for spec in queues {
            self.queues().entry(spec.queue.clone()).or_default();
            if let Some(partition) = &spec.partition {
                self.inner
                    .partitioned
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(partition.source.clone(), partition.count);
            }
        }
        Box::pin(async { Ok(()) })
    }

    fn consume(
        &self,
        spec: QueueSpec,
        prefetch: u16,
        mailbox: mpsc::Sender<Delivery>,
        mut stop: StopSignal,
    ) -> BoxFuture<'static, ()> {
        let transport = self.clone();
        Box::pin(async move {
            while !*stop.borrow() {
                let changed = transport.inner.changed.notified();
                if let Some(envelope) = transport.take(&spec.queue, prefetch) {
                    let settle = Box::new(MemorySettle {
                        transport: transport.clone(),
                        queue: spec.queue.clone(),
                        envelope: Some(envelope.clone()),
                    });
                    if mailbox.send(Delivery { envelope, settle }).await.is_err() {
                        break;
                    }
                    continue;
                }
                tokio::select! {
                    () = changed => {}
                    _ = stop.changed() => {}
                }
            }
        })
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// Settles one in-memory delivery; dropped unsettled (a crash, an abandoned worker), the
/// message goes back to its queue as a redelivery.
struct MemorySettle {
    transport: MemoryTransport,
    queue: String,
    envelope: Option<Envelope>,
}

impl MemorySettle {
    fn finish(&mut self, apply: impl FnOnce(&mut Queue, Envelope)) {
        if let Some(envelope) = self.envelope.take() {
            self.transport.settle(&self.queue, |q| apply(q, envelope));
        }
    }
}

impl Drop for MemorySettle {
    fn drop(&mut self) {
        if let Some(mut envelope) = self.envelope.take() {
            // Redelivered, as the same attempt: nothing failed.
            envelope.redelivered = true;
            self.transport
                .settle(&self.queue, |q| q.ready.push_front(envelope));
        }
    }
}

impl Settle for MemorySettle {
    fn ack(mut self: Box<Self>) -> BoxFuture<'static, Result<(), TransportError>> {
        self.finish(|q, _| q.acked += 1);
        Box::pin(async { Ok(()) })
    }

    fn retry<'a>(
        mut self: Box<Self>,
        _: &'a Envelope,
        delay: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        let (transport, queue) = (self.transport.clone(), self.queue.clone());
        let mut retried = None;
        self.finish(|_, envelope| retried = Some(envelope));
        if let Some(mut envelope) = retried {
            envelope.attempt += 1;
            let first = IdemHeader::FirstFailure.name();
            if envelope.headers.get(first).is_none() {
                envelope.headers.insert(first, super::headers::epoch_ms());
            }
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                transport.publish(&queue, envelope);
            });
        }
        Box::pin(async { Ok(()) })
    }

    fn dead_letter<'a>(
        mut self: Box<Self>,
        _: &'a Envelope,
        reason: &'a DeadLetter,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        let reason = reason.clone();
        self.finish(|q, envelope| q.dead.push((envelope, reason)));
        Box::pin(async { Ok(()) })
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), TransportError>> {
        drop(self);
        Box::pin(async { Ok(()) })
    }
}
