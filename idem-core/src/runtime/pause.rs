//! A store that cannot write for now (read-only after a failover, disk full, restarting) pauses
//! the consumption of its handlers instead of failing their messages: the delivery that met
//! the failure ([`crate::model::Outcome::Unavailable`]) waits in its worker, unsettled, and no worker of
//! the store's handlers takes another delivery, so the rest stay in the mailbox and the broker
//! (within the prefetch). One task probes the store with a write
//! ([`crate::store::InboxStore::probe`]), backing off with jitter; once a probe commits, the store
//! resumes and the waiting deliveries run again as the same attempt. No attempt is spent and
//! nothing is dead-lettered for the store's state. While paused, readiness is false and the
//! gauge `idem_store_paused` is 1.

use super::stats::Stats;
use crate::future::BoxFuture;
use crate::jitter::jittered;
use crate::model::StoreError;
use crate::pipeline::ErasedHandler;
use crate::store::{StoreKind, Stores};
use crate::telemetry;
use crate::transport::StopSignal;
use futures_util::FutureExt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// How long the first probe waits after the store failed; each next wait doubles, up to
/// [`PROBE_LONGEST`], with up to a quarter taken off at random so that the replicas of a
/// service do not probe in step.
const PROBE_FIRST: Duration = Duration::from_millis(500);
/// The longest wait between two probes.
const PROBE_LONGEST: Duration = Duration::from_secs(5);
/// How long one probe may take before it counts as failed.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// A store's probe: a write that commits and leaves nothing behind.
pub(crate) type ProbeFn = Arc<dyn Fn() -> BoxFuture<'static, Result<(), StoreError>> + Send + Sync>;

/// The pauses of a runtime's stores: one for each store its handlers write to, made when the
/// first of them starts.
#[derive(Default)]
pub(crate) struct Pauses {
    stats: Arc<Stats>,
    pauses: Mutex<Vec<Arc<Pause>>>,
}

impl Pauses {
    /// No pauses yet; those made count in `stats`.
    pub(crate) fn new(stats: Arc<Stats>) -> Self {
        Self {
            stats,
            pauses: Mutex::default(),
        }
    }

    /// The pause of `handler`'s store in `stores`, made (probing through `handler`) if it is
    /// the first handler of that store.
    pub(crate) fn of(
        &self,
        handler: &'static dyn ErasedHandler,
        stores: &Arc<Stores>,
    ) -> Arc<Pause> {
        let mut pauses = self.pauses.lock().unwrap_or_else(PoisonError::into_inner);
        let kind = handler.store();
        if let Some(pause) = pauses.iter().find(|pause| pause.kind == kind) {
            return pause.clone();
        }
        let stores = stores.clone();
        let probe: ProbeFn = Arc::new(move || {
            let stores = stores.clone();
            Box::pin(async move { handler.probe_store(&stores).await })
        });
        let pause = Arc::new(Pause::new(kind, probe, self.stats.clone()));
        pauses.push(pause.clone());
        pause
    }

    /// Every store that is paused now: its name, for how long, and why.
    pub(crate) fn paused(&self) -> Vec<(StoreKind, Duration, String)> {
        let pauses = self.pauses.lock().unwrap_or_else(PoisonError::into_inner);
        pauses
            .iter()
            .filter_map(|pause| {
                let (since, reason) = pause.paused()?;
                Some((pause.kind, since, reason))
            })
            .collect()
    }
}

/// Whether one store writes, shared by the workers of every handler on it.
pub(crate) struct Pause {
    kind: StoreKind,
    probe: ProbeFn,
    state: watch::Sender<Option<Paused>>,
    stats: Arc<Stats>,
}

/// Why and since when a store is paused.
#[derive(Debug, Clone)]
struct Paused {
    since: Instant,
    reason: String,
}

impl Pause {
    /// The pause of the store `kind`, writable until a handler meets an unavailable store;
    /// `probe` tells when it writes again.
    pub(crate) fn new(kind: StoreKind, probe: ProbeFn, stats: Arc<Stats>) -> Self {
        telemetry::store_paused(kind, false);
        Self {
            kind,
            probe,
            state: watch::Sender::new(None),
            stats,
        }
    }

    /// The store failed as unavailable (`reason`): pauses its handlers' consumption unless it is
    /// paused already, and starts the probe that resumes it (which ends early when `stop` is
    /// raised).
    pub(crate) fn enter(self: &Arc<Self>, reason: &str, stop: &StopSignal) {
        let mut started = false;
        self.state.send_if_modified(|state| {
            if state.is_some() {
                return false;
            }
            *state = Some(Paused {
                since: Instant::now(),
                reason: reason.to_owned(),
            });
            started = true;
            true
        });
        if !started {
            return;
        }
        tracing::warn!(store = %self.kind, reason, "the store cannot write for now; pausing the consumption of its handlers until a probe write succeeds (nothing is retried or dead-lettered meanwhile)");
        Stats::add(&self.stats.pauses);
        telemetry::store_paused(self.kind, true);
        tokio::spawn(probe_until_writable(self.clone(), stop.clone()));
    }

    /// Waits while the store is paused; `false` when `stop` was raised first (or already).
    pub(crate) async fn writable(&self, stop: &StopSignal) -> bool {
        let mut stop = stop.clone();
        let mut state = self.state.subscribe();
        if *stop.borrow() {
            return false;
        }
        tokio::select! {
            writable = state.wait_for(Option::is_none) => writable.is_ok(),
            _ = stop.wait_for(|stopped| *stopped) => false,
        }
    }

    /// How long the store has been paused and why, while it is.
    pub(crate) fn paused(&self) -> Option<(Duration, String)> {
        let state = self.state.borrow();
        state
            .as_ref()
            .map(|paused| (paused.since.elapsed(), paused.reason.clone()))
    }

    /// The store wrote: resume its handlers.
    fn resume(&self) {
        let was = self.state.send_replace(None);
        telemetry::store_paused(self.kind, false);
        if let Some(paused) = was {
            tracing::info!(store = %self.kind, paused = ?paused.since.elapsed(), "the store writes again; resuming the consumption of its handlers");
        }
    }
}

/// Probes `pause`'s store, backing off with jitter, until a probe commits (then resumes it) or
/// `stop` is raised.
async fn probe_until_writable(pause: Arc<Pause>, mut stop: StopSignal) {
    let mut wait = PROBE_FIRST;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(jittered(wait)) => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
        let probe = std::panic::AssertUnwindSafe((pause.probe)()).catch_unwind();
        match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
            Ok(Ok(Ok(()))) => {
                pause.resume();
                return;
            }
            Ok(Err(_)) => {
                tracing::error!(store = %pause.kind, "the store's probe panicked; probing again");
            }
            Ok(Ok(Err(e))) => {
                tracing::debug!(store = %pause.kind, error = %e, retry_in = ?wait, "the store cannot write yet");
                pause.state.send_if_modified(|state| match state {
                    Some(paused) => {
                        paused.reason = e.to_string();
                        false
                    }
                    None => false,
                });
            }
            Err(_) => {
                tracing::debug!(store = %pause.kind, timeout = ?PROBE_TIMEOUT, "the store's probe did not answer in time");
            }
        }
        wait = (wait * 2).min(PROBE_LONGEST);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    const KIND: StoreKind = StoreKind::new("Memory", "memory", "MemStore");

    #[tokio::test(start_paused = true)]
    async fn a_paused_store_resumes_once_a_probe_commits() {
        let probes = Arc::new(AtomicU32::new(0));
        let counted = probes.clone();
        let probe: ProbeFn = Arc::new(move || {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            Box::pin(async move {
                match n >= 3 {
                    true => Ok(()),
                    false => Err(StoreError::new(
                        "probe",
                        crate::model::ErrorClass::Unavailable,
                        "read-only",
                    )),
                }
            })
        });
        let stats = Arc::new(Stats::default());
        let pause = Arc::new(Pause::new(KIND, probe, stats.clone()));
        let (_stop_tx, stop) = watch::channel(false);
        assert!(pause.writable(&stop).await, "writable until a failure");
        pause.enter("read-only", &stop);
        pause.enter("read-only again", &stop);
        assert_eq!(
            pause.paused().map(|(_, reason)| reason).as_deref(),
            Some("read-only")
        );
        assert!(pause.writable(&stop).await);
        assert!(pause.paused().is_none());
        assert_eq!(
            probes.load(Ordering::SeqCst),
            3,
            "probed until one committed"
        );
        assert_eq!(
            stats.snapshot().pauses,
            1,
            "one pause, however many workers met it"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_ends_the_wait_of_a_paused_store() {
        let probe: ProbeFn = Arc::new(|| {
            Box::pin(async {
                Err(StoreError::new(
                    "probe",
                    crate::model::ErrorClass::Unavailable,
                    "disk full",
                ))
            })
        });
        let pause = Arc::new(Pause::new(KIND, probe, Arc::default()));
        let (stop_tx, stop) = watch::channel(false);
        pause.enter("disk full", &stop);
        let waiting = {
            let pause = pause.clone();
            let stop = stop.clone();
            tokio::spawn(async move { pause.writable(&stop).await })
        };
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(
            !waiting.is_finished(),
            "still paused after a minute of failed probes"
        );
        stop_tx.send(true).unwrap();
        assert!(!waiting.await.unwrap(), "the stop ended the wait");
    }

    #[test]
    fn jitter_takes_off_at_most_a_quarter() {
        for _ in 0..1000 {
            let wait = jittered(Duration::from_secs(4));
            assert!(
                wait > Duration::from_secs(3) && wait <= Duration::from_secs(4),
                "{wait:?}"
            );
        }
    }
}
