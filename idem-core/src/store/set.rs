//! The set of inbox stores a runtime holds, one per store type, with their sweepers and the
//! state its handlers ask for.

use super::inbox::{InboxStore, StoreKind};
use super::roles::RuntimeStore;
use super::sweep::{Pace, SweepReport};
use crate::future::BoxFuture;
use crate::model::StoreError;
use crate::outbox::{Dispatch, Relay, RelayFn, RemoveFn, WakeupFn};
use crate::state::State;
use crate::transport::Outbound;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The inbox stores available to handlers, one per store type, and the [`State`] they ask for.
#[derive(Clone, Default)]
pub struct Stores {
    stores: HashMap<TypeId, Arc<dyn Any + Send + Sync>>,
    sweepers: HashMap<TypeId, Sweeper>,
    relays: HashMap<TypeId, Relay>,
    outbound: Option<Arc<dyn Outbound>>,
    state: State,
    retention: Option<Duration>,
    poison_limit: Option<u32>,
    dead_letter_stale: bool,
    #[cfg(feature = "testing")]
    injected: Arc<std::sync::atomic::AtomicU32>,
}

/// One store's [`SweepStore::sweep_paced`](super::SweepStore::sweep_paced), type-erased: `(batch, max_batches, pace)`.
pub type SweepFn = Arc<
    dyn Fn(u32, u32, Pace) -> BoxFuture<'static, Result<SweepReport, StoreError>> + Send + Sync,
>;

/// A store's sweeper, as the runtime runs it.
#[derive(Clone)]
pub struct Sweeper {
    /// The database.
    pub kind: StoreKind,
    /// Runs one sweep.
    pub sweep: SweepFn,
}

impl Stores {
    /// No stores.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `store`, replacing any store of the same type.
    pub fn with<S: RuntimeStore>(mut self, store: S) -> Self {
        self.insert(store);
        self
    }

    /// Adds `store`, replacing any store of the same type.
    pub fn insert<S: RuntimeStore>(&mut self, store: S) {
        let store = Arc::new(store);
        let sweeping = store.clone();
        let sweep: SweepFn = Arc::new(move |batch, max_batches, pace| {
            let store = sweeping.clone();
            Box::pin(async move { store.sweep_paced(batch, max_batches, pace).await })
        });
        self.sweepers.insert(
            TypeId::of::<S>(),
            Sweeper {
                kind: S::KIND,
                sweep,
            },
        );
        if store.outbox_table().is_none() {
            self.relays.remove(&TypeId::of::<S>());
            self.stores.insert(TypeId::of::<S>(), store);
            return;
        }
        let relaying = store.clone();
        let relay: RelayFn = Arc::new(move |select, outbound| {
            let store = relaying.clone();
            Box::pin(async move { store.relay(&select, outbound.as_ref()).await })
        });
        let waking = store.clone();
        let wakeup: WakeupFn = Arc::new(move || {
            let store = waking.clone();
            Box::pin(async move { store.outbox_wakeup().await })
        });
        let removing = store.clone();
        let remove: RemoveFn = Arc::new(move |ids| {
            let store = removing.clone();
            Box::pin(async move { store.outbox_remove(&ids).await })
        });
        self.relays.insert(
            TypeId::of::<S>(),
            Relay {
                kind: S::KIND,
                relay,
                wakeup,
                remove,
                queue: Arc::default(),
            },
        );
        self.stores.insert(TypeId::of::<S>(), store);
    }

    /// Publishes outbox messages through `outbound` (the runtime sets its transport's).
    pub fn with_outbound(mut self, outbound: Arc<dyn Outbound>) -> Self {
        #[cfg(feature = "fault-injection")]
        let outbound: Arc<dyn Outbound> = Arc::new(crate::fault::Crashing(outbound));
        self.outbound = Some(outbound);
        self
    }

    /// The publisher set with [`Self::with_outbound`].
    pub fn outbound(&self) -> Option<&Arc<dyn Outbound>> {
        self.outbound.as_ref()
    }

    /// The relays of the stores held that keep an outbox, one per store.
    pub fn relays(&self) -> impl Iterator<Item = &Relay> {
        self.relays.values()
    }

    /// What dispatches the messages staged in store `S`'s transactions, when a publisher is
    /// set.
    pub fn dispatch<S: InboxStore>(&self) -> Option<Dispatch<'_>> {
        let outbound = self.outbound.as_ref()?;
        let relay = self.relays.get(&TypeId::of::<S>())?;
        Some(Dispatch { relay, outbound })
    }

    /// Adds a state value that handlers ask for with a parameter `&T`, replacing any value of
    /// the same type.
    pub fn with_state<T: Send + Sync + 'static>(mut self, value: T) -> Self {
        self.state.insert(value);
        self
    }

    /// The state values held.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// The state values held, to add to.
    pub fn state_mut(&mut self) -> &mut State {
        &mut self.state
    }

    /// The sweepers of the stores held, one per store.
    pub fn sweepers(&self) -> impl Iterator<Item = &Sweeper> {
        self.sweepers.values()
    }

    /// Keeps rows for `retention` for handlers that set none of their own (default: each
    /// store's own retention).
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Counts, in the handler's store, the runs of a handler on redeliveries that started and
    /// never settled, and refuses a message whose key is new at its delivery after `limit` of
    /// them as `poison` (default: no limit here; the runtime sets 5). See
    /// [`DeadLetterStore::count_delivery`](super::DeadLetterStore::count_delivery).
    pub fn with_poison_limit(mut self, limit: Option<u32>) -> Self {
        self.poison_limit = limit.map(|l| l.max(1));
        self
    }

    /// Dead-letters stale versioned messages (reason `stale`) instead of acking them (default:
    /// ack and count them).
    pub fn with_dead_letter_stale(mut self, dead_letter: bool) -> Self {
        self.dead_letter_stale = dead_letter;
        self
    }

    /// The choice made with [`Self::with_dead_letter_stale`].
    pub fn dead_letter_stale(&self) -> bool {
        self.dead_letter_stale
    }

    /// The limit set with [`Self::with_poison_limit`].
    pub fn poison_limit(&self) -> Option<u32> {
        self.poison_limit
    }

    /// The retention set with [`Self::with_retention`].
    pub fn retention(&self) -> Option<Duration> {
        self.retention
    }

    /// Test harnesses only (feature `testing`): the next `count` claims through these stores
    /// (per-message processing, either mode) fail with a transient database error after the
    /// transaction began, so the transaction is rolled back and the delivery is retried.
    /// Clones of this set share the count.
    #[cfg(feature = "testing")]
    pub fn inject_transient(&self, count: u32) {
        self.injected
            .fetch_add(count, std::sync::atomic::Ordering::SeqCst);
    }

    /// Takes one injected failure, if any is left (never, without the feature `testing`).
    pub(crate) fn take_injected(&self) -> bool {
        #[cfg(feature = "testing")]
        {
            use std::sync::atomic::Ordering;
            self.injected
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        }
        #[cfg(not(feature = "testing"))]
        false
    }

    /// The store of type `S`, if one was added.
    pub fn get<S: InboxStore>(&self) -> Option<&S> {
        self.stores
            .get(&TypeId::of::<S>())
            .and_then(|store| store.downcast_ref::<S>())
    }
}

impl fmt::Debug for Stores {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stores")
            .field("count", &self.stores.len())
            .field("state", &self.state)
            .finish()
    }
}
