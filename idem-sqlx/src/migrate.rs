//! Creating and upgrading inbox tables: one transaction per migration, serialized across
//! processes by the dialect's lock, recording each table's schema version.

use crate::config::TableName;
use crate::dialect::{Conn, Dialect, Driver};
use crate::exec::Param;
use crate::exec::Sql;
use crate::session::LockedSession;
use crate::statements::fill;
use sqlx::{Connection, Pool, Transaction};

/// The current inbox schema version.
pub const SCHEMA_VERSION: i32 = 14;

/// The oldest schema version whose idem can run on tables of [`SCHEMA_VERSION`]. `migrate()`
/// records it beside the version; an older idem that finds a newer schema runs on it when its
/// own schema version is at least this one (a rollback, or old and new processes side by side
/// in a rolling deploy), and refuses it otherwise. A migration that only adds what older code
/// can ignore keeps it; one that older code cannot work with raises it to the new version.
pub const READERS_FROM: i32 = 12;

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
    /// The table was migrated by a newer idem, which does not run with this one.
    #[error(
        "inbox table `{table}` has schema version {found}, newer than the {SCHEMA_VERSION} this idem knows, and runs with an idem of schema version {readers_from} or later only; upgrade idem"
    )]
    TooNew {
        /// The inbox table.
        table: String,
        /// The version found.
        found: i32,
        /// The oldest schema version whose idem runs on it.
        readers_from: i32,
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

impl<DB: Driver> InboxPool for Pool<DB> {
    fn migrate_inbox(&self) -> impl std::future::Future<Output = Result<(), MigrateError>> + Send {
        let pool = self.clone();
        async move { run::<DB::Dialect>(&pool, &TableName::default()).await }
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
    pool: &Pool<DB::Db>,
    table: &TableName,
) -> Result<(), MigrateError> {
    let steps = DB::MIGRATION;
    let err = MigrateError::database;
    let mut conn = pool.acquire().await.map_err(err(table))?;
    if let (Some(read), Some(supported)) = (steps.server_version, steps.server) {
        let read: std::sync::Arc<str> = read.into();
        let row = DB::Db::fetch_optional(&mut *conn, &read, &[])
            .await
            .map_err(err(table))?;
        let version = match row {
            Some(row) => DB::Db::text(&row, "version"),
            None => Ok(String::new()),
        }
        .map_err(err(table))?;
        supported(&version).map_err(|reason| MigrateError::Unsupported {
            table: table.as_str().to_owned(),
            reason,
        })?;
    }
    if let Some(prepare) = steps.prepare {
        DB::Db::execute_raw(&mut *conn, prepare)
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
        let unlocked = DB::Db::execute_raw(&mut *session.conn, unlock).await;
        session.released = unlocked.is_ok();
        unlocked.map_err(err(table))?;
    }
    migrated
}

/// Inside the migration's transaction: takes the lock, reads the table's version and runs the
/// steps after it.
async fn upgrade<DB: Dialect>(
    tx: &mut Transaction<'_, DB::Db>,
    table: &TableName,
) -> Result<(), MigrateError> {
    let steps = DB::MIGRATION;
    let err = MigrateError::database;
    for statement in steps.lock.into_iter().chain([steps.version_table]) {
        DB::Db::execute_raw(&mut **tx, statement)
            .await
            .map_err(err(table))?;
    }
    let current = read_version::<DB>(tx, table.as_str())
        .await
        .map_err(err(table))?
        .unwrap_or(0);
    let readers = readers_row(table);
    if current > SCHEMA_VERSION {
        // Recorded by the newer idem that migrated it; a schema recorded without it runs with
        // its own version's idem only.
        let readers_from = read_version::<DB>(tx, &readers)
            .await
            .map_err(err(table))?
            .unwrap_or(current);
        if readers_from > SCHEMA_VERSION {
            return Err(MigrateError::TooNew {
                table: table.as_str().to_owned(),
                found: current,
                readers_from,
            });
        }
        tracing::info!(
            table = table.as_str(),
            found = current,
            known = SCHEMA_VERSION,
            readers_from,
            "the inbox schema is newer than this idem's and runs with it; leaving it as it is"
        );
        return Ok(());
    }
    let write = fill(steps.write_version, table, DB::NOW);
    let recorded = [Param::Text(&readers), Param::Int32(READERS_FROM)];
    DB::Db::execute(&mut **tx, &write, &recorded)
        .await
        .map_err(err(table))?;
    if current == SCHEMA_VERSION {
        return Ok(());
    }
    let pending = steps
        .steps
        .iter()
        .filter(|(version, _)| *version > current)
        .flat_map(|(_, statements)| statements.iter());
    for statement in pending {
        let statement = fill(statement, table, DB::NOW);
        DB::Db::execute(&mut **tx, &statement, &[])
            .await
            .map_err(err(table))?;
    }
    let write = fill(steps.write_version, table, DB::NOW);
    let version = [Param::Text(table.as_str()), Param::Int32(SCHEMA_VERSION)];
    DB::Db::execute(&mut **tx, &write, &version)
        .await
        .map_err(err(table))?;
    Ok(())
}

/// The statements that create `table` at [`SCHEMA_VERSION`] from nothing, in the order
/// `migrate()` runs them, ending with the rows of `idem_schema_version` that `migrate()`
/// records (so that it finds the tables current): for teams whose schema changes go through
/// a migration tool of their own (`idem schema` prints them). Run them in one transaction
/// (MariaDB commits each DDL statement by itself; each can be run again); each ends without
/// its `;`.
pub fn schema<DB: Dialect>(table: &TableName) -> Vec<String> {
    let steps = DB::MIGRATION;
    let mut statements = vec![steps.version_table.to_owned()];
    for (_, step) in steps.steps {
        statements.extend(step.iter().map(|s| fill(s, table, DB::NOW).to_string()));
    }
    for (name, version) in [
        (table.as_str().to_owned(), SCHEMA_VERSION),
        (readers_row(table), READERS_FROM),
    ] {
        statements.push(with_values(steps.write_version, &name, version));
    }
    statements
}

/// `template` (`write_version`) with its two parameters, the row's name and its version,
/// written in: `$1` and `$2` (PostgreSQL), `?1` and `?2` (SQLite), or two `?` (MariaDB). The
/// name is a table name, a plain identifier, or one with `@readers` after it: it needs no
/// escaping inside quotes.
fn with_values(template: &str, name: &str, version: i32) -> String {
    let (name, version) = (format!("'{name}'"), version.to_string());
    if template.contains("$1") {
        template.replace("$2", &version).replace("$1", &name)
    } else if template.contains("?1") {
        template.replace("?2", &version).replace("?1", &name)
    } else {
        template.replacen('?', &name, 1).replacen('?', &version, 1)
    }
}

/// The row of `idem_schema_version` that records the oldest schema version whose idem runs on
/// `table` ([`READERS_FROM`]); table names are plain identifiers, so it cannot be a table's.
fn readers_row(table: &TableName) -> String {
    format!("{}@readers", table.as_str())
}

/// The version `idem_schema_version` records under `name`, if any.
async fn read_version<DB: Dialect>(
    tx: &mut Transaction<'_, DB::Db>,
    name: &str,
) -> Result<Option<i32>, sqlx::Error> {
    let read = fill(DB::MIGRATION.read_version, &TableName::default(), DB::NOW);
    match DB::Db::fetch_optional(&mut **tx, &read, &[Param::Text(name)]).await? {
        Some(row) => DB::Db::int32(&row, "version").map(Some),
        None => Ok(None),
    }
}

/// Starts a transaction on `conn` the way the dialect's inbox transactions start.
pub(crate) async fn begin<DB: Dialect>(
    conn: &mut Conn<DB>,
) -> Result<Transaction<'_, DB::Db>, sqlx::Error> {
    match DB::BEGIN {
        Some(begin) => conn.begin_with(sqlx::SqlStr::from_static(begin)).await,
        None => conn.begin().await,
    }
}
