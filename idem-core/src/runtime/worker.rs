//! A handler's workers (one transaction per delivery): take a delivery from the mailbox, run
//! the pipeline (unless its key is parked: `parked`), settle it after the commit. A delivery whose store cannot write waits in its
//! worker for the store, and no worker of the store takes another meanwhile (`pause`).

use super::actor::Shared;
use super::parked::{self, Admit};
use super::settle;
use crate::model::{Envelope, HeaderValue, Outcome};
use crate::pipeline::HeldConnection;
use crate::telemetry;
use crate::transport::headers::{self, IdemHeader};
use crate::transport::{Delivery, StopSignal};
use std::sync::Arc;
use tokio::sync::{Mutex, mpsc};
use tracing::Instrument;

/// Runs until the mailbox is closed and empty, taking a delivery only while its store writes.
/// After `stop` is raised, deliveries not yet started are released to the broker instead of
/// processed.
pub(crate) async fn run(
    shared: Arc<Shared>,
    mailbox: Arc<Mutex<mpsc::Receiver<Delivery>>>,
    stop: StopSignal,
) {
    // The worker's database connection, kept from one delivery to the next.
    let mut held = HeldConnection::default();
    loop {
        shared.pause.writable(&stop).await;
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

/// Processes and settles one delivery, in a transaction on the connection in `held`. The
/// settlement is sent only after the pipeline returned, that is after the inbox transaction
/// committed or rolled back. A delivery whose store cannot write waits for it and runs again as
/// the same attempt; an ordered handler's transient failure is retried here, in place, after
/// the policy's delay (a stop during either wait gives the delivery back instead).
async fn handle(shared: &Shared, delivery: Delivery, stop: &StopSignal, held: &mut HeldConnection) {
    let Delivery {
        mut envelope,
        settle,
    } = delivery;
    let handler = shared.handler;
    let span = telemetry::delivery_span(handler.consumer(), &envelope);
    async {
        // How often this delivery waited for its store and ran again after a probe committed.
        let mut waits = 0;
        loop {
            let permit = match &shared.permits {
                Some(permits) => permits.acquire().await.ok(),
                None => None,
            };
            // A key parked behind its dead letter keeps its later messages from running.
            let (mut outcome, released) = match parked::admit(shared, &envelope, held).await {
                Admit::Run { released } => {
                    let processed = handler.process(&shared.stores, &envelope, held).await;
                    let outcome = processed.unwrap_or_else(|e| settle::undispatched(shared, e));
                    (outcome, released)
                }
                Admit::Settled(outcome) => (outcome, None),
            };
            drop(permit);
            if let Outcome::Unavailable(failure) = &outcome {
                if waits < settle::STORE_WAITS {
                    waits += 1;
                    telemetry::record_outcome(&tracing::Span::current(), &outcome);
                    if !settle::wait_for_store(shared, failure, 1, stop).await {
                        settle::release(Delivery { envelope, settle }).await;
                        return;
                    }
                    continue;
                }
                outcome = settle::unavailable_again(failure);
            }
            telemetry::record_outcome(&tracing::Span::current(), &outcome);
            if let Some(delay) = settle::retried_in_place(shared, &outcome, &envelope) {
                if stopped_within(delay, stop).await {
                    settle::release(Delivery { envelope, settle }).await;
                    return;
                }
                envelope.attempt = envelope.attempt.saturating_add(1);
                keep_first_failure(&mut envelope);
                continue;
            }
            // A released message that settled hands its key's release on before it is acked.
            if let Some(seq) = released
                && matches!(
                    outcome,
                    Outcome::Processed { .. } | Outcome::Duplicate { .. } | Outcome::Stale(_)
                )
                && !parked::hand_on(shared, &envelope, seq, stop).await
            {
                settle::release(Delivery { envelope, settle }).await;
                return;
            }
            settle::settle(shared, &outcome, &envelope, settle, stop).await;
            return;
        }
    }
    .instrument(span)
    .await;
}

/// Marks when an in-place retry's first attempt failed, as a retry copy's header does
/// ([`IdemHeader::FirstFailure`]), so that a dead letter's record tells when its failures began.
fn keep_first_failure(envelope: &mut Envelope) {
    let now = headers::epoch_ms();
    if headers::first_failure(envelope, now).is_none() {
        envelope
            .headers
            .insert(IdemHeader::FirstFailure.name(), HeaderValue::Int(now));
    }
}

/// Waits `delay`; `true` when `stop` was raised first (or already).
async fn stopped_within(delay: std::time::Duration, stop: &StopSignal) -> bool {
    let mut stop = stop.clone();
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(crate::jitter::jittered(delay)) => false,
        _ = stop.wait_for(|stopped| *stopped) => true,
    }
}
