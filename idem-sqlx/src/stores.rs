//! The store types `#[idempotent(store = ...)]` names, one per enabled dialect. The macro
//! expands `store = Postgres` to `idem::__private::stores::Postgres`.

/// `store = Postgres`.
#[cfg(feature = "postgres")]
pub type Postgres = crate::PgInbox;
/// `store = Sqlite`.
#[cfg(feature = "sqlite")]
pub type Sqlite = crate::SqliteInbox;
/// `store = MySql` (MySQL or MariaDB).
#[cfg(feature = "mysql")]
pub type MySql = crate::MySqlInbox;
