//! The actor runtime: one actor per handler, fed by the transport's consumer through a bounded
//! mailbox, with N workers that process deliveries and settle them after the commit.

mod batch;
mod builder;
mod decide;
mod stats;
mod sweeper;
mod worker;

pub use builder::RuntimeBuilder;
pub use stats::{Snapshot, Stats};

use crate::registry::{Registration, RegistryError};
use crate::retry::RetryPolicy;
use crate::store::{StoreKind, Stores};
use crate::transport::{QueueSpec, Transport, TransportError};
use batch::BatchSpec;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, mpsc, watch};
use tokio::task::JoinSet;

/// How long closing the transport may take at shutdown.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A wrong runtime configuration or a failed start.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// No transport was configured.
    #[error(
        "no transport: call .transport(...) on the runtime builder, with idem::rabbitmq::RabbitTransport::new(RabbitConfig::new(url)) or idem::MemoryTransport::new()"
    )]
    NoTransport,
    /// No handler is registered or selected.
    #[error("no handlers: annotate an async fn with #[idempotent(queue = \"...\", ...)]")]
    NoHandlers,
    /// A handler has no queue to consume.
    #[error("handler `{consumer}` has no queue: add queue = \"...\" to its #[idempotent]")]
    NoQueue {
        /// The handler's consumer identity.
        consumer: &'static str,
    },
    /// A handler's store is missing.
    #[error(
        "handler `{consumer}` writes to {store}, but the runtime has no {store} store: add one with .store({hint}::new(pool))"
    )]
    MissingStore {
        /// The handler's consumer identity.
        consumer: &'static str,
        /// The store it needs.
        store: StoreKind,
        /// The store type to add.
        hint: &'static str,
    },
    /// A chosen handler is not registered.
    #[error("no registered handler has consumer = \"{0}\"")]
    UnknownHandler(String),
    /// Two handlers share a consumer.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// A handler's inbox is not usable (for example, its table was never migrated).
    #[error(
        "the inbox of handler `{consumer}` is not usable: {error}; run the store's migrate() (or idem::sql::migrate(&pool)) before starting"
    )]
    Store {
        /// The handler's consumer identity.
        consumer: &'static str,
        /// What the store said.
        #[source]
        error: crate::error::StoreError,
    },
    /// A numeric setting is out of range.
    #[error("invalid setting: {0}")]
    Setting(String),
    /// The transport refused the topology or could not connect.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

struct Actor {
    registration: &'static Registration,
    spec: QueueSpec,
    /// Deliveries (batch mode: batches) processed at once.
    workers: usize,
    prefetch: u16,
    batch: Option<BatchSpec>,
}

/// A configured runtime; [`Runtime::run_until`] runs it.
pub struct Runtime {
    transport: Arc<dyn Transport>,
    stores: Arc<Stores>,
    actors: Vec<Actor>,
    retry: RetryPolicy,
    shutdown_grace: Duration,
    stats: Arc<Stats>,
    sweep: Option<sweeper::SweepSettings>,
}

impl Runtime {
    /// A builder with the defaults: every registered handler, concurrency 8, prefetch 32,
    /// [`RetryPolicy::default`], 30 s shutdown grace.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// The runtime's counters, readable while it runs.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Declares the topology, consumes until `shutdown` completes, then shuts down gracefully:
    /// consumers stop, deliveries not yet started are released, in-flight ones may finish
    /// within the grace period, and the transport is closed (anything unsettled goes back to
    /// the broker, unacked).
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
        for actor in &self.actors {
            let consumer = actor.registration.consumer();
            actor
                .registration
                .check_store(&self.stores)
                .await
                .map_err(|error| RuntimeError::Store { consumer, error })?;
        }
        let specs: Vec<QueueSpec> = self.actors.iter().map(|a| a.spec.clone()).collect();
        self.transport.declare(&specs).await?;

        let (stop_tx, stop) = watch::channel(false);
        let mut consumers = JoinSet::new();
        let mut workers = JoinSet::new();
        for actor in &self.actors {
            let (mailbox_tx, mailbox) = mpsc::channel(usize::from(actor.prefetch));
            consumers.spawn(self.transport.consume(
                actor.spec.clone(),
                actor.prefetch,
                mailbox_tx,
                stop.clone(),
            ));
            let shared = Arc::new(worker::Shared {
                registration: actor.registration,
                stores: self.stores.clone(),
                retry: self.retry.clone(),
                stats: self.stats.clone(),
            });
            match actor.batch {
                None => {
                    let mailbox = Arc::new(Mutex::new(mailbox));
                    for _ in 0..actor.workers {
                        workers.spawn(worker::run(shared.clone(), mailbox.clone(), stop.clone()));
                    }
                }
                Some(spec) => {
                    let mailbox = Arc::new(Mutex::new(mailbox));
                    for _ in 0..actor.workers {
                        workers.spawn(batch::execute(
                            shared.clone(),
                            mailbox.clone(),
                            stop.clone(),
                            spec,
                        ));
                    }
                }
            }
            tracing::info!(
                consumer = actor.spec.consumer,
                queue = actor.spec.queue,
                workers = actor.workers,
                prefetch = actor.prefetch,
                batch = actor.batch.map(|b| b.size),
                "handler started"
            );
        }

        let mut sweepers = JoinSet::new();
        if let Some(settings) = self.sweep {
            for sweeper in self.stores.sweepers() {
                sweepers.spawn(sweeper::run(sweeper.clone(), settings, stop.clone()));
            }
        }
        crate::telemetry::describe();

        shutdown.await;
        tracing::info!("shutting down: no new deliveries; finishing those in flight");
        let _ = stop_tx.send(true);
        // A sweep in progress is dropped: each batch is its own statement, and the lock's
        // session goes back to the pool.
        sweepers.abort_all();
        let drained = tokio::time::timeout(self.shutdown_grace, async {
            while consumers.join_next().await.is_some() {}
            while workers.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(grace = ?self.shutdown_grace, "in-flight deliveries did not finish in time; abandoning them uncommitted");
            consumers.abort_all();
            workers.abort_all();
            while workers.join_next().await.is_some() {}
        }
        // Closing returns whatever is still unsettled to the broker; a broker that does not
        // answer must not keep the process from exiting (the broker requeues on disconnect).
        if tokio::time::timeout(CLOSE_TIMEOUT, self.transport.close())
            .await
            .is_err()
        {
            tracing::warn!(
                "the transport did not close in time; leaving it to the broker to notice"
            );
        }
        tracing::info!("runtime stopped");
        Ok(())
    }
}
