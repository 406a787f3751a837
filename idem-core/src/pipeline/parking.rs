//! A store's parked keys with its type erased ([`ErasedParking`]): what the workers of an
//! ordered handler that parks keys ask of its store (see [`ParkingStore`]).

use super::held::HeldConnection;
use crate::future::BoxFuture;
use crate::model::{Envelope, Fingerprint, ParkedMessage, Parking, StoreError};
use crate::store::ParkingStore;

/// [`ParkingStore`], callable without the store's type.
pub trait ErasedParking: Send + Sync {
    /// [`ParkingStore::parks`].
    fn parks(&self) -> bool;

    /// [`ParkingStore::admit_ordered`], on the worker's connection `held`.
    fn admit<'a>(
        &'a self,
        consumer: &'a str,
        order_key: &'a str,
        envelope: &'a Envelope,
        held: &'a mut HeldConnection,
    ) -> BoxFuture<'a, Result<Parking, StoreError>>;

    /// [`ParkingStore::next_parked`].
    fn next<'a>(
        &'a self,
        consumer: &'a str,
        order_key: &'a str,
        after: i64,
    ) -> BoxFuture<'a, Result<Option<ParkedMessage>, StoreError>>;

    /// [`ParkingStore::finish_release`].
    fn finish<'a>(
        &'a self,
        consumer: &'a str,
        order_key: &'a str,
        seq: i64,
        fingerprint: &'a Fingerprint,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// [`ParkingStore::parked_summary`].
    fn summary<'a>(
        &'a self,
        consumer: &'a str,
    ) -> BoxFuture<'a, Result<(u64, Option<i64>), StoreError>>;
}

impl<S: ParkingStore> ErasedParking for S {
    fn parks(&self) -> bool {
        ParkingStore::parks(self)
    }

    fn admit<'a>(
        &'a self,
        consumer: &'a str,
        order_key: &'a str,
        envelope: &'a Envelope,
        held: &'a mut HeldConnection,
    ) -> BoxFuture<'a, Result<Parking, StoreError>> {
        Box::pin(self.admit_ordered(consumer, order_key, envelope, held.of::<S>()))
    }

    fn next<'a>(
        &'a self,
        consumer: &'a str,
        order_key: &'a str,
        after: i64,
    ) -> BoxFuture<'a, Result<Option<ParkedMessage>, StoreError>> {
        Box::pin(self.next_parked(consumer, order_key, after))
    }

    fn finish<'a>(
        &'a self,
        consumer: &'a str,
        order_key: &'a str,
        seq: i64,
        fingerprint: &'a Fingerprint,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.finish_release(consumer, order_key, seq, fingerprint))
    }

    fn summary<'a>(
        &'a self,
        consumer: &'a str,
    ) -> BoxFuture<'a, Result<(u64, Option<i64>), StoreError>> {
        Box::pin(self.parked_summary(consumer))
    }
}
