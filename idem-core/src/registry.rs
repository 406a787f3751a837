//! The handler registry: every `#[idempotent]` function submits a [`Registration`] through
//! `inventory`, and the runtime finds them here.

use crate::batch::{Stages, process_batch_in};
use crate::envelope::Envelope;
use crate::error::StoreError;
use crate::external::process_external_in;
use crate::handler::{Handler, Mode};
use crate::key::KeySource;
use crate::outcome::Outcome;
use crate::pipeline::process_in;
use crate::store::{InboxStore, StoreKind, Stores, retention_of};
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// The type-erased store check of one handler.
pub type CheckFn = for<'a> fn(&'a Stores) -> BoxFuture<'a, Result<(), StoreError>>;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The type-erased entry point of one handler.
pub type InvokeFn =
    for<'a> fn(&'a Stores, &'a Envelope) -> BoxFuture<'a, Result<Outcome, DispatchError>>;

/// The type-erased batch entry point of one handler.
pub type InvokeBatchFn = for<'a> fn(
    &'a Stores,
    &'a [Envelope],
    Stages,
) -> BoxFuture<'a, Result<Vec<Outcome>, DispatchError>>;

/// One registered handler.
#[derive(Debug)]
pub struct Registration {
    name: &'static str,
    consumer: &'static str,
    queue: Option<&'static str>,
    key: KeySource,
    store: StoreKind,
    invoke: InvokeFn,
    invoke_batch: InvokeBatchFn,
    available: fn(&Stores) -> bool,
    check: CheckFn,
    mode: Mode,
    retention: Option<Duration>,
    store_retention: fn(&Stores) -> Option<Duration>,
}

inventory::collect!(Registration);

impl Registration {
    /// The registration of handler `H`; `#[idempotent]` submits one per function.
    pub const fn of<H: Handler>() -> Self {
        Self {
            name: H::NAME,
            consumer: H::CONSUMER,
            queue: H::QUEUE,
            key: H::KEY,
            store: <H::Store as InboxStore>::KIND,
            invoke: invoke::<H>,
            invoke_batch: invoke_batch::<H>,
            mode: H::MODE,
            retention: H::RETENTION,
            store_retention: store_retention::<H>,
            available: available::<H>,
            check: check::<H>,
        }
    }

    /// Checks that this handler's store is present and usable.
    pub async fn check_store(&self, stores: &Stores) -> Result<(), StoreError> {
        (self.check)(stores).await
    }

    /// Whether `stores` holds the store this handler writes to.
    pub fn store_available(&self, stores: &Stores) -> bool {
        (self.available)(stores)
    }

    /// The function's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The consumer identity scoping its keys.
    pub fn consumer(&self) -> &'static str {
        self.consumer
    }

    /// The queue it consumes, when set.
    pub fn queue(&self) -> Option<&'static str> {
        self.queue
    }

    /// Where its dedup key comes from.
    pub fn key(&self) -> KeySource {
        self.key
    }

    /// Which database its transaction runs on.
    pub fn store(&self) -> StoreKind {
        self.store
    }

    /// Transactional or external.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// How long this handler's inbox rows are kept with `stores`: its own retention, else the
    /// one [`Stores::with_retention`] set, else its store's (`None`: the store is missing).
    pub fn retention(&self, stores: &Stores) -> Option<Duration> {
        self.retention
            .or(stores.retention())
            .or_else(|| (self.store_retention)(stores))
    }

    /// Processes one delivery with this handler, using its store from `stores`.
    pub async fn invoke(
        &self,
        stores: &Stores,
        envelope: &Envelope,
    ) -> Result<Outcome, DispatchError> {
        (self.invoke)(stores, envelope).await
    }

    /// Processes a batch of deliveries with this handler in one transaction of its store; one
    /// outcome per envelope, in order.
    pub async fn invoke_batch(
        &self,
        stores: &Stores,
        envelopes: &[Envelope],
    ) -> Result<Vec<Outcome>, DispatchError> {
        (self.invoke_batch)(stores, envelopes, Stages::default()).await
    }

    /// [`Self::invoke_batch`], overlapping with the neighbouring batches through `stages`.
    pub async fn invoke_batch_staged(
        &self,
        stores: &Stores,
        envelopes: &[Envelope],
        stages: Stages,
    ) -> Result<Vec<Outcome>, DispatchError> {
        (self.invoke_batch)(stores, envelopes, stages).await
    }
}

fn check<'a, H: Handler>(stores: &'a Stores) -> BoxFuture<'a, Result<(), StoreError>> {
    Box::pin(async move {
        match stores.get::<H::Store>() {
            Some(store) => store.check().await,
            None => Err(StoreError::new(
                "check",
                crate::error::ErrorClass::Permanent,
                format!("no {} store was provided", <H::Store as InboxStore>::KIND),
            )),
        }
    })
}

fn store_retention<H: Handler>(stores: &Stores) -> Option<Duration> {
    stores.get::<H::Store>().map(InboxStore::retention)
}

fn available<H: Handler>(stores: &Stores) -> bool {
    stores.get::<H::Store>().is_some()
}

/// The store handler `H` writes to, from `stores`.
fn store_of<H: Handler>(stores: &Stores) -> Result<&H::Store, DispatchError> {
    stores.get::<H::Store>().ok_or(DispatchError::MissingStore {
        consumer: H::CONSUMER,
        store: <H::Store as InboxStore>::KIND,
    })
}

fn invoke<'a, H: Handler>(
    stores: &'a Stores,
    envelope: &'a Envelope,
) -> BoxFuture<'a, Result<Outcome, DispatchError>> {
    Box::pin(async move {
        let store = store_of::<H>(stores)?;
        let retention = retention_of::<H>(store, stores.retention());
        Ok(match H::MODE {
            Mode::Transactional => process_in::<H>(store, envelope, retention).await,
            Mode::External { .. } => process_external_in::<H>(store, envelope, retention).await,
        })
    })
}

/// A batch in one transaction; an external handler shares no transaction, so its batch is its
/// messages one after another, each leased and settled on its own, after the previous batch.
fn invoke_batch<'a, H: Handler>(
    stores: &'a Stores,
    envelopes: &'a [Envelope],
    stages: Stages,
) -> BoxFuture<'a, Result<Vec<Outcome>, DispatchError>> {
    Box::pin(async move {
        let store = store_of::<H>(stores)?;
        let retention = retention_of::<H>(store, stores.retention());
        if H::MODE == Mode::Transactional {
            return Ok(process_batch_in::<H>(store, envelopes, stages, retention).await);
        }
        if let Some(after) = stages.after {
            let _ = after.await;
        }
        let mut outcomes = Vec::with_capacity(envelopes.len());
        for envelope in envelopes {
            outcomes.push(process_external_in::<H>(store, envelope, retention).await);
        }
        for done in [stages.committing, stages.committed].into_iter().flatten() {
            let _ = done.send(());
        }
        Ok(outcomes)
    })
}

/// A handler could not be run at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DispatchError {
    /// The handler's store was not provided.
    #[error("handler `{consumer}` writes to a {store} inbox, but no {store} store was provided")]
    MissingStore {
        /// The handler's consumer identity.
        consumer: &'static str,
        /// The store it needs.
        store: StoreKind,
    },
}

/// The registry is inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// Two handlers on the same store share a consumer identity, so they would share (and
    /// suppress each other's) dedup keys.
    #[error(
        "handlers `{first}` and `{second}` both use consumer = \"{consumer}\" on {store}; give each its own `consumer`"
    )]
    DuplicateConsumer {
        /// The store both write to.
        store: StoreKind,
        /// The shared identity.
        consumer: &'static str,
        /// One handler.
        first: &'static str,
        /// The other.
        second: &'static str,
    },
}

/// Every registered handler, ordered by consumer identity (link order does not matter).
pub fn handlers() -> Vec<&'static Registration> {
    let mut all: Vec<_> = inventory::iter::<Registration>.into_iter().collect();
    all.sort_by_key(|r| (r.consumer, r.store, r.name));
    all
}

/// The registered handler with consumer identity `consumer` (the first, if several stores
/// have one).
pub fn find(consumer: &str) -> Option<&'static Registration> {
    handlers().into_iter().find(|r| r.consumer == consumer)
}

/// The registered handlers writing to `store`.
pub fn for_store(store: StoreKind) -> Vec<&'static Registration> {
    handlers()
        .into_iter()
        .filter(|r| r.store == store)
        .collect()
}

/// Checks that no two of `handlers` share a consumer identity on the same store. (The same
/// consumer on two stores is two key spaces, as when one handler is written for PostgreSQL and
/// SQLite and the deployment picks one.)
pub fn validate(handlers: &[&'static Registration]) -> Result<(), RegistryError> {
    let mut seen = BTreeMap::new();
    for r in handlers {
        if let Some(first) = seen.insert((r.store, r.consumer), r.name) {
            return Err(RegistryError::DuplicateConsumer {
                store: r.store,
                consumer: r.consumer,
                first,
                second: r.name,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn never<'a>(_: &'a Stores, _: &'a Envelope) -> BoxFuture<'a, Result<Outcome, DispatchError>> {
        Box::pin(async { unreachable!("not invoked") })
    }

    const fn registration(
        name: &'static str,
        consumer: &'static str,
        store: StoreKind,
    ) -> Registration {
        Registration {
            name,
            consumer,
            queue: None,
            key: KeySource::MessageId,
            store,
            invoke: never,
            invoke_batch: |_, _, _| Box::pin(async { unreachable!("not invoked") }),
            available: |_| true,
            check: |_| Box::pin(async { Ok(()) }),
            mode: Mode::Transactional,
            retention: None,
            store_retention: |_| None,
        }
    }

    static A: Registration = registration("a", "billing", StoreKind::Postgres);
    static B: Registration = registration("b", "billing", StoreKind::Postgres);
    static C: Registration = registration("c", "billing", StoreKind::Sqlite);

    #[test]
    fn consumers_are_unique_per_store() {
        validate(&[&A, &C]).unwrap();
        let err = validate(&[&A, &C, &B]).unwrap_err().to_string();
        assert!(
            err.contains("`a` and `b` both use consumer = \"billing\" on Postgres"),
            "{err}"
        );
    }
}
