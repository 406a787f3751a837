//! The steps every mode shares: read a delivery (decode, key, fingerprint), judge a key that
//! exists (duplicate or conflict), and turn a handler's result or a store's failure into an
//! outcome.

use crate::handler::Handler;
use crate::model::{
    Context, Envelope, ErrorClass, Fingerprint, HandlerError, Outcome, RejectReason, Rejection,
    StoreError, StoredOutput, Transient,
};
use crate::store::{ClaimRequest, InboxStore};
use crate::telemetry;
use std::time::{Duration, Instant};

/// What identifies a delivery to the inbox: its dedup key and its body's fingerprint.
#[derive(Debug, Clone)]
pub(crate) struct Keyed {
    pub(crate) key: String,
    pub(crate) fingerprint: Fingerprint,
}

impl Keyed {
    /// The claim of this key for `consumer` by `envelope`'s delivery, kept for `retention`.
    pub(crate) fn request<'a>(
        &'a self,
        consumer: &'a str,
        envelope: &Envelope,
        retention: Duration,
    ) -> ClaimRequest<'a> {
        ClaimRequest {
            consumer,
            key: &self.key,
            fingerprint: &self.fingerprint,
            attempt: envelope.attempt,
            retention,
        }
    }
}

/// Decodes the payload, reads its key and fingerprints the body; a failure is the rejection.
pub(crate) fn prepare<H: Handler>(envelope: &Envelope) -> Result<(H::Payload, Keyed), Outcome> {
    let payload = H::decode(envelope).map_err(Outcome::Rejected)?;
    let key = H::key(envelope, &payload).map_err(|e| {
        Outcome::Rejected(Rejection::new(
            RejectReason::MissingKey,
            e.to_string(),
            None,
        ))
    })?;
    let fingerprint = Fingerprint::of(&envelope.body);
    Ok((payload, Keyed { key, fingerprint }))
}

/// Runs handler `H` on `payload` in the inbox transaction `tx`, timed.
pub(crate) async fn call<H: Handler>(
    tx: &mut <H::Store as InboxStore>::Tx,
    payload: H::Payload,
    envelope: &Envelope,
    key: &str,
) -> Result<H::Output, HandlerError> {
    let ctx = Context::new(envelope, H::CONSUMER, key);
    let running = Instant::now();
    let result = H::call(tx, payload, &ctx).await;
    telemetry::handler_duration(H::CONSUMER, running.elapsed());
    result
}

/// The outcome of a message whose key was committed before: a duplicate when the payload is
/// the same, a conflict when it is not.
pub(crate) fn existing(
    consumer: &str,
    envelope: &Envelope,
    key: String,
    fingerprint: &Fingerprint,
    stored: &Fingerprint,
    output: Option<StoredOutput>,
) -> Outcome {
    let correlation_id = envelope.correlation_id.as_deref();
    if stored == fingerprint {
        tracing::debug!(consumer, %key, correlation_id, "duplicate skipped");
        Outcome::Duplicate {
            key,
            output: output.unwrap_or_else(StoredOutput::null),
        }
    } else {
        tracing::warn!(consumer, %key, correlation_id, %stored, received = %fingerprint, "same key, different payload");
        Outcome::Conflict { key }
    }
}

/// The handler's result as the output to store, or the outcome of its failure (a database
/// error classified by `store`).
pub(crate) fn encode_result<H: Handler>(
    store: &H::Store,
    result: Result<H::Output, HandlerError>,
    key: &str,
) -> Result<StoredOutput, Outcome> {
    match result.map(|value| StoredOutput::encode(&value)) {
        Ok(Ok(output)) => Ok(output),
        Ok(Err(e)) => Err(Outcome::Rejected(Rejection::new(
            RejectReason::Output,
            format!("the handler's result could not be serialized: {e}"),
            Some(key.to_owned()),
        ))),
        Err(e) => Err(handler_failure(e.classify(|e| store.classify(e)), key)),
    }
}

fn handler_failure(error: HandlerError, key: &str) -> Outcome {
    let message = error.to_string();
    match error.class() {
        Some(ErrorClass::Permanent) => Outcome::Rejected(Rejection::new(
            RejectReason::Handler,
            message,
            Some(key.to_owned()),
        )),
        // `classify` left no database error unclassified.
        Some(ErrorClass::Transient) | None => Outcome::Retry(Transient {
            message,
            key: Some(key.to_owned()),
        }),
    }
}

/// The outcome of a store failure.
pub(crate) fn store_failure(error: StoreError, key: &str) -> Outcome {
    failure(error.class(), error.to_string(), key)
}

/// The outcome of a store failure of `class`, described by `message`.
pub(crate) fn failure(class: ErrorClass, message: String, key: &str) -> Outcome {
    match class {
        ErrorClass::Transient => Outcome::Retry(Transient {
            message,
            key: Some(key.to_owned()),
        }),
        ErrorClass::Permanent => Outcome::Rejected(Rejection::new(
            RejectReason::Store,
            message,
            Some(key.to_owned()),
        )),
    }
}

/// The retention of handler `H`'s rows: its own `retention = ...`, else the runtime's, else
/// its store's.
pub(crate) fn retention_of<H: Handler>(store: &H::Store, runtime: Option<Duration>) -> Duration {
    H::RETENTION
        .or(runtime)
        .unwrap_or_else(|| store.retention())
}
