//! [`SqlInbox`]: the store of every dialect, one generic implementation over `DB: Dialect` of
//! [`InboxStore`] and of every optional role (leases, dead letters, sweeps, the outbox).

use crate::claim;
use crate::config::{ConfigError, InboxConfig};
use crate::dialect::{Conn, Dialect};
use crate::durability::{self, Durability};
use crate::error::{classify_error, store_error};
use crate::exec::Sql;
use crate::keys;
use crate::migrate::{self, MigrateError};
use crate::statements::Prepared;
use idem_core::store::{DeadLetterStore, LeaseStore, OutboxStore, Pace, SweepStore};
use idem_core::{
    model::DeadLetterRecord, model::ErrorClass, model::Outgoing, model::StoreError,
    model::StoredOutput, outbox::OutboxSelect, outbox::RelayReport, store::Claim,
    store::ClaimRequest, store::InboxStore, store::Lease, store::LeaseEnd, store::StoreKind,
    store::SweepReport, transport::Outbound,
};
use sqlx::{Pool, Transaction};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// An inbox in a database of dialect `DB`; see [`crate::PgInbox`], [`crate::MySqlInbox`] and
/// [`crate::SqliteInbox`].
pub struct SqlInbox<DB: Dialect> {
    pub(crate) pool: Pool<DB::Db>,
    pub(crate) config: InboxConfig,
    pub(crate) sql: Arc<Prepared>,
    /// The outbox table beside the inbox table.
    pub(crate) outbox: String,
    /// The relay's wake-ups (notifications of rows staged outside any handler).
    pub(crate) wake: Arc<crate::wake::Wake>,
    /// Set while this process's sweeper of this inbox works, where
    /// [`Dialect::LOCAL_SWEEP_LOCK`].
    sweeping: Arc<AtomicBool>,
    /// How long a worker keeps one connection ([`SqlInbox::hold_connections`]).
    pub(crate) hold_for: Duration,
    /// When a parked outbox row is given up ([`SqlInbox::outbox_give_up`]).
    pub(crate) give_up: Duration,
    /// What the start does about settings that can lose acked commits.
    durability: Durability,
    /// Set once the risks found were logged, so that each start logs them once.
    durability_told: Arc<AtomicBool>,
}

impl<DB: Dialect> SqlInbox<DB> {
    /// An inbox in table `idem_inbox` with the default retention.
    pub fn new(pool: Pool<DB::Db>) -> Self {
        Self::with_config(pool, InboxConfig::default())
    }

    /// An inbox with `config`.
    pub fn with_config(pool: Pool<DB::Db>, config: InboxConfig) -> Self {
        let sql = Arc::new(DB::STATEMENTS.fill(&config.table, DB::NOW));
        Self {
            pool,
            outbox: config.table.outbox(),
            wake: Arc::default(),
            config,
            sql,
            sweeping: Arc::default(),
            hold_for: crate::held::HOLD_FOR,
            give_up: crate::config::DEFAULT_GIVE_UP,
            durability: Durability::default(),
            durability_told: Arc::default(),
        }
    }

    /// The same inbox in table `name`.
    pub fn table(self, name: &str) -> Result<Self, ConfigError> {
        let config = self.config.clone().table(name)?;
        Ok(self.reconfigured(config))
    }

    /// The same inbox keeping rows for `retention`.
    pub fn retention(self, retention: Duration) -> Result<Self, ConfigError> {
        let config = self.config.clone().retention(retention)?;
        Ok(self.reconfigured(config))
    }

    /// This inbox with `config`, keeping its other settings.
    fn reconfigured(self, config: InboxConfig) -> Self {
        Self {
            hold_for: self.hold_for,
            give_up: self.give_up,
            durability: self.durability,
            ..Self::with_config(self.pool, config)
        }
    }

    /// The same inbox giving up an outbox row that the broker still refuses `after` it was
    /// staged (default [`crate::config::DEFAULT_GIVE_UP`], one day; at most
    /// [`crate::config::MAX_GIVE_UP`], which a longer one is taken as): the relay stops trying
    /// it, it stays parked as an outbox dead letter with its reason (`idem outbox parked`), and
    /// `idem_outbox_given_up_total` counts it.
    pub fn outbox_give_up(mut self, after: Duration) -> Self {
        self.give_up = after.min(crate::config::MAX_GIVE_UP);
        self
    }

    /// The same inbox with each per-message worker keeping its pooled connection for up to
    /// `hold_for` between transactions before it takes a fresh one (default
    /// [`crate::held::HOLD_FOR`], 60 s); `Duration::ZERO` keeps none: every transaction
    /// acquires its connection from the pool.
    pub fn hold_connections(mut self, hold_for: Duration) -> Self {
        self.hold_for = hold_for;
        self
    }

    /// The same inbox with `durability` deciding what a runtime's start does when the
    /// database's settings can lose a commit after idem acked its message (asynchronous
    /// replication, commits not flushed): [`Durability::Warn`] by default, and
    /// [`Durability::Require`] to refuse to start ([`crate::durability`]).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &InboxConfig {
        &self.config
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB::Db> {
        &self.pool
    }

    /// Creates or upgrades the inbox table, in one transaction that concurrent migrations
    /// (from other processes too) wait for. Run it on every start.
    pub async fn migrate(&self) -> Result<(), MigrateError> {
        migrate::run::<DB>(&self.pool, &self.config.table).await
    }

    /// Starts an inbox transaction the way the dialect's start.
    pub(crate) async fn begin_tx(&self) -> Result<Transaction<'static, DB::Db>, StoreError> {
        crate::held::begin_pooled::<DB>(&self.pool).await
    }

    /// This process's sweeper lock where the dialect needs one; `None` when another sweeper
    /// of this process holds it.
    pub(crate) fn sweep_guard(&self) -> Option<SweepGuard<'_>> {
        if !DB::LOCAL_SWEEP_LOCK {
            return Some(SweepGuard(None));
        }
        self.sweeping
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| SweepGuard(Some(&self.sweeping)))
    }
}

impl<DB: Dialect> InboxStore for SqlInbox<DB> {
    type Tx<'c> = Transaction<'c, DB::Db>;
    type Held = crate::held::Held<DB>;
    const KIND: StoreKind = DB::KIND;

    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> ErrorClass {
        classify_error(error)
    }

    async fn check(&self) -> Result<(), StoreError> {
        let probed = async {
            let mut conn = self.pool.acquire().await?;
            DB::Db::execute(&mut *conn, &self.sql.probe, &[]).await
        };
        // A database that cannot be reached, or is restarting (57P01), fails transiently;
        // a missing table or column for good.
        probed.await.map(drop).map_err(|e| {
            let class = crate::error::classify_sqlx(&e);
            StoreError::new(
                "check",
                class,
                format!("inbox table `{}`: {e}", self.config.table_name()),
            )
        })?;
        durability::check::<DB>(&self.pool, self.durability, &self.durability_told).await
    }

    fn retention(&self) -> Duration {
        self.config.retention_period()
    }

    async fn begin(&self) -> Result<Self::Tx<'static>, StoreError> {
        self.begin_tx().await
    }

    fn begin_on<'c>(
        &'c self,
        held: &'c mut Option<Self::Held>,
    ) -> impl Future<Output = Result<Self::Tx<'c>, StoreError>> + Send + 'c {
        crate::held::begin_on(&self.pool, self.hold_for, held)
    }

    async fn claim(
        &self,
        tx: &mut Self::Tx<'_>,
        request: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        DB::check_request(request)?;
        let key = keys::stored::<DB>(request.key);
        DB::claim(&self.sql, &mut **tx, &with_key(request, &key)).await
    }

    async fn try_claim(
        &self,
        tx: &mut Self::Tx<'_>,
        request: &ClaimRequest<'_>,
    ) -> Result<Option<Claim>, StoreError> {
        DB::check_request(request)?;
        let key = keys::stored::<DB>(request.key);
        DB::try_claim(&self.sql, &mut **tx, &with_key(request, &key)).await
    }

    async fn complete(
        &self,
        tx: &mut Self::Tx<'_>,
        request: &ClaimRequest<'_>,
        output: &StoredOutput,
    ) -> Result<(), StoreError> {
        let key = keys::stored::<DB>(request.key);
        let request = &with_key(request, &key);
        claim::complete::<DB::Db>(&self.sql, &mut **tx, request, output).await
    }

    async fn claim_batch(
        &self,
        tx: &mut Self::Tx<'_>,
        requests: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        requests.iter().try_for_each(DB::check_request)?;
        let keys: Vec<_> = requests.iter().map(|r| keys::stored::<DB>(r.key)).collect();
        let requests: Vec<_> = requests
            .iter()
            .zip(&keys)
            .map(|(r, k)| with_key(r, k))
            .collect();
        DB::claim_batch(&self.sql, &mut **tx, &requests).await
    }

    async fn complete_batch(
        &self,
        tx: &mut Self::Tx<'_>,
        completed: &[(ClaimRequest<'_>, &StoredOutput)],
    ) -> Result<(), StoreError> {
        let keys: Vec<_> = completed
            .iter()
            .map(|(r, _)| keys::stored::<DB>(r.key))
            .collect();
        let completed: Vec<_> = completed
            .iter()
            .zip(&keys)
            .map(|((r, output), k)| (with_key(r, k), *output))
            .collect();
        DB::complete_batch(&self.sql, &mut **tx, &completed).await
    }

    async fn savepoint(&self, tx: &mut Self::Tx<'_>, first: bool) -> Result<(), StoreError> {
        let savepoint = &self.sql.savepoint;
        let statement = if first {
            savepoint.first
        } else {
            savepoint.next
        };
        DB::Db::execute_raw(&mut **tx, statement)
            .await
            .map_err(|e| store_error("savepoint", e))
    }

    async fn rollback_to_savepoint(&self, tx: &mut Self::Tx<'_>) -> Result<(), StoreError> {
        DB::Db::execute_raw(&mut **tx, self.sql.savepoint.rollback)
            .await
            .map_err(|e| store_error("rollback to savepoint", e))
    }

    async fn advance_version(
        &self,
        tx: &mut Self::Tx<'_>,
        consumer: &str,
        entity: &str,
        version: i64,
    ) -> Result<Option<i64>, StoreError> {
        let entity = keys::stored::<DB>(entity);
        crate::versions::advance::<DB::Db>(&self.sql, &mut **tx, consumer, &entity, version).await
    }

    async fn unclaim(
        &self,
        tx: &mut Self::Tx<'_>,
        consumer: &str,
        keys: &[&str],
    ) -> Result<(), StoreError> {
        let stored: Vec<_> = keys.iter().map(|k| keys::stored::<DB>(k)).collect();
        let keys: Vec<&str> = stored.iter().map(|k| k.as_ref()).collect();
        DB::unclaim(&self.sql, &mut **tx, consumer, &keys).await
    }

    async fn commit(&self, tx: Self::Tx<'_>) -> Result<(), StoreError> {
        tx.commit().await.map_err(|e| store_error("commit", e))
    }

    /// Rolls back, logging a failure: a transaction that cannot be rolled back is not
    /// committed either, and its connection is discarded.
    async fn rollback(&self, tx: Self::Tx<'_>) {
        if let Err(e) = tx.rollback().await {
            tracing::warn!(error = %e, "inbox rollback failed; the connection is discarded");
        }
    }
}

impl<DB: Dialect> LeaseStore for SqlInbox<DB> {
    async fn lease(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
        lease: Duration,
    ) -> Result<Lease, StoreError> {
        DB::check_request(request)?;
        let key = keys::stored::<DB>(request.key);
        self.lease_key(&with_key(request, &key), owner, lease).await
    }

    async fn settle(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
        end: LeaseEnd,
        output: &StoredOutput,
    ) -> Result<bool, StoreError> {
        let key = keys::stored::<DB>(request.key);
        self.settle_key(&with_key(request, &key), owner, end, output)
            .await
    }

    async fn release(&self, request: &ClaimRequest<'_>, owner: &str) -> Result<(), StoreError> {
        let key = keys::stored::<DB>(request.key);
        self.release_key(&with_key(request, &key), owner).await
    }

    async fn abandon(&self, request: &ClaimRequest<'_>, owner: &str) -> Result<bool, StoreError> {
        let key = keys::stored::<DB>(request.key);
        self.abandon_key(&with_key(request, &key), owner).await
    }
}

impl<DB: Dialect> DeadLetterStore for SqlInbox<DB> {
    async fn count_delivery(&self, request: &ClaimRequest<'_>) -> Result<u32, StoreError> {
        DB::check_request(request)?;
        let key = keys::stored::<DB>(request.key);
        self.count_delivery_of(&with_key(request, &key)).await
    }

    async fn settle_deliveries(&self, consumer: &str, keys: &[&str]) -> Result<(), StoreError> {
        let stored: Vec<_> = keys.iter().map(|k| keys::stored::<DB>(k)).collect();
        let keys: Vec<&str> = stored.iter().map(|k| k.as_ref()).collect();
        self.settle_deliveries_of(consumer, &keys).await
    }

    async fn forget_deliveries(&self, consumer: &str, keys: &[&str]) -> Result<(), StoreError> {
        let stored: Vec<_> = keys.iter().map(|k| keys::stored::<DB>(k)).collect();
        let keys: Vec<&str> = stored.iter().map(|k| k.as_ref()).collect();
        self.forget_deliveries_of(consumer, &keys).await
    }

    async fn uncount_delivery(&self, consumer: &str, key: &str) -> Result<(), StoreError> {
        let key = keys::stored::<DB>(key);
        self.uncount_delivery_of(consumer, &key).await
    }

    async fn record_dead_letter(&self, record: &DeadLetterRecord) -> Result<(), StoreError> {
        self.record(record).await
    }
}

impl<DB: Dialect> SweepStore for SqlInbox<DB> {
    async fn sweep(&self, batch: u32, max_batches: u32) -> Result<SweepReport, StoreError> {
        self.sweep_expired(batch, max_batches, Pace::none()).await
    }

    async fn sweep_paced(
        &self,
        batch: u32,
        max_batches: u32,
        pace: Pace,
    ) -> Result<SweepReport, StoreError> {
        self.sweep_expired(batch, max_batches, pace).await
    }
}

impl<DB: Dialect> OutboxStore for SqlInbox<DB> {
    fn outbox_table(&self) -> Option<&str> {
        Some(&self.outbox)
    }

    fn outbox_give_up(&self) -> Option<Duration> {
        Some(self.give_up)
    }

    async fn stage_rows(
        &self,
        tx: &mut Self::Tx<'_>,
        consumer: &str,
        run: &str,
        messages: &[Outgoing],
    ) -> Result<(), StoreError> {
        self.stage_in(tx, consumer, run, messages).await
    }

    async fn outbox_remove(&self, message_ids: &[String]) -> Result<u64, StoreError> {
        self.remove_published(message_ids).await
    }

    fn transaction_identity(&self, tx: &Self::Tx<'_>) -> Option<usize> {
        Some(transaction_identity::<DB>(tx))
    }

    async fn outbox_wakeup(&self) {
        self.staged_elsewhere().await;
    }

    async fn relay(
        &self,
        select: &OutboxSelect,
        publish: &dyn Outbound,
    ) -> Result<RelayReport, StoreError> {
        self.relay_rows(select, publish).await
    }
}

impl<DB: Dialect> Clone for SqlInbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            config: self.config.clone(),
            sql: self.sql.clone(),
            outbox: self.outbox.clone(),
            wake: self.wake.clone(),
            sweeping: self.sweeping.clone(),
            hold_for: self.hold_for,
            give_up: self.give_up,
            durability: self.durability,
            durability_told: self.durability_told.clone(),
        }
    }
}

impl<DB: Dialect> fmt::Debug for SqlInbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlInbox")
            .field("database", &DB::KIND.name())
            .field("config", &self.config)
            .finish()
    }
}

/// Holds this process's sweeper lock of one inbox until dropped.
pub(crate) struct SweepGuard<'a>(Option<&'a AtomicBool>);

impl Drop for SweepGuard<'_> {
    fn drop(&mut self) {
        if let Some(flag) = self.0 {
            flag.store(false, Ordering::Release);
        }
    }
}

/// The identity of `tx` that [`idem_core::model::Context::keep_staged`] compares: the address of
/// its connection, which stays put while a handler borrows the transaction.
pub(crate) fn transaction_identity<DB: Dialect>(tx: &Transaction<'_, DB::Db>) -> usize {
    let connection: &Conn<DB> = tx;
    std::ptr::from_ref(connection) as usize
}

/// `request` with `key`, its key as the dialect stores it ([`keys::stored`]).
fn with_key<'a>(request: &ClaimRequest<'a>, key: &'a str) -> ClaimRequest<'a> {
    ClaimRequest { key, ..*request }
}
