//! [`Runtime::run_until`]: the actors are started (a consumer feeding each handler's mailbox,
//! its workers draining it), the sweepers run, and on the shutdown signal everything stops in
//! order.

use super::actor::{Actor, Shared};
use super::error::RuntimeError;
use super::health::Health;
use super::pause::Pauses;
use super::retry::RetryPolicy;
use super::stats::Stats;
use super::sweeper::{self, SweepSettings};
use super::{batch_worker, lanes, worker};
use crate::outbox::relay::{self, RelaySettings};
use crate::pipeline::ErasedHandler;
use crate::store::Stores;
use crate::transport::{DeadLetterLog, Delivery, Demand, QueueSpec, StopSignal, Transport, Wants};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, Semaphore, mpsc, watch};
use tokio::task::JoinSet;

/// How long closing the transport may take at shutdown.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A configured runtime ([`Runtime::builder`] makes one); [`Runtime::run_until`] runs it.
pub struct Runtime {
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) stores: Arc<Stores>,
    pub(crate) actors: Vec<Actor>,
    pub(crate) retry: RetryPolicy,
    pub(crate) shutdown_grace: Duration,
    /// How long start-up waits for a store or broker that fails transiently.
    pub(crate) start_deadline: Duration,
    pub(crate) stats: Arc<Stats>,
    pub(crate) sweep: Option<SweepSettings>,
    pub(crate) relay: Option<RelaySettings>,
    pub(crate) health: Arc<Health>,
    /// Whether each store writes.
    pub(crate) pauses: Arc<Pauses>,
}

impl Runtime {
    /// The runtime's counters, readable while it runs.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// The runtime's health, readable while it runs: for `/healthz` and `/readyz`.
    pub fn health(&self) -> Arc<Health> {
        self.health.clone()
    }

    /// Checks every handler's store and declares the topology (waiting, up to the start
    /// deadline, for a database or broker that is not reachable yet), consumes until
    /// `shutdown` completes, then shuts down gracefully:
    /// consumers stop, deliveries not yet started are released, in-flight ones may finish
    /// within the grace period, and so may the dispatch of what they staged in the outbox;
    /// then the transport is closed (anything unsettled goes back to
    /// the broker, unacked).
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
        let specs: Vec<QueueSpec> = self.actors.iter().map(|a| a.spec.clone()).collect();
        self.start(&specs).await?;

        let (stop_tx, stop) = watch::channel(false);
        let mut tasks = Tasks::default();
        // An ordered handler's partitions share its concurrency.
        let mut permits: HashMap<&str, Arc<Semaphore>> = HashMap::new();
        for actor in &self.actors {
            self.start_actor(actor, &stop, &mut tasks, &mut permits);
        }
        let mut background = self.start_background(&stop);
        crate::telemetry::describe();
        self.health.set_consuming(true);

        shutdown.await;
        tracing::info!("shutting down: no new deliveries; finishing those in flight");
        let _ = stop_tx.send(true);
        // Once it reads false, the stop is raised.
        self.health.set_consuming(false);
        // A sweep in progress is dropped: each batch is its own statement, and a session that
        // holds the sweeper lock is closed rather than returned to the pool. A relay pass in
        // progress is dropped too: its transaction rolls back, and its rows stay for a later
        // pass (those it had published go out again, with the same ids).
        background.abort_all();
        self.drain(tasks).await;
        tracing::info!("runtime stopped");
        Ok(())
    }

    /// Starts `actor`: the transport's consumer of its queue, feeding its mailbox, and its
    /// workers, draining it.
    fn start_actor<'a>(
        &self,
        actor: &'a Actor,
        stop: &StopSignal,
        tasks: &mut Tasks,
        permits: &mut HashMap<&'a str, Arc<Semaphore>>,
    ) {
        let (mailbox_tx, mailbox) = mpsc::channel(usize::from(actor.prefetch));
        let handler = actor.registration.handler();
        let mut spec = actor.spec.clone();
        spec.dead_letters = dead_letter_log(handler, &self.stores);
        // Batch workers want deliveries only while a batch gathers.
        let (wants, demand) = Demand::gated();
        if actor.batch.is_some() {
            spec.demand = demand;
        }
        tasks.consumers.spawn(self.transport.consume(
            spec,
            actor.prefetch,
            mailbox_tx,
            stop.clone(),
        ));
        let shared = Arc::new(Shared {
            handler,
            stores: self.stores.clone(),
            queue: Arc::from(actor.spec.queue.as_str()),
            retry: self.retry.clone(),
            stats: self.stats.clone(),
            in_place: actor.ordered,
            permits: actor.ordered.then(|| {
                permits
                    .entry(handler.consumer())
                    .or_insert_with(|| Arc::new(Semaphore::new(actor.workers)))
                    .clone()
            }),
            pause: self.pauses.of(handler, &self.stores),
            parks: actor.parking.clone().map(|source| super::actor::Parks {
                source,
                outbound: self.stores.outbound().cloned(),
            }),
        });
        start_workers(
            actor,
            shared,
            mailbox,
            Arc::new(wants),
            stop,
            &mut tasks.workers,
        );
        tracing::info!(
            consumer = actor.spec.consumer,
            queue = actor.spec.queue,
            workers = actor.workers,
            prefetch = actor.prefetch,
            batch = actor.batch.map(|b| b.size),
            ordered = actor.ordered,
            "handler started"
        );
    }

    /// Starts the sweepers, the outbox relays and the gauges of parked keys.
    fn start_background(&self, stop: &StopSignal) -> JoinSet<()> {
        let mut background = JoinSet::new();
        if let Some(settings) = self.sweep {
            for sweeper in self.stores.sweepers() {
                background.spawn(sweeper::run(sweeper.clone(), settings, stop.clone()));
            }
        }
        let mut watched = std::collections::HashSet::new();
        for actor in self.actors.iter().filter(|a| a.parking.is_some()) {
            let handler = actor.registration.handler();
            if watched.insert(handler.consumer()) {
                background.spawn(super::parked::watch(
                    handler,
                    self.stores.clone(),
                    stop.clone(),
                ));
            }
        }
        if let (Some(settings), Some(outbound)) = (self.relay, self.stores.outbound()) {
            for store in self.stores.relays() {
                let pass = relay::run(store.clone(), outbound.clone(), settings, stop.clone());
                background.spawn(pass);
            }
        }
        background
    }

    /// After the stop: the consumers and workers finish within the grace period (else they
    /// are abandoned, uncommitted), what they staged is dispatched within it, and the
    /// transport is closed.
    async fn drain(&self, mut tasks: Tasks) {
        let grace_ends = tokio::time::Instant::now() + self.shutdown_grace;
        let drained = tokio::time::timeout_at(grace_ends, async {
            while tasks.consumers.join_next().await.is_some() {}
            while tasks.workers.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(grace = ?self.shutdown_grace, "in-flight deliveries did not finish in time; abandoning them uncommitted");
            tasks.consumers.abort_all();
            tasks.workers.abort_all();
            while tasks.workers.join_next().await.is_some() {}
        }
        // What the handlers staged goes out, and its rows are removed, before the publisher's
        // connection closes: a graceful stop leaves the relay nothing to publish again.
        let dispatched = tokio::time::timeout_at(grace_ends, async {
            for relay in self.stores.relays() {
                relay.queue.in_flight.idle().await;
            }
        })
        .await;
        if dispatched.is_err() {
            tracing::warn!(grace = ?self.shutdown_grace, "staged messages were still being dispatched; their rows stay for the relay");
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
    }
}

/// The consumers and the workers of a running runtime.
#[derive(Default)]
struct Tasks {
    consumers: JoinSet<()>,
    workers: JoinSet<()>,
}

/// Starts `actor`'s workers on its mailbox: per-message workers sharing it, an ordered
/// handler's workers each on a lane of its own (a dispatcher routes by key), or batch workers.
fn start_workers(
    actor: &Actor,
    shared: Arc<Shared>,
    mailbox: mpsc::Receiver<Delivery>,
    wants: Arc<Wants>,
    stop: &StopSignal,
    workers: &mut JoinSet<()>,
) {
    match actor.batch {
        None if actor.ordered => {
            let mut lanes = Vec::with_capacity(actor.workers);
            for _ in 0..actor.workers {
                let (lane_tx, lane) = mpsc::channel(usize::from(actor.prefetch));
                lanes.push(lane_tx);
                let lane = Arc::new(Mutex::new(lane));
                workers.spawn(worker::run(shared.clone(), lane, stop.clone()));
            }
            workers.spawn(lanes::dispatch(mailbox, lanes));
        }
        None => {
            let mailbox = Arc::new(Mutex::new(mailbox));
            for _ in 0..actor.workers {
                workers.spawn(worker::run(shared.clone(), mailbox.clone(), stop.clone()));
            }
        }
        Some(spec) => {
            let mailbox = Arc::new(Mutex::new(mailbox));
            for _ in 0..actor.workers {
                workers.spawn(batch_worker::run(
                    shared.clone(),
                    mailbox.clone(),
                    stop.clone(),
                    spec,
                    wants.clone(),
                ));
            }
        }
    }
}

/// The log through which the transport records the dead letters it refuses on its own: the
/// handler's store, each record with its consumer's retention.
fn dead_letter_log(handler: &'static dyn ErasedHandler, stores: &Arc<Stores>) -> DeadLetterLog {
    let stores = stores.clone();
    DeadLetterLog::new(move |record| {
        let stores = stores.clone();
        Box::pin(async move {
            let record = match (
                record.retention,
                crate::registry::retention_of(handler, &stores),
            ) {
                (None, Some(retention)) => {
                    let first = record.first_failed_at_ms;
                    record.with_history(first, retention)
                }
                _ => record,
            };
            handler.record_dead_letter(&stores, &record).await
        })
    })
}
