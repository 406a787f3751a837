//! The inbox pipelines, and their one entry point: [`ErasedHandler`], which every registered
//! handler is, runs the pipeline of the handler's kind ([`Pipeline`], in `kinds.rs`), chosen
//! by its type when the handler is registered:
//!
//! | kind | one delivery | a batch |
//! |---|---|---|
//! | transactional | `transactional`: one transaction, claim, handler, commit | `batch`: one transaction for the batch, a handler run per message |
//! | batch | `batch`, as a batch of one | `batch`: one transaction, one handler run |
//! | external | `external`: lease, handler, settle | each delivery on its own, after the previous batch |
//!
//! `steps` holds what every mode shares (decode, key and fingerprint; duplicate or conflict;
//! turning failures into outcomes); [`stages`] how consecutive batches overlap.

mod admit;
mod batch;
mod external;
mod held;
mod kinds;
pub mod parking;
pub mod stages;
mod steps;
mod transactional;

pub use held::HeldConnection;
pub use kinds::Pipeline;
pub use parking::ErasedParking;
pub use stages::Stages;

use steps::Limits;

use crate::future::BoxFuture;
use crate::handler::{Handler, Mode};
use crate::model::KeySource;
use crate::model::{DeadLetterRecord, Envelope, Outcome, StoreError};
use crate::state::StateType;
use crate::store::{DeadLetterStore, InboxStore, StoreKind, Stores};
use futures_util::FutureExt;
use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

/// Processes one delivery with handler `H` in `store`, through its kind's pipeline, keeping
/// its row for the handler's retention (else the store's), with no poison limit.
///
/// In transactional mode the marker row and the handler's writes commit together or not at
/// all: nothing is committed unless the outcome is [`Outcome::Processed`].
pub async fn process<H: Handler<Kind: Pipeline<H>>>(
    store: &H::Store,
    envelope: &Envelope,
) -> Outcome {
    let limits = Limits::of::<H>(store, None, None);
    H::Kind::one(store, envelope, limits, &mut None).await
}

/// Processes `envelopes` with handler `H` in `store` (transactional mode: one transaction),
/// returning one outcome per envelope, in order.
///
/// A key that occurs twice in the batch is processed once; its later copies are duplicates (or
/// conflicts) of the first once that has committed, and are retried if it did not.
pub async fn process_batch<H: Handler<Kind: Pipeline<H>>>(
    store: &H::Store,
    envelopes: &[Envelope],
) -> Vec<Outcome> {
    let limits = Limits::of::<H>(store, None, None);
    H::Kind::batch(store, envelopes, &mut Stages::default(), limits, &mut None).await
}

/// A handler with its types erased: what the registry holds and the runtime calls. Every
/// [`Handler`] is one.
pub trait ErasedHandler: Send + Sync + 'static {
    /// The function's name.
    fn name(&self) -> &'static str;
    /// The consumer identity scoping its keys.
    fn consumer(&self) -> &'static str;
    /// The queue it consumes, when set.
    fn queue(&self) -> Option<&'static str>;
    /// Where its dedup key comes from.
    fn key(&self) -> KeySource;
    /// The database its inbox is in.
    fn store(&self) -> StoreKind;
    /// Transactional or external.
    fn mode(&self) -> Mode;
    /// The state types its parameters ask for.
    fn state_types(&self) -> Vec<StateType>;
    /// Its own retention, if it sets one.
    fn retention(&self) -> Option<Duration>;
    /// The batch size it asks for (`batch = N`), if any.
    fn batch_size(&self) -> Option<usize>;
    /// The retention of its store in `stores` (`None`: the store is missing).
    fn store_retention(&self, stores: &Stores) -> Option<Duration>;
    /// How long its store's relay tries a refused row before giving it up, if it has one.
    fn store_give_up(&self, stores: &Stores) -> Option<Duration>;
    /// Whether `stores` holds its store.
    fn store_available(&self, stores: &Stores) -> bool;
    /// Checks that its store is present and usable.
    fn check_store<'a>(&'a self, stores: &'a Stores) -> BoxFuture<'a, Result<(), StoreError>>;
    /// Whether its store can write now ([`InboxStore::probe`]).
    fn probe_store<'a>(&'a self, stores: &'a Stores) -> BoxFuture<'a, Result<(), StoreError>>;
    /// Records `record` in its store from `stores` (see [`DeadLetterStore::record_dead_letter`]).
    fn record_dead_letter<'a>(
        &'a self,
        stores: &'a Stores,
        record: &'a DeadLetterRecord,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    /// Its store's parked keys, from `stores` (`None`: the store is missing).
    fn parking<'a>(&self, stores: &'a Stores) -> Option<&'a dyn ErasedParking>;
    /// Processes one delivery with its store from `stores`, in a transaction on the
    /// connection `held` keeps for the caller. A panic in the handler is caught and reported
    /// as [`DispatchError::Panicked`]; its transaction is rolled back and `held` emptied.
    fn process<'a>(
        &'a self,
        stores: &'a Stores,
        envelope: &'a Envelope,
        held: &'a mut HeldConnection,
    ) -> BoxFuture<'a, Result<Outcome, DispatchError>>;
    /// Processes a batch with its store from `stores`, in a transaction on the connection
    /// `held` keeps for the caller, overlapping with the neighbouring batches through
    /// `stages`; one outcome per envelope, in order. A panic is caught as in
    /// [`ErasedHandler::process`]. What a batch whose store could not write leaves unfired in
    /// `stages` is the caller's to hand to the batch's next run (see [`Stages`]).
    fn process_batch<'a>(
        &'a self,
        stores: &'a Stores,
        envelopes: &'a [Envelope],
        stages: &'a mut Stages,
        held: &'a mut HeldConnection,
    ) -> BoxFuture<'a, Result<Vec<Outcome>, DispatchError>>;
}

impl<H: Handler<Kind: Pipeline<H>>> ErasedHandler for H {
    fn name(&self) -> &'static str {
        H::NAME
    }

    fn consumer(&self) -> &'static str {
        H::CONSUMER
    }

    fn queue(&self) -> Option<&'static str> {
        H::QUEUE
    }

    fn key(&self) -> KeySource {
        H::KEY
    }

    fn store(&self) -> StoreKind {
        <H::Store as InboxStore>::KIND
    }

    fn mode(&self) -> Mode {
        H::Kind::mode()
    }

    fn state_types(&self) -> Vec<StateType> {
        H::state_types()
    }

    fn retention(&self) -> Option<Duration> {
        H::RETENTION
    }

    fn batch_size(&self) -> Option<usize> {
        H::BATCH_SIZE
    }

    fn store_retention(&self, stores: &Stores) -> Option<Duration> {
        stores.get::<H::Store>().map(InboxStore::retention)
    }

    fn store_give_up(&self, stores: &Stores) -> Option<Duration> {
        stores
            .get::<H::Store>()
            .and_then(crate::store::OutboxStore::outbox_give_up)
    }

    fn store_available(&self, stores: &Stores) -> bool {
        stores.get::<H::Store>().is_some()
    }

    fn check_store<'a>(&'a self, stores: &'a Stores) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            match stores.get::<H::Store>() {
                Some(store) => store.check().await,
                None => Err(StoreError::new(
                    "check",
                    crate::model::ErrorClass::Permanent,
                    format!("no {} store was provided", <H::Store as InboxStore>::KIND),
                )),
            }
        })
    }

    fn probe_store<'a>(&'a self, stores: &'a Stores) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            match stores.get::<H::Store>() {
                Some(store) => store.probe().await,
                None => Err(StoreError::new(
                    "probe",
                    crate::model::ErrorClass::Permanent,
                    format!("no {} store was provided", <H::Store as InboxStore>::KIND),
                )),
            }
        })
    }

    fn record_dead_letter<'a>(
        &'a self,
        stores: &'a Stores,
        record: &'a DeadLetterRecord,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            match store_of::<H>(stores) {
                Ok(store) => store.record_dead_letter(record).await,
                Err(e) => Err(StoreError::new(
                    "record dead letter",
                    crate::model::ErrorClass::Transient,
                    e.to_string(),
                )),
            }
        })
    }

    fn parking<'a>(&self, stores: &'a Stores) -> Option<&'a dyn ErasedParking> {
        stores
            .get::<H::Store>()
            .map(|store| store as &dyn ErasedParking)
    }

    fn process<'a>(
        &'a self,
        stores: &'a Stores,
        envelope: &'a Envelope,
        held: &'a mut HeldConnection,
    ) -> BoxFuture<'a, Result<Outcome, DispatchError>> {
        Box::pin(async move {
            let store = store_of::<H>(stores)?;
            let limits = Limits {
                inject_failure: stores.take_injected(),
                ..Limits::of::<H>(store, stores.retention(), stores.poison_limit())
            }
            .with_stores::<H::Store>(stores);
            let held = held.of::<H::Store>();
            let processed = unwound(H::Kind::one(store, envelope, limits, held)).await;
            if processed.is_err() {
                // A panic may have left the connection mid-way; the pool checks it.
                *held = None;
            }
            processed
        })
    }

    fn process_batch<'a>(
        &'a self,
        stores: &'a Stores,
        envelopes: &'a [Envelope],
        stages: &'a mut Stages,
        held: &'a mut HeldConnection,
    ) -> BoxFuture<'a, Result<Vec<Outcome>, DispatchError>> {
        Box::pin(async move {
            let store = store_of::<H>(stores)?;
            let limits = Limits::of::<H>(store, stores.retention(), stores.poison_limit())
                .with_stores::<H::Store>(stores);
            let held = held.of::<H::Store>();
            let processed = unwound(H::Kind::batch(store, envelopes, stages, limits, held)).await;
            if processed.is_err() {
                // A panic may have left the connection mid-way; the pool checks it.
                *held = None;
            }
            processed
        })
    }
}

/// Runs `pipeline`, catching a handler's panic: the panic unwinds through the pipeline, which
/// drops (and so rolls back) its transaction, and is reported instead of propagated.
async fn unwound<T>(pipeline: impl Future<Output = T>) -> Result<T, DispatchError> {
    AssertUnwindSafe(pipeline)
        .catch_unwind()
        .await
        .map_err(|panic| DispatchError::Panicked(panic_message(panic.as_ref())))
}

/// The text a panic carried.
fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic".to_owned())
}

/// The store handler `H` writes to, from `stores`.
fn store_of<H: Handler>(stores: &Stores) -> Result<&H::Store, DispatchError> {
    stores.get::<H::Store>().ok_or(DispatchError::MissingStore {
        consumer: H::CONSUMER,
        store: <H::Store as InboxStore>::KIND,
    })
}

/// A handler could not be run, or did not return.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DispatchError {
    /// The handler panicked; nothing it did was committed.
    #[error("handler panicked: {0}")]
    Panicked(String),
    /// The handler's store was not provided.
    #[error("handler `{consumer}` writes to a {store} inbox, but no {store} store was provided")]
    MissingStore {
        /// The handler's consumer identity.
        consumer: &'static str,
        /// The store it needs.
        store: StoreKind,
    },
}
