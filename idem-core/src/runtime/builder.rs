//! [`RuntimeBuilder`]: the configuration of a [`Runtime`], checked when it is built.

use super::error::RuntimeError;
use super::health::Health;
use super::pause::Pauses;
use super::retry::RetryPolicy;
use super::run::Runtime;
use super::stats::Stats;
use super::sweeper::{DEFAULT_SWEEP_PAUSE, SweepSettings};
use crate::model::KeyPolicy;
use crate::outbox::relay::RelaySettings;
use crate::registry;
use crate::store::{RuntimeStore, Stores};
use crate::transport::Transport;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Deliveries processed at once per handler, one transaction each, unless configured.
pub(super) const DEFAULT_CONCURRENCY: usize = 8;
/// Batches executing at once per handler in batch mode, unless configured.
pub(super) const DEFAULT_BATCHES_IN_FLIGHT: usize = 1;
/// Unsettled deliveries per handler, one transaction each, unless configured.
pub(super) const DEFAULT_PREFETCH: u16 = 32;
/// How long a batch waits for more deliveries after its first, unless configured.
pub(super) const DEFAULT_LINGER: Duration = Duration::from_millis(5);
/// Runs of a handler on redeliveries that never settled before a message is refused as poison,
/// unless configured.
pub const DEFAULT_POISON_LIMIT: u32 = 5;

impl Runtime {
    /// A builder with the defaults: every registered handler, concurrency 8, prefetch 32,
    /// [`RetryPolicy::default`], 30 s shutdown grace, 30 s start deadline.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }
}

/// Builds a [`Runtime`].
pub struct RuntimeBuilder {
    pub(super) transport: Option<Arc<dyn Transport>>,
    pub(super) stores: Stores,
    pub(super) handlers: Option<Vec<String>>,
    pub(super) concurrency: Option<usize>,
    pub(super) per_handler: HashMap<String, usize>,
    pub(super) queues: HashMap<String, String>,
    pub(super) prefetch: Option<u16>,
    pub(super) batch: usize,
    pub(super) per_handler_batch: HashMap<String, usize>,
    pub(super) linger: Duration,
    pub(super) retry: RetryPolicy,
    pub(super) shutdown_grace: Duration,
    pub(super) start_deadline: Duration,
    pub(super) sweep: Option<SweepSettings>,
    pub(super) relay: Option<RelaySettings>,
    pub(super) ordered: HashMap<String, usize>,
    pub(super) key_policies: HashMap<String, KeyPolicy>,
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        Self {
            transport: None,
            stores: Stores::new().with_poison_limit(Some(DEFAULT_POISON_LIMIT)),
            handlers: None,
            concurrency: None,
            per_handler: HashMap::new(),
            queues: HashMap::new(),
            prefetch: None,
            batch: 0,
            per_handler_batch: HashMap::new(),
            linger: DEFAULT_LINGER,
            retry: RetryPolicy::default(),
            shutdown_grace: Duration::from_secs(30),
            start_deadline: super::startup::DEFAULT_START_DEADLINE,
            sweep: Some(SweepSettings::default()),
            relay: Some(RelaySettings::default()),
            ordered: HashMap::new(),
            key_policies: HashMap::new(),
        }
    }
}

impl RuntimeBuilder {
    /// The transport deliveries come from.
    pub fn transport(mut self, transport: impl Transport) -> Self {
        self.transport = Some(Arc::new(transport));
        self
    }

    /// Adds an inbox store.
    pub fn store<S: RuntimeStore>(mut self, store: S) -> Self {
        self.stores.insert(store);
        self
    }

    /// Gives handlers a shared value of type `T` (a client, a configuration, a cache): a handler
    /// asks for it with a parameter `name: &T` after its payload, in either mode. One value per
    /// type (a second call with the same type replaces the first); call it once per type. A
    /// handler asking for a type no call gave is refused by [`Self::build`].
    pub fn state<T: Send + Sync + 'static>(mut self, value: T) -> Self {
        self.stores.state_mut().insert(value);
        self
    }

    /// Runs only the handlers with these consumer identities (default: every registered one).
    /// A name that is no consumer identity picks the handler functions of that name: the way
    /// to choose between two handlers of one consumer (a batch handler and a single one share
    /// the consumer's key space, so switching between them never runs a message twice).
    pub fn handlers<I: IntoIterator<Item = S>, S: Into<String>>(mut self, consumers: I) -> Self {
        self.handlers = Some(consumers.into_iter().map(Into::into).collect());
        self
    }

    /// Deliveries processed at once per handler (default 8); in batch mode, batches executing
    /// at once (default 1).
    pub fn concurrency(mut self, workers: usize) -> Self {
        self.concurrency = Some(workers);
        self
    }

    /// Deliveries (in batch mode: batches) processed at once for the handler with consumer
    /// identity `consumer`.
    pub fn handler_concurrency(mut self, consumer: impl Into<String>, workers: usize) -> Self {
        self.per_handler.insert(consumer.into(), workers);
        self
    }

    /// Consumes `queue` for the handler with consumer identity `consumer`, instead of the
    /// queue its `#[idempotent(queue = ...)]` names (for example from configuration).
    pub fn handler_queue(mut self, consumer: impl Into<String>, queue: impl Into<String>) -> Self {
        self.queues.insert(consumer.into(), queue.into());
        self
    }

    /// Consumes the handler with consumer identity `consumer` in order per partition key, over
    /// `partitions` partition queues (1 to [`MAX_PARTITIONS`](crate::runtime::MAX_PARTITIONS)). Its queue name (from
    /// `#[idempotent(queue = ...)]` or [`Self::handler_queue`]) becomes an exchange that routes
    /// each message by its routing key, the partition key, to one of the queues
    /// `<queue>.p0` … (on RabbitMQ, a consistent-hash exchange). One process at a time
    /// consumes each partition (single active consumer), so that a key's messages are handled
    /// one at a time and in publish order across processes and restarts. Inside the process,
    /// each partition is split into lanes by key, one per worker, and the handler's concurrency
    /// bounds the deliveries in progress across all its partitions: different keys run at
    /// once, never two messages of one key. A transient failure is retried in place, after the
    /// retry policy's delay, holding back the messages of its key behind it; a message out of
    /// attempts, or rejected, is dead-lettered and its key is parked: its later messages are
    /// stored behind it, in order, until an operator releases the key (`idem dlq replay
    /// --key`, `idem dlq skip --key`; see [`Self::key_policy`]). Not with batch mode.
    pub fn ordered(mut self, consumer: impl Into<String>, partitions: usize) -> Self {
        self.ordered.insert(consumer.into(), partitions);
        self
    }

    /// What the ordered handler with consumer identity `consumer` does with a key whose
    /// message was dead-lettered: [`KeyPolicy::Park`] (the default) stores the key's later
    /// messages behind it until an operator releases the key, which needs a store that parks
    /// keys (the SQL stores do); [`KeyPolicy::Retire`] lets the key move on without it. A
    /// consumer that is not ordered is refused by [`Self::build`].
    pub fn key_policy(mut self, consumer: impl Into<String>, policy: KeyPolicy) -> Self {
        self.key_policies.insert(consumer.into(), policy);
        self
    }

    /// Unsettled deliveries per handler the broker may send ahead (default 32; in batch mode
    /// three times the batch size). This bounds what is held in memory: the mailbox holds at most
    /// this many.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = Some(prefetch);
        self
    }

    /// Batch mode for every handler: up to `size` deliveries per transaction (0, the default:
    /// one transaction per delivery). Keys are claimed with one statement, each new message
    /// runs under its own savepoint (a failure rolls back and dead-letters that message only),
    /// and the deliveries are acked after the one commit. Prefetch defaults to `3 × size`, so
    /// the broker keeps delivering while one batch commits and the next one claims; a batch
    /// larger than the prefetch is refused.
    pub fn batch(mut self, size: usize) -> Self {
        self.batch = size;
        self
    }

    /// Batch mode for the handler with consumer identity `consumer` (see [`Self::batch`]).
    pub fn handler_batch(mut self, consumer: impl Into<String>, size: usize) -> Self {
        self.per_handler_batch.insert(consumer.into(), size);
        self
    }

    /// How long a batch waits for more deliveries after its first (default 5 ms): the most a
    /// message waits for company when traffic is light.
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// Keeps inbox rows for `retention` for every handler that sets none of its own with
    /// `#[idempotent(retention = "...")]` (default: each store's retention, 7 days unless
    /// configured). It must outlast every way a copy can arrive late: the queue's message TTL,
    /// the retry delays, operators replaying dead letters.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.stores = std::mem::take(&mut self.stores).with_retention(retention);
        self
    }

    /// A message whose handler started `limit` times on redeliveries and never settled (its
    /// process died, or lost its connection, while the handler ran) is dead-lettered with reason
    /// `poison` at its next delivery (default [`DEFAULT_POISON_LIMIT`], 5), on every queue type.
    /// Each such run is counted in the handler's store before it starts, in a short transaction
    /// of its own, and the count is removed when the delivery settles; a first delivery pays
    /// nothing and is not counted. Deliveries never handed to a handler (waiting in a killed
    /// process, given back at shutdown) never count, and a copy of a completed key is always a
    /// duplicate.
    pub fn poison_limit(mut self, limit: u32) -> Self {
        self.stores = std::mem::take(&mut self.stores).with_poison_limit(Some(limit));
        self
    }

    /// Dead-letters stale versioned messages with reason `stale` instead of acking them (the
    /// default acks them and counts them as `stale`): for producers that must never send a
    /// stale update, so that one is looked at.
    pub fn dead_letter_stale(mut self) -> Self {
        self.stores = std::mem::take(&mut self.stores).with_dead_letter_stale(true);
        self
    }

    /// No poison limit: a message that kills its consumers is delivered again and again.
    pub fn without_poison_limit(mut self) -> Self {
        self.stores = std::mem::take(&mut self.stores).with_poison_limit(None);
        self
    }

    /// Sweeps expired inbox rows every `interval` (default 60 s), deleting at most `batch` rows
    /// per statement (default 1000) so that no lock is held long. One sweeper works at a time
    /// per inbox across all processes; the others skip their turn.
    pub fn sweep(mut self, interval: Duration, batch: u32) -> Self {
        let pause = self.sweep.map_or(DEFAULT_SWEEP_PAUSE, |sweep| sweep.pause);
        self.sweep = Some(SweepSettings {
            interval,
            batch,
            pause,
            ..SweepSettings::default()
        });
        self
    }

    /// After each delete statement the sweeper pauses `pause` times as long as the statement
    /// took (default [`DEFAULT_SWEEP_PAUSE`](crate::runtime::DEFAULT_SWEEP_PAUSE), 9: it deletes at
    /// most a tenth of the time, so that a backlog of expired rows leaves the database to the
    /// consumers); 0 deletes as fast as the database can. Without a sweeper it does nothing.
    pub fn sweep_pause(mut self, pause: u32) -> Self {
        if let Some(sweep) = self.sweep.as_mut() {
            sweep.pause = pause;
        }
        self
    }

    /// Runs no sweeper in this process (another process, or a scheduled job calling the
    /// store's `sweep`, keeps the inbox from growing).
    pub fn without_sweeper(mut self) -> Self {
        self.sweep = None;
        self
    }

    /// Relays outbox rows that no dispatch took (their process crashed before or while it
    /// published them, or the broker was away): every `interval` (default 500 ms) the relay
    /// takes rows staged more than `age` ago (default 2 s; the process that staged a row
    /// publishes it right after its commit), oldest first. Relays of several processes skip
    /// each other's rows.
    pub fn relay(mut self, interval: Duration, age: Duration) -> Self {
        self.relay = Some(RelaySettings {
            interval,
            age,
            ..RelaySettings::default()
        });
        self
    }

    /// Runs no outbox relay in this process (another process runs one). Messages staged here
    /// are still published right after their commit.
    pub fn without_relay(mut self) -> Self {
        self.relay = None;
        self
    }

    /// How transient failures are retried.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How long shutdown waits for in-flight deliveries and the dispatch of the messages they
    /// staged (default 30 s); a delivery not finished by then is abandoned, uncommitted, and
    /// goes back to the broker, and staged messages not yet published stay for the relay.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// How long start-up waits for a database or broker that is not reachable yet (it is
    /// restarting, or starting beside this process), trying again with backoff (default
    /// [`DEFAULT_START_DEADLINE`](crate::runtime::DEFAULT_START_DEADLINE), 30 s). A failure that waiting
    /// will not mend (an inbox table never migrated, topology the broker refuses) ends the
    /// start at once.
    pub fn start_deadline(mut self, deadline: Duration) -> Self {
        self.start_deadline = deadline;
        self
    }

    /// Checks the configuration.
    pub fn build(self) -> Result<Runtime, RuntimeError> {
        let handlers = self.select_handlers()?;
        registry::validate(&handlers)?;
        self.check_ordered(&handlers)?;
        self.check_key_policies(&handlers)?;
        for registration in &handlers {
            if let Some(missing) = registration.missing_state(&self.stores) {
                return Err(RuntimeError::MissingState {
                    handler: registration.name(),
                    consumer: registration.consumer(),
                    state: missing.name(),
                    given: given_state(&self.stores),
                });
            }
        }
        let transport = self.transport.clone().ok_or(RuntimeError::NoTransport)?;
        if let Some(sweep) = self.sweep
            && (sweep.batch == 0 || sweep.interval.is_zero())
        {
            return Err(RuntimeError::setting(
                "sweeper",
                "the sweeper needs a batch of at least 1 row and a non-zero interval; use without_sweeper() to run none",
            ));
        }
        if let Some(relay) = self.relay
            && relay.interval.is_zero()
        {
            return Err(RuntimeError::setting(
                "relay",
                "the outbox relay needs a non-zero interval; use without_relay() to run none",
            ));
        }
        if self.prefetch == Some(0) {
            return Err(RuntimeError::setting(
                "prefetch",
                "prefetch must be at least 1",
            ));
        }
        if self
            .stores
            .retention()
            .is_some_and(|r| r < Duration::from_secs(1))
        {
            return Err(RuntimeError::setting(
                "retention",
                "retention must be at least one second",
            ));
        }
        let mut actors = Vec::with_capacity(handlers.len());
        let mut queues = HashMap::new();
        for registration in handlers {
            for actor in self.actors(registration)? {
                self.check_windows(&actor, transport.as_ref())?;
                if let Some(first) = queues.insert(actor.spec.queue.clone(), registration.name()) {
                    return Err(RuntimeError::SharedQueue {
                        queue: actor.spec.queue,
                        first,
                        second: registration.name(),
                    });
                }
                actors.push(actor);
            }
        }
        let mut stores = self.stores;
        if let Some(outbound) = transport.outbound() {
            stores = stores.with_outbound(outbound);
        }
        let stores = Arc::new(stores);
        let handlers = actors
            .iter()
            .map(|a| (a.registration, a.spec.queue.clone()))
            .collect();
        let stats = Arc::new(Stats::default());
        let pauses = Arc::new(Pauses::new(stats.clone()));
        let health = Arc::new(Health::new(
            transport.clone(),
            stores.clone(),
            handlers,
            pauses.clone(),
        ));
        Ok(Runtime {
            pauses,
            transport,
            stores,
            health,
            actors,
            retry: self.retry,
            shutdown_grace: self.shutdown_grace,
            start_deadline: self.start_deadline,
            stats,
            sweep: self.sweep,
            relay: self.relay,
        })
    }
}

/// The state types `stores` holds, for a message.
pub(crate) fn given_state(stores: &Stores) -> String {
    let names: Vec<_> = stores.state().type_names().collect();
    match names.is_empty() {
        true => "none".to_owned(),
        false => names.join(", "),
    }
}

#[cfg(test)]
mod tests {
    use crate::runtime::builder::RuntimeBuilder;
    use crate::runtime::sweeper::{DEFAULT_SWEEP_PAUSE, SweepSettings};
    use std::time::Duration;

    #[test]
    fn the_runtime_sweeps_paced_by_default_and_keeps_the_pause_it_is_given() {
        assert_eq!(SweepSettings::default().pause, DEFAULT_SWEEP_PAUSE);
        assert_eq!(DEFAULT_SWEEP_PAUSE, 9);
        let builder = RuntimeBuilder::default().sweep(Duration::from_secs(5), 100);
        assert_eq!(builder.sweep.map(|s| s.pause), Some(DEFAULT_SWEEP_PAUSE));
        let builder = RuntimeBuilder::default()
            .sweep_pause(0)
            .sweep(Duration::from_secs(5), 100);
        assert_eq!(
            builder.sweep,
            Some(SweepSettings {
                interval: Duration::from_secs(5),
                batch: 100,
                pause: 0,
                ..SweepSettings::default()
            })
        );
        assert_eq!(
            RuntimeBuilder::default()
                .without_sweeper()
                .sweep_pause(2)
                .sweep,
            None
        );
    }
}
