//! The handler registry: every `#[idempotent]` function submits a [`Registration`] through
//! `inventory`, and the runtime finds them here.

use crate::future::BoxFuture;
use crate::handler::Mode;
use crate::model::{Envelope, KeySource, Outcome, StoreError};
use crate::pipeline::{DispatchError, ErasedHandler, Stages};
use crate::state::StateType;
use crate::store::{StoreKind, Stores};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// One registered handler: a handler with its types erased.
#[derive(Clone, Copy)]
pub struct Registration {
    handler: &'static dyn ErasedHandler,
}

inventory::collect!(Registration);

impl Registration {
    /// The registration of `handler`; `#[idempotent]` submits one per function. A handler
    /// written by hand registers with `inventory::submit!(Registration::new(&MyHandler))`.
    pub const fn new(handler: &'static dyn ErasedHandler) -> Self {
        Self { handler }
    }

    /// The handler itself.
    pub fn handler(&self) -> &'static dyn ErasedHandler {
        self.handler
    }

    /// Whether this handler's store can write now (see [`InboxStore::probe`](crate::store::InboxStore::probe)).
    pub fn probe_store<'a>(&'a self, stores: &'a Stores) -> BoxFuture<'a, Result<(), StoreError>> {
        self.handler.probe_store(stores)
    }

    /// Checks that this handler's store is present and usable.
    pub fn check_store<'a>(&'a self, stores: &'a Stores) -> BoxFuture<'a, Result<(), StoreError>> {
        self.handler.check_store(stores)
    }

    /// Whether `stores` holds the store this handler writes to.
    pub fn store_available(&self, stores: &Stores) -> bool {
        self.handler.store_available(stores)
    }

    /// The function's name.
    pub fn name(&self) -> &'static str {
        self.handler.name()
    }

    /// The consumer identity scoping its keys.
    pub fn consumer(&self) -> &'static str {
        self.handler.consumer()
    }

    /// The queue it consumes, when set.
    pub fn queue(&self) -> Option<&'static str> {
        self.handler.queue()
    }

    /// Where its dedup key comes from.
    pub fn key(&self) -> KeySource {
        self.handler.key()
    }

    /// Which database its transaction runs on.
    pub fn store(&self) -> StoreKind {
        self.handler.store()
    }

    /// Transactional or external.
    pub fn mode(&self) -> Mode {
        self.handler.mode()
    }

    /// The state types its parameters ask for.
    pub fn state_types(&self) -> Vec<StateType> {
        self.handler.state_types()
    }

    /// The first state type it asks for that `stores` lacks.
    pub fn missing_state(&self, stores: &Stores) -> Option<StateType> {
        stores.state().missing(&self.state_types())
    }

    /// How long this handler's inbox rows are kept with `stores`: its own retention, else the
    /// one [`Stores::with_retention`] set, else its store's (`None`: the store is missing).
    pub fn retention(&self, stores: &Stores) -> Option<Duration> {
        retention_of(self.handler, stores)
    }

    /// How long its store's relay tries a row the broker refuses before giving it up, if the
    /// store keeps an outbox in `stores` and gives up.
    pub fn outbox_give_up(&self, stores: &Stores) -> Option<Duration> {
        self.handler.store_give_up(stores)
    }

    /// The batch size the handler asks for (`batch = N`), if any.
    pub fn batch_size(&self) -> Option<usize> {
        self.handler.batch_size()
    }

    /// Processes one delivery with this handler, using its store from `stores`.
    pub fn invoke<'a>(
        &'a self,
        stores: &'a Stores,
        envelope: &'a Envelope,
    ) -> BoxFuture<'a, Result<Outcome, DispatchError>> {
        Box::pin(async move {
            let mut held = crate::pipeline::HeldConnection::default();
            self.handler.process(stores, envelope, &mut held).await
        })
    }

    /// Processes a batch of deliveries with this handler in one transaction of its store; one
    /// outcome per envelope, in order.
    pub fn invoke_batch<'a>(
        &'a self,
        stores: &'a Stores,
        envelopes: &'a [Envelope],
    ) -> BoxFuture<'a, Result<Vec<Outcome>, DispatchError>> {
        self.invoke_batch_staged(stores, envelopes, Stages::default())
    }

    /// [`Self::invoke_batch`], overlapping with the neighbouring batches through `stages`.
    pub fn invoke_batch_staged<'a>(
        &'a self,
        stores: &'a Stores,
        envelopes: &'a [Envelope],
        stages: Stages,
    ) -> BoxFuture<'a, Result<Vec<Outcome>, DispatchError>> {
        Box::pin(async move {
            let (mut held, mut stages) = (crate::pipeline::HeldConnection::default(), stages);
            let processed = self
                .handler
                .process_batch(stores, envelopes, &mut stages, &mut held);
            processed.await
        })
    }
}

/// How long `handler`'s inbox rows are kept with `stores` ([`Registration::retention`]).
pub(crate) fn retention_of(handler: &dyn ErasedHandler, stores: &Stores) -> Option<Duration> {
    handler
        .retention()
        .or(stores.retention())
        .or_else(|| handler.store_retention(stores))
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("name", &self.name())
            .field("consumer", &self.consumer())
            .field("queue", &self.queue())
            .field("key", &self.key())
            .field("store", &self.store())
            .field("mode", &self.mode())
            .finish()
    }
}

/// The registry is inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
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
    /// A handler takes the consumer identity the stores' write probe uses.
    #[error(
        "handler `{handler}` uses consumer = \"{consumer}\", which idem keeps for its store probe; give it another `consumer`"
    )]
    ReservedConsumer {
        /// The handler.
        handler: &'static str,
        /// The reserved identity.
        consumer: &'static str,
    },
}

/// Every registered handler, ordered by consumer identity (link order does not matter).
pub fn handlers() -> Vec<&'static Registration> {
    let mut all: Vec<_> = inventory::iter::<Registration>.into_iter().collect();
    all.sort_by_key(|r| (r.consumer(), r.store(), r.name()));
    all
}

/// The registered handler with consumer identity `consumer` (the first, if several stores
/// have one).
pub fn find(consumer: &str) -> Option<&'static Registration> {
    handlers().into_iter().find(|r| r.consumer() == consumer)
}

/// The registered handlers writing to `store`.
pub fn for_store(store: StoreKind) -> Vec<&'static Registration> {
    handlers()
        .into_iter()
        .filter(|r| r.store() == store)
        .collect()
}

/// Checks that no handler takes a reserved consumer identity
/// ([`PROBE_CONSUMER`](crate::store::inbox::PROBE_CONSUMER)), and that no two of `handlers`
/// share a consumer identity on the same store. (The same
/// consumer on two stores is two key spaces, as when one handler is written for PostgreSQL and
/// SQLite and the deployment picks one.)
pub fn validate(handlers: &[&'static Registration]) -> Result<(), RegistryError> {
    let mut seen = BTreeMap::new();
    for r in handlers {
        if r.consumer() == crate::store::inbox::PROBE_CONSUMER {
            return Err(RegistryError::ReservedConsumer {
                handler: r.name(),
                consumer: r.consumer(),
            });
        }
        if let Some(first) = seen.insert((r.store(), r.consumer()), r.name()) {
            return Err(RegistryError::DuplicateConsumer {
                store: r.store(),
                consumer: r.consumer(),
                first,
                second: r.name(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::Handler;
    use crate::model::{Context, HandlerError, KeyError};
    use crate::store::{Claim, ClaimRequest, InboxStore};

    /// A store that is never used: the registry only reads its kind.
    struct Never<const S: usize>;

    impl<const S: usize> InboxStore for Never<S> {
        type Tx<'c> = ();
        type Held = ();
        const KIND: StoreKind = StoreKind::new(["Postgres", "Sqlite"][S], "never", "Never");

        async fn check(&self) -> Result<(), StoreError> {
            Ok(())
        }
        async fn begin(&self) -> Result<(), StoreError> {
            unreachable!("not invoked")
        }
        async fn begin_on(&self, _: &mut Option<()>) -> Result<(), StoreError> {
            unreachable!("not invoked")
        }
        async fn claim(
            &self,
            _: &mut Self::Tx<'_>,
            _: &ClaimRequest<'_>,
        ) -> Result<Claim, StoreError> {
            unreachable!("not invoked")
        }
        async fn complete(
            &self,
            _: &mut Self::Tx<'_>,
            _: &ClaimRequest<'_>,
            _: &crate::model::StoredOutput,
        ) -> Result<(), StoreError> {
            unreachable!("not invoked")
        }
        async fn savepoint(&self, _: &mut Self::Tx<'_>, _: bool) -> Result<(), StoreError> {
            unreachable!("not invoked")
        }
        async fn rollback_to_savepoint(&self, _: &mut Self::Tx<'_>) -> Result<(), StoreError> {
            unreachable!("not invoked")
        }
        async fn unclaim(
            &self,
            _: &mut Self::Tx<'_>,
            _: &str,
            _: &[&str],
        ) -> Result<(), StoreError> {
            unreachable!("not invoked")
        }
        async fn commit(&self, _: Self::Tx<'_>) -> Result<(), StoreError> {
            unreachable!("not invoked")
        }
        async fn rollback(&self, _: Self::Tx<'_>) {}
    }

    // The optional roles, at their defaults: a minimal store.
    impl<const S: usize> crate::store::LeaseStore for Never<S> {}
    impl<const S: usize> crate::store::DeadLetterStore for Never<S> {}
    impl<const S: usize> crate::store::SweepStore for Never<S> {}
    impl<const S: usize> crate::store::OutboxStore for Never<S> {}
    impl<const S: usize> crate::store::ParkingStore for Never<S> {}

    /// Handler `["a", "b", "c"][NAME]` of consumer "billing", on store `S`.
    struct Billing<const NAME: usize, const S: usize>;

    impl<const NAME: usize, const S: usize> Handler for Billing<NAME, S> {
        type Store = Never<S>;
        type Payload = ();
        type Output = ();
        type Kind = crate::handler::kind::Transactional;
        const NAME: &'static str = ["a", "b", "c"][NAME];
        const CONSUMER: &'static str = "billing";
        const QUEUE: Option<&'static str> = None;
        const KEY: KeySource = KeySource::MessageId;

        fn key(envelope: &Envelope, _: &()) -> Result<String, KeyError> {
            Self::KEY.from_envelope(envelope)
        }
    }

    impl<const NAME: usize, const S: usize> crate::handler::TransactionalHandler for Billing<NAME, S> {
        async fn call<'a, 'c: 'a>(
            _: &'a mut <Never<S> as InboxStore>::Tx<'c>,
            _: (),
            _: &'a Context<'a>,
        ) -> Result<(), HandlerError> {
            unreachable!("not invoked")
        }
    }

    static A: Registration = Registration::new(&Billing::<0, 0>);
    static B: Registration = Registration::new(&Billing::<1, 0>);
    static C: Registration = Registration::new(&Billing::<2, 1>);

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
