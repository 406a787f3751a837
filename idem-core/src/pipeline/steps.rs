//! The steps every mode shares: read a delivery (decode, key, fingerprint), judge a key that
//! exists (duplicate or conflict), and turn a handler's result or a store's failure into an
//! outcome.

use crate::handler::{Handler, TransactionalHandler};
use crate::model::{
    Context, Envelope, ErrorClass, Fingerprint, HandlerError, Outcome, Outgoing, RejectReason,
    Rejection, Stale, StoreError, StoredOutput, Transient, Versioned,
};
use crate::outbox::Dispatch;
use crate::state::{self, State};
use crate::store::{ClaimRequest, DeadLetterStore, InboxStore, OutboxStore, Refusal, Stores};
use crate::telemetry;
use std::time::Duration;

/// What identifies a delivery to the inbox: its dedup key and its body's fingerprint.
#[derive(Debug, Clone)]
pub(crate) struct Keyed {
    pub(crate) key: String,
    pub(crate) fingerprint: Fingerprint,
    /// The entity and version, for a versioned handler.
    pub(crate) versioned: Option<Versioned>,
    /// The poison limit's count of this key's handler runs on redeliveries that did not settle,
    /// this one included, when this delivery was counted (see [`count_start`]).
    pub(crate) unsettled: Option<u32>,
    /// The outcome of a count that failed (see [`count_start`]): the delivery may not run,
    /// since its run could not be counted, but a copy of a completed key is still a duplicate.
    pub(crate) uncounted: Option<Outcome>,
    /// When its message was first published, where known ([`Envelope::published_at_ms`]).
    pub(crate) published_at_ms: Option<i64>,
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
    let versioned = match H::versioned(&payload).transpose() {
        Ok(versioned) => versioned,
        Err(e) => {
            let rejection = Rejection::new(RejectReason::Version, e.to_string(), Some(key));
            return Err(Outcome::Rejected(rejection));
        }
    };
    let fingerprint = Fingerprint::of(&envelope.body);
    Ok((
        payload,
        Keyed {
            key,
            fingerprint,
            versioned,
            unsettled: None,
            uncounted: None,
            published_at_ms: envelope.published_at_ms,
        },
    ))
}

/// For a versioned message, raises its entity's applied version in the claim's transaction
/// `tx` before the handler runs. `Ok(Some(outcome))`: the message is stale (acked, or
/// dead-lettered where `limits` say so), nothing was written and the handler must not run.
pub(crate) async fn advance<H: Handler>(
    store: &H::Store,
    tx: &mut <H::Store as InboxStore>::Tx<'_>,
    keyed: &Keyed,
    limits: &Limits<'_>,
) -> Result<Option<Outcome>, StoreError> {
    let Some(versioned) = &keyed.versioned else {
        return Ok(None);
    };
    let advanced = store
        .advance_version(tx, H::CONSUMER, &versioned.entity, versioned.version)
        .await?;
    let Some(applied) = advanced else {
        return Ok(None);
    };
    let stale = Stale {
        key: keyed.key.clone(),
        entity: versioned.entity.clone(),
        version: versioned.version,
        applied,
    };
    Ok(Some(match limits.dead_letter_stale {
        true => Outcome::Rejected(Rejection::new(
            RejectReason::Stale,
            stale.to_string(),
            Some(stale.key),
        )),
        false => Outcome::Stale(stale),
    }))
}

/// Runs handler `H` on `payload` in the inbox transaction `tx`, with `state`, timed.
pub(crate) async fn call<H: TransactionalHandler>(
    store: &H::Store,
    tx: &mut <H::Store as InboxStore>::Tx<'_>,
    payload: H::Payload,
    envelope: &Envelope,
    key: &str,
    run: &str,
    state: &State,
) -> Called<H::Output> {
    let ctx = Context::new(envelope, H::CONSUMER, key)
        .with_state(state)
        .with_outbox(store.outbox_table())
        .with_run(run)
        .with_transaction(store.transaction_identity(tx));
    let running = telemetry::HandlerRun::start(H::CONSUMER);
    let result = H::call(tx, payload, &ctx).await;
    running.end();
    Called {
        result,
        staged: ctx.staged(),
        kept: ctx.kept(),
    }
}

/// The outcome of a duplicate, once the stored result is sent again to the `reply_to` queue
/// its request names (published directly: nothing is committed for a duplicate); a reply
/// that cannot be sent makes the duplicate a retry, so that the sender gets one.
pub(crate) async fn reply_again(
    consumer: &str,
    envelope: &Envelope,
    outcome: Outcome,
    dispatch: Option<Dispatch<'_>>,
) -> Outcome {
    let (Outcome::Duplicate { key, output }, Some(dispatch)) = (&outcome, dispatch) else {
        return outcome;
    };
    let Some(reply) = crate::model::outgoing::reply(envelope, consumer, key, output) else {
        return outcome;
    };
    match dispatch.outbound().publish(&reply).await {
        Ok(()) => outcome,
        Err(e) => failure(
            ErrorClass::Transient,
            format!("the stored result could not be sent to reply_to again: {e}"),
            key,
        ),
    }
}

/// What a handler's run returned, how many messages it staged in the outbox, and those
/// messages when all were staged in its own transaction outside any savepoint.
pub(crate) struct Called<T> {
    pub(crate) result: Result<T, HandlerError>,
    pub(crate) staged: u32,
    pub(crate) kept: Option<Vec<Outgoing>>,
}

/// The outcome of a delivery with `fingerprint` whose key is recorded with `stored` and
/// `output`: a duplicate, or a conflict ([`Refusal::of_existing`] judges).
pub(crate) fn existing(
    consumer: &str,
    envelope: &Envelope,
    key: String,
    fingerprint: &Fingerprint,
    stored: &Fingerprint,
    output: Option<StoredOutput>,
) -> Outcome {
    let refusal = Refusal::of_existing(*stored, output, fingerprint);
    refused(consumer, envelope, key, fingerprint, refusal)
}

/// The outcome of a delivery with `fingerprint` that the inbox refused to run: a duplicate
/// (acked, its output replayed), a conflict, a key that failed before (dead-lettered), or a key
/// another consumer is running (retried later).
pub(crate) fn refused(
    consumer: &str,
    envelope: &Envelope,
    key: String,
    fingerprint: &Fingerprint,
    refusal: Refusal,
) -> Outcome {
    let correlation_id = envelope.correlation_id.as_deref();
    match refusal {
        Refusal::Duplicate { output } => {
            tracing::debug!(consumer, %key, correlation_id, "duplicate skipped");
            Outcome::Duplicate {
                key,
                output: output.unwrap_or_else(StoredOutput::null),
            }
        }
        Refusal::Conflict { stored } => {
            tracing::warn!(consumer, %key, correlation_id, %stored, received = %fingerprint, "same key, different payload");
            Outcome::Conflict { key }
        }
        Refusal::Failed { output } => {
            let reason = output
                .and_then(|o| o.decode::<String>().ok())
                .unwrap_or_else(|| "no reason stored".to_owned());
            Outcome::Rejected(Rejection::new(
                RejectReason::PreviouslyFailed,
                format!("an earlier copy of this key failed permanently: {reason}"),
                Some(key),
            ))
        }
        Refusal::Busy { remaining } => {
            tracing::debug!(consumer, %key, correlation_id, ?remaining,
                "another consumer holds the key; retrying later");
            let message = match remaining {
                Some(remaining) => format!(
                    "another consumer is processing this key (its lease runs {} ms more)",
                    remaining.as_millis()
                ),
                None => "another consumer is processing this key".to_owned(),
            };
            Outcome::Retry(Transient {
                message,
                key: Some(key),
            })
        }
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

/// The outcome of a handler's failure `error`, classified (dead-lettered if permanent, held
/// while its store cannot write, else retried).
pub(crate) fn handler_failure(error: HandlerError, key: &str) -> Outcome {
    let message = error.to_string();
    match error.class() {
        Some(ErrorClass::Permanent) => Outcome::Rejected(Rejection::new(
            RejectReason::Handler,
            message,
            Some(key.to_owned()),
        )),
        Some(ErrorClass::Unavailable) => Outcome::Unavailable(Transient {
            message,
            key: Some(key.to_owned()),
        }),
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
        ErrorClass::Unavailable => Outcome::Unavailable(Transient {
            message,
            key: Some(key.to_owned()),
        }),
    }
}

/// What bounds one handler's rows and deliveries.
#[derive(Debug, Clone, Copy)]
pub struct Limits<'a> {
    /// How long its rows are kept.
    pub(crate) retention: Duration,
    /// After how many deliveries without a settlement a message is refused as poison.
    pub(crate) poison: Option<u32>,
    /// Whether a test harness injected a transient failure into this delivery's claim.
    pub(crate) inject_failure: bool,
    /// Whether a stale message is dead-lettered (reason `stale`) instead of acked.
    pub(crate) dead_letter_stale: bool,
    /// The state its handler asks for.
    pub(crate) state: &'a State,
    /// What publishes the messages its handler stages, once they are committed.
    pub(crate) dispatch: Option<Dispatch<'a>>,
}

/// The transient database error a test harness injects (see `Stores::inject_transient`).
pub(crate) fn injected_failure(key: &str) -> Outcome {
    failure(
        crate::model::ErrorClass::Transient,
        "claim failed: a transient database error injected by the test harness".to_owned(),
        key,
    )
}

impl Limits<'static> {
    /// The limits of handler `H`: its own `retention = ...`, else the runtime's, else its
    /// store's; the runtime's poison limit; no state (see [`Limits::with_stores`]).
    pub(crate) fn of<H: Handler>(
        store: &H::Store,
        runtime_retention: Option<Duration>,
        poison: Option<u32>,
    ) -> Self {
        let retention = H::RETENTION
            .or(runtime_retention)
            .unwrap_or_else(|| store.retention());
        Self {
            retention,
            poison,
            inject_failure: false,
            dead_letter_stale: false,
            state: &state::EMPTY,
            dispatch: None,
        }
    }
}

impl Limits<'_> {
    /// These limits, with the handler reading the state of `stores` and stale messages
    /// handled as they say.
    pub(crate) fn with_stores<S: InboxStore>(self, stores: &Stores) -> Limits<'_> {
        Limits {
            state: stores.state(),
            dispatch: stores.dispatch::<S>(),
            dead_letter_stale: stores.dead_letter_stale(),
            ..self
        }
    }
}

/// Counts the run of the handler that this redelivery is about to start, in the store's
/// transaction of its own (first deliveries and handlers without a poison limit pay nothing),
/// into `keyed`: [`Keyed::unsettled`], this key's runs on redeliveries that did not settle,
/// this one included; or, when the count fails, [`Keyed::uncounted`]. The count is taken back
/// when the delivery settles ([`settle_counts`]), and judged only once its key is claimed
/// ([`admit`](super::admit::admit)): a copy of a completed key is a duplicate whatever its count, even
/// when counting it failed.
pub(crate) async fn count_start<H: Handler>(
    store: &H::Store,
    envelope: &Envelope,
    keyed: &mut Keyed,
    retention: Duration,
    limit: Option<u32>,
) {
    if limit.is_none() || !envelope.redelivered {
        return;
    }
    let counted = store
        .count_delivery(&keyed.request(H::CONSUMER, envelope, retention))
        .await;
    match counted {
        Ok(unsettled) => keyed.unsettled = Some(unsettled),
        Err(e) => keyed.uncounted = Some(store_failure(e, &keyed.key)),
    }
}

/// Settles the poison limit's counts of the runs that were counted, each with its outcome: the
/// count of a key now done (processed, a duplicate or a conflict of a processed key, stale) is
/// removed whole, since a copy of a done key is a duplicate whatever its count; any other run
/// takes back its own count only (the runs before it that never settled still count). A
/// failure is logged: a count left behind expires with its key.
pub(crate) async fn settle_counts<H: Handler>(store: &H::Store, runs: &[(&str, &Outcome)]) {
    let (done, settled): (Vec<_>, Vec<_>) = runs.iter().partition(|(_, outcome)| {
        matches!(
            outcome,
            Outcome::Processed { .. }
                | Outcome::Duplicate { .. }
                | Outcome::Conflict { .. }
                | Outcome::Stale(_)
        )
    });
    let done: Vec<&str> = done.iter().map(|(key, _)| *key).collect();
    let settled: Vec<&str> = settled.iter().map(|(key, _)| *key).collect();
    if !done.is_empty()
        && let Err(e) = store.forget_deliveries(H::CONSUMER, &done).await
    {
        tracing::warn!(consumer = H::CONSUMER, error = %e, keys = done.len(), "could not remove the poison limit's counts of keys now done");
    }
    if !settled.is_empty()
        && let Err(e) = store.settle_deliveries(H::CONSUMER, &settled).await
    {
        tracing::warn!(consumer = H::CONSUMER, error = %e, keys = settled.len(), "could not take back the poison limit's counts of settled deliveries");
    }
}
