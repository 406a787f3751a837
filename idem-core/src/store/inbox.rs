//! The inbox store contract every store implements: transactions, and claims of dedup markers
//! in them. The optional roles (leases, dead-letter records, sweeps, the outbox) are in
//! `roles`.

pub use crate::model::StoreKind;
use crate::model::{ErrorClass, Fingerprint, StoreError, StoredOutput};
use std::future::Future;
use std::time::Duration;

/// One claim: "I am about to process `key` for `consumer`".
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The consumer identity scoping the key.
    pub consumer: &'a str,
    /// The dedup key.
    pub key: &'a str,
    /// The payload's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// The delivery attempt, recorded on the row.
    pub attempt: u32,
    /// How long the row is kept: it expires this long after the claim.
    pub retention: Duration,
}

/// The operation of a [`StoreError`] by which [`InboxStore::check`] refuses a start because
/// the database's settings can lose a commit after its message was acked: the runtime reports
/// it as `RuntimeError::StoreSettings`, not as an inbox to migrate.
pub const DURABILITY: &str = "durability";

/// The consumer identity of the key [`InboxStore::probe`] writes and removes again; no handler
/// may take it.
pub const PROBE_CONSUMER: &str = "idem.probe";

/// How long inbox rows are kept unless the handler, the runtime or the store says otherwise:
/// 7 days. It must outlast the broker's redelivery window (including operators resubmitting
/// from a dead-letter queue), or a late redelivery finds no marker and is processed again.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// What a claim found.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// The row was inserted in the caller's transaction: the key is new. It becomes visible
    /// to others only when that transaction commits.
    Claimed,
    /// A committed row exists for this key.
    Existing {
        /// The fingerprint stored with it.
        fingerprint: Fingerprint,
        /// The result stored with it (`None` when the handler's result was `null`).
        output: Option<StoredOutput>,
    },
}

/// An inbox: claims and completes dedup markers inside a transaction the caller also hands to
/// the user's handler, so that marker and side effects commit together or not at all.
///
/// A claim must be insert-first (the database's unique key on `(consumer, key)` decides between
/// concurrent copies), must not abort the transaction on conflict, and must block behind an
/// uncommitted claim of the same key until that transaction ends.
///
/// This is the one role every store implements; the others ([`LeaseStore`](super::LeaseStore),
/// [`DeadLetterStore`](super::DeadLetterStore), [`SweepStore`](super::SweepStore),
/// [`OutboxStore`](super::OutboxStore)) have defaults for every method.
pub trait InboxStore: Send + Sync + 'static {
    /// The transaction type handed to handlers; `'c` is the connection it runs on when that is
    /// borrowed from a worker ([`InboxStore::begin_on`]), `'static` when it owns its own.
    type Tx<'c>: Send;
    /// A connection one worker keeps between its transactions ([`InboxStore::begin_on`]);
    /// `()` for a store that keeps none.
    type Held: Send + 'static;
    /// Which database this is.
    const KIND: StoreKind;

    /// Classifies an error a handler got from this store's database ([`crate::model::HandlerError::Database`]),
    /// knowing the database's error codes. The default calls every such error transient: a
    /// retry costs little, a lost message a lot.
    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> ErrorClass {
        let _ = error;
        ErrorClass::Transient
    }

    /// Checks that the inbox is usable (its table exists with the expected columns); the
    /// runtime calls this before it consumes anything.
    fn check(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Whether the store can write now: a transaction that writes, commits and leaves nothing
    /// behind. The runtime probes a store that failed as unavailable
    /// ([`ErrorClass::Unavailable`]) until this succeeds, then resumes its handlers. The
    /// default claims a key of its own under the consumer [`PROBE_CONSUMER`], removes it again
    /// and commits.
    fn probe(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        async move {
            let key = super::lease::owner_token();
            let fingerprint = Fingerprint::of(key.as_bytes());
            let request = ClaimRequest {
                consumer: PROBE_CONSUMER,
                key: &key,
                fingerprint: &fingerprint,
                attempt: 1,
                retention: Duration::from_secs(60),
            };
            let mut tx = self.begin().await?;
            let written = match self.claim(&mut tx, &request).await {
                Ok(_) => self.unclaim(&mut tx, PROBE_CONSUMER, &[&key]).await,
                Err(e) => Err(e),
            };
            match end_transaction(self, tx, written).await {
                Ok(_) => Ok(()),
                Err(Ended::RolledBack(e) | Ended::NotCommitted(e)) => Err(e),
            }
        }
    }

    /// How long rows are kept when neither the handler nor the runtime sets a retention
    /// (default [`DEFAULT_RETENTION`]).
    fn retention(&self) -> Duration {
        DEFAULT_RETENTION
    }

    /// Opens a transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx<'static>, StoreError>> + Send;

    /// Opens a transaction on the connection `held`, which one worker keeps between its
    /// transactions: taken first when `held` is empty, replaced when it no longer answers,
    /// given back after a while so that the store's own connection policy applies. A store
    /// with no connection to spare (or none to keep) leaves `held` empty and opens the
    /// transaction as [`InboxStore::begin`] does.
    fn begin_on<'c>(
        &'c self,
        held: &'c mut Option<Self::Held>,
    ) -> impl Future<Output = Result<Self::Tx<'c>, StoreError>> + Send + 'c;

    /// Inserts the marker for `request`, or reports the committed row that holds its key.
    fn claim(
        &self,
        tx: &mut Self::Tx<'_>,
        request: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Claims like [`InboxStore::claim`], but answers `None` at once, instead of waiting, when
    /// another transaction's uncommitted claim holds the key (its request is still running:
    /// HTTP answers 409). A store that cannot tell waits, as `claim` does (the default).
    fn try_claim(
        &self,
        tx: &mut Self::Tx<'_>,
        request: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Option<Claim>, StoreError>> + Send {
        async move { self.claim(tx, request).await.map(Some) }
    }

    /// Stores the handler's result on the marker claimed in this transaction. Not called for
    /// `null` results.
    fn complete(
        &self,
        tx: &mut Self::Tx<'_>,
        request: &ClaimRequest<'_>,
        output: &StoredOutput,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Claims several keys at once (batch mode), answering in `requests`' order. The keys are
    /// distinct, and the claim is the first statement of its transaction (a store may rely on
    /// that). The default claims one by one; stores override it with one statement.
    fn claim_batch(
        &self,
        tx: &mut Self::Tx<'_>,
        requests: &[ClaimRequest<'_>],
    ) -> impl Future<Output = Result<Vec<Claim>, StoreError>> + Send {
        async move {
            let mut claims = Vec::with_capacity(requests.len());
            for request in requests {
                claims.push(self.claim(tx, request).await?);
            }
            Ok(claims)
        }
    }

    /// Stores the results of several messages claimed in this transaction (batch mode). The
    /// default completes one by one.
    fn complete_batch(
        &self,
        tx: &mut Self::Tx<'_>,
        completed: &[(ClaimRequest<'_>, &StoredOutput)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        async move {
            for (request, output) in completed {
                self.complete(tx, request, output).await?;
            }
            Ok(())
        }
    }

    /// Starts the savepoint of the next message of a batch: the first one (`first`), or
    /// releasing the previous message's and starting a new one, in one round trip.
    fn savepoint(
        &self,
        tx: &mut Self::Tx<'_>,
        first: bool,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Undoes everything since the current savepoint: one message of a batch failed.
    fn rollback_to_savepoint(
        &self,
        tx: &mut Self::Tx<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Raises the version applied to `entity` for `consumer` to `version`, in the caller's
    /// transaction, unless it is already at or above it. `Ok(None)`: raised (or first seen), the
    /// message may run; `Ok(Some(applied))`: the message is stale, nothing was written.
    /// Concurrent transactions on one entity are serialized by its row: the later one sees the
    /// version the earlier committed. The default refuses: the store keeps no versions.
    fn advance_version(
        &self,
        tx: &mut Self::Tx<'_>,
        consumer: &str,
        entity: &str,
        version: i64,
    ) -> impl Future<Output = Result<Option<i64>, StoreError>> + Send {
        let _ = (tx, consumer, entity, version);
        async {
            Err(StoreError::new(
                "advance version",
                ErrorClass::Permanent,
                "this inbox store keeps no entity versions",
            ))
        }
    }

    /// Removes the markers of `keys`, claimed in this transaction by messages that then failed,
    /// so that they are not committed with the rest of the batch.
    fn unclaim(
        &self,
        tx: &mut Self::Tx<'_>,
        consumer: &str,
        keys: &[&str],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Commits the transaction.
    fn commit(&self, tx: Self::Tx<'_>) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls the transaction back. Failures are logged, not returned: a transaction that
    /// cannot be rolled back is not committed either.
    fn rollback(&self, tx: Self::Tx<'_>) -> impl Future<Output = ()> + Send;
}

/// How an inbox transaction ended that did not commit what its body gave.
#[derive(Debug)]
pub enum Ended<E> {
    /// The body said to roll back, for this reason; the transaction was rolled back.
    RolledBack(E),
    /// The commit failed: it may or may not have happened (a retry finds out).
    NotCommitted(StoreError),
}

/// Ends the transaction `tx` of `store` as what ran in it says: committed when `result` is
/// `Ok`, rolled back when it is `Err`. The one place an inbox transaction ends, whoever
/// drives it (the per-message pipeline, a batch's pass, the HTTP layer, a store's probe); the
/// shape of sqlx's `Connection::transaction`, with the body's result passed in rather than a
/// closure that borrows the transaction, so that a caller may lend the transaction out (the
/// HTTP layer hands it to the request's handler). A panic or a dropped future drops `tx`,
/// which a store rolls back.
pub async fn end_transaction<'c, S, T, E>(
    store: &S,
    tx: S::Tx<'c>,
    result: Result<T, E>,
) -> Result<T, Ended<E>>
where
    S: InboxStore + ?Sized,
{
    match result {
        Ok(value) => match store.commit(tx).await {
            Ok(()) => Ok(value),
            Err(e) => Err(Ended::NotCommitted(e)),
        },
        Err(why) => {
            store.rollback(tx).await;
            Err(Ended::RolledBack(why))
        }
    }
}
