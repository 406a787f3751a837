//! A handler's batch workers: take a batch from the mailbox (up to `size` deliveries, or what
//! arrived within `linger` of the first; the transport reads the broker only while a batch
//! gathers), run it in one transaction and settle its deliveries after the commit. While one
//! batch executes, the broker delivers the next one into its client's buffer; while it
//! commits, the next one is gathered, begins and claims its keys (its handlers wait for the
//! commit). A worker keeps two database connections: each batch runs on the one the batch
//! before the previous one used, handed over once that batch has committed and dispatched
//! its staged messages.

use super::actor::{BatchSpec, Shared};
use super::settle;
use crate::model::{Envelope, Outcome};
use crate::pipeline::{HeldConnection, Stages};
use crate::telemetry;
use crate::transport::{Delivery, Settle, StopSignal, Wants};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout_at};
use tracing::Instrument;

/// Takes the next batch from the mailbox: what is there up to `size`, then whatever arrives
/// within `linger` of the first delivery. Empty when the mailbox is closed and empty.
async fn gather(mailbox: &mut mpsc::Receiver<Delivery>, spec: BatchSpec) -> Gathered {
    let ready = Instant::now();
    let mut batch = Vec::with_capacity(spec.size);
    if mailbox.recv_many(&mut batch, spec.size).await == 0 {
        return Gathered::default();
    }
    let first = Instant::now();
    let deadline = first + spec.linger;
    while batch.len() < spec.size {
        let wanted = spec.size - batch.len();
        match timeout_at(deadline, mailbox.recv_many(&mut batch, wanted)).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    Gathered {
        batch,
        waited: first - ready,
        filled_in: first.elapsed(),
    }
}

/// A batch taken from the mailbox, with how long its worker waited for its first delivery and
/// how long the batch then took to fill.
#[derive(Default)]
struct Gathered {
    batch: Vec<Delivery>,
    waited: Duration,
    filled_in: Duration,
}

/// Gathers and runs batches until the mailbox is closed and empty. While a batch executes, the
/// broker keeps delivering the next ones (the default prefetch is three batches); `wants` is
/// raised only while a batch gathers, so the transport hands those deliveries over in one go
/// when the next batch gathers, not one wake-up at a time. After `stop` is raised, batches
/// are released to the broker instead of processed.
pub(crate) async fn run(
    shared: Arc<Shared>,
    mailbox: Arc<Mutex<mpsc::Receiver<Delivery>>>,
    stop: StopSignal,
    spec: BatchSpec,
    wants: Arc<Wants>,
) {
    let mut in_flight = JoinSet::new();
    let mut previous: Option<oneshot::Receiver<()>> = None;
    let mut connections = Lanes::default();
    loop {
        // A store that cannot write pauses the gathering: what arrives waits in the mailbox.
        shared.pause.writable(&stop).await;
        let batch = {
            let mut mailbox = mailbox.lock().await;
            let gathering = wants.gathering();
            let gathered = gather(&mut mailbox, spec).await;
            drop(gathering);
            let consumer = shared.handler.consumer();
            telemetry::mailbox_depth(consumer, mailbox.len());
            let Gathered {
                batch,
                waited,
                filled_in,
            } = gathered;
            if !batch.is_empty() {
                telemetry::batch_gathered(consumer, batch.len(), waited, filled_in);
            }
            batch
        };
        if batch.is_empty() {
            break;
        }
        if *stop.borrow() {
            for delivery in batch {
                settle::release(delivery).await;
            }
            continue;
        }
        let (committing_tx, committing) = oneshot::channel();
        let (committed_tx, committed) = oneshot::channel();
        let stages = Stages {
            after: previous.take(),
            committing: Some(committing_tx),
            committed: Some(committed_tx),
        };
        let batch_stop = stop.clone();
        let connections = connections.next();
        in_flight.spawn(handle(
            shared.clone(),
            batch,
            stages,
            connections,
            batch_stop,
        ));
        previous = Some(committed);
        // Pipelining: the next batch is gathered, begun and claimed while this one commits.
        let _ = committing.await;
        while in_flight.try_join_next().is_some() {}
    }
    while in_flight.join_next().await.is_some() {}
}

/// The two database connections a worker's batches keep: the batches take turns on them,
/// so a batch runs on the connection of the batch before the previous one, handed over once
/// that batch has committed and dispatched its staged messages (by then its successor, on the
/// other connection, is committing; see `hold_connections`). A batch that ended without
/// handing its connection over (stopped, panicked) leaves its successor an empty one, which
/// takes a fresh connection.
#[derive(Default)]
struct Lanes {
    /// The connections the last two batches will hand over, the older first.
    handed: VecDeque<oneshot::Receiver<HeldConnection>>,
}

impl Lanes {
    /// Where the next batch gets its connection and where it hands it over.
    fn next(&mut self) -> Lane {
        let from = if self.handed.len() == 2 {
            self.handed.pop_front()
        } else {
            None
        };
        let (to, handed) = oneshot::channel();
        self.handed.push_back(handed);
        Lane { from, to: Some(to) }
    }
}

/// One batch's connection: handed over by the batch before the previous one (none for a
/// worker's first two batches), and handed on to the batch after the next one.
struct Lane {
    from: Option<oneshot::Receiver<HeldConnection>>,
    to: Option<oneshot::Sender<HeldConnection>>,
}

impl Lane {
    /// The connection to run on: the one handed over the first time, empty (a fresh one is
    /// taken) for a later pass of the same batch.
    async fn take(&mut self) -> HeldConnection {
        match self.from.take() {
            Some(handed) => handed.await.unwrap_or_default(),
            None => HeldConnection::default(),
        }
    }

    /// Hands `held` on, the first time; a later pass's connection goes back to the pool.
    fn give_back(&mut self, held: HeldConnection) {
        if let Some(to) = self.to.take() {
            let _ = to.send(held);
        }
    }
}

/// Processes one batch in one transaction on the connection of its lane `connections`, then
/// settles each delivery by its outcome. The deliveries that found the store unable to write
/// wait for it, unsettled, and run again as a batch of their own, as the same attempt (given
/// back if `stop` is raised first), keeping the batch's place: the next batch waits for that
/// run (`stages`), so two batches never run their handlers at once.
async fn handle(
    shared: Arc<Shared>,
    batch: Vec<Delivery>,
    mut stages: Stages,
    mut connections: Lane,
    stop: StopSignal,
) {
    let handler = shared.handler;
    let span = tracing::info_span!("batch", consumer = handler.consumer(), size = batch.len());
    async {
        let mut pending = batch;
        // How often the batch's waiting deliveries waited for their store and ran again.
        let mut waits = 0;
        while !pending.is_empty() {
            let (envelopes, settles): (Vec<Envelope>, Vec<Box<dyn Settle>>) = pending
                .into_iter()
                .map(|delivery| (delivery.envelope, delivery.settle))
                .unzip();
            let mut held = connections.take().await;
            let processed = handler
                .process_batch(&shared.stores, &envelopes, &mut stages, &mut held)
                .await;
            connections.give_back(held);
            let outcomes = match processed {
                Ok(outcomes) => outcomes,
                Err(failed) => vec![settle::undispatched(&shared, failed); envelopes.len()],
            };
            let again = outcomes
                .iter()
                .any(|outcome| matches!(outcome, Outcome::Unavailable(_)));
            if !again || waits >= settle::STORE_WAITS {
                // Nothing runs again: the next batch goes (a panic left its signals unfired).
                drop(std::mem::take(&mut stages));
            }
            let mut waiting = Vec::new();
            let mut failure = None;
            for ((mut outcome, envelope), settle) in
                outcomes.into_iter().zip(envelopes).zip(settles)
            {
                let span = telemetry::delivery_span(handler.consumer(), &envelope);
                if let Outcome::Unavailable(unavailable) = &outcome {
                    if waits < settle::STORE_WAITS {
                        telemetry::record_outcome(&span, &outcome);
                        failure = Some(unavailable.clone());
                        waiting.push(Delivery { envelope, settle });
                        continue;
                    }
                    outcome = settle::unavailable_again(unavailable);
                }
                telemetry::record_outcome(&span, &outcome);
                settle::settle(&shared, &outcome, &envelope, settle, &stop)
                    .instrument(span)
                    .await;
            }
            pending = waiting;
            let Some(failure) = failure else { break };
            waits += 1;
            if !settle::wait_for_store(&shared, &failure, pending.len(), &stop).await {
                for delivery in pending {
                    settle::release(delivery).await;
                }
                return;
            }
        }
    }
    .instrument(span)
    .await;
}
