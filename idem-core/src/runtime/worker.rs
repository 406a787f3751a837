//! A handler's workers (one transaction per delivery): take a delivery from the mailbox, run
//! the pipeline, settle it after the commit.

use super::actor::Shared;
use super::settle;
use crate::pipeline::HeldConnection;
use crate::telemetry;
use crate::transport::{Delivery, StopSignal};
use std::sync::Arc;
use tokio::sync::{Mutex, mpsc};
use tracing::Instrument;

/// Runs until the mailbox is closed and empty. After `stop` is raised, deliveries not yet
/// started are released to the broker instead of processed.
pub(crate) async fn run(
    shared: Arc<Shared>,
    mailbox: Arc<Mutex<mpsc::Receiver<Delivery>>>,
    stop: StopSignal,
) {
    // The worker's database connection, kept from one delivery to the next.
    let mut held = HeldConnection::default();
    loop {
        let next = {
            let mut mailbox = mailbox.lock().await;
            let next = mailbox.recv().await;
            telemetry::mailbox_depth(shared.handler.consumer(), mailbox.len());
            next
        };
        let Some(delivery) = next else { break };
        if *stop.borrow() {
            settle::release(delivery).await;
            continue;
        }
        handle(&shared, delivery, &stop, &mut held).await;
    }
}

/// Processes and settles one delivery, in a transaction on the connection in `held`. The settlement is sent only after the pipeline
/// returned, that is after the inbox transaction committed or rolled back. An ordered
/// handler's transient failure is retried here, in place, after the policy's delay (a stop
/// during the delay gives the delivery back instead).
async fn handle(shared: &Shared, delivery: Delivery, stop: &StopSignal, held: &mut HeldConnection) {
    let Delivery {
        mut envelope,
        settle,
    } = delivery;
    let handler = shared.handler;
    let span = telemetry::delivery_span(handler.consumer(), &envelope);
    async {
        loop {
            let permit = match &shared.permits {
                Some(permits) => permits.acquire().await.ok(),
                None => None,
            };
            let outcome = match handler.process(&shared.stores, &envelope, held).await {
                Ok(outcome) => outcome,
                Err(failed) => settle::undispatched(shared, failed),
            };
            drop(permit);
            telemetry::record_outcome(&tracing::Span::current(), &outcome);
            if let Some(delay) = settle::retried_in_place(shared, &outcome, &envelope) {
                if stopped_within(delay, stop).await {
                    settle::release(Delivery { envelope, settle }).await;
                    return;
                }
                envelope.attempt = envelope.attempt.saturating_add(1);
                continue;
            }
            settle::settle(shared, &outcome, &envelope, settle).await;
            return;
        }
    }
    .instrument(span)
    .await;
}

/// Waits `delay`; `true` when `stop` was raised first (or already).
async fn stopped_within(delay: std::time::Duration, stop: &StopSignal) -> bool {
    let mut stop = stop.clone();
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(delay) => false,
        _ = stop.wait_for(|stopped| *stopped) => true,
    }
}
