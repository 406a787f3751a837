//! Batch mode: executors take batches from the mailbox (up to `size` deliveries, or what
//! arrived within `linger` of the first), run each in one transaction and settle its
//! deliveries after the commit. While one batch executes, the next one fills the mailbox; while
//! it commits, the next one begins and claims its keys (its handlers wait for the commit).

use super::worker::{Shared, delivery_span, panicked, record_outcome, settle_outcome};
use crate::batch::Stages;
use crate::envelope::Envelope;
use crate::outcome::{Outcome, Transient};
use crate::transport::{Delivery, Settle, StopSignal};
use futures_util::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout_at};
use tracing::Instrument;

/// How a handler's deliveries are grouped into transactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchSpec {
    /// At most this many deliveries per transaction.
    pub(crate) size: usize,
    /// How long a batch waits for more deliveries after its first.
    pub(crate) linger: Duration,
}

/// Takes the next batch from the mailbox: what is there up to `size`, then whatever arrives
/// within `linger` of the first delivery. Empty when the mailbox is closed and empty.
async fn gather(mailbox: &mut mpsc::Receiver<Delivery>, spec: BatchSpec) -> Vec<Delivery> {
    let mut batch = Vec::with_capacity(spec.size);
    if mailbox.recv_many(&mut batch, spec.size).await == 0 {
        return batch;
    }
    let deadline = Instant::now() + spec.linger;
    while batch.len() < spec.size {
        let wanted = spec.size - batch.len();
        match timeout_at(deadline, mailbox.recv_many(&mut batch, wanted)).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    batch
}

/// Gathers and runs batches until the mailbox is closed and empty. While a batch executes, the
/// broker keeps delivering the next one into the mailbox (prefetch is at least twice the batch
/// size), so it is ready the moment this one is settled. After `stop` is raised, batches are
/// released to the broker instead of processed.
pub(crate) async fn execute(
    shared: Arc<Shared>,
    mailbox: Arc<Mutex<mpsc::Receiver<Delivery>>>,
    stop: StopSignal,
    spec: BatchSpec,
) {
    let mut in_flight = JoinSet::new();
    let mut previous: Option<oneshot::Receiver<()>> = None;
    loop {
        let batch = gather(&mut *mailbox.lock().await, spec).await;
        if batch.is_empty() {
            break;
        }
        if *stop.borrow() {
            for delivery in batch {
                if let Err(e) = delivery.settle.release().await {
                    tracing::debug!(error = %e, "release failed; the broker redelivers on close");
                }
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
        in_flight.spawn(handle(shared.clone(), batch, stages));
        previous = Some(committed);
        // Pipelining: the next batch is gathered, begun and claimed while this one commits.
        let _ = committing.await;
        while in_flight.try_join_next().is_some() {}
    }
    while in_flight.join_next().await.is_some() {}
}

/// Processes one batch in one transaction, then settles each delivery by its outcome.
async fn handle(shared: Arc<Shared>, batch: Vec<Delivery>, stages: Stages) {
    let (envelopes, settles): (Vec<Envelope>, Vec<Box<dyn Settle>>) = batch
        .into_iter()
        .map(|delivery| (delivery.envelope, delivery.settle))
        .unzip();
    let span = tracing::info_span!(
        "batch",
        consumer = shared.registration.consumer(),
        size = envelopes.len()
    );
    async {
        let invoked = AssertUnwindSafe(shared.registration.invoke_batch_staged(
            &shared.stores,
            &envelopes,
            stages,
        ))
        .catch_unwind()
        .await;
        let outcomes = match invoked {
            Ok(Ok(outcomes)) => outcomes,
            Ok(Err(dispatch)) => {
                let failed = Outcome::Retry(Transient {
                    message: dispatch.to_string(),
                    key: None,
                });
                vec![failed; envelopes.len()]
            }
            Err(panic) => vec![panicked(&shared, panic); envelopes.len()],
        };
        for ((outcome, envelope), settle) in outcomes.iter().zip(&envelopes).zip(settles) {
            let span = delivery_span(shared.registration.consumer(), envelope);
            record_outcome(&span, outcome);
            settle_outcome(&shared, outcome, envelope, settle)
                .instrument(span)
                .await;
        }
    }
    .instrument(span)
    .await;
}
