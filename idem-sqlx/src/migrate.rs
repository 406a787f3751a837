//! Creating and upgrading inbox tables: one transaction per migration, serialized across
//! processes by the dialect's lock, recording each table's schema version.

use crate::config::TableName;
use crate::dialect::Dialect;
use crate::exec::Param;
use crate::session::LockedSession;
use crate::statements::fill;
use sqlx::{Connection, Pool, Transaction};

/// The current inbox schema version.
pub const SCHEMA_VERSION: i32 = 12;

/// The table recording which schema version each inbox table has.
pub const SCHEMA_TABLE: &str = "idem_schema_version";

/// Migrating an inbox table failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// The database refused a statement.
    #[error("migrating inbox table `{table}` failed: {source}")]
    Database {
        /// The inbox table.
        table: String,
        /// What the database said.
        #[source]
        source: sqlx::Error,
    },
    /// The server is not one this dialect runs on (MySQL, where only MariaDB is supported).
    #[error("inbox table `{table}`: {reason}")]
    Unsupported {
        /// The inbox table.
        table: String,
        /// Which server it is, and what to use instead.
        reason: String,
    },
    /// The table was migrated by a newer idem.
    #[error(
        "inbox table `{table}` has schema version {found}, newer than the {SCHEMA_VERSION} this idem knows; upgrade idem"
    )]
    TooNew {
        /// The inbox table.
        table: String,
        /// The version found.
        found: i32,
    },
}

impl MigrateError {
    fn database(table: &TableName) -> impl FnOnce(sqlx::Error) -> Self + '_ {
        move |source| Self::Database {
            table: table.as_str().to_owned(),
            source,
        }
    }
}

/// A pool whose database can hold an inbox: [`migrate`] accepts any of these.
pub trait InboxPool {
    /// Creates or upgrades the default inbox table (`idem_inbox`) in this pool's database.
    fn migrate_inbox(&self) -> impl std::future::Future<Output = Result<(), MigrateError>> + Send;
}

impl<DB: Dialect> InboxPool for Pool<DB> {
    fn migrate_inbox(&self) -> impl std::future::Future<Output = Result<(), MigrateError>> + Send {
        let pool = self.clone();
        async move { run::<DB>(&pool, &TableName::default()).await }
    }
}

/// Creates or upgrades the default inbox table in `pool`'s database: `idem_sqlx::migrate(&pool)`.
/// For another table name, configure the store and call its own `migrate`.
pub async fn migrate<P: InboxPool>(pool: &P) -> Result<(), MigrateError> {
    pool.migrate_inbox().await
}

/// Creates or upgrades `table` in `pool`'s database, in one transaction that concurrent
/// migrations (from other processes too) wait for.
pub(crate) async fn run<DB: Dialect>(
    pool: &Pool<DB>,
    table: &TableName,
) -> Result<(), MigrateError> {
    let steps = DB::MIGRATION;
    let err = MigrateError::database;
    let mut conn = pool.acquire().await.map_err(err(table))?;
    if let (Some(read), Some(supported)) = (steps.server_version, steps.server) {
        let read: std::sync::Arc<str> = read.into();
        let row = DB::fetch_optional(&mut *conn, &read, &[])
            .await
            .map_err(err(table))?;
        let version = match row {
            Some(row) => DB::text(&row, "version"),
            None => Ok(String::new()),
        }
        .map_err(err(table))?;
        supported(&version).map_err(|reason| MigrateError::Unsupported {
            table: table.as_str().to_owned(),
            reason,
        })?;
    }
    if let Some(prepare) = steps.prepare {
        DB::execute_raw(&mut *conn, prepare)
            .await
            .map_err(err(table))?;
    }
    let mut session = LockedSession::new(conn);
    session.released = steps.unlock.is_none();
    let migrated = async {
        let mut tx = begin::<DB>(&mut *session.conn).await.map_err(err(table))?;
        upgrade::<DB>(&mut tx, table).await?;
        tx.commit().await.map_err(err(table))
    }
    .await;
    if let Some(unlock) = steps.unlock {
        // After the commit, so the next migration reads the version this one wrote; also
        // after a failure (its rollback runs first). Should the unlock fail, the session
        // closes on drop, which releases the lock.
        let unlocked = DB::execute_raw(&mut *session.conn, unlock).await;
        session.released = unlocked.is_ok();
        unlocked.map_err(err(table))?;
    }
    migrated
}

/// Inside the migration's transaction: takes the lock, reads the table's version and runs the
/// steps after it.
async fn upgrade<DB: Dialect>(
    tx: &mut Transaction<'_, DB>,
    table: &TableName,
) -> Result<(), MigrateError> {
    let steps = DB::MIGRATION;
    let err = MigrateError::database;
    for statement in steps.lock.into_iter().chain([steps.version_table]) {
        DB::execute_raw(&mut **tx, statement)
            .await
            .map_err(err(table))?;
    }
    let name = [Param::Text(table.as_str())];
    let read = fill(steps.read_version, table, DB::NOW);
    let current = match DB::fetch_optional(&mut **tx, &read, &name)
        .await
        .map_err(err(table))?
    {
        Some(row) => DB::int32(&row, "version").map_err(err(table))?,
        None => 0,
    };
    if current == SCHEMA_VERSION {
        return Ok(());
    }
    if current > SCHEMA_VERSION {
        return Err(MigrateError::TooNew {
            table: table.as_str().to_owned(),
            found: current,
        });
    }
    let pending = steps
        .steps
        .iter()
        .filter(|(version, _)| *version > current)
        .flat_map(|(_, statements)| statements.iter());
    for statement in pending {
        let statement = fill(statement, table, DB::NOW);
        DB::execute(&mut **tx, &statement, &[])
            .await
            .map_err(err(table))?;
    }
    let write = fill(steps.write_version, table, DB::NOW);
    let version = [Param::Text(table.as_str()), Param::Int32(SCHEMA_VERSION)];
    DB::execute(&mut **tx, &write, &version)
        .await
        .map_err(err(table))?;
    Ok(())
}

/// Starts a transaction on `conn` the way the dialect's inbox transactions start.
pub(crate) async fn begin<DB: Dialect>(
    conn: &mut DB::Connection,
) -> Result<Transaction<'_, DB>, sqlx::Error> {
    match DB::BEGIN {
        Some(begin) => conn.begin_with(sqlx::SqlStr::from_static(begin)).await,
        None => conn.begin().await,
    }
}
