//! SQL inbox stores for idem, on sqlx.
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! let inbox = idem_sqlx::PgInbox::new(pool);
//! inbox.migrate().await?; // creates idem_inbox and its companions, or upgrades them
//! # Ok(()) }
//! ```
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
//!
//! All three are [`SqlInbox<DB>`], one generic [`idem_core::store::InboxStore`] over a [`Dialect`],
//! a marker type ([`PgDialect`], [`MySqlDialect`], [`SqliteDialect`]) whose sqlx driver is an
//! associated type, so that dialects can share a driver; tools pick one by URL from
//! [`dialect::DIALECTS`]. A dialect module (`postgres.rs`, `mysql.rs`, `sqlite.rs`) holds its
//! statements by name
//! ([`statements`]), its migrations and the claims it makes its own way; the code they share
//! is generic (`inbox.rs`, `claim.rs`, `lease.rs`, `sweep.rs`, `migrate.rs`), with sqlx's
//! per-type bounds written once ([`exec`]). Database errors are classified here
//! ([`classify_sqlx`]). Beside the inbox table, `{table}_deliveries` counts the handler runs on
//! redeliveries that never settled (the poison limit) and `{table}_dead_letters` records why
//! each dead letter was refused
//! ([`dead_letters`]); [`parking`] keeps an ordered handler's keys parked behind their
//! dead-lettered messages; [`admin`] holds what an operator reads and changes. The outbox
//! (`idem_outbox` beside `idem_inbox`) is staged in the caller's transaction ([`outbox`]) and
//! published by relay passes (`relay.rs`), which PostgreSQL's notifications wake
//! (`wake.rs`).
//!
//! Adding a database: a dialect module with a marker type implementing [`Dialect`] (and
//! [`Driver`] and [`exec::RowsAffected`] for a driver of its own), its entry in
//! [`dialect::DIALECTS`] and [`dialect::by_name`], a feature for it, its alias in `stores.rs`, its error codes in
//! `error.rs` if they need more than SQLSTATEs, and its name in the `#[idempotent]` macro's
//! store list.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admin;
mod claim;
pub mod config;
pub mod dead_letters;
mod deliveries;
pub mod dialect;
pub mod durability;
mod error;
pub mod exec;
pub mod held;
pub mod inbox;
pub mod keys;
mod lease;
pub mod migrate;
#[cfg(feature = "mysql")]
pub mod mysql;
pub mod outbox;
pub mod parking;
#[cfg(feature = "postgres")]
pub mod postgres;
mod session;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod statements;
#[doc(hidden)]
pub mod stores;
mod sweep;
pub mod urls;
mod versions;
pub(crate) mod wake;

pub use admin::{DeadLetterCount, InboxRow, InboxStats, KeyReport, Removed, StatusCount};
pub use config::{ConfigError, DEFAULT_RETENTION, DEFAULT_TABLE, InboxConfig, TableName};
pub use dead_letters::DeadLetterRow;
pub use dialect::{Dialect, Driver};
pub use durability::{Durability, Risk};
pub use error::{classify_database_code, classify_error, classify_mysql_number, classify_sqlx};
pub use held::Held;
pub use inbox::SqlInbox;
pub use migrate::{
    InboxPool, MigrateError, READERS_FROM, SCHEMA_TABLE, SCHEMA_VERSION, migrate, schema,
};
#[cfg(feature = "mysql")]
pub use mysql::{MySqlDialect, MySqlInbox};
pub use parking::{ParkedKey, Release, Started};
#[cfg(feature = "postgres")]
pub use postgres::{PgDialect, PgInbox};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteDialect, SqliteInbox};
