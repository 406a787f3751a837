//! The optional roles of a store, each a trait over [`InboxStore`] whose methods all have
//! defaults: a store implements the ones its database can keep and leaves the others empty
//! (`impl LeaseStore for MyStore {}`), and the runtime falls back to what each default says.
//! [`RuntimeStore`] is all of them: what a runtime and the `#[idempotent]` handlers ask of a
//! store.

use super::inbox::{ClaimRequest, InboxStore, StoreKind};
use super::lease::{Lease, LeaseEnd};
use super::sweep::{Pace, SweepReport};
use crate::model::{
    DeadLetterRecord, Envelope, ErrorClass, Fingerprint, Outgoing, ParkedMessage, Parking,
    StoreError, StoredOutput,
};
use crate::outbox::{OutboxSelect, RelayReport};
use crate::transport::Outbound;
use std::future::Future;
use std::time::Duration;

/// Leases: the per-key states of `mode = "external"` handlers and of the HTTP layer's external
/// mode, each in a transaction of its own. Needed when such handlers use the store; the
/// defaults refuse, so that a start-up or a request with an external handler fails naming the
/// store.
pub trait LeaseStore: InboxStore {
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
}

/// Dead-letter records and the poison limit: why a message was dead-lettered (kept for
/// `idem dlq` and replays), and how many runs of a redelivered message started and never
/// settled. Needed for the poison limit and for dead-letter reasons an operator can query; the
/// defaults keep nothing, and then a message that kills its consumer is redelivered for ever.
pub trait DeadLetterStore: InboxStore {
    /// Counts one more run of the handler on a redelivery of `request`'s message (the broker
    /// flagged it redelivered), just before that run, in a transaction of its own committed
    /// before this returns, so that the count survives a crash in the handler; returns the
    /// count. The runtime takes this run back when the delivery settles
    /// ([`DeadLetterStore::settle_deliveries`]), so it counts runs that started and never settled.
    /// The count expires with `request.retention`. The default counts nothing (`0`): such a
    /// store has no poison limit.
    fn count_delivery(
        &self,
        request: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<u32, StoreError>> + Send {
        let _ = request;
        async { Ok(0) }
    }

    /// Takes back one run from the counts of [`DeadLetterStore::count_delivery`] for
    /// `consumer`'s `keys`: those runs settled (processed, duplicate, retried or dead-lettered),
    /// and the runs before them that never settled still count. In a transaction of its own.
    /// The default keeps no counts.
    fn settle_deliveries(
        &self,
        consumer: &str,
        keys: &[&str],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (consumer, keys);
        async { Ok(()) }
    }

    /// Removes the counts of [`DeadLetterStore::count_delivery`] for `consumer`'s `keys` whole:
    /// their keys are done (processed, or found processed), and a copy of a done key is a
    /// duplicate whatever its count. In a transaction of its own. The default keeps no counts.
    fn forget_deliveries(
        &self,
        consumer: &str,
        keys: &[&str],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (consumer, keys);
        async { Ok(()) }
    }

    /// Takes back the count [`DeadLetterStore::count_delivery`] added for a delivery whose handler
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
}

/// Sweeps: deleting expired inbox rows and delivery counts, for the runtime's sweeper and
/// `idem inbox sweep`. Needed unless the database expires rows on its own; the defaults delete
/// nothing.
pub trait SweepStore: InboxStore {
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

    /// As [`sweep`](Self::sweep), pausing after each batch `pace.pause` times as long as the
    /// batch took, so that deleting takes at most `1 / (pause + 1)` of the sweep's time and
    /// expired rows never take the database from the consumers (the runtime's sweeper pauses 9
    /// times by default) — while it keeps up: once the oldest expired row left expired more than
    /// `pace.behind_after` ago, the inflow expires rows faster than paced deletes remove them,
    /// and it deletes back to back until it has caught up. The default ignores `pace`.
    fn sweep_paced(
        &self,
        batch: u32,
        max_batches: u32,
        pace: Pace,
    ) -> impl Future<Output = Result<SweepReport, StoreError>> + Send {
        let _ = pace;
        self.sweep(batch, max_batches)
    }
}

/// The outbox: messages staged in the handler's transaction and published after it commits
/// (`Context::outgoing`), with their relay. Needed when handlers stage messages; the defaults
/// keep no outbox and refuse to stage.
pub trait OutboxStore: InboxStore {
    /// The table the store's handlers stage outgoing messages in ([`crate::model::Context::outgoing`]);
    /// `None` (the default): the store keeps no outbox.
    fn outbox_table(&self) -> Option<&str> {
        None
    }

    /// How long after it was staged the relay keeps trying a row the broker refuses before it
    /// gives it up; `None` (the default): the store keeps no outbox, or never gives up. The
    /// runtime refuses to start when this outlasts a handler's retention: a row published that
    /// late would be older than its consumer's dedup window.
    fn outbox_give_up(&self) -> Option<Duration> {
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
    /// which the store's staging recognises ([`crate::model::Context::keep_staged`]); `None` (the
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
}

/// Parked keys (`crate::model::parking`): an ordered handler's key whose message was
/// dead-lettered keeps its later messages in the store, in order, until an operator releases
/// it. Needed for ordered handlers with [`KeyPolicy::Park`](crate::model::KeyPolicy), the
/// default; the defaults park nothing, and the runtime refuses to start such a handler on a
/// store that does not park ([`ParkingStore::parks`]). A dead letter parks its key through
/// its record ([`DeadLetterRecord::park`], written by [`DeadLetterStore::record_dead_letter`]
/// in the record's transaction).
pub trait ParkingStore: InboxStore {
    /// Whether the store keeps parked keys (default `false`).
    fn parks(&self) -> bool {
        false
    }

    /// The verdict on `envelope`, a delivery of `consumer` with `order_key`: when the key is
    /// parked (or releasing, and this is not the released message whose turn it is), the
    /// message is stored behind the key's messages, in a transaction that holds the key's row,
    /// and [`Parking::Parked`] returned once that committed; the key's dead-lettered message
    /// itself, delivered again, runs. A key with no row runs at once: only its own dead letter
    /// parks it, and one consumer at a time takes its deliveries. `held` is the worker's
    /// connection ([`InboxStore::begin_on`]). The default lets everything run.
    fn admit_ordered(
        &self,
        consumer: &str,
        order_key: &str,
        envelope: &Envelope,
        held: &mut Option<Self::Held>,
    ) -> impl Future<Output = Result<Parking, StoreError>> + Send {
        let _ = (consumer, order_key, envelope, held);
        async { Ok(Parking::Run) }
    }

    /// The parked message of `consumer`'s `order_key` after place `after`, the next to
    /// release; `None` when none is left. The default keeps none.
    fn next_parked(
        &self,
        consumer: &str,
        order_key: &str,
        after: i64,
    ) -> impl Future<Output = Result<Option<ParkedMessage>, StoreError>> + Send {
        let _ = (consumer, order_key, after);
        async { Ok(None) }
    }

    /// Removes the released message at `seq` (whose body has `fingerprint`) once it settled,
    /// and frees the key when no parked message is left, in one transaction. The default
    /// keeps none.
    fn finish_release(
        &self,
        consumer: &str,
        order_key: &str,
        seq: i64,
        fingerprint: &Fingerprint,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (consumer, order_key, seq, fingerprint);
        async { Ok(()) }
    }

    /// How many keys of `consumer` are parked (or releasing), and when the oldest was parked
    /// (milliseconds since the Unix epoch). The default: none.
    fn parked_summary(
        &self,
        consumer: &str,
    ) -> impl Future<Output = Result<(u64, Option<i64>), StoreError>> + Send {
        let _ = consumer;
        async { Ok((0, None)) }
    }
}

/// Every role of a store: what a runtime, its sweeper and relay, and `#[idempotent]` handlers
/// ask of one. Implemented for every type with all the roles; a store never implements it
/// itself.
pub trait RuntimeStore:
    InboxStore + LeaseStore + DeadLetterStore + SweepStore + OutboxStore + ParkingStore
{
}

impl<S> RuntimeStore for S where
    S: InboxStore + LeaseStore + DeadLetterStore + SweepStore + OutboxStore + ParkingStore
{
}

/// The lease operations of external mode, which a store without them refuses.
fn no_external(operation: &'static str, kind: StoreKind) -> StoreError {
    StoreError::new(
        operation,
        ErrorClass::Permanent,
        format!("the {kind} store does not support mode = \"external\""),
    )
}
