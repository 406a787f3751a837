//! The inbox store contract: claims in the caller's transaction, leases (external mode),
//! dead-letter records and sweeps.

use super::lease::{Lease, LeaseEnd};
use super::relay::{OutboxSelect, RelayReport};
use crate::model::{DeadLetterRecord, ErrorClass, Fingerprint, Outgoing, StoreError, StoredOutput};
use crate::transport::Outbound;
use std::fmt;
use std::future::Future;
use std::time::Duration;

/// What a store says about itself: its database's name, as `#[idempotent(store = ...)]`, error
/// messages and metric labels show it, and how a user adds one to a runtime. Core keeps no list
/// of databases; each store type carries its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StoreKind {
    name: &'static str,
    label: &'static str,
    constructor: &'static str,
}

impl StoreKind {
    /// A store kind: `name` as `store = ...` spells it (`"Postgres"`), `label` for metrics
    /// (`"postgres"`), and the type path a start-up error tells the user to construct
    /// (`"idem::sql::PgInbox"`).
    pub const fn new(name: &'static str, label: &'static str, constructor: &'static str) -> Self {
        Self {
            name,
            label,
            constructor,
        }
    }

    /// The name, as `store = ...` spells it.
    pub const fn name(self) -> &'static str {
        self.name
    }

    /// The metric label.
    pub const fn label(self) -> &'static str {
        self.label
    }

    /// The type a user constructs to provide this store (`idem::sql::PgInbox`).
    pub const fn constructor(self) -> &'static str {
        self.constructor
    }
}

impl fmt::Display for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

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

/// What one sweep of an inbox did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SweepReport {
    /// Whether this sweeper held the inbox's sweeper lock; `false`: another sweeper (in this
    /// or another process) was at work, and this one did nothing.
    pub locked: bool,
    /// Expired rows deleted.
    pub deleted: u64,
    /// Delete statements run on the inbox rows (each at most one batch of rows).
    pub batches: u32,
    /// Expired delivery counts of the poison limit deleted (in batches of their own).
    pub counts_deleted: u64,
    /// The longest of them: the longest any row lock was held.
    pub longest_batch: Duration,
    /// How far behind the sweeper is after this sweep: the age of the oldest expired row left
    /// (zero when none is).
    pub lag: Duration,
    /// The inbox's rows after this sweep, estimated where the database keeps statistics.
    pub rows: u64,
    /// The age of the row that expires first after this sweep (zero when the inbox is empty).
    pub oldest: Duration,
    /// Expired rows this sweep left (its statement budget ran out, or they expired since),
    /// counted up to 1,000,000.
    pub expired: u64,
    /// Time spent in the delete statements.
    pub busy: Duration,
    /// Time spent pausing between them ([`InboxStore::sweep_paced`]).
    pub paused: Duration,
}

/// An inbox: claims and completes dedup markers inside a transaction the caller also hands to
/// the user's handler, so that marker and side effects commit together or not at all.
///
/// A claim must be insert-first (the database's unique key on `(consumer, key)` decides between
/// concurrent copies), must not abort the transaction on conflict, and must block behind an
/// uncommitted claim of the same key until that transaction ends.
pub trait InboxStore: Send + Sync + 'static {
    /// The transaction type handed to handlers; `'c` is the connection it runs on when that is
    /// borrowed from a worker ([`InboxStore::begin_on`]), `'static` when it owns its own.
    type Tx<'c>: Send;
    /// A connection one worker keeps between its transactions ([`InboxStore::begin_on`]);
    /// `()` for a store that keeps none.
    type Held: Send + 'static;
    /// Which database this is.
    const KIND: StoreKind;

    /// Classifies an error a handler got from this store's database ([`crate::HandlerError::Database`]),
    /// knowing the database's error codes. The default calls every such error transient: a
    /// retry costs little, a lost message a lot.
    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> ErrorClass {
        let _ = error;
        ErrorClass::Transient
    }

    /// Checks that the inbox is usable (its table exists with the expected columns); the
    /// runtime calls this before it consumes anything.
    fn check(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

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

    /// External mode: claims `request`'s key with a lease for `owner` lasting `lease`, in a
    /// transaction of its own that is committed before this returns. A new key is inserted
    /// `in_progress`; an `in_progress` row whose lease expired (same payload) is taken over,
    /// attempts + 1; anything else is reported as it is.
    fn lease(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<Lease, StoreError>> + Send {
        let _ = (request, owner, lease);
        async { Err(no_external("lease", Self::KIND)) }
    }

    /// External mode: ends `owner`'s lease on `request`'s key as `end`, storing `output`.
    /// `false`: the lease was lost (taken over after it expired), and nothing was written.
    fn settle(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
        end: LeaseEnd,
        output: &StoredOutput,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let _ = (request, owner, end, output);
        async { Err(no_external("settle", Self::KIND)) }
    }

    /// External mode: gives up `owner`'s lease after a transient failure, so that the retry
    /// takes the key over at once.
    fn release(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (request, owner);
        async { Err(no_external("release", Self::KIND)) }
    }

    /// External mode: removes `request`'s key while `owner` still holds it in progress (the
    /// request was refused before it ran: the key is free for a corrected one). `false`: the
    /// lease was taken over and the key is another's; nothing was removed.
    fn abandon(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let _ = (request, owner);
        async { Err(no_external("abandon", Self::KIND)) }
    }

    /// Counts one more run of the handler on a redelivery of `request`'s message (the broker
    /// flagged it redelivered), just before that run, in a transaction of its own committed
    /// before this returns, so that the count survives a crash in the handler; returns the
    /// count. The runtime removes it when the delivery settles
    /// ([`InboxStore::settle_deliveries`]), so it counts runs that started and never settled.
    /// The count expires with `request.retention`. The default counts nothing (`0`): such a
    /// store has no poison limit.
    fn count_delivery(
        &self,
        request: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<u32, StoreError>> + Send {
        let _ = request;
        async { Ok(0) }
    }

    /// Removes the counts of [`InboxStore::count_delivery`] for `consumer`'s `keys`: their
    /// deliveries settled (processed, duplicate, retried or dead-lettered). In a transaction of
    /// its own. The default keeps no counts.
    fn settle_deliveries(
        &self,
        consumer: &str,
        keys: &[&str],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (consumer, keys);
        async { Ok(()) }
    }

    /// Takes back the count [`InboxStore::count_delivery`] added for a delivery whose handler
    /// did not start after all (another consumer holds the key's lease), leaving the counts of
    /// earlier runs that never settled. In a transaction of its own. The default keeps no
    /// counts.
    fn uncount_delivery(
        &self,
        consumer: &str,
        key: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (consumer, key);
        async { Ok(()) }
    }

    /// Records why a message is dead-lettered, keyed by `(record.consumer, record.key)`, in a
    /// transaction of its own that is committed before this returns; a second record of the
    /// same key replaces the first. The runtime calls this before the message is moved to the
    /// dead-letter queue. The default keeps nothing.
    fn record_dead_letter(
        &self,
        record: &DeadLetterRecord,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = record;
        async { Ok(()) }
    }

    /// Deletes expired rows (of every consumer and status) in batches of at most `batch`,
    /// oldest first, until none is left or `max_batches` ran, holding the inbox's sweeper lock
    /// so that one sweeper works at a time across processes. The default sweeps nothing.
    fn sweep(
        &self,
        batch: u32,
        max_batches: u32,
    ) -> impl Future<Output = Result<SweepReport, StoreError>> + Send {
        let _ = (batch, max_batches);
        async { Ok(SweepReport::default()) }
    }

    /// As [`sweep`](Self::sweep), pausing after each batch `pause` times as long as the batch
    /// took, so that deleting takes at most `1 / (pause + 1)` of the sweep's time and a
    /// backlog of expired rows never takes the database from the consumers (the runtime's
    /// sweeper pauses 9 times by default). The default ignores `pause`.
    fn sweep_paced(
        &self,
        batch: u32,
        max_batches: u32,
        pause: u32,
    ) -> impl Future<Output = Result<SweepReport, StoreError>> + Send {
        let _ = pause;
        self.sweep(batch, max_batches)
    }

    /// The table the store's handlers stage outgoing messages in ([`crate::Context::outgoing`]);
    /// `None` (the default): the store keeps no outbox.
    fn outbox_table(&self) -> Option<&str> {
        None
    }

    /// Stages `messages` in the outbox, in the transaction `tx`, as staged by `consumer` and
    /// grouped under `run` for their dispatch (the runtime stages replies this way). The
    /// default refuses: the store keeps no outbox.
    fn stage_rows<'a>(
        &'a self,
        tx: &'a mut Self::Tx<'_>,
        consumer: &'a str,
        run: &'a str,
        messages: &'a [Outgoing],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        let _ = (tx, consumer, run, messages);
        async {
            Err(StoreError::new(
                "stage",
                ErrorClass::Permanent,
                format!("the {} store keeps no outbox", Self::KIND),
            ))
        }
    }

    /// Publishes the committed outbox rows `select` names through `publish`, in the order they
    /// were staged, and removes those the broker confirmed, in a transaction of its own that
    /// keeps other passes (of this or other processes) off the rows it holds. A confirmed row is
    /// removed; a message the broker cannot route (or carry) is moved out of the relay's way
    /// (parked, for an operator); another failure keeps every row from there on: they go out
    /// again (with their ids) in a later pass. The default has no rows.
    fn relay<'a>(
        &'a self,
        select: &'a OutboxSelect,
        publish: &'a dyn Outbound,
    ) -> impl Future<Output = Result<RelayReport, StoreError>> + Send + 'a {
        let _ = (select, publish);
        async { Ok(RelayReport::default()) }
    }

    /// Removes the outbox rows of these message ids (published and confirmed by a dispatch
    /// that had them in memory); returns how many it removed. The default has no rows.
    fn outbox_remove<'a>(
        &'a self,
        message_ids: &'a [String],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a {
        let _ = message_ids;
        async { Ok(0) }
    }

    /// An identity of the transaction `tx` that stays the same while a handler runs in it,
    /// which the store's staging recognises ([`crate::Context::keep_staged`]); `None` (the
    /// default): the dispatch reads what was staged back from the outbox.
    fn transaction_identity(&self, tx: &Self::Tx<'_>) -> Option<usize> {
        let _ = tx;
        None
    }

    /// Resolves when rows staged outside any handler may have been committed (PostgreSQL: a
    /// `NOTIFY` sent by their transaction), so that a relay takes them at once
    /// ([`OutboxSelect::Unowned`]) instead of at its next poll. The default never resolves.
    fn outbox_wakeup(&self) -> impl Future<Output = ()> + Send + '_ {
        std::future::pending()
    }

    /// Commits the transaction.
    fn commit(&self, tx: Self::Tx<'_>) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls the transaction back. Failures are logged, not returned: a transaction that
    /// cannot be rolled back is not committed either.
    fn rollback(&self, tx: Self::Tx<'_>) -> impl Future<Output = ()> + Send;
}

/// The lease operations of external mode, which a store without them refuses.
fn no_external(operation: &'static str, kind: StoreKind) -> StoreError {
    StoreError::new(
        operation,
        ErrorClass::Permanent,
        format!("the {kind} store does not support mode = \"external\""),
    )
}
