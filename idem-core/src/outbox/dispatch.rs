//! A store's outbox as the runtime drives it: its relay passes ([`Relay`]), and the dispatch
//! of staged messages right after their transaction commits ([`Dispatch::after_commit`]).
//! Messages the handler staged in its own transaction are published from memory (`kept.rs`);
//! any other run is queued, and one task per store takes the runs queued since its last pass
//! and publishes their rows in one pass, so a busy consumer pays one select, one burst of
//! publishes and one delete for many commits.

use super::in_flight::InFlight;
use super::kept::{self, RemoveFn};
use super::select::{OutboxSelect, RelayReport};
use crate::future::BoxFuture;
use crate::model::StoreKind;
use crate::model::{Outgoing, StoreError};
use crate::transport::{Outbound, OutboundError};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};

/// One store's [`OutboxStore::relay`](crate::store::OutboxStore::relay), type-erased.
pub type RelayFn = Arc<
    dyn Fn(OutboxSelect, Arc<dyn Outbound>) -> BoxFuture<'static, Result<RelayReport, StoreError>>
        + Send
        + Sync,
>;

/// One store's [`OutboxStore::outbox_wakeup`](crate::store::OutboxStore::outbox_wakeup), type-erased.
pub type WakeupFn = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// A store's outbox relay, as the runtime runs it: after a commit that staged messages, on
/// an interval for the rows a crash left, and when the store says rows staged outside any
/// handler were committed.
#[derive(Clone)]
pub struct Relay {
    /// The database.
    pub kind: StoreKind,
    /// Runs one relay pass.
    pub relay: RelayFn,
    /// Resolves when rows staged outside any handler may be waiting.
    pub wakeup: WakeupFn,
    /// Removes the rows of messages a dispatch published from memory.
    pub remove: RemoveFn,
    /// The runs committed and waiting for their dispatch.
    pub(crate) queue: Arc<DispatchQueue>,
}

impl fmt::Debug for Relay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay").field("kind", &self.kind).finish()
    }
}

/// The most runs one dispatch pass takes (two parameters each).
const RUNS_PER_PASS: usize = 256;

/// About how many rows one dispatch pass takes, when the runs before staged several each.
const ROWS_PER_PASS: u64 = 1_000;

/// Dispatch passes of one store running at once.
const PASSES_IN_FLIGHT: usize = 4;

/// Committed runs of one store waiting for a dispatch pass. When the broker stops confirming
/// (a resource alarm, a partition), a full queue makes the next commit wait before it is
/// acked: consumption slows down instead of memory growing.
pub(crate) const DISPATCH_QUEUE: usize = 1_024;

/// A committed run waiting for its dispatch: `(consumer, key)` and when it committed.
type Pending = (String, String, Instant);

/// A store's dispatch queue; its task starts with the first commit that staged messages and
/// ends, after the runs queued, when the queue is dropped. So does the task removing the
/// rows of messages published from memory.
#[derive(Debug)]
pub(crate) struct DispatchQueue {
    sender: OnceLock<mpsc::Sender<Pending>>,
    remover: OnceLock<mpsc::UnboundedSender<Vec<String>>>,
    /// Runs published from memory and not yet confirmed.
    in_memory: Arc<Semaphore>,
    /// Runs whose dispatch has not ended; shutdown waits for them.
    pub(crate) in_flight: Arc<InFlight>,
}

impl Default for DispatchQueue {
    fn default() -> Self {
        Self {
            sender: OnceLock::new(),
            remover: OnceLock::new(),
            in_memory: Arc::new(Semaphore::new(kept::RUNS_IN_FLIGHT)),
            in_flight: Arc::default(),
        }
    }
}

/// What dispatches a handler's staged messages right after its transaction commits: its
/// store's relay and the transport's publisher.
#[derive(Clone, Copy, Debug)]
pub struct Dispatch<'a> {
    pub(crate) relay: &'a Relay,
    pub(crate) outbound: &'a Arc<dyn Outbound>,
}

impl Dispatch<'_> {
    /// The transport's publisher.
    pub fn outbound(&self) -> &Arc<dyn Outbound> {
        self.outbound
    }

    /// Publishes, in the background, the messages `consumer` staged while processing `key`,
    /// once their transaction committed: `kept` (all of them, in the order staged) from
    /// memory, else their rows read back from the outbox; the rows a failure leaves are the
    /// relay's. Returns at once, unless as many runs as the store's dispatch allows are
    /// already waiting for the broker: then it waits for room, and the caller (the commit
    /// path, before its ack) with it.
    pub async fn after_commit(&self, consumer: &str, key: &str, kept: Option<Vec<Outgoing>>) {
        let committed = Instant::now();
        let queue = &self.relay.queue;
        if let Some(messages) = kept.filter(|kept| !kept.is_empty())
            && let Ok(permit) = queue.in_memory.clone().try_acquire_owned()
        {
            let store = self.relay.kind.label();
            let remover = queue.remover.get_or_init(|| {
                let (sender, receiver) = mpsc::unbounded_channel();
                let in_flight = queue.in_flight.clone();
                let remove = self.relay.remove.clone();
                tokio::spawn(kept::remove(store, remove, receiver, in_flight));
                sender
            });
            queue.in_flight.start(1);
            let run = kept::Run {
                store,
                committed,
                permit,
                in_flight: queue.in_flight.clone(),
            };
            let outbound = self.outbound.clone();
            tokio::spawn(kept::publish(run, outbound, messages, remover.clone()));
            return;
        }
        let sender = self.relay.queue.sender.get_or_init(|| {
            let (sender, receiver) = mpsc::channel(DISPATCH_QUEUE);
            tokio::spawn(drain(self.relay.clone(), self.outbound.clone(), receiver));
            sender
        });
        queue.in_flight.start(1);
        // The task ends only once every sender is gone: a send cannot fail while this one is.
        let pending = (consumer.to_owned(), key.to_owned(), committed);
        if sender.send(pending).await.is_err() {
            queue.in_flight.end(1);
        }
    }
}

/// Dispatches the runs `queue` brings until it closes. A pass starts at once when no other is
/// reading and sending its rows; otherwise it waits for a full pass's worth of runs (as many
/// as make about [`ROWS_PER_PASS`] rows at the rows per run seen so far) or until the others
/// have sent theirs, taking every run queued meanwhile: a pass reads while the last awaits
/// its confirms. Up to [`PASSES_IN_FLIGHT`] passes run at once. A run's rows all go in one
/// pass, in the order staged.
async fn drain(relay: Relay, outbound: Arc<dyn Outbound>, mut queue: mpsc::Receiver<Pending>) {
    let store = relay.kind.label();
    let in_flight = relay.queue.in_flight.clone();
    let passes = Arc::new(Semaphore::new(PASSES_IN_FLIGHT));
    // Passes that have not sent their rows yet.
    let sending = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(Notify::new());
    // Rows per run, in hundredths, as the last pass found them.
    let rows_per_run = Arc::new(AtomicU64::new(100));
    loop {
        let Ok(permit) = passes.clone().acquire_owned().await else {
            return;
        };
        let per_run = rows_per_run.load(Ordering::Relaxed).max(100);
        let take = (ROWS_PER_PASS * 100 / per_run).clamp(1, RUNS_PER_PASS as u64) as usize;
        let mut pending = Vec::with_capacity(take);
        if queue.recv_many(&mut pending, take).await == 0 {
            return;
        }
        while pending.len() < take && sending.load(Ordering::Acquire) > 0 {
            let room = take - pending.len();
            tokio::select! {
                more = queue.recv_many(&mut pending, room) => if more == 0 {
                    break;
                },
                () = sent.notified() => {}
            }
        }
        let runs = pending
            .iter()
            .map(|(consumer, key, _)| (consumer.clone(), key.clone()))
            .collect();
        let (watched, on_sent) = Watched::new(outbound.clone());
        let mut pass = (relay.relay)(OutboxSelect::Runs { runs }, watched.clone());
        let (rows_per_run, sending, sent) = (rows_per_run.clone(), sending.clone(), sent.clone());
        let in_flight = in_flight.clone();
        sending.fetch_add(1, Ordering::AcqRel);
        tokio::spawn(async move {
            let mut on_sent = on_sent;
            let ended = tokio::select! {
                _ = &mut on_sent => None,
                report = &mut pass => Some(report),
            };
            // Sent, or ended without sending: either way it holds up no other pass now. A
            // permit is kept when nobody waits: the gatherer re-checks `sending`.
            sending.fetch_sub(1, Ordering::AcqRel);
            sent.notify_one();
            let report = match ended {
                Some(report) => report,
                None => pass.await,
            };
            match report {
                Ok(report) => {
                    report.record(store, "dispatch");
                    let rows = report.published + report.unroutable;
                    rows_per_run.store(rows * 100 / pending.len() as u64, Ordering::Relaxed);
                    if report.failure.is_none() {
                        let confirmed = watched.confirmed().unwrap_or_else(Instant::now);
                        for (_, _, committed) in &pending {
                            let took = confirmed.saturating_duration_since(*committed);
                            crate::telemetry::dispatched(store, took);
                        }
                    }
                }
                Err(e) => tracing::warn!(
                    store,
                    error = %e,
                    "dispatching staged messages failed; the relay publishes them"
                ),
            }
            in_flight.end(pending.len());
            drop(permit);
        });
    }
}

/// A pass's publisher: says how many messages the pass sent as soon as they are on their way,
/// and notes when the broker confirmed them all.
pub(crate) struct Watched {
    inner: Arc<dyn Outbound>,
    sent: Mutex<Option<oneshot::Sender<usize>>>,
    confirmed: OnceLock<Instant>,
}

impl Watched {
    /// `inner`, watched; the receiver hears how many messages were sent (0 for a pass that
    /// found no rows), or is dropped unanswered when the pass ends before it publishes.
    pub(crate) fn new(inner: Arc<dyn Outbound>) -> (Arc<Self>, oneshot::Receiver<usize>) {
        let (sent, told) = oneshot::channel();
        let watched = Self {
            inner,
            sent: Mutex::new(Some(sent)),
            confirmed: OnceLock::new(),
        };
        (Arc::new(watched), told)
    }

    /// When the broker had confirmed every message of the pass.
    pub(crate) fn confirmed(&self) -> Option<Instant> {
        self.confirmed.get().copied()
    }
}

impl Outbound for Watched {
    fn publish<'a>(&'a self, message: &'a Outgoing) -> BoxFuture<'a, Result<(), OutboundError>> {
        self.inner.publish(message)
    }

    fn publish_all<'a>(
        &'a self,
        messages: &'a [Outgoing],
    ) -> BoxFuture<'a, Vec<Result<(), OutboundError>>> {
        let told = self.sent.lock().unwrap_or_else(|e| e.into_inner()).take();
        let count = messages.len();
        Box::pin(async move {
            let sent = Box::new(move || {
                if let Some(told) = told {
                    let _ = told.send(count);
                }
            });
            let results = self.inner.publish_all_then(messages, sent).await;
            let _ = self.confirmed.set(Instant::now());
            results
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::destination::Destination;
    use std::sync::Mutex;

    /// Publishes nothing: the passes under test never call it.
    struct Nowhere;

    impl Outbound for Nowhere {
        fn publish<'a>(&'a self, _: &'a Outgoing) -> BoxFuture<'a, Result<(), OutboundError>> {
            Box::pin(async { Ok(()) })
        }
    }

    /// A relay whose passes record the runs they were given, send nothing (`send`: no
    /// messages) and wait for `gate` to let them end.
    fn recording(seen: Arc<Mutex<Vec<Vec<String>>>>, gate: Arc<Semaphore>, send: bool) -> Relay {
        let relay: RelayFn = Arc::new(move |select, outbound| {
            let (seen, gate) = (seen.clone(), gate.clone());
            Box::pin(async move {
                if send {
                    outbound.publish_all(&[]).await;
                }
                let OutboxSelect::Runs { runs } = select else {
                    panic!("a dispatch reads runs, not {select:?}");
                };
                let keys: Vec<String> = runs.into_iter().map(|(_, key)| key).collect();
                let report = RelayReport {
                    published: keys.len() as u64,
                    ..RelayReport::default()
                };
                seen.lock().expect("not poisoned").push(keys);
                gate.acquire().await.expect("open").forget();
                Ok(report)
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

    async fn passes_seen(seen: &Mutex<Vec<Vec<String>>>, count: usize) -> Vec<Vec<String>> {
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let passes = seen.lock().expect("not poisoned").clone();
            if passes.len() >= count {
                return passes;
            }
            assert!(
                Instant::now() < deadline,
                "{count} passes expected, saw {passes:?}"
            );
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn commits_during_a_pass_go_together_in_the_next() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(Semaphore::new(0));
        let relay = recording(seen.clone(), gate.clone(), false);
        let outbound: Arc<dyn Outbound> = Arc::new(Nowhere);
        let dispatch = Dispatch {
            relay: &relay,
            outbound: &outbound,
        };
        dispatch.after_commit("c", "k0", None).await;
        assert_eq!(passes_seen(&seen, 1).await, [vec!["k0".to_owned()]]);
        // The first pass holds: the commits meanwhile wait for it, and then go in one pass.
        for n in 1..=5 {
            dispatch.after_commit("c", &format!("k{n}"), None).await;
        }
        tokio::task::yield_now().await;
        assert_eq!(seen.lock().expect("not poisoned").len(), 1);
        gate.add_permits(1);
        let passes = passes_seen(&seen, 2).await;
        let expected: Vec<String> = (1..=5).map(|n| format!("k{n}")).collect();
        assert_eq!(passes[1], expected);
        gate.add_permits(1);
    }

    #[tokio::test]
    async fn a_pass_starts_while_the_last_awaits_its_confirms() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(Semaphore::new(0));
        let relay = recording(seen.clone(), gate.clone(), true);
        let outbound: Arc<dyn Outbound> = Arc::new(Nowhere);
        let dispatch = Dispatch {
            relay: &relay,
            outbound: &outbound,
        };
        dispatch.after_commit("c", "k0", None).await;
        passes_seen(&seen, 1).await;
        // The first pass has sent its messages and holds: the next commit does not wait.
        dispatch.after_commit("c", "k1", None).await;
        let passes = passes_seen(&seen, 2).await;
        assert_eq!(passes[1], ["k1".to_owned()]);
        gate.add_permits(2);
    }

    /// A run whose messages were kept goes out from memory, with no read of the outbox, and
    /// the rows of its confirmed messages are removed.
    #[tokio::test]
    async fn a_kept_run_is_not_read_back() {
        let removed = Arc::new(Mutex::new(Vec::new()));
        let seen = removed.clone();
        let mut relay = recording(Arc::default(), Arc::new(Semaphore::new(0)), false);
        relay.relay = Arc::new(|select, _| panic!("a kept run is not read back: {select:?}"));
        relay.remove = Arc::new(move |ids| {
            let count = ids.len() as u64;
            seen.lock().expect("not poisoned").extend(ids);
            Box::pin(async move { Ok(count) })
        });
        let outbound: Arc<dyn Outbound> = Arc::new(Nowhere);
        let dispatch = Dispatch {
            relay: &relay,
            outbound: &outbound,
        };
        let kept =
            ["k1", "k2"].map(|id| Outgoing::new(Destination::queue("q"), "x").with_message_id(id));
        dispatch.after_commit("c", "k", Some(kept.to_vec())).await;
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while removed.lock().expect("not poisoned").len() < 2 {
            assert!(Instant::now() < deadline, "the kept rows were not removed");
            tokio::task::yield_now().await;
        }
        assert_eq!(*removed.lock().expect("not poisoned"), ["k1", "k2"]);
    }
}
