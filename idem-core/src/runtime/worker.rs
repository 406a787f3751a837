//! A handler's workers (one transaction per delivery): take a delivery from the mailbox, run
//! the pipeline, settle it after the commit.

use super::actor::Shared;
use super::settle;
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
        handle(&shared, delivery).await;
    }
}

/// Processes and settles one delivery. The settlement is sent only after the pipeline
/// returned, that is after the inbox transaction committed or rolled back.
async fn handle(shared: &Shared, delivery: Delivery) {
    let Delivery { envelope, settle } = delivery;
    let handler = shared.handler;
    let span = telemetry::delivery_span(handler.consumer(), &envelope);
    async {
        let outcome = match handler.process(&shared.stores, &envelope).await {
            Ok(outcome) => outcome,
            Err(failed) => settle::undispatched(shared, failed),
        };
        telemetry::record_outcome(&tracing::Span::current(), &outcome);
        settle::settle(shared, &outcome, &envelope, settle).await;
    }
    .instrument(span)
    .await;
}
