//! Turning an [`Outcome`] into exactly one transport decision.

use crate::envelope::Envelope;
use crate::outcome::Outcome;
use crate::retry::RetryPolicy;
use crate::transport::DeadLetter;
use std::time::Duration;

/// What to do with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Settlement {
    /// Processed or duplicate: ack.
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
        })
    };
    match outcome {
        Outcome::Processed { .. } | Outcome::Duplicate { .. } => Settlement::Ack,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::{RejectReason, Rejection, StoredOutput, Transient};

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
