//! An ordered handler's parked keys, as its workers meet them (see `crate::model::parking`):
//! whether a delivery runs or waits behind its key's dead letter ([`admit`]), the key a dead
//! letter parks ([`park_key`]), a release handed on to the key's next parked message
//! ([`hand_on`]), and the gauges of a handler's parked keys ([`watch`]).

use super::actor::Shared;
use crate::jitter::jittered;
use crate::model::{
    Envelope, ErrorClass, Fingerprint, Outcome, ParkKey, Parking, StoreError, Transient,
};
use crate::pipeline::{ErasedHandler, HeldConnection};
use crate::store::Stores;
use crate::telemetry;
use crate::transport::{StopSignal, release, released_seq};
use std::sync::Arc;
use std::time::Duration;

/// The first wait before a failed step of a release is tried again; it doubles up to
/// [`LONGEST`].
const FIRST: Duration = Duration::from_millis(50);
/// The longest wait between two tries of a release's step.
const LONGEST: Duration = Duration::from_secs(5);

/// What becomes of a delivery of a handler that parks keys, before it runs.
pub(crate) enum Admit {
    /// It runs; `released`: as the release of the parked message at that place.
    Run { released: Option<i64> },
    /// It does not run: parked (acked), or its store failed (retried or waited for).
    Settled(Outcome),
}

/// Asks the handler's store, on the worker's connection `held`, whether `envelope` runs: its
/// key (its routing key) may be parked. A handler that parks no keys, or a delivery without a
/// routing key, runs.
pub(crate) async fn admit(
    shared: &Shared,
    envelope: &Envelope,
    held: &mut HeldConnection,
) -> Admit {
    let run = Admit::Run { released: None };
    let (Some(_), Some(order_key)) = (&shared.parks, envelope.routing_key.as_deref()) else {
        return run;
    };
    // A missing store is the pipeline's to report.
    let Some(store) = shared.handler.parking(&shared.stores) else {
        return run;
    };
    match store
        .admit(shared.handler.consumer(), order_key, envelope, held)
        .await
    {
        Ok(Parking::Run) => run,
        Ok(Parking::Released(seq)) => Admit::Run {
            released: Some(seq),
        },
        Ok(Parking::Parked) => Admit::Settled(Outcome::Parked {
            order_key: order_key.to_owned(),
        }),
        Err(e) => Admit::Settled(failed(&e)),
    }
}

/// A store that could not tell whether a key is parked: waited for when it cannot write,
/// else retried as a transient failure (never run unchecked).
fn failed(e: &StoreError) -> Outcome {
    let failure = Transient {
        message: e.to_string(),
        key: None,
    };
    match e.class() {
        ErrorClass::Unavailable => Outcome::Unavailable(failure),
        _ => Outcome::Retry(failure),
    }
}

/// The key `envelope`'s dead letter parks, for a handler that parks keys: its routing key,
/// and the place it held if it was a released message.
pub(crate) fn park_key(shared: &Shared, envelope: &Envelope) -> Option<ParkKey> {
    let parks = shared.parks.as_ref()?;
    let order_key = envelope.routing_key.as_deref()?;
    Some(ParkKey::new(order_key, &*parks.source).released(released_seq(envelope)))
}

/// The release of the parked message at `seq` (`envelope`), which settled (applied, a
/// duplicate or stale): the key's next parked message is published, marked as its release,
/// and only then `seq` leaves the parked messages (freeing the key when it was the last).
/// A failed step is tried again, backing off, until `stop`; `false`: stopped first, and the
/// delivery is to be given back (its next run, a duplicate, hands the release on again).
pub(crate) async fn hand_on(
    shared: &Shared,
    envelope: &Envelope,
    seq: i64,
    stop: &StopSignal,
) -> bool {
    let mut wait = FIRST;
    // Once the next message is published, a failed removal is tried again without it.
    let mut published = false;
    loop {
        let failure = match step(shared, envelope, seq, &mut published).await {
            Ok(()) => return true,
            Err(failure) => failure,
        };
        tracing::warn!(failure = %failure, seq, retry_in = ?wait, "handing a parked key's release on failed; trying again");
        let mut stopping = stop.clone();
        tokio::select! {
            _ = tokio::time::sleep(jittered(wait)) => {}
            _ = stopping.wait_for(|stopped| *stopped) => return false,
        }
        wait = (wait * 2).min(LONGEST);
    }
}

/// One try of [`hand_on`]; `published` is set once the next message is.
async fn step(
    shared: &Shared,
    envelope: &Envelope,
    seq: i64,
    published: &mut bool,
) -> Result<(), String> {
    let (Some(parks), Some(order_key)) = (&shared.parks, envelope.routing_key.as_deref()) else {
        return Ok(());
    };
    let store = shared
        .handler
        .parking(&shared.stores)
        .ok_or("the handler's store is missing")?;
    let consumer = shared.handler.consumer();
    let next = match *published {
        true => None,
        false => store
            .next(consumer, order_key, seq)
            .await
            .map_err(|e| e.to_string())?,
    };
    if let Some(next) = next {
        let outbound = parks
            .outbound
            .as_ref()
            .ok_or("the transport cannot publish")?;
        let message = release(&next, consumer, order_key, &parks.source);
        outbound
            .publish(&message)
            .await
            .map_err(|e| e.to_string())?;
        tracing::debug!(
            order_key,
            seq = next.seq,
            "released the next parked message"
        );
    }
    *published = true;
    let fingerprint = Fingerprint::of(&envelope.body);
    store
        .finish(consumer, order_key, seq, &fingerprint)
        .await
        .map_err(|e| e.to_string())
}

/// How often a handler's parked keys are counted for the gauges.
pub(crate) const WATCH_EVERY: Duration = Duration::from_secs(15);

/// Sets the gauges of `handler`'s parked keys from its store every [`WATCH_EVERY`] (at once
/// first), until `stop`.
pub(crate) async fn watch(
    handler: &'static dyn ErasedHandler,
    stores: Arc<Stores>,
    mut stop: StopSignal,
) {
    let consumer = handler.consumer();
    loop {
        if let Some(store) = handler.parking(&stores) {
            match store.summary(consumer).await {
                Ok((keys, oldest)) => {
                    let now = crate::model::epoch_ms();
                    let waited = oldest.map_or(0, |ms| now.saturating_sub(ms).max(0));
                    let waited = Duration::from_millis(u64::try_from(waited).unwrap_or(0));
                    telemetry::parked_keys(consumer, keys, waited);
                }
                Err(e) => {
                    tracing::debug!(consumer, error = %e, "counting parked keys failed; trying again later")
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(WATCH_EVERY) => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
    }
}
