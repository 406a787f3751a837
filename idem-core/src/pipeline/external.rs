//! The pipeline of an external-mode handler ([`crate::handler::ExternalHandler`]): lease the key, run the
//! handler outside any transaction, then settle the row as completed or failed.
//!
//! State machine of one key: *absent* → `in_progress` (lease held) → `completed` or `failed`.
//! An `in_progress` row whose lease expired is taken over by the next copy (attempts + 1), which
//! runs the handler again with the same key: the downstream service deduplicates on it.

use super::admit::admit;
use super::steps::{
    Keyed, Limits, count_start, encode_result, prepare, refused, settle_counts, store_failure,
};
use crate::handler::{ExternalHandler, Handler};
use crate::model::{Context, Envelope, Fingerprint, Outcome, StoreError, StoredOutput, Transient};
use crate::store::{DeadLetterStore, LeaseEnd, LeasedRun, Leasing, Refusal};
use crate::telemetry;
use std::time::{Duration, Instant};

/// Processes one delivery with external-mode handler `H`, holding each lease for `lease`,
/// within `limits`.
pub(crate) async fn process<H: ExternalHandler>(
    store: &H::Store,
    envelope: &Envelope,
    limits: Limits<'_>,
) -> Outcome {
    let lease = H::LEASE;
    let (payload, mut keyed) = match prepare::<H>(envelope) {
        Ok(prepared) => prepared,
        Err(rejected) => return rejected,
    };
    count_start::<H>(store, envelope, &mut keyed, limits.retention, limits.poison).await;
    let (outcome, ran) = run::<H>(store, envelope, payload, &keyed, lease, limits).await;
    match (keyed.unsettled.is_some(), ran) {
        (false, _) => {}
        (true, Ran::Settled) => settle_counts::<H>(store, &[(keyed.key.as_str(), &outcome)]).await,
        // Another consumer holds the lease: this delivery's run did not start, so only its own
        // count is taken back; the runs before it that never settled still count.
        (true, Ran::HeldElsewhere) => {
            if let Err(e) = store.uncount_delivery(H::CONSUMER, &keyed.key).await {
                tracing::warn!(consumer = H::CONSUMER, key = %keyed.key, error = %e, "could not take back the poison limit's count of a delivery that did not run");
            }
        }
    }
    outcome
}

/// Whether a delivery settled its key, or found its lease held by another consumer.
enum Ran {
    Settled,
    HeldElsewhere,
}

/// [`process`] once the delivery is read and its handler's run counted: lease, run, settle.
async fn run<H: ExternalHandler>(
    store: &H::Store,
    envelope: &Envelope,
    payload: H::Payload,
    keyed: &Keyed,
    lease: Duration,
    limits: Limits<'_>,
) -> (Outcome, Ran) {
    let request = keyed.request(H::CONSUMER, envelope, limits.retention);
    let (key, fingerprint) = (&keyed.key, &keyed.fingerprint);
    if limits.inject_failure {
        return (super::steps::injected_failure(key), Ran::Settled);
    }
    let owner = crate::store::owner_token();
    let claiming = Instant::now();
    let leased = LeasedRun::take(store, &request, owner, lease).await;
    telemetry::claim_duration(H::CONSUMER, claiming.elapsed());
    let run = match may_run::<H>(leased, envelope, key, fingerprint) {
        Ok(run) => run,
        // Another consumer holds the lease: this delivery's run did not start.
        Err((outcome, true)) => return (outcome, Ran::HeldElsewhere),
        Err((outcome, false)) => return (outcome, Ran::Settled),
    };
    if let Some(refused) = admit::<H>(keyed, &limits) {
        if let Err(e) = run.release().await {
            // The lease then runs out on its own.
            tracing::warn!(consumer = H::CONSUMER, %key, error = %e, "releasing the lease failed");
        }
        return (refused, Ran::Settled);
    }

    let ctx = Context::new(envelope, H::CONSUMER, key).with_state(limits.state);
    let running = telemetry::HandlerRun::start(H::CONSUMER);
    let result = <H as ExternalHandler>::call(payload, &ctx).await;
    running.end();
    let (end, output, outcome) = match encode_result::<H>(store, result, key) {
        Ok(output) => {
            let outcome = Outcome::Processed {
                key: key.clone(),
                output: output.clone(),
            };
            (LeaseEnd::Completed, output, outcome)
        }
        Err(Outcome::Rejected(rejection)) => {
            let output =
                StoredOutput::encode(&rejection.message).unwrap_or_else(|_| StoredOutput::null());
            (LeaseEnd::Failed, output, Outcome::Rejected(rejection))
        }
        Err(retry) => {
            if let Err(e) = run.release().await {
                // The lease then runs out on its own; the retry waits for it.
                tracing::warn!(consumer = H::CONSUMER, %key, error = %e, "releasing the lease failed");
            }
            return (retry, Ran::Settled);
        }
    };
    let outcome = match run.settle(end, &output).await {
        Ok(true) => outcome,
        Ok(false) => Outcome::Retry(Transient {
            message: "the lease expired while the handler ran and another consumer took the key \
                      over; a later copy finds its result"
                .to_owned(),
            key: Some(key.clone()),
        }),
        // The row stays in progress; once the lease runs out a retry calls again with the
        // same key.
        Err(e) => store_failure(e, key),
    };
    (outcome, Ran::Settled)
}

/// The lease of the handler's run, or the delivery's outcome when the key is not its
/// ([`Admission::of_lease`] judged what the lease found), and whether that is because another
/// consumer holds the key now.
fn may_run<'a, H: Handler>(
    leased: Result<Leasing<'a, H::Store>, StoreError>,
    envelope: &Envelope,
    key: &str,
    fingerprint: &Fingerprint,
) -> Result<LeasedRun<'a, H::Store>, (Outcome, bool)> {
    match leased.map_err(|e| (store_failure(e, key), false))? {
        Leasing::Run(run) => {
            let attempts = run.attempts();
            if attempts > 1 {
                let correlation_id = envelope.correlation_id.as_deref();
                tracing::info!(consumer = H::CONSUMER, %key, correlation_id, attempts,
                    "taking the key over from an earlier attempt (its lease expired or was released); calling again with the same key");
            }
            Ok(run)
        }
        Leasing::Refused(refusal) => {
            let busy = matches!(refusal, Refusal::Busy { .. });
            let outcome = refused(H::CONSUMER, envelope, key.to_owned(), fingerprint, refusal);
            Err((outcome, busy))
        }
    }
}
