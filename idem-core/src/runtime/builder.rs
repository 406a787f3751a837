//! [`RuntimeBuilder`]: the configuration of a [`Runtime`], checked when it is built.

use super::actor::{Actor, BatchSpec};
use super::error::RuntimeError;
use super::health::Health;
use super::retry::RetryPolicy;
use super::run::Runtime;
use super::stats::Stats;
use super::sweeper::SweepSettings;
use crate::handler::Mode;
use crate::registry::{self, Registration};
use crate::store::{InboxStore, Stores};
use crate::transport::{QueueSpec, Transport};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Deliveries processed at once per handler, one transaction each, unless configured.
const DEFAULT_CONCURRENCY: usize = 8;
/// Batches executing at once per handler in batch mode, unless configured.
const DEFAULT_BATCHES_IN_FLIGHT: usize = 1;
/// Unsettled deliveries per handler, one transaction each, unless configured.
const DEFAULT_PREFETCH: u16 = 32;
/// How long a batch waits for more deliveries after its first, unless configured.
const DEFAULT_LINGER: Duration = Duration::from_millis(5);
/// Deliveries without a settlement before a message is refused as poison, unless configured.
pub const DEFAULT_POISON_LIMIT: u32 = 5;

impl Runtime {
    /// A builder with the defaults: every registered handler, concurrency 8, prefetch 32,
    /// [`RetryPolicy::default`], 30 s shutdown grace.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }
}

/// Builds a [`Runtime`].
pub struct RuntimeBuilder {
    transport: Option<Arc<dyn Transport>>,
    stores: Stores,
    handlers: Option<Vec<String>>,
    concurrency: Option<usize>,
    per_handler: HashMap<String, usize>,
    queues: HashMap<String, String>,
    prefetch: Option<u16>,
    batch: usize,
    per_handler_batch: HashMap<String, usize>,
    linger: Duration,
    retry: RetryPolicy,
    shutdown_grace: Duration,
    sweep: Option<SweepSettings>,
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
            sweep: Some(SweepSettings::default()),
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
    pub fn store<S: InboxStore>(mut self, store: S) -> Self {
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

    /// Unsettled deliveries per handler the broker may send ahead (default 32; in batch mode
    /// twice the batch size). This bounds what is held in memory: the mailbox holds at most
    /// this many.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = Some(prefetch);
        self
    }

    /// Batch mode for every handler: up to `size` deliveries per transaction (0, the default:
    /// one transaction per delivery). Keys are claimed with one statement, each new message
    /// runs under its own savepoint (a failure rolls back and dead-letters that message only),
    /// and the deliveries are acked after the one commit. Prefetch defaults to `2 × size`, so
    /// the next batch gathers while one commits; a batch larger than the prefetch is refused.
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

    /// A message delivered `limit` times without a settlement (its consumers died on it, or
    /// lost their connection) is dead-lettered with reason `poison` at its next delivery
    /// (default [`DEFAULT_POISON_LIMIT`], 5), on every queue type. Each redelivery is counted in
    /// the handler's store, in a short transaction of its own (a first delivery pays nothing).
    /// A delivery given back at shutdown counts too.
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
        self.sweep = Some(SweepSettings {
            interval,
            batch,
            ..SweepSettings::default()
        });
        self
    }

    /// Runs no sweeper in this process (another process, or a scheduled job calling the
    /// store's `sweep`, keeps the inbox from growing).
    pub fn without_sweeper(mut self) -> Self {
        self.sweep = None;
        self
    }

    /// How transient failures are retried.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How long shutdown waits for in-flight deliveries (default 30 s); what has not finished
    /// by then is abandoned, uncommitted, and goes back to the broker.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// The handlers to run: the chosen consumers (or every registered one). A consumer written
    /// for several stores (one function per database) runs on the store the runtime has.
    fn select_handlers(&self) -> Result<Vec<&'static Registration>, RuntimeError> {
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
            let candidates: Vec<_> = all
                .iter()
                .copied()
                .filter(|r| r.consumer() == consumer)
                .collect();
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

    /// Checks the configuration.
    pub fn build(self) -> Result<Runtime, RuntimeError> {
        let handlers = self.select_handlers()?;
        registry::validate(&handlers)?;
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
            let actor = self.actor(registration)?;
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
        let stores = Arc::new(self.stores);
        let handlers = actors
            .iter()
            .map(|a| (a.registration, a.spec.queue.clone()))
            .collect();
        let health = Arc::new(Health::new(transport.clone(), stores.clone(), handlers));
        Ok(Runtime {
            transport,
            stores,
            health,
            actors,
            retry: self.retry,
            shutdown_grace: self.shutdown_grace,
            stats: Arc::new(Stats::default()),
            sweep: self.sweep,
        })
    }

    /// Refuses windows that would let a copy run twice: a queue TTL longer than the handler's
    /// retention (a late copy would find no marker), and an external handler's lease at least
    /// as long as the retry window (a copy waiting for the lease would run out of attempts).
    fn check_windows(&self, actor: &Actor, transport: &dyn Transport) -> Result<(), RuntimeError> {
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
        Ok(())
    }

    /// One handler's queue, workers, prefetch and batching.
    fn actor(&self, registration: &'static Registration) -> Result<Actor, RuntimeError> {
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
        let size = self
            .per_handler_batch
            .get(consumer)
            .copied()
            .unwrap_or(self.batch);
        let batch = (size > 0).then_some(BatchSpec {
            size,
            linger: self.linger,
        });
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
        let prefetch = match (self.prefetch, batch) {
            (Some(prefetch), Some(batch)) if batch.size > usize::from(prefetch) => {
                return Err(RuntimeError::setting(
"prefetch", format!(
                    "`{consumer}` batches {} deliveries but prefetch is {prefetch}: a batch could never fill; set .prefetch({}) or a smaller batch",
                    batch.size,
                    batch.size.saturating_mul(2).min(usize::from(u16::MAX)),
                )));
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
            (None, Some(batch)) => u16::try_from(batch.size.saturating_mul(2))
                .map_err(|_| {
                    RuntimeError::setting(
"batch", format!(
                        "`{consumer}` batches {} deliveries; at most {} fit twice in a prefetch",
                        batch.size,
                        u16::MAX / 2
                    ))
                })?
                .max(DEFAULT_PREFETCH),
            (None, None) => DEFAULT_PREFETCH,
        };
        Ok(Actor {
            registration,
            spec: QueueSpec {
                queue: queue.to_owned(),
                consumer: consumer.to_owned(),
                retry_delays: self.retry.delays(),
                dead_letters: Default::default(),
            },
            workers,
            prefetch,
            batch,
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
