//! The inbox store shared by every dialect: pool, configuration and prepared statement text.

use crate::config::{ConfigError, InboxConfig, TableName};
use crate::session::LockedSession;
use crate::{MigrateError, Migrations, SCHEMA_VERSION, pending};
use sqlx::{Database, Pool, Transaction};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A SQL dialect idem can keep an inbox in: the statement templates, with `{table}` standing for
/// the inbox table.
pub trait Dialect: Database {
    /// Inserts the marker, doing nothing if the key exists.
    const CLAIM: &'static str;
    /// Reads the fingerprint and stored result of a key.
    const EXISTING: &'static str;
    /// Stores the handler's result on a claimed row.
    const COMPLETE: &'static str;
    /// Removes a marker claimed in the current transaction (a failed message of a batch).
    const UNCLAIM: &'static str;
    /// Batch statements of this dialect, if it has any beyond the single-row ones.
    const BATCH: [&'static str; 3];
    /// External mode's lease statements: insert, takeover, read, settle, release.
    const LEASE: crate::lease::LeaseStatements;
    /// The retention sweeper's statements (see [`crate::sweep`]).
    const SWEEP: crate::sweep::SweepStatements;
    /// Whether sweepers must also exclude each other inside this process (SQLite, whose
    /// sweeper lock cannot span processes).
    const LOCAL_SWEEP_LOCK: bool = false;
    /// The current time in the dialect's timestamp column type, for `{now}` in statements.
    const NOW: &'static str = "now()";
    /// The schema versions of the inbox table.
    const MIGRATIONS: Migrations;
    /// Reads nothing, but fails unless the inbox table has the columns idem uses.
    const PROBE: &'static str = PROBE;
    /// Runs before the migration transaction.
    const PREPARE: Option<&'static str>;
    /// Starts inbox transactions, the migration's too (`None`: a plain `BEGIN`).
    const BEGIN: Option<&'static str>;
    /// Runs first inside the migration transaction.
    const LOCK: Option<&'static str>;
    /// Releases a session-level [`Dialect::LOCK`], last on the migration's connection.
    const UNLOCK: Option<&'static str> = None;
    /// Creates the schema version table.
    const VERSION_TABLE: &'static str;
    /// Reads a table's version (`$1`/`?1`: the table).
    const READ_VERSION: &'static str;
    /// Records a table's version (the table, the version).
    const WRITE_VERSION: &'static str;
}

/// Reads nothing, but fails unless the inbox table exists with the columns idem uses.
const PROBE: &str = r#"SELECT consumer, key, fingerprint, status, outcome, attempts, created_at, completed_at,
    expires_at, owner, locked_until FROM "{table}" WHERE 1 = 0"#;

/// An inbox in a database of dialect `DB`; see [`crate::PgInbox`] and [`crate::SqliteInbox`].
pub struct SqlInbox<DB: Dialect> {
    pub(crate) pool: Pool<DB>,
    pub(crate) config: InboxConfig,
    pub(crate) sql: Arc<Statements>,
    /// Set while this process's sweeper of this inbox works, where
    /// [`Dialect::LOCAL_SWEEP_LOCK`].
    pub(crate) sweeping: Arc<AtomicBool>,
}

/// The statements of one inbox, with its table name filled in once.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) claim: Arc<str>,
    pub(crate) existing: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) unclaim: Arc<str>,
    pub(crate) probe: Arc<str>,
    /// Dialect-specific batch statements (PostgreSQL: claim, existing, complete).
    pub(crate) batch: [Arc<str>; 3],
    /// External mode: insert, takeover, read, settle, release.
    pub(crate) lease: [Arc<str>; 5],
    /// The sweeper: lock, unlock, delete a batch, lag.
    pub(crate) sweep: [Arc<str>; 4],
}

impl<DB: Dialect> SqlInbox<DB> {
    /// An inbox in table `idem_inbox` with the default retention.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::with_config(pool, InboxConfig::default())
    }

    /// An inbox with `config`.
    pub fn with_config(pool: Pool<DB>, config: InboxConfig) -> Self {
        let sql = Arc::new(Statements {
            claim: statement(DB::CLAIM, &config.table),
            existing: statement(DB::EXISTING, &config.table),
            complete: statement(DB::COMPLETE, &config.table),
            unclaim: statement(DB::UNCLAIM, &config.table),
            probe: statement(DB::PROBE, &config.table),
            batch: DB::BATCH.map(|template| statement(template, &config.table)),
            lease: DB::LEASE
                .map(|template| statement(&template.replace("{now}", DB::NOW), &config.table)),
            sweep: DB::SWEEP
                .map(|template| statement(&template.replace("{now}", DB::NOW), &config.table)),
        });
        Self {
            pool,
            config,
            sql,
            sweeping: Arc::default(),
        }
    }

    /// The same inbox in table `name`.
    pub fn table(self, name: &str) -> Result<Self, ConfigError> {
        let config = self.config.clone().table(name)?;
        Ok(Self::with_config(self.pool, config))
    }

    /// The same inbox keeping rows for `retention`.
    pub fn retention(self, retention: Duration) -> Result<Self, ConfigError> {
        let config = self.config.clone().retention(retention)?;
        Ok(Self::with_config(self.pool, config))
    }

    /// The configuration.
    pub fn config(&self) -> &InboxConfig {
        &self.config
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }
}

impl<DB: Dialect> SqlInbox<DB>
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i32: for<'q> sqlx::Encode<'q, DB> + for<'r> sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    /// Creates or upgrades the inbox table, in one transaction that concurrent migrations
    /// (from other processes too) wait for. Run it on every start.
    pub async fn migrate(&self) -> Result<(), MigrateError> {
        let table = &self.config.table;
        let err = MigrateError::database;
        if let Some(prepare) = DB::PREPARE {
            sqlx::query(prepare)
                .execute(&self.pool)
                .await
                .map_err(err(table))?;
        }
        let conn = self.pool.acquire().await.map_err(err(table))?;
        let mut session = LockedSession::new(conn);
        session.released = DB::UNLOCK.is_none();
        let migrated = async {
            let mut tx = begin_with::<DB>(&mut session.conn)
                .await
                .map_err(err(table))?;
            Self::migrate_in(&mut tx, table).await?;
            tx.commit().await.map_err(err(table))
        }
        .await;
        if let Some(unlock) = DB::UNLOCK {
            // After the commit, so the next migration reads the version this one wrote; also
            // after a failure (its rollback runs first). Should the unlock fail, the session
            // closes on drop, which releases the lock.
            let unlocked = sqlx::query(unlock).execute(&mut *session.conn).await;
            session.released = unlocked.is_ok();
            unlocked.map_err(err(table))?;
        }
        migrated
    }

    async fn migrate_in(
        tx: &mut Transaction<'_, DB>,
        table: &TableName,
    ) -> Result<(), MigrateError> {
        use sqlx::Row;
        let err = MigrateError::database;
        for statement in DB::LOCK.into_iter().chain([DB::VERSION_TABLE]) {
            sqlx::query(statement)
                .execute(&mut **tx)
                .await
                .map_err(err(table))?;
        }
        let current = match sqlx::query(DB::READ_VERSION)
            .bind(table.as_str().to_owned())
            .fetch_optional(&mut **tx)
            .await
            .map_err(err(table))?
        {
            Some(row) => row.try_get::<i32, usize>(0).map_err(err(table))?,
            None => 0,
        };
        if current == SCHEMA_VERSION {
            return Ok(());
        }
        for statement in pending(DB::MIGRATIONS, table, current)? {
            sqlx::query(statement)
                .execute(&mut **tx)
                .await
                .map_err(err(table))?;
        }
        sqlx::query(DB::WRITE_VERSION)
            .bind(table.as_str().to_owned())
            .bind(SCHEMA_VERSION)
            .execute(&mut **tx)
            .await
            .map_err(err(table))?;
        Ok(())
    }
}

impl<DB: Dialect> Clone for SqlInbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            config: self.config.clone(),
            sql: self.sql.clone(),
            sweeping: self.sweeping.clone(),
        }
    }
}

impl<DB: Dialect> SqlInbox<DB> {
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

/// Holds this process's sweeper lock of one inbox until dropped.
pub(crate) struct SweepGuard<'a>(Option<&'a AtomicBool>);

impl Drop for SweepGuard<'_> {
    fn drop(&mut self) {
        if let Some(flag) = self.0 {
            flag.store(false, Ordering::Release);
        }
    }
}

impl<DB: Dialect> fmt::Debug for SqlInbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlInbox")
            .field("database", &DB::NAME)
            .field("config", &self.config)
            .finish()
    }
}

/// Fills the table name into a statement template. The name is a validated identifier (see
/// [`TableName`]), so the resulting text is safe to hand to `sqlx::AssertSqlSafe`.
pub(crate) fn statement(template: &str, table: &TableName) -> Arc<str> {
    template.replace("{table}", table.as_str()).into()
}

/// Starts a transaction on `pool` the way the dialect's inbox transactions start.
pub(crate) async fn begin_on<DB: Dialect>(
    pool: &Pool<DB>,
) -> Result<Transaction<'static, DB>, sqlx::Error> {
    match DB::BEGIN {
        Some(begin) => pool.begin_with(begin).await,
        None => pool.begin().await,
    }
}

/// Starts a transaction on `conn` the way the dialect's inbox transactions start.
async fn begin_with<DB: Dialect>(
    conn: &mut DB::Connection,
) -> Result<Transaction<'_, DB>, sqlx::Error> {
    use sqlx::Connection;
    match DB::BEGIN {
        Some(begin) => conn.begin_with(sqlx::SqlStr::from_static(begin)).await,
        None => conn.begin().await,
    }
}
