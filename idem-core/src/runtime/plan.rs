//! How a [`RuntimeBuilder`] becomes actors: which handlers run, on which queues (one per
//! partition for an ordered handler), with how many workers and what prefetch, and the
//! windows that must not let a copy run twice.

use super::actor::{Actor, BatchSpec};
use super::builder::{
    DEFAULT_BATCHES_IN_FLIGHT, DEFAULT_CONCURRENCY, DEFAULT_PREFETCH, RuntimeBuilder,
};
use super::error::RuntimeError;
use crate::handler::Mode;
use crate::model::KeyPolicy;
use crate::registry::{self, Registration};
use crate::transport::{Partition, QueueSpec, Transport};
use std::time::Duration;

/// The most partitions an ordered handler may have.
pub const MAX_PARTITIONS: usize = 1024;

impl RuntimeBuilder {
    /// The handlers to run: the chosen consumers (or every registered one). A consumer written
    /// for several stores (one function per database) runs on the store the runtime has. A
    /// name that is no consumer identity chooses the functions of that name (to pick one of
    /// two handlers sharing a consumer, such as a batch handler and a single one).
    pub(super) fn select_handlers(&self) -> Result<Vec<&'static Registration>, RuntimeError> {
        let all = registry::handlers();
        let consumers: Vec<&str> = match &self.handlers {
            Some(chosen) => chosen.iter().map(String::as_str).collect(),
            None => {
                let mut names: Vec<&str> = all.iter().map(|r| r.consumer()).collect();
                names.dedup();
                names
            }
        };
        let mut selected = Vec::new();
        for consumer in consumers {
            let mut candidates: Vec<_> = all
                .iter()
                .copied()
                .filter(|r| r.consumer() == consumer)
                .collect();
            if candidates.is_empty() {
                candidates = all
                    .iter()
                    .copied()
                    .filter(|r| r.name() == consumer)
                    .collect();
            }
            let Some(first) = candidates.first() else {
                return Err(RuntimeError::UnknownHandler(consumer.to_owned()));
            };
            let runnable: Vec<_> = candidates
                .iter()
                .copied()
                .filter(|r| r.store_available(&self.stores))
                .collect();
            if runnable.is_empty() {
                return Err(RuntimeError::MissingStore {
                    consumer: first.consumer(),
                    store: first.store(),
                });
            }
            selected.extend(runnable);
        }
        if selected.is_empty() {
            return Err(RuntimeError::NoHandlers);
        }
        Ok(selected)
    }

    /// Refuses windows that would let a copy run twice, or refuse it: a queue TTL longer than
    /// the handler's retention (a late copy would find no marker), a retry policy or a relay's
    /// give-up time that outlasts it (a late copy would be beyond its dedup window), and an
    /// external handler's lease at least as long as the retry window (a copy waiting for the
    /// lease would run out of attempts).
    pub(super) fn check_windows(
        &self,
        actor: &Actor,
        transport: &dyn Transport,
    ) -> Result<(), RuntimeError> {
        let consumer = actor.registration.consumer();
        let queue = &actor.spec.queue;
        if let (Some(ttl), Some(retention)) = (
            transport.message_ttl(queue),
            actor.registration.retention(&self.stores),
        ) && ttl > retention
        {
            return Err(RuntimeError::setting(
                "message_ttl",
                format!(
                    "queue `{queue}` declares a message TTL of {}s, longer than the {}s retention of `{consumer}`'s inbox rows: a message delivered late would find no marker and be processed again; raise the retention (#[idempotent(retention = \"...\")] or RuntimeBuilder::retention) or lower the TTL",
                    ttl.as_secs(),
                    retention.as_secs()
                ),
            ));
        }
        if let Mode::External { lease } = actor.registration.mode() {
            if let Some(retention) = actor.registration.retention(&self.stores)
                && retention <= lease
            {
                return Err(RuntimeError::setting(
                    "retention",
                    format!(
                        "`{consumer}` holds its lease for {lease:?}, but its inbox rows are kept only {retention:?}: the sweeper could delete a key still in progress, and a retry would call the other services again; raise the retention (#[idempotent(retention = \"...\")] or RuntimeBuilder::retention) or shorten the lease"
                    ),
                ));
            }
            let window: Duration = self.retry.delays().iter().sum();
            if lease >= window {
                return Err(RuntimeError::setting(
                    "lease",
                    format!(
                        "`{consumer}` holds its lease for {lease:?}, but the retry policy gives up after {window:?} of delays: a copy waiting for the lease would be dead-lettered; shorten the lease or lengthen the retry policy"
                    ),
                ));
            }
        }
        if let Some(retention) = actor.registration.retention(&self.stores) {
            let retries = self.retry.total_delay();
            if retries >= retention {
                return Err(RuntimeError::setting(
                    "retry",
                    format!(
                        "the retry policy waits {retries:?} between a message's first failure and its last attempt, but `{consumer}`'s inbox rows are kept only {retention:?}: its last retries would be older than the dedup window and refused as `beyond-dedup-window`; raise the retention (#[idempotent(retention = \"...\")] or RuntimeBuilder::retention) or shorten the retry policy"
                    ),
                ));
            }
            if self.relay.is_some()
                && let Some(give_up) = actor.registration.outbox_give_up(&self.stores)
                && give_up > retention
            {
                return Err(RuntimeError::setting(
                    "outbox_give_up",
                    format!(
                        "the outbox relay keeps trying a refused row for {give_up:?} after it was staged, but `{consumer}`'s inbox rows are kept only {retention:?}: a row published that late would be older than the dedup window; raise the retention or shorten the give-up time (SqlInbox::outbox_give_up)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// One handler's actors: its queue, workers, prefetch and batching; an ordered handler has
    /// one actor per partition queue.
    pub(super) fn actors(
        &self,
        registration: &'static Registration,
    ) -> Result<Vec<Actor>, RuntimeError> {
        let consumer = registration.consumer();
        let queue = match self.queues.get(consumer) {
            Some(queue) => queue.as_str(),
            None => registration
                .queue()
                .ok_or(RuntimeError::NoQueue { consumer })?,
        };
        if queue.is_empty() || queue.len() > 200 {
            return Err(RuntimeError::setting(
                "queue",
                format!("queue name {queue:?} must be 1 to 200 characters"),
            ));
        }
        let batch = self.batch_of(registration);
        let workers = self.workers_of(consumer, batch)?;
        let prefetch = self.prefetch_of(consumer, batch)?;
        let spec = QueueSpec {
            queue: queue.to_owned(),
            consumer: consumer.to_owned(),
            retry_delays: self.retry.delays(),
            dead_letters: Default::default(),
            partition: None,
            demand: Default::default(),
        };
        let Some(&count) = self.ordered.get(consumer) else {
            return Ok(vec![Actor {
                registration,
                spec,
                workers,
                prefetch,
                batch,
                ordered: false,
                parking: None,
            }]);
        };
        if batch.is_some() {
            return Err(RuntimeError::setting(
                "ordered",
                format!(
                    "`{consumer}` is ordered and batched: an ordered handler runs one transaction per delivery; drop its batch setting"
                ),
            ));
        }
        if count == 0 || count > MAX_PARTITIONS {
            return Err(RuntimeError::setting(
                "ordered",
                format!("`{consumer}` asks for {count} partitions: give 1 to {MAX_PARTITIONS}"),
            ));
        }
        let parking = match self.key_policies.get(consumer).copied().unwrap_or_default() {
            KeyPolicy::Park => Some(std::sync::Arc::from(queue)),
            KeyPolicy::Retire => None,
        };
        // The handler's queue names the partitions' source (RabbitMQ: an exchange); each partition is a queue of its own, with
        // no retry queues (a failure is retried in place, so that nothing overtakes it).
        Ok((0..count)
            .map(|index| Actor {
                registration,
                spec: QueueSpec {
                    queue: Partition::queue_name(queue, index),
                    retry_delays: Vec::new(),
                    partition: Some(Partition::new(queue, index, count)),
                    ..spec.clone()
                },
                workers,
                prefetch,
                batch: None,
                ordered: true,
                parking: parking.clone(),
            })
            .collect())
    }

    /// The handler's batching: the builder's setting for it, its macro's, the builder's
    /// default; none at size 0.
    fn batch_of(&self, registration: &'static Registration) -> Option<BatchSpec> {
        let size = self
            .per_handler_batch
            .get(registration.consumer())
            .copied()
            .or(registration.batch_size())
            .unwrap_or(self.batch);
        (size > 0).then_some(BatchSpec {
            size,
            linger: self.linger,
        })
    }

    /// How many deliveries (batch mode: batches) the handler processes at once.
    fn workers_of(
        &self,
        consumer: &'static str,
        batch: Option<BatchSpec>,
    ) -> Result<usize, RuntimeError> {
        let workers = self
            .per_handler
            .get(consumer)
            .copied()
            .or(self.concurrency)
            .unwrap_or(match batch {
                Some(_) => DEFAULT_BATCHES_IN_FLIGHT,
                None => DEFAULT_CONCURRENCY,
            });
        if workers == 0 {
            return Err(RuntimeError::setting(
                "concurrency",
                format!("concurrency of `{consumer}` must be at least 1"),
            ));
        }
        Ok(workers)
    }

    /// The handler's prefetch: set, or the default for its batching; a batch that could never
    /// fill is refused, one above half the prefetch warned about.
    fn prefetch_of(
        &self,
        consumer: &'static str,
        batch: Option<BatchSpec>,
    ) -> Result<u16, RuntimeError> {
        Ok(match (self.prefetch, batch) {
            (Some(prefetch), Some(batch)) if batch.size > usize::from(prefetch) => {
                return Err(RuntimeError::setting(
                    "prefetch",
                    format!(
                        "`{consumer}` batches {} deliveries but prefetch is {prefetch}: a batch could never fill; set .prefetch({}) or a smaller batch",
                        batch.size,
                        batch.size.saturating_mul(3).min(usize::from(u16::MAX)),
                    ),
                ));
            }
            (Some(prefetch), Some(batch)) => {
                if batch.size * 2 > usize::from(prefetch) {
                    tracing::warn!(
                        consumer,
                        batch = batch.size,
                        prefetch,
                        "batch size is above prefetch / 2: the next batch cannot gather while one commits"
                    );
                }
                prefetch
            }
            (Some(prefetch), None) => prefetch,
            (None, Some(batch)) => default_batch_prefetch(consumer, batch.size)?,
            (None, None) => DEFAULT_PREFETCH,
        })
    }

    /// Refuses a key policy for a consumer that is not ordered, and an ordered handler that
    /// parks keys on a store that keeps none.
    pub(super) fn check_key_policies(
        &self,
        handlers: &[&'static Registration],
    ) -> Result<(), RuntimeError> {
        for consumer in self.key_policies.keys() {
            if !self.ordered.contains_key(consumer) {
                return Err(RuntimeError::setting(
                    "key_policy",
                    format!(
                        "`{consumer}` is not ordered: a key policy says what an ordered handler does with a key whose message was dead-lettered; add .ordered(\"{consumer}\", partitions) or drop the policy"
                    ),
                ));
            }
        }
        for registration in handlers {
            let consumer = registration.consumer();
            let parks = self.ordered.contains_key(consumer)
                && self.key_policies.get(consumer).copied().unwrap_or_default() == KeyPolicy::Park;
            let store = registration.handler().parking(&self.stores);
            if parks && store.is_some_and(|store| !store.parks()) {
                return Err(RuntimeError::setting(
                    "key_policy",
                    format!(
                        "`{consumer}` is ordered, and parks a key behind its dead letter by default, but its {} store keeps no parked keys; use a store that does (the SQL stores) or .key_policy(\"{consumer}\", KeyPolicy::Retire)",
                        registration.handler().store()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Refuses an ordered handler that is not run.
    pub(super) fn check_ordered(
        &self,
        handlers: &[&'static Registration],
    ) -> Result<(), RuntimeError> {
        for consumer in self.ordered.keys() {
            if !handlers.iter().any(|r| r.consumer() == consumer) {
                return Err(RuntimeError::setting(
                    "ordered",
                    format!(
                        "no handler run by this runtime has consumer = \"{consumer}\"; name a registered consumer (or add it to .handlers(...))"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Batch mode's default prefetch: room for three batches (one committing, the next claimed and
/// in its handlers, a third gathering), so the broker keeps delivering while two batches are in
/// their transactions; at least [`DEFAULT_PREFETCH`], at most `u16::MAX`. A batch that does
/// not fit twice is refused: the next one could not gather while it commits.
fn default_batch_prefetch(consumer: &str, size: usize) -> Result<u16, RuntimeError> {
    if size.saturating_mul(2) > usize::from(u16::MAX) {
        return Err(RuntimeError::setting(
            "batch",
            format!(
                "`{consumer}` batches {size} deliveries; at most {} fit twice in a prefetch",
                u16::MAX / 2
            ),
        ));
    }
    let prefetch = size.saturating_mul(3).min(usize::from(u16::MAX));
    Ok(u16::try_from(prefetch)
        .unwrap_or(u16::MAX)
        .max(DEFAULT_PREFETCH))
}

#[cfg(test)]
mod tests {
    use crate::runtime::plan::default_batch_prefetch;

    #[test]
    fn batch_mode_prefetches_three_batches_within_the_bounds() {
        assert_eq!(default_batch_prefetch("c", 5).ok(), Some(32));
        assert_eq!(default_batch_prefetch("c", 200).ok(), Some(600));
        assert_eq!(default_batch_prefetch("c", 30_000).ok(), Some(u16::MAX));
        assert!(default_batch_prefetch("c", 32_768).is_err());
    }
}
