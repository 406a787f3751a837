//! SQL inbox stores for idem, on sqlx.
//!
//! One table holds every consumer's dedup markers, keyed `PRIMARY KEY (consumer, key)`, with the
//! payload fingerprint, status, stored result, attempts and timestamps (`expires_at` indexed
//! for the retention sweeper). A claim is insert-first in one statement; the database's unique
//! key decides between concurrent copies of a message.
//!
//! - [`PgInbox`]: PostgreSQL (feature `postgres`).
//! - [`MySqlInbox`]: MySQL and MariaDB, InnoDB (feature `mysql`).
//! - [`SqliteInbox`]: SQLite, the embedded default (feature `sqlite`); see [`sqlite::pool`] for
//!   a pool set up as idem needs (WAL, busy timeout).

// Helpers shared by some dialects go unused when those dialects' features are off.
#![cfg_attr(
    not(all(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(unused)
)]

mod claim;
pub mod config;
pub mod inbox;
mod lease;
mod methods;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
mod session;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod sweep;

pub use config::{ConfigError, DEFAULT_RETENTION, DEFAULT_TABLE, InboxConfig, TableName};
pub use inbox::{Dialect, SqlInbox};
#[cfg(feature = "mysql")]
pub use mysql::MySqlInbox;
#[cfg(feature = "postgres")]
pub use postgres::PgInbox;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteInbox;

use idem_core::{Fingerprint, StoreError};

/// A pool whose database can hold an inbox: [`migrate`] accepts any of these.
pub trait InboxPool {
    /// Creates or upgrades the default inbox table (`idem_inbox`) in this pool's database.
    fn migrate_inbox(&self) -> impl std::future::Future<Output = Result<(), MigrateError>> + Send;
}

#[cfg(feature = "postgres")]
impl InboxPool for sqlx::PgPool {
    fn migrate_inbox(&self) -> impl std::future::Future<Output = Result<(), MigrateError>> + Send {
        let inbox = PgInbox::new(self.clone());
        async move { inbox.migrate().await }
    }
}

#[cfg(feature = "mysql")]
impl InboxPool for sqlx::MySqlPool {
    fn migrate_inbox(&self) -> impl std::future::Future<Output = Result<(), MigrateError>> + Send {
        let inbox = MySqlInbox::new(self.clone());
        async move { inbox.migrate().await }
    }
}

#[cfg(feature = "sqlite")]
impl InboxPool for sqlx::SqlitePool {
    fn migrate_inbox(&self) -> impl std::future::Future<Output = Result<(), MigrateError>> + Send {
        let inbox = SqliteInbox::new(self.clone());
        async move { inbox.migrate().await }
    }
}

/// Creates or upgrades the default inbox table in `pool`'s database: `idem_sqlx::migrate(&pool)`.
/// For another table name, configure the store and call its own `migrate`.
pub async fn migrate<P: InboxPool>(pool: &P) -> Result<(), MigrateError> {
    pool.migrate_inbox().await
}

/// The current inbox schema version.
pub const SCHEMA_VERSION: i32 = 2;

/// The table recording which schema version each inbox table has.
pub const SCHEMA_TABLE: &str = "idem_schema_version";

/// Migrating an inbox table failed.
#[derive(Debug, thiserror::Error)]
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
    pub(crate) fn database(table: &TableName) -> impl FnOnce(sqlx::Error) -> Self + '_ {
        move |source| Self::Database {
            table: table.as_str().to_owned(),
            source,
        }
    }
}

/// The migration steps of one dialect: `(version, statements)`, with `{table}` standing for the
/// inbox table name.
pub(crate) type Migrations = &'static [(i32, &'static [&'static str])];

/// The statements of `migrations` newer than `current`, with the table name filled in.
pub(crate) fn pending(
    migrations: Migrations,
    table: &TableName,
    current: i32,
) -> Result<Vec<sqlx::AssertSqlSafe<String>>, MigrateError> {
    if current > SCHEMA_VERSION {
        return Err(MigrateError::TooNew {
            table: table.as_str().to_owned(),
            found: current,
        });
    }
    Ok(migrations
        .iter()
        .filter(|(version, _)| *version > current)
        .flat_map(|(_, statements)| statements.iter())
        // The table name is a validated identifier (see `TableName`), so this text is safe.
        .map(|statement| sqlx::AssertSqlSafe(statement.replace("{table}", table.as_str())))
        .collect())
}

/// The claim of a key whose row exists: its stored fingerprint and result.
pub(crate) fn existing_claim(
    fingerprint: &[u8],
    outcome: Option<String>,
) -> Result<idem_core::Claim, StoreError> {
    Ok(idem_core::Claim::Existing {
        fingerprint: stored_fingerprint(fingerprint)?,
        output: outcome.map(idem_core::StoredOutput::from_json),
    })
}

/// Decodes a stored fingerprint.
pub(crate) fn stored_fingerprint(bytes: &[u8]) -> Result<Fingerprint, StoreError> {
    Fingerprint::from_slice(bytes).ok_or_else(|| {
        StoreError::new(
            "claim",
            idem_core::ErrorClass::Permanent,
            format!("stored fingerprint has {} bytes, expected 32", bytes.len()),
        )
    })
}
