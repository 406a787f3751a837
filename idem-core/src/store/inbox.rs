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

/// How a sweep paces its deletes ([`SweepStore::sweep_paced`](super::SweepStore::sweep_paced)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pace {
    /// After each full batch, a pause this many times as long as the batch took.
    pub pause: u32,
    /// No pause while the oldest expired row left expired longer ago than this: the sweeper is
    /// behind, and deletes back to back until it has caught up.
    pub behind_after: Duration,
}

impl Pace {
    /// Pauses `pause` times a batch's time, unless the oldest expired row left expired more than
    /// `behind_after` ago.
    pub fn new(pause: u32, behind_after: Duration) -> Self {
        Self {
            pause,
            behind_after,
        }
    }

    /// No pause.
    pub fn none() -> Self {
        Self::new(0, Duration::ZERO)
    }
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
    /// Time spent pausing between them ([`SweepStore::sweep_paced`](super::SweepStore::sweep_paced)).
    pub paused: Duration,
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
            match written {
                Ok(()) => self.commit(tx).await,
                Err(e) => {
                    self.rollback(tx).await;
                    Err(e)
                }
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

impl SweepReport {
    /// Records this sweep of `store` in idem's metrics.
    pub(crate) fn record(&self, store: &'static str) {
        use crate::telemetry::{
            INBOX_EXPIRED, INBOX_OLDEST, INBOX_ROWS, ROWS_SWEPT, SWEEP_BUSY, SWEEP_PAUSED,
            SWEEPER_LAG,
        };
        metrics::counter!(ROWS_SWEPT, "store" => store).increment(self.deleted);
        metrics::gauge!(SWEEPER_LAG, "store" => store).set(self.lag.as_secs_f64());
        metrics::gauge!(INBOX_ROWS, "store" => store).set(self.rows as f64);
        metrics::gauge!(INBOX_OLDEST, "store" => store).set(self.oldest.as_secs_f64());
        metrics::gauge!(INBOX_EXPIRED, "store" => store).set(self.expired as f64);
        metrics::gauge!(SWEEP_BUSY, "store" => store).set(self.busy.as_secs_f64());
        metrics::gauge!(SWEEP_PAUSED, "store" => store).set(self.paused.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::captured::Captured;
    use std::time::Duration;

    #[test]
    fn a_process_that_does_not_hold_the_sweep_lock_tells_no_sweep_figures() {
        let captured = Captured::default();
        metrics::with_local_recorder(&captured, || {
            let report = SweepReport {
                locked: true,
                lag: Duration::from_secs(4000),
                expired: 7,
                ..SweepReport::default()
            };
            report.record("s");
            assert_eq!(
                captured.gauge("idem_sweeper_lag_seconds{store=s}"),
                Some(4000.0)
            );
            crate::telemetry::not_sweeping("s");
            for gauge in crate::telemetry::SWEEP_GAUGES {
                let value = captured.gauge(&format!("{gauge}{{store=s}}"));
                assert!(value.is_some_and(f64::is_nan), "{gauge}: {value:?}");
            }
        });
    }
}
