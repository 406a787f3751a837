//! The runtime's outbox relay: one task per store that keeps an outbox, publishing the rows
//! that no dispatch took (the process that staged them crashed, or the broker was away).

use super::dispatch::{Relay, Watched};
use super::select::{OutboxSelect, RelayReport};
use crate::model::{ErrorClass, StoreError};
use crate::telemetry;
use crate::transport::{Outbound, StopSignal};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How the runtime relays outbox rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RelaySettings {
    /// Time between passes when the last one found less than a full batch.
    pub(crate) interval: Duration,
    /// How long a row is left to the dispatch of the process that staged it.
    pub(crate) age: Duration,
    /// Rows per pass.
    pub(crate) batch: u32,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(500),
            age: Duration::from_secs(2),
            batch: 500,
        }
    }
}

/// Relays `relay`'s rows through `outbound` until `stop`. A pass that sent a full batch is
/// followed at once by the next, which reads and sends while the broker confirms the last (at
/// most two passes at once: the next skips the rows the last holds, and sends behind them on
/// the same channel); anything less waits `settings.interval`, or until the store says rows
/// staged outside any handler were committed (then those are taken at once).
pub(crate) async fn run(
    relay: Relay,
    outbound: Arc<dyn Outbound>,
    settings: RelaySettings,
    mut stop: StopSignal,
) {
    let store = relay.kind.label();
    let older = OutboxSelect::Older {
        age: settings.age,
        limit: settings.batch,
    };
    let full = settings.batch as usize;
    let mut select = older.clone();
    // The pass that sent its rows and awaits their confirms.
    let mut confirming: Option<Pass> = None;
    loop {
        let (pass, sent) = Pass::start(&relay, select.clone(), &outbound);
        let sent = tokio::select! {
            sent = sent => sent.unwrap_or(0),
            _ = stop.wait_for(|stopped| *stopped) => return,
        };
        let mut healthy = true;
        if let Some(last) = confirming.take() {
            let report = tokio::select! {
                report = last.end() => report,
                _ = stop.wait_for(|stopped| *stopped) => return,
            };
            healthy = judge(store, &report, full).is_some();
        }
        if healthy && sent >= full {
            confirming = Some(pass);
            continue;
        }
        let report = tokio::select! {
            report = pass.end() => report,
            _ = stop.wait_for(|stopped| *stopped) => return,
        };
        if healthy && judge(store, &report, full) == Some(true) {
            continue;
        }
        select = tokio::select! {
            () = tokio::time::sleep(settings.interval) => older.clone(),
            () = (relay.wakeup)() => OutboxSelect::Unowned { limit: settings.batch },
            _ = stop.wait_for(|stopped| *stopped) => return,
        };
    }
}

/// Records what a pass did: `None` when it failed, else whether it published a full batch.
fn judge(
    store: &'static str,
    report: &Result<RelayReport, StoreError>,
    full: usize,
) -> Option<bool> {
    match report {
        Ok(report) => {
            report.record(store, "relay");
            if let Some(failure) = &report.failure {
                telemetry::relay_failed(store);
                tracing::warn!(
                    store,
                    failure,
                    "the outbox relay stopped early; retrying at the next interval"
                );
                return None;
            }
            if report.published > 0 {
                tracing::debug!(store, published = report.published, "outbox rows relayed");
            }
            // Parked rows count: a pass full of rows the broker refused goes on at once to
            // the rows behind them.
            Some(report.published + report.parked >= full as u64)
        }
        Err(e) => {
            telemetry::relay_failed(store);
            tracing::warn!(store, error = %e, "the outbox relay failed; retrying at the next interval");
            None
        }
    }
}

/// A relay pass running as its own task; dropping it ends the task (its transaction rolls
/// back, and its rows stay for a later pass).
struct Pass(JoinHandle<Result<RelayReport, StoreError>>);

impl Pass {
    /// Starts a pass over `select`; the receiver gets how many messages it sent, once they are
    /// on their way (dropped unanswered when the pass ends without sending).
    fn start(
        relay: &Relay,
        select: OutboxSelect,
        outbound: &Arc<dyn Outbound>,
    ) -> (Self, oneshot::Receiver<usize>) {
        let (watched, told) = Watched::new(outbound.clone());
        (Self(tokio::spawn((relay.relay)(select, watched))), told)
    }

    /// The pass's report.
    async fn end(mut self) -> Result<RelayReport, StoreError> {
        match (&mut self.0).await {
            Ok(report) => report,
            Err(e) => Err(StoreError::new(
                "relay",
                ErrorClass::Transient,
                format!("the relay pass did not finish: {e}"),
            )),
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::future::BoxFuture;
    use crate::model::Outgoing;
    use crate::model::StoreKind;
    use crate::model::destination::Destination;
    use crate::outbox::RelayFn;
    use crate::transport::OutboundError;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;
    use tokio::sync::{Semaphore, watch};

    /// Confirms nothing until `gate` lets it, once the messages are sent.
    struct Confirming {
        gate: Arc<Semaphore>,
    }

    impl Outbound for Confirming {
        fn publish<'a>(&'a self, _: &'a Outgoing) -> BoxFuture<'a, Result<(), OutboundError>> {
            Box::pin(async { Ok(()) })
        }

        fn publish_all_then<'a>(
            &'a self,
            messages: &'a [Outgoing],
            sent: Box<dyn FnOnce() + Send + 'a>,
        ) -> BoxFuture<'a, Vec<Result<(), OutboundError>>> {
            Box::pin(async move {
                sent();
                self.gate.acquire().await.expect("open").forget();
                messages.iter().map(|_| Ok(())).collect()
            })
        }

        fn publish_all<'a>(
            &'a self,
            messages: &'a [Outgoing],
        ) -> BoxFuture<'a, Vec<Result<(), OutboundError>>> {
            self.publish_all_then(messages, Box::new(|| {}))
        }
    }

    /// Passes that each send a full batch of two and count themselves: started, ended.
    fn counting(started: Arc<AtomicUsize>, ended: Arc<AtomicUsize>) -> Relay {
        let relay: RelayFn = Arc::new(move |_, outbound| {
            let (started, ended) = (started.clone(), ended.clone());
            Box::pin(async move {
                started.fetch_add(1, Ordering::SeqCst);
                let messages = vec![Outgoing::new(Destination::queue("q"), Vec::new()); 2];
                let published = outbound.publish_all(&messages).await.len() as u64;
                ended.fetch_add(1, Ordering::SeqCst);
                Ok(RelayReport {
                    published,
                    ..RelayReport::default()
                })
            })
        });
        Relay {
            kind: StoreKind::new("Test", "test", "Test"),
            relay,
            wakeup: Arc::new(|| Box::pin(std::future::pending())),
            remove: Arc::new(|ids| Box::pin(async move { Ok(ids.len() as u64) })),
            queue: Arc::default(),
        }
    }

    async fn until(what: &str, condition: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn the_next_pass_sends_while_the_last_awaits_its_confirms() {
        let (started, ended) = (Arc::default(), Arc::default());
        let gate = Arc::new(Semaphore::new(0));
        let (stop, stopped) = watch::channel(false);
        let settings = RelaySettings {
            interval: Duration::from_secs(3600),
            age: Duration::ZERO,
            batch: 2,
        };
        let task = tokio::spawn(run(
            counting(Arc::clone(&started), Arc::clone(&ended)),
            Arc::new(Confirming { gate: gate.clone() }),
            settings,
            stopped,
        ));
        let count = |n: &Arc<AtomicUsize>| n.load(Ordering::SeqCst);
        // The first pass's confirms are held: the second starts beside it, a third does not.
        until("two passes started", || count(&started) == 2).await;
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!((count(&started), count(&ended)), (2, 0));
        // The first pass ends: a third starts beside the second.
        gate.add_permits(1);
        until("the third pass started", || count(&started) == 3).await;
        assert_eq!(count(&ended), 1);
        let _ = stop.send(true);
        task.await.expect("the relay stops");
    }
}
