//! Where the ack is decided: an [`Outcome`] becomes exactly one settlement (ack, retry later,
//! dead letter), counted and sent through the delivery's [`Settle`], always after the pipeline
//! returned (after the commit). A dead letter's record is written to the handler's store
//! before the message is moved: a record that cannot be written sends the message round
//! again instead.

use super::actor::Shared;
use super::retry::RetryPolicy;
use super::stats::Stats;
use crate::model::{DeadLetter, DeadLetterRecord, Envelope, ErrorClass, Outcome, Transient};
use crate::pipeline::DispatchError;
use crate::telemetry;
use crate::transport::{Delivery, Settle};
use std::time::Duration;

/// How long a dead letter whose record could not be written waits before it is delivered
/// again, when the retry policy has no delay of its own.
const RECORD_RETRY: Duration = Duration::from_secs(1);

/// What to do with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Settlement {
    /// Processed, duplicate or stale: ack.
    Ack,
    /// Transient failure with attempts left: deliver again after the delay.
    Retry(Duration),
    /// Rejected, conflicting, or out of attempts: dead-letter with the reason.
    DeadLetter(DeadLetter),
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
        Outcome::Processed { .. } | Outcome::Duplicate { .. } | Outcome::Stale(_) => {
            Settlement::Ack
        }
        Outcome::Conflict { key } => dead_letter(
            "conflict",
            format!("key {key:?} was processed before with a different payload"),
        ),
        Outcome::Rejected(rejection) => {
            dead_letter(rejection.reason.code(), rejection.message.clone())
        }
        Outcome::Retry(failure) => match policy.delay_after(envelope.attempt) {
            Some(delay) => Settlement::Retry(delay),
            None => dead_letter(
                "retries-exhausted",
                format!(
                    "failed {} times; last: {}",
                    envelope.attempt, failure.message
                ),
            ),
        },
    }
}

/// Settles one delivery according to its outcome, counting it.
pub(crate) async fn settle(
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
    let consumer = shared.handler.consumer();
    let settled = match decide(outcome, envelope, consumer, &shared.retry) {
        Settlement::Ack => {
            let (counter, label) = match outcome {
                Outcome::Duplicate { .. } => (&stats.duplicates, "duplicate"),
                Outcome::Stale(stale) => {
                    tracing::info!(key = %stale.key, entity = %stale.entity, version = stale.version, applied = stale.applied, "stale message skipped");
                    (&stats.stale, "stale")
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
        Settlement::DeadLetter(reason) => {
            tracing::warn!(key = outcome.key(), correlation_id = envelope.correlation_id.as_deref(), reason = %reason.reason, detail = %reason.detail, "dead-lettering");
            let record = DeadLetterRecord::new(&reason, envelope, &shared.queue);
            let recorded = shared
                .handler
                .record_dead_letter(&shared.stores, &record)
                .await;
            let (recorded, reason) = match recorded {
                Err(e) if e.class() == ErrorClass::Permanent => {
                    // Retrying will not write it: moved all the same, its reason in its
                    // headers and logged here, and counted.
                    tracing::error!(error = %e, key = outcome.key(), reason = %reason.reason, detail = %reason.detail, "the dead letter's record cannot be written; moving it without one");
                    telemetry::dead_letter_unrecorded(consumer);
                    (Ok(()), reason.unrecorded())
                }
                recorded => (recorded, reason),
            };
            if let Err(e) = recorded {
                // Not moved without its reason: deliver it again later and decide again.
                tracing::warn!(error = %e, "could not record the dead letter; retrying it later");
                Stats::add(&stats.retried);
                telemetry::message(consumer, "retried");
                let delay = shared
                    .retry
                    .delays()
                    .first()
                    .copied()
                    .unwrap_or(RECORD_RETRY);
                if shared.in_place {
                    // An ordered partition has no delay queues: give it back in its place.
                    tokio::time::sleep(delay).await;
                    settle.release().await
                } else {
                    settle.retry(envelope, delay).await
                }
            } else {
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
        }
    };
    if let Err(e) = settled {
        Stats::add(&stats.settle_failures);
        telemetry::settle_failed(consumer);
        tracing::warn!(error = %e, "settling failed; the broker will redeliver and the inbox will recognise what committed");
    }
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
        Outcome::Retry(t) => t.message.clone(),
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
