//! The dispatch of messages a handler staged in its own transaction, from memory: right after
//! the commit they are published as the handler staged them, with no read of the outbox, and
//! once the broker confirmed them their rows are removed, many runs' in one statement.

use super::in_flight::InFlight;
use super::select::RelayReport;
use crate::future::BoxFuture;
use crate::model::{Outgoing, StoreError};
use crate::transport::{Outbound, OutboundError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, mpsc};

/// One store's [`OutboxStore::outbox_remove`](crate::store::OutboxStore::outbox_remove), type-erased.
pub type RemoveFn =
    Arc<dyn Fn(Vec<String>) -> BoxFuture<'static, Result<u64, StoreError>> + Send + Sync>;

/// Runs published from memory and not yet confirmed, per store; a commit beyond them has its
/// rows read back by a dispatch pass instead (so a broker that stopped confirming holds no
/// more than this many runs in memory).
pub(super) const RUNS_IN_FLIGHT: usize = 1_024;

/// Message ids removed per statement (and runs gathered for one).
const IDS_PER_REMOVE: usize = 500;

/// How long the remover gathers the runs confirmed after the first it has, before it removes
/// their rows.
const LINGER: Duration = Duration::from_millis(10);

/// Tries to remove confirmed rows this many times before leaving them to the relay.
const REMOVE_ATTEMPTS: u32 = 3;

/// One run published from memory: its store, when it committed, its slot among the runs in
/// flight, and the count shutdown waits on (counted once already; the remover ends it once
/// the run's rows are removed).
pub(super) struct Run {
    pub(super) store: &'static str,
    pub(super) committed: Instant,
    pub(super) permit: OwnedSemaphorePermit,
    pub(super) in_flight: Arc<InFlight>,
}

/// Publishes `messages` (one run, in the order staged), and hands the ids the broker
/// confirmed, up to the first it did not, to `remover`; from that one on, the rows stay for
/// the relay, which sends them again in order with their ids.
pub(super) async fn publish(
    run: Run,
    outbound: Arc<dyn Outbound>,
    messages: Vec<Outgoing>,
    remover: mpsc::UnboundedSender<Vec<String>>,
) {
    let Run {
        store,
        committed,
        permit,
        in_flight,
    } = run;
    let results = outbound.publish_all(&messages).await;
    let confirmed = Instant::now();
    drop(permit);
    let mut report = RelayReport::default();
    let mut done = Vec::with_capacity(messages.len());
    for (message, result) in messages.iter().zip(results) {
        match result {
            Ok(()) => done.push(message.message_id().unwrap_or_default().to_owned()),
            Err(e) => {
                if matches!(e, OutboundError::Unroutable { .. }) {
                    report.unroutable += 1;
                }
                tracing::debug!(store, error = %e, "dispatching a staged message failed; the relay publishes it");
                report.failure = Some(e.to_string());
                break;
            }
        }
    }
    report.record(store, "dispatch");
    if report.failure.is_none() {
        crate::telemetry::dispatched(store, confirmed.saturating_duration_since(committed));
    }
    // The remover ends the run once its rows are removed; a send cannot fail while this
    // sender lives, as the remover ends only once every sender is gone.
    if done.is_empty() || remover.send(done).is_err() {
        in_flight.end(1);
    }
}

/// Removes the rows of the ids `confirmed` brings, those of the runs confirmed within
/// [`LINGER`] of each other together (up to [`IDS_PER_REMOVE`] a statement), until it closes. Rows it cannot remove stay for the
/// relay, which publishes them again with their ids (the next consumer deduplicates them).
pub(super) async fn remove(
    store: &'static str,
    remove: RemoveFn,
    mut confirmed: mpsc::UnboundedReceiver<Vec<String>>,
    in_flight: Arc<InFlight>,
) {
    let mut waiting = Vec::new();
    loop {
        if confirmed.recv_many(&mut waiting, IDS_PER_REMOVE).await == 0 {
            return;
        }
        // A statement (and on most databases a commit) per few runs would compete with the
        // handlers' commits for the disk: the runs confirmed soon after go in the same one.
        let gathered = Instant::now() + LINGER;
        while waiting.len() < IDS_PER_REMOVE {
            let room = IDS_PER_REMOVE - waiting.len();
            match tokio::time::timeout_at(gathered.into(), confirmed.recv_many(&mut waiting, room))
                .await
            {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        let runs = waiting.len();
        let mut ids: Vec<String> = waiting.drain(..).flatten().collect();
        while !ids.is_empty() {
            let rest = ids.split_off(ids.len().min(IDS_PER_REMOVE));
            let chunk = std::mem::replace(&mut ids, rest);
            let count = chunk.len();
            let mut attempt = 1;
            let removed = loop {
                match remove(chunk.clone()).await {
                    Ok(removed) => break removed,
                    Err(e) if attempt < REMOVE_ATTEMPTS => {
                        tracing::debug!(store, error = %e, attempt, "removing dispatched rows failed; retrying");
                        tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
                        attempt += 1;
                    }
                    Err(e) => {
                        tracing::warn!(store, error = %e, count, "removing dispatched rows failed; the relay publishes them again");
                        break 0;
                    }
                }
            };
            let report = RelayReport {
                published: removed,
                ..RelayReport::default()
            };
            report.record(store, "dispatch");
        }
        in_flight.end(runs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::destination::Destination;
    use std::sync::Mutex;

    /// Publishes to queues named `…-routed` only, and records the ids it was given.
    struct Routing(Mutex<Vec<String>>);

    impl Outbound for Routing {
        fn publish<'a>(
            &'a self,
            message: &'a Outgoing,
        ) -> BoxFuture<'a, Result<(), OutboundError>> {
            Box::pin(async move {
                let id = message.message_id().unwrap_or_default().to_owned();
                self.0.lock().expect("not poisoned").push(id);
                match message.destination.parts().1.ends_with("-routed") {
                    true => Ok(()),
                    false => Err(OutboundError::Unroutable {
                        destination: message.destination.clone(),
                    }),
                }
            })
        }
    }

    /// A kept run goes out in order; the rows of the messages confirmed are removed, and from
    /// the first the broker did not take on, the rows stay for the relay.
    #[tokio::test]
    async fn only_the_rows_confirmed_before_a_failure_are_removed() {
        let removed = Arc::new(Mutex::new(Vec::new()));
        let seen = removed.clone();
        let remove_fn: RemoveFn = Arc::new(move |ids| {
            let count = ids.len() as u64;
            seen.lock().expect("not poisoned").push(ids);
            Box::pin(async move { Ok(count) })
        });
        let (remover, confirmed) = mpsc::unbounded_channel();
        let in_flight = Arc::new(InFlight::default());
        let removing = tokio::spawn(remove("test", remove_fn, confirmed, in_flight.clone()));
        let routing = Arc::new(Routing(Mutex::default()));
        let slots = Arc::new(tokio::sync::Semaphore::new(2));
        let message =
            |to: &str, id: &str| Outgoing::new(Destination::queue(to), "x").with_message_id(id);
        let runs = [
            vec![message("q-routed", "a1"), message("q-routed", "a2")],
            vec![
                message("q-routed", "b1"),
                message("q-missing", "b2"),
                message("q-routed", "b3"),
            ],
        ];
        for run in runs {
            let permit = slots.clone().try_acquire_owned().expect("a slot");
            let outbound: Arc<dyn Outbound> = routing.clone();
            in_flight.start(1);
            let kept = Run {
                store: "test",
                committed: Instant::now(),
                permit,
                in_flight: in_flight.clone(),
            };
            publish(kept, outbound, run, remover.clone()).await;
        }
        tokio::time::timeout(Duration::from_secs(5), in_flight.idle())
            .await
            .expect("both runs end: published, and their confirmed rows removed");
        assert_eq!(
            slots.available_permits(),
            2,
            "each run's slot is given back"
        );
        drop(remover);
        removing
            .await
            .expect("the remover ends once its senders are gone");
        let ids = removed.lock().expect("not poisoned").concat();
        assert_eq!(ids, ["a1", "a2", "b1"], "the confirmed rows, and only they");
        let sent = routing.0.lock().expect("not poisoned").clone();
        // All sent, in order; b3's row stays, to go out again after b2's.
        assert_eq!(sent, ["a1", "a2", "b1", "b2", "b3"]);
    }
}
