//! Where the ack is decided: an [`Outcome`] becomes exactly one settlement (ack, retry later,
//! dead letter), counted and sent through the delivery's [`Settle`], always after the pipeline
//! returned (after the commit). A dead letter's record is written to the handler's store
//! before the message is moved: a record that fails transiently is written again in place, one
//! that meets a store unable to write waits for the store (see `pause`), and only a record the
//! store refuses for its content lets the message go without one. A delivery whose store
//! cannot write is not settled at all: it waits for the store ([`wait_for_store`]).

use super::actor::Shared;
use super::retry::RetryPolicy;
use super::stats::Stats;
use crate::jitter::jittered;
use crate::model::reasons;
use crate::model::{
    DeadLetter, DeadLetterRecord, Envelope, ErrorClass, Outcome, StoreError, Transient,
};
use crate::pipeline::DispatchError;
use crate::telemetry;
use crate::transport::{Delivery, Settle, StopSignal};
use std::time::Duration;

/// The first wait before a dead letter's record that failed transiently is written again; it
/// doubles up to [`RECORD_LONGEST`].
const RECORD_FIRST: Duration = Duration::from_millis(10);
/// The longest wait between two tries of a dead letter's record.
const RECORD_LONGEST: Duration = Duration::from_secs(5);
/// How many times a dead letter's record that fails transiently is tried in place before the
/// message goes round again (about 8 s of tries).
const RECORD_TRIES: u32 = 10;

/// What to do with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Settlement {
    /// Processed, duplicate or stale: ack.
    Ack,
    /// Transient failure with attempts left: deliver again after the delay.
    Retry(Duration),
    /// Rejected, conflicting, or out of attempts: dead-letter with the reason.
    DeadLetter(DeadLetter),
    /// The store cannot write for now: nothing is settled; the delivery waits for the store
    /// and is tried again as the same attempt.
    Hold,
}

/// The settlement for `outcome` of `envelope`'s delivery.
pub(crate) fn decide(
    outcome: &Outcome,
    envelope: &Envelope,
    consumer: &str,
    policy: &RetryPolicy,
) -> Settlement {
    let dead_letter = |reason: &str, detail: String| {
        Settlement::DeadLetter(DeadLetter {
            reason: reason.to_owned(),
            detail,
            consumer: consumer.to_owned(),
            key: outcome.key().map(str::to_owned),
            attempts: envelope.attempt,
            unrecorded: false,
        })
    };
    match outcome {
        Outcome::Processed { .. }
        | Outcome::Duplicate { .. }
        | Outcome::Stale(_)
        | Outcome::Parked { .. } => Settlement::Ack,
        Outcome::Unavailable(_) => Settlement::Hold,
        Outcome::Conflict { key } => dead_letter(
            reasons::CONFLICT,
            format!("key {key:?} was processed before with a different payload"),
        ),
        Outcome::Rejected(rejection) => {
            dead_letter(rejection.reason.code(), rejection.message.clone())
        }
        Outcome::Retry(failure) => match policy.delay_after(envelope.attempt) {
            Some(delay) => Settlement::Retry(delay),
            None => dead_letter(
                reasons::RETRIES_EXHAUSTED,
                format!(
                    "failed {} times; last: {}",
                    envelope.attempt, failure.message
                ),
            ),
        },
    }
}

/// Settles one delivery according to its outcome, counting it. A dead letter's record waits
/// for a store that cannot write, up to `stop` (then the delivery is given back unsettled).
pub(crate) async fn settle(
    shared: &Shared,
    outcome: &Outcome,
    envelope: &Envelope,
    settle: Box<dyn Settle>,
    stop: &StopSignal,
) {
    #[cfg(feature = "fault-injection")]
    if matches!(outcome, Outcome::Processed { .. }) {
        crate::fault::maybe_crash(crate::fault::Point::AfterCommit);
    }
    let stats = &shared.stats;
    let consumer = shared.handler.consumer();
    let settled = match decide(outcome, envelope, consumer, &shared.retry) {
        Settlement::Ack => {
            let (counter, label) = match outcome {
                Outcome::Duplicate { .. } => (&stats.duplicates, "duplicate"),
                Outcome::Stale(stale) => {
                    tracing::info!(key = %stale.key, entity = %stale.entity, version = stale.version, applied = stale.applied, "stale message skipped");
                    (&stats.stale, "stale")
                }
                Outcome::Parked { order_key } => {
                    tracing::info!(order_key = %order_key, "its key is parked behind a dead letter; stored behind it");
                    (&stats.parked, "parked")
                }
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
        // The workers wait for the store before they settle; given one all the same, it goes
        // back to the broker unsettled.
        Settlement::Hold => settle.release().await,
        Settlement::DeadLetter(reason) => {
            match dead_letter(shared, outcome, envelope, reason, settle, stop).await {
                Some(settled) => settled,
                None => return,
            }
        }
    };
    if let Err(e) = settled {
        settle_failed(shared, &e, "the inbox will recognise what committed");
    }
}

/// Counts and logs a settlement the transport could not send.
fn settle_failed(shared: &Shared, error: &crate::transport::TransportError, then: &str) {
    Stats::add(&shared.stats.settle_failures);
    telemetry::settle_failed(shared.handler.consumer());
    tracing::warn!(error = %error, "settling failed; the broker will redeliver; {then}");
}

/// Dead-letters the delivery once its record is written (or refused for good, then moved
/// with its reason in its headers); `None` when it settled the delivery otherwise: given back
/// at a stop, or delivered again later because the record keeps failing.
async fn dead_letter(
    shared: &Shared,
    outcome: &Outcome,
    envelope: &Envelope,
    reason: DeadLetter,
    settle: Box<dyn Settle>,
    stop: &StopSignal,
) -> Option<Result<(), crate::transport::TransportError>> {
    let (stats, consumer) = (&shared.stats, shared.handler.consumer());
    tracing::warn!(key = outcome.key(), correlation_id = envelope.correlation_id.as_deref(), reason = %reason.reason, detail = %reason.detail, "dead-lettering");
    let mut record = history(
        shared,
        DeadLetterRecord::new(&reason, envelope, &shared.queue),
        envelope,
    );
    if let Some(park) = super::parked::park_key(shared, envelope) {
        record = record.parking(park);
    }
    let reason = match record_dead_letter(shared, &record, stop).await {
        Recorded::Written => reason,
        Recorded::Refused(e) => {
            // The store refuses this record for what it holds, and always will: moved all the
            // same, its reason in its headers and logged here, and counted.
            tracing::error!(error = %e, key = outcome.key(), reason = %reason.reason, detail = %reason.detail, "the store refuses the dead letter's record; moving it without one");
            telemetry::dead_letter_unrecorded(consumer);
            reason.unrecorded()
        }
        Recorded::Stopped => {
            release(Delivery {
                envelope: envelope.clone(),
                settle,
            })
            .await;
            return None;
        }
        Recorded::Later(e) => {
            // Not moved without its reason: delivered again later, and decided again.
            tracing::warn!(error = %e, tries = RECORD_TRIES, "the dead letter's record keeps failing; delivering it again later");
            deliver_again_later(shared, envelope, settle).await;
            return None;
        }
    };
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
    Some(settle.dead_letter(envelope, &reason).await)
}

/// `record` with its failures' start (its retry copies' header) and its consumer's retention,
/// for a replay to judge whether the inbox can still tell a duplicate of it.
fn history(shared: &Shared, record: DeadLetterRecord, envelope: &Envelope) -> DeadLetterRecord {
    let now = crate::transport::headers::epoch_ms();
    let first = crate::transport::headers::first_failure(envelope, now);
    match crate::registry::retention_of(shared.handler, &shared.stores) {
        Some(retention) => record.with_history(first, retention),
        None => record,
    }
}

/// A delivery whose dead letter's record keeps failing, retried after the policy's first
/// delay (an ordered partition, which has no delay queues, gives it back in its place).
async fn deliver_again_later(shared: &Shared, envelope: &Envelope, settle: Box<dyn Settle>) {
    Stats::add(&shared.stats.retried);
    telemetry::message(shared.handler.consumer(), "retried");
    let delay = shared
        .retry
        .delays()
        .first()
        .copied()
        .unwrap_or(RECORD_LONGEST);
    let settled = match shared.in_place {
        true => {
            tokio::time::sleep(jittered(delay)).await;
            settle.release().await
        }
        false => settle.retry(envelope, delay).await,
    };
    if let Err(e) = settled {
        settle_failed(shared, &e, "it is decided again then");
    }
}

/// What became of a dead letter's record.
enum Recorded {
    Written,
    /// The store refuses it for what it holds: retrying will not write it.
    Refused(StoreError),
    /// The runtime stopped while the store could not write it.
    Stopped,
    /// It failed transiently [`RECORD_TRIES`] times: the message goes round again instead.
    Later(StoreError),
}

/// Writes `record` to the handler's store: again in place after a transient failure (backing
/// off, with jitter, [`RECORD_TRIES`] times at most), and after the store could not write, once
/// it can again (the handler's consumption pauses meanwhile); until it is written, the store
/// refuses it for good, it failed transiently too often, or `stop` is raised.
async fn record_dead_letter(
    shared: &Shared,
    record: &DeadLetterRecord,
    stop: &StopSignal,
) -> Recorded {
    let mut wait = RECORD_FIRST;
    let mut tries = 0;
    loop {
        tries += 1;
        let failed = match shared
            .handler
            .record_dead_letter(&shared.stores, record)
            .await
        {
            Ok(()) => return Recorded::Written,
            Err(e) => e,
        };
        match failed.class() {
            ErrorClass::Permanent => return Recorded::Refused(failed),
            ErrorClass::Unavailable => {
                tracing::warn!(error = %failed, key = %record.key, "the dead letter's record waits for the store to write");
                shared.pause.enter(&failed.to_string(), stop);
                if !shared.pause.writable(stop).await {
                    return Recorded::Stopped;
                }
            }
            ErrorClass::Transient if tries >= RECORD_TRIES => return Recorded::Later(failed),
            ErrorClass::Transient => {
                tracing::debug!(error = %failed, retry_in = ?wait, "the dead letter's record failed; writing it again");
                let mut stopping = stop.clone();
                tokio::select! {
                    _ = tokio::time::sleep(jittered(wait)) => {}
                    _ = stopping.wait_for(|stopped| *stopped) => return Recorded::Stopped,
                }
                wait = (wait * 2).min(RECORD_LONGEST);
            }
        }
    }
}

/// How many times a delivery waits for its store and runs again: one that still meets an
/// unavailable store after as many probes committed fails for what it is (its handler writes
/// to another database that is down, a table of its own is read-only or full), and is retried
/// as a transient failure, spending an attempt, instead of pausing the store for ever.
pub(crate) const STORE_WAITS: u32 = 3;

/// The outcome of a delivery that met an unavailable store again after [`STORE_WAITS`] waits,
/// each ended by a probe write that committed: a transient failure of the message.
pub(crate) fn unavailable_again(failure: &Transient) -> Outcome {
    tracing::warn!(key = failure.key.as_deref(), failure = %failure.message, waits = STORE_WAITS,
        "the store writes again, but this message keeps failing as if it could not; retrying it as a transient failure");
    Outcome::Retry(failure.clone())
}

/// `count` deliveries found their store unable to write (`failure`): pauses the store's
/// handlers and waits until a probe write succeeds. `false`: `stop` was raised first, and the
/// deliveries are to be given back. No attempt is spent.
pub(crate) async fn wait_for_store(
    shared: &Shared,
    failure: &Transient,
    count: usize,
    stop: &StopSignal,
) -> bool {
    for _ in 0..count {
        Stats::add(&shared.stats.unavailable);
        telemetry::message(shared.handler.consumer(), "unavailable");
    }
    tracing::debug!(key = failure.key.as_deref(), failure = %failure.message, count, "the store cannot write; waiting for it");
    shared.pause.enter(&failure.message, stop);
    shared.pause.writable(stop).await
}

/// For an ordered handler (retrying in place), the delay before `outcome` is tried again, when
/// it is a transient failure with attempts left; counted as a retry.
pub(crate) fn retried_in_place(
    shared: &Shared,
    outcome: &Outcome,
    envelope: &Envelope,
) -> Option<Duration> {
    if !shared.in_place {
        return None;
    }
    let consumer = shared.handler.consumer();
    let Settlement::Retry(delay) = decide(outcome, envelope, consumer, &shared.retry) else {
        return None;
    };
    tracing::info!(?delay, key = outcome.key(), attempt = envelope.attempt, failure = %describe(outcome), "transient failure; retrying in place");
    Stats::add(&shared.stats.retried);
    telemetry::message(consumer, "retried");
    Some(delay)
}

/// The outcome of a delivery the pipeline could not process: a handler's panic (counted) or a
/// missing store is a transient failure, so the message is retried and the worker lives on.
pub(crate) fn undispatched(shared: &Shared, error: DispatchError) -> Outcome {
    if let DispatchError::Panicked(message) = &error {
        Stats::add(&shared.stats.panics);
        telemetry::panicked(shared.handler.consumer());
        tracing::error!(panic = %message, "handler panicked; the message will be retried");
    }
    Outcome::Retry(Transient {
        message: error.to_string(),
        key: None,
    })
}

/// Gives a delivery back unprocessed (shutdown).
pub(crate) async fn release(delivery: Delivery) {
    if let Err(e) = delivery.settle.release().await {
        tracing::debug!(error = %e, "release failed; the broker redelivers on close");
    }
}

fn describe(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Retry(t) | Outcome::Unavailable(t) => t.message.clone(),
        other => other.label().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{RejectReason, Rejection, StoredOutput, Transient};

    #[test]
    fn every_outcome_has_one_settlement() {
        let policy = RetryPolicy::default();
        let env = Envelope::new("{}").with_message_id("m");
        let decide =
            |o: &Outcome, attempt| decide(o, &env.clone().with_attempt(attempt), "c", &policy);
        let processed = Outcome::Processed {
            key: "k".into(),
            output: StoredOutput::null(),
        };
        assert_eq!(decide(&processed, 1), Settlement::Ack);
        let duplicate = Outcome::Duplicate {
            key: "k".into(),
            output: StoredOutput::null(),
        };
        assert_eq!(decide(&duplicate, 3), Settlement::Ack);
        let retry = Outcome::Retry(Transient {
            message: "db down".into(),
            key: Some("k".into()),
        });
        assert_eq!(decide(&retry, 1), Settlement::Retry(Duration::from_secs(1)));
        assert_eq!(decide(&retry, 2), Settlement::Retry(Duration::from_secs(4)));
        let Settlement::DeadLetter(dl) = decide(&retry, 5) else {
            panic!("the fifth failure is the last")
        };
        assert_eq!(
            (dl.reason.as_str(), dl.attempts, dl.key.as_deref()),
            ("retries-exhausted", 5, Some("k"))
        );
        assert!(dl.detail.contains("db down"));
        let rejected = Outcome::Rejected(Rejection::new(RejectReason::Decode, "not JSON", None));
        let Settlement::DeadLetter(dl) = decide(&rejected, 1) else {
            panic!()
        };
        assert_eq!(
            (dl.reason.as_str(), dl.detail.as_str(), dl.consumer.as_str()),
            ("decode", "not JSON", "c")
        );
        let Settlement::DeadLetter(dl) = decide(&Outcome::Conflict { key: "k".into() }, 1) else {
            panic!()
        };
        assert_eq!(dl.reason, "conflict");
    }
}
