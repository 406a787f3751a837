//! Batch mode: a gatherer forms batches from the mailbox (up to `size` deliveries, or what
//! arrived within `linger` of the first), executors run each in one transaction and settle its
//! deliveries after the commit. While one batch executes, the next one gathers.

use super::worker::{Shared, panicked, settle_outcome};
use crate::envelope::Envelope;
use crate::outcome::{Outcome, Transient};
use crate::transport::{Delivery, Settle, StopSignal};
use futures_util::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, mpsc};
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

/// Forms batches until the mailbox is closed and empty. The batch channel holds one formed
/// batch: the next one is ready when an executor finishes.
pub(crate) async fn gather(
    mut mailbox: mpsc::Receiver<Delivery>,
    batches: mpsc::Sender<Vec<Delivery>>,
    spec: BatchSpec,
) {
    loop {
        let mut batch = Vec::with_capacity(spec.size);
        if mailbox.recv_many(&mut batch, spec.size).await == 0 {
            return;
        }
        let deadline = Instant::now() + spec.linger;
        while batch.len() < spec.size {
            let wanted = spec.size - batch.len();
            match timeout_at(deadline, mailbox.recv_many(&mut batch, wanted)).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        if batches.send(batch).await.is_err() {
            return;
        }
    }
}

/// Runs batches until the batch channel is closed and empty. After `stop` is raised, batches
/// not yet started are released to the broker instead of processed.
pub(crate) async fn execute(
    shared: Arc<Shared>,
    batches: Arc<Mutex<mpsc::Receiver<Vec<Delivery>>>>,
    stop: StopSignal,
) {
    loop {
        let next = batches.lock().await.recv().await;
        let Some(batch) = next else { break };
        if *stop.borrow() {
            for delivery in batch {
                if let Err(e) = delivery.settle.release().await {
                    tracing::debug!(error = %e, "release failed; the broker redelivers on close");
                }
            }
            continue;
        }
        handle(&shared, batch).await;
    }
}

/// Processes one batch in one transaction, then settles each delivery by its outcome.
async fn handle(shared: &Shared, batch: Vec<Delivery>) {
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
        let invoked =
            AssertUnwindSafe(shared.registration.invoke_batch(&shared.stores, &envelopes))
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
            Err(panic) => vec![panicked(shared, panic); envelopes.len()],
        };
        for ((outcome, envelope), settle) in outcomes.iter().zip(&envelopes).zip(settles) {
            settle_outcome(shared, outcome, envelope, settle).await;
        }
    }
    .instrument(span)
    .await;
}
