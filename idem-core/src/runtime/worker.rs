//! A handler's workers: take a delivery from the mailbox, run the pipeline, settle it.

use super::decide::{Settlement, decide};
use super::stats::Stats;
use crate::envelope::Envelope;
use crate::outcome::{Outcome, Transient};
use crate::registry::Registration;
use crate::retry::RetryPolicy;
use crate::store::Stores;
use crate::telemetry;
use crate::transport::{Delivery, Settle, StopSignal};
use futures_util::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use tokio::sync::{Mutex, mpsc};
use tracing::{Instrument, field};

/// What every worker of one handler shares.
pub(crate) struct Shared {
    pub(crate) registration: &'static Registration,
    pub(crate) stores: Arc<Stores>,
    pub(crate) retry: RetryPolicy,
    pub(crate) stats: Arc<Stats>,
}

/// Runs until the mailbox is closed and empty. After `stop` is raised, deliveries not yet
/// started are released to the broker instead of processed.
pub(crate) async fn run(
    shared: Arc<Shared>,
    mailbox: Arc<Mutex<mpsc::Receiver<Delivery>>>,
    stop: StopSignal,
) {
    loop {
        let next = mailbox.lock().await.recv().await;
        let Some(delivery) = next else { break };
        if *stop.borrow() {
            if let Err(e) = delivery.settle.release().await {
                tracing::debug!(error = %e, "release failed; the broker redelivers on close");
            }
            continue;
        }
        handle(&shared, delivery).await;
    }
}

/// Processes and settles one delivery. The settlement is sent only after the pipeline
/// returned, that is after the inbox transaction committed or rolled back.
async fn handle(shared: &Shared, delivery: Delivery) {
    let Delivery { envelope, settle } = delivery;
    let span = delivery_span(shared.registration.consumer(), &envelope);
    async {
        let outcome = run_pipeline(shared, &envelope).await;
        record_outcome(&tracing::Span::current(), &outcome);
        settle_outcome(shared, &outcome, &envelope, settle).await;
    }
    .instrument(span)
    .await;
}

/// The span of one delivery: consumer, message id, correlation id and attempt now; key and
/// outcome once known ([`record_outcome`]).
pub(crate) fn delivery_span(consumer: &str, envelope: &Envelope) -> tracing::Span {
    tracing::info_span!(
        "delivery",
        consumer,
        message_id = envelope.message_id.as_deref(),
        correlation_id = envelope.correlation_id.as_deref(),
        attempt = envelope.attempt,
        key = field::Empty,
        outcome = field::Empty,
    )
}

/// Records the key and outcome on a delivery's span.
pub(crate) fn record_outcome(span: &tracing::Span, outcome: &Outcome) {
    if let Some(key) = outcome.key() {
        span.record("key", key);
    }
    span.record("outcome", outcome.label());
}

/// Settles one delivery according to its outcome, counting it.
pub(crate) async fn settle_outcome(
    shared: &Shared,
    outcome: &Outcome,
    envelope: &Envelope,
    settle: Box<dyn Settle>,
) {
    #[cfg(feature = "fault-injection")]
    if matches!(outcome, Outcome::Processed { .. }) {
        crate::fault::maybe_crash(crate::fault::Point::AfterCommit);
    }
    let stats = &shared.stats;
    let consumer = shared.registration.consumer();
    let settled = match decide(outcome, envelope, consumer, &shared.retry) {
        Settlement::Ack => {
            let (counter, label) = match outcome {
                Outcome::Duplicate { .. } => (&stats.duplicates, "duplicate"),
                _ => (&stats.processed, "processed"),
            };
            Stats::add(counter);
            telemetry::message(consumer, label);
            settle.ack().await
        }
        Settlement::Retry(delay) => {
            tracing::info!(?delay, key = outcome.key(), correlation_id = envelope.correlation_id.as_deref(), failure = %describe(outcome), "transient failure; retrying later");
            Stats::add(&stats.retried);
            telemetry::message(consumer, "retried");
            settle.retry(envelope, delay).await
        }
        Settlement::DeadLetter(reason) => {
            tracing::warn!(key = outcome.key(), correlation_id = envelope.correlation_id.as_deref(), reason = %reason.reason, detail = %reason.detail, "dead-lettering");
            let label = match outcome {
                Outcome::Conflict { .. } => {
                    Stats::add(&stats.conflicts);
                    "conflict"
                }
                Outcome::Rejected(_) => {
                    Stats::add(&stats.rejected);
                    "rejected"
                }
                _ => "dead_lettered",
            };
            Stats::add(&stats.dead_lettered);
            telemetry::message(consumer, label);
            telemetry::dead_letter(consumer, &reason.reason);
            settle.dead_letter(envelope, &reason).await
        }
    };
    if let Err(e) = settled {
        Stats::add(&stats.settle_failures);
        tracing::warn!(error = %e, "settling failed; the broker will redeliver and the inbox will recognise what committed");
    }
}

/// The pipeline, with a panic turned into a transient failure so the message is retried and
/// the worker lives on.
async fn run_pipeline(shared: &Shared, envelope: &Envelope) -> Outcome {
    let invoked = AssertUnwindSafe(shared.registration.invoke(&shared.stores, envelope))
        .catch_unwind()
        .await;
    match invoked {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(dispatch)) => Outcome::Retry(Transient {
            message: dispatch.to_string(),
            key: None,
        }),
        Err(panic) => panicked(shared, panic),
    }
}

/// A panic in a handler, as a transient failure: the message is retried, the worker lives on.
pub(crate) fn panicked(shared: &Shared, panic: Box<dyn std::any::Any + Send>) -> Outcome {
    Stats::add(&shared.stats.panics);
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic".to_owned());
    tracing::error!(panic = %message, "handler panicked; the message will be retried");
    Outcome::Retry(Transient {
        message: format!("handler panicked: {message}"),
        key: None,
    })
}

fn describe(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Retry(t) => t.message.clone(),
        other => other.label().to_owned(),
    }
}
