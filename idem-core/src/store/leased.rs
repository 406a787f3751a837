//! [`LeasedRun`]: external mode's state machine of one key, for every entry point (the
//! runtime's pipeline and the HTTP layer). A run leases the key ([`LeasedRun::take`], judged by
//! [`Admission::of_lease`]), and ends its lease in exactly one way: settled with the run's
//! result, released after a transient failure, or abandoned when the run was refused before
//! it began.

use super::admission::{Admission, Refusal};
use super::inbox::ClaimRequest;
use super::lease::LeaseEnd;
use super::roles::LeaseStore;
use super::settlement::settle_lease;
use crate::model::{StoreError, StoredOutput};
use std::time::Duration;

/// What leasing a key gave a request: the lease, or why the request does not run.
#[derive(Debug)]
pub enum Leasing<'a, S: ?Sized> {
    /// The key is leased to this run.
    Run(LeasedRun<'a, S>),
    /// The key is not this request's.
    Refused(Refusal),
}

/// A key leased `in_progress` to one run. Dropping it leaves the lease to run out, as a crash
/// would: a later request takes the key over then.
#[derive(Debug)]
#[must_use = "a lease is settled, released or abandoned; dropped, it holds the key until it expires"]
pub struct LeasedRun<'a, S: ?Sized> {
    store: &'a S,
    request: &'a ClaimRequest<'a>,
    owner: String,
    attempts: u32,
    /// How long the lease lasts: how long a settlement waits for a store that cannot write.
    lease: Duration,
}

impl<'a, S: LeaseStore + ?Sized> LeasedRun<'a, S> {
    /// Leases `request`'s key to `owner` (unique to this run: [`super::owner_token`]) for
    /// `lease`, in a transaction of its own, and judges the answer with the request's
    /// fingerprint.
    pub async fn take(
        store: &'a S,
        request: &'a ClaimRequest<'a>,
        owner: String,
        lease: Duration,
    ) -> Result<Leasing<'a, S>, StoreError> {
        let leased = store.lease(request, &owner, lease).await?;
        Ok(match Admission::of_lease(leased, request.fingerprint) {
            Admission::Run { attempts } => Leasing::Run(Self {
                store,
                request,
                owner,
                attempts,
                lease,
            }),
            Admission::Refused(refusal) => Leasing::Refused(refusal),
        })
    }

    /// The runs granted on the key, this one included: more than 1 when an expired lease was
    /// taken over, and the downstream calls are made again with the same key.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Settles the lease as `end` with `output` ([`settle_lease`]: a transient failure is
    /// retried in place, and a store that cannot write is waited for, up to the lease).
    /// `false`: the lease expired while the run went on and another run took the key over;
    /// nothing was written.
    pub async fn settle(self, end: LeaseEnd, output: &StoredOutput) -> Result<bool, StoreError> {
        let (request, owner) = (self.request, &self.owner);
        settle_lease(self.store, request, owner, end, output, self.lease).await
    }

    /// Gives the lease up after a transient failure: the retry takes the key over at once.
    /// When this fails, the lease runs out on its own.
    pub async fn release(self) -> Result<(), StoreError> {
        self.store.release(self.request, &self.owner).await
    }

    /// Deletes the key, while this run still holds it: the request was refused before it
    /// began, and the key is free for a corrected one. `false`: another run took it over (and
    /// may have completed it); nothing was deleted.
    pub async fn abandon(self) -> Result<bool, StoreError> {
        self.store.abandon(self.request, &self.owner).await
    }
}
