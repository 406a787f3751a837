//! A test harness for handlers (feature `testing`): deliveries handed to the registered
//! handlers one by one, through the same pipeline and the same settlement decision as the
//! runtime, against real inbox stores, with the outcome of each returned.
//!
//! What a test can do with it: send a message and read its [`Outcome`]; send copies at once;
//! redeliver a message whose transaction committed but whose ack was lost; send messages in any
//! order; make the next claims fail with a transient database error; follow a message through
//! its retries; and read the dead letters, each with its reason code.

use crate::model::{DeadLetter, Envelope, Outcome};
use crate::pipeline::DispatchError;
use crate::registry::{self, Registration};
use crate::runtime::settle::{Settlement, decide};
use crate::runtime::{RetryPolicy, RetryPolicyError};
use crate::store::Stores;
use std::sync::Mutex;
use std::time::Duration;

/// Why a harness could not deliver a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// No registered handler has this consumer identity.
    #[error(
        "no registered handler has consumer = \"{0}\"; check its #[idempotent(consumer = ...)]"
    )]
    UnknownHandler(String),
    /// The handler panicked, or its store was not given to the harness.
    #[error(transparent)]
    Dispatch(#[from] DispatchError),
    /// The handler asks for state the harness was not given.
    #[error(
        "handler `{handler}` asks for state of type `{state}`: give it with Harness::state(value) (state given: {given})"
    )]
    MissingState {
        /// The handler's function.
        handler: &'static str,
        /// The type it asks for.
        state: &'static str,
        /// The types given.
        given: String,
    },
    /// The payload could not be serialized into a message body.
    #[error("cannot serialize the message: {0}")]
    Serialize(#[from] serde_json::Error),
}

/// A message the harness dead-lettered, as the runtime would have.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeadLettered {
    /// The message, as last delivered.
    pub envelope: Envelope,
    /// Why: the reason code (`decode`, `conflict`, `retries-exhausted`, …), the detail, the
    /// consumer, the key and the attempts, as in the `x-idem-*` headers of a real dead letter.
    pub dead_letter: DeadLetter,
}

/// Runs registered handlers over given inbox stores, one delivery at a time.
///
/// ```no_run
/// # async fn demo(stores: idem_core::store::Stores) -> Result<(), idem_core::testing::HarnessError> {
/// use idem_core::testing::Harness;
/// let harness = Harness::new(stores);
/// let order = serde_json::json!({"order_id": "o-1", "customer": "c", "amount_cents": 100});
/// assert_eq!(harness.send_json("billing", "o-1", &order).await?.label(), "processed");
/// assert_eq!(harness.send_json("billing", "o-1", &order).await?.label(), "duplicate");
/// assert!(harness.dead_letters().is_empty());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Harness {
    stores: Stores,
    policy: RetryPolicy,
    dead_letters: Mutex<Vec<DeadLettered>>,
}

impl Harness {
    /// A harness over `stores` (the stores a runtime would get), with the runtime's default
    /// retry policy.
    pub fn new(stores: Stores) -> Self {
        Self {
            stores,
            policy: RetryPolicy::default(),
            dead_letters: Mutex::default(),
        }
    }

    /// Retries transient failures up to `max_attempts` deliveries in [`Harness::deliver`]
    /// (delays are not waited out).
    pub fn max_attempts(mut self, max_attempts: u32) -> Result<Self, RetryPolicyError> {
        self.policy = RetryPolicy::new(
            max_attempts,
            Duration::from_millis(1),
            1,
            Duration::from_millis(1),
        )?;
        Ok(self)
    }

    /// Gives the handlers a state value of type `T`, as [`RuntimeBuilder::state`] does.
    ///
    /// [`RuntimeBuilder::state`]: crate::runtime::RuntimeBuilder::state
    pub fn state<T: Send + Sync + 'static>(mut self, value: T) -> Self {
        self.stores.state_mut().insert(value);
        self
    }

    /// The stores the handlers write to.
    pub fn stores(&self) -> &Stores {
        &self.stores
    }

    /// Delivers `envelope` once to the handler with consumer identity `consumer` and returns
    /// the outcome. A rejected or conflicting message, or one out of attempts, is recorded in
    /// [`Harness::dead_letters`]; a retryable one is not retried (see [`Harness::deliver`]).
    pub async fn send(&self, consumer: &str, envelope: Envelope) -> Result<Outcome, HarnessError> {
        let handler = self.find(consumer)?;
        let outcome = handler.invoke(&self.stores, &envelope).await?;
        if let Settlement::DeadLetter(dead_letter) =
            decide(&outcome, &envelope, handler.consumer(), &self.policy)
        {
            self.lock().push(DeadLettered {
                envelope,
                dead_letter,
            });
        }
        Ok(outcome)
    }

    /// Sends `payload` as a JSON message with `message_id`.
    pub async fn send_json<T: serde::Serialize + ?Sized>(
        &self,
        consumer: &str,
        message_id: &str,
        payload: &T,
    ) -> Result<Outcome, HarnessError> {
        let envelope = Envelope::new(serde_json::to_vec(payload)?)
            .with_message_id(message_id)
            .with_content_type("application/json");
        self.send(consumer, envelope).await
    }

    /// Delivers `copies` copies of `envelope` at the same time, as a producer's retries or a
    /// redelivery racing the original do; outcomes in the order of the copies.
    pub async fn send_copies(
        &self,
        consumer: &str,
        envelope: &Envelope,
        copies: usize,
    ) -> Result<Vec<Outcome>, HarnessError> {
        let sends = (0..copies).map(|_| self.send(consumer, envelope.clone()));
        futures_util::future::join_all(sends)
            .await
            .into_iter()
            .collect()
    }

    /// Delivers `envelope` again as the broker does when the transaction committed but the ack
    /// was lost (a crash or a dropped connection after the commit): flagged redelivered, the
    /// same attempt. A handler that is idempotent through idem answers [`Outcome::Duplicate`].
    pub async fn redeliver(
        &self,
        consumer: &str,
        envelope: &Envelope,
    ) -> Result<Outcome, HarnessError> {
        let mut again = envelope.clone();
        again.redelivered = true;
        self.send(consumer, again).await
    }

    /// Delivers `envelopes` one after another in the order given (a test reorders them by
    /// passing them in another order); outcomes in that order.
    pub async fn send_all(
        &self,
        consumer: &str,
        envelopes: impl IntoIterator<Item = Envelope>,
    ) -> Result<Vec<Outcome>, HarnessError> {
        let mut outcomes = Vec::new();
        for envelope in envelopes {
            outcomes.push(self.send(consumer, envelope).await?);
        }
        Ok(outcomes)
    }

    /// Delivers `envelope` and, while the outcome is a retry with attempts left, delivers it
    /// again as the next attempt, as the runtime's retry queues do. Returns every attempt's
    /// outcome; the last one settled the message (acked or dead-lettered).
    pub async fn deliver(
        &self,
        consumer: &str,
        envelope: Envelope,
    ) -> Result<Vec<Outcome>, HarnessError> {
        let mut outcomes = Vec::new();
        let mut envelope = envelope;
        loop {
            let outcome = self.send(consumer, envelope.clone()).await?;
            let retry = matches!(outcome, Outcome::Retry(_))
                && self.policy.delay_after(envelope.attempt).is_some();
            outcomes.push(outcome);
            if !retry {
                return Ok(outcomes);
            }
            envelope.attempt = envelope.attempt.saturating_add(1);
        }
    }

    /// Makes the next `count` claims fail with a transient database error after their
    /// transaction began: the transaction is rolled back and the outcome is
    /// [`Outcome::Retry`], as for a deadlock or a lost connection.
    pub fn inject_transient(&self, count: u32) {
        self.stores.inject_transient(count);
    }

    /// The messages dead-lettered so far, oldest first.
    pub fn dead_letters(&self) -> Vec<DeadLettered> {
        self.lock().clone()
    }

    /// The handler with this consumer identity whose store the harness holds (a consumer may
    /// have one handler per database, as the runtime allows), refused as `build()` would refuse
    /// it when it asks for state the harness lacks.
    fn find(&self, consumer: &str) -> Result<&'static Registration, HarnessError> {
        let candidates: Vec<_> = registry::handlers()
            .into_iter()
            .filter(|h| h.consumer() == consumer)
            .collect();
        let handler = candidates
            .iter()
            .find(|h| h.store_available(&self.stores))
            .or(candidates.first())
            .copied()
            .ok_or_else(|| HarnessError::UnknownHandler(consumer.to_owned()))?;
        match handler.missing_state(&self.stores) {
            Some(missing) => Err(HarnessError::MissingState {
                handler: handler.name(),
                state: missing.name(),
                given: crate::runtime::given_state(&self.stores),
            }),
            None => Ok(handler),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<DeadLettered>> {
        self.dead_letters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
