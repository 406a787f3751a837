//! [`Dialect`]: what one database brings to the inbox. Its statements and migrations, by
//! name; how its transactions start; and the few claims it makes its own way (PostgreSQL
//! claims in one round trip and a batch with array parameters; the others insert, then read).
//! Everything else is generic code over `DB: Dialect` (`inbox.rs`, `claim.rs`, `lease.rs`,
//! `sweep.rs`, `migrate.rs`).
//!
//! A dialect is a marker type ([`crate::PgDialect`], [`crate::MySqlDialect`],
//! [`crate::SqliteDialect`]) whose sqlx driver is an associated type ([`Dialect::Db`]), so that
//! two dialects can share a driver (a database that speaks PostgreSQL's protocol with other
//! rules). A driver names the dialect that functions taking only its transaction use
//! ([`Driver`]). Tools pick a dialect by URL from a table ([`DIALECTS`], [`by_url`]).

use crate::claim;
use crate::exec::Sql;
use crate::statements::{MigrationStatements, Prepared, Statements};
use idem_core::{
    model::StoreError, model::StoredOutput, store::Claim, store::ClaimRequest, store::StoreKind,
};
use sqlx::Database;
use std::future::Future;

/// The connection type of dialect `D`'s driver.
pub type Conn<D> = <<D as Dialect>::Db as Database>::Connection;

/// The row type of dialect `D`'s driver.
pub type Row<D> = <<D as Dialect>::Db as Database>::Row;

/// A SQL database idem can keep an inbox in.
pub trait Dialect: Send + Sync + Sized + 'static {
    /// The sqlx driver it runs on.
    type Db: Sql;
    /// Its entry in the table of dialects tools choose from by URL ([`DIALECTS`]).
    const ENTRY: Entry;
    /// The store's name, as `#[idempotent(store = ...)]` spells it, and how a user makes one.
    const KIND: StoreKind;
    /// The statements.
    const STATEMENTS: Statements;
    /// The inbox table's schema versions, and how migrations are serialized.
    const MIGRATION: MigrationStatements;
    /// The current time in the dialect's timestamp column type, for `{now}` in statements.
    const NOW: &'static str = "now()";
    /// Starts inbox transactions, the migration's too (`None`: a plain `BEGIN`).
    const BEGIN: Option<&'static str> = None;
    /// Whether sweepers must also exclude each other inside this process (SQLite, whose
    /// sweeper lock cannot span processes).
    const LOCAL_SWEEP_LOCK: bool = false;
    /// Whether keys and the text of records are written escaped where they hold NUL, which
    /// the database's text type refuses (PostgreSQL), as the module `keys` says.
    const ESCAPES_NUL: bool = false;
    /// A query of the settings under which a commit can be lost after idem acked it, one row
    /// per risk found with the text columns `setting`, `found` and `fix` ([`crate::durability`]);
    /// empty: the dialect cannot tell.
    const DURABILITY: &'static str = "";

    /// A pool of at most `max` connections to the database `url` names, as idem's tools open
    /// it (its [`Entry`] says which URLs are this dialect's).
    fn connect(
        url: &str,
        max: u32,
    ) -> impl Future<Output = Result<sqlx::Pool<Self::Db>, sqlx::Error>> + Send;

    /// Bind parameter `n` (from 1) in statement text put together at run time (default `?`).
    fn placeholder(n: usize) -> String {
        let _ = n;
        "?".to_owned()
    }

    /// Starts listening, on a connection of `pool`'s own, for the notifications that rows were
    /// staged in `outbox` outside any handler, waking `wake` at each; `false` (the default):
    /// the database sends none, and the relays poll.
    fn listen(
        pool: sqlx::Pool<Self::Db>,
        outbox: String,
        wake: std::sync::Arc<crate::wake::Wake>,
    ) -> bool {
        let _ = (pool, outbox, wake);
        false
    }

    /// Refuses a request this database cannot hold as it is (default: none).
    fn check_request(request: &ClaimRequest<'_>) -> Result<(), StoreError> {
        let _ = request;
        Ok(())
    }

    /// Claims one key in the transaction on `conn`. The default inserts, then reads the row
    /// that holds the key (`claim::insert_then_read`).
    fn claim<'a>(
        sql: &'a Prepared,
        conn: &'a mut Conn<Self>,
        request: &'a ClaimRequest<'a>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a {
        claim::insert_then_read::<Self::Db>(sql, conn, request)
    }

    /// Claims one key like [`Dialect::claim`], but answers `None` instead of waiting behind
    /// another transaction's uncommitted claim of it. The default cannot tell, and waits.
    fn try_claim<'a>(
        sql: &'a Prepared,
        conn: &'a mut Conn<Self>,
        request: &'a ClaimRequest<'a>,
    ) -> impl Future<Output = Result<Option<Claim>, StoreError>> + Send + 'a {
        async move { Self::claim(sql, conn, request).await.map(Some) }
    }

    /// Claims a batch's distinct keys, answering in `requests`' order. The default claims
    /// with multi-row statements where the dialect has them (`claim::claim_rows`), else one
    /// by one.
    fn claim_batch<'a>(
        sql: &'a Prepared,
        conn: &'a mut Conn<Self>,
        requests: &'a [ClaimRequest<'a>],
    ) -> impl Future<Output = Result<Vec<Claim>, StoreError>> + Send + 'a {
        async move {
            if let Some(rows) = &sql.rows {
                return claim::claim_rows::<Self::Db>(rows, conn, requests).await;
            }
            let mut claims = Vec::with_capacity(requests.len());
            for request in requests {
                claims.push(Self::claim(sql, &mut *conn, request).await?);
            }
            Ok(claims)
        }
    }

    /// Stores the results of several messages claimed in this transaction. The default
    /// completes one by one.
    fn complete_batch<'a>(
        sql: &'a Prepared,
        conn: &'a mut Conn<Self>,
        completed: &'a [(ClaimRequest<'a>, &'a StoredOutput)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        async move {
            for (request, output) in completed {
                claim::complete::<Self::Db>(sql, &mut *conn, request, output).await?;
            }
            Ok(())
        }
    }

    /// Removes the markers of `keys`, claimed in this transaction by messages that then
    /// failed. The default removes them one by one.
    fn unclaim<'a>(
        sql: &'a Prepared,
        conn: &'a mut Conn<Self>,
        consumer: &'a str,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        claim::unclaim_each::<Self::Db>(sql, conn, consumer, keys)
    }
}

/// A sqlx driver, and the dialect that functions given only its transaction use (a handler's
/// `stage(&mut tx, ..)`): PostgreSQL's, MySQL's, SQLite's.
pub trait Driver: Sql {
    /// The dialect of this driver's own database.
    type Dialect: Dialect<Db = Self>;
}

/// A dialect's entry in the table tools choose a dialect from ([`DIALECTS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Its name, as `idem schema --dialect` takes it.
    pub name: &'static str,
    /// The beginnings of the URLs that name it (`postgres://`).
    pub schemes: &'static [&'static str],
    /// Whether a URL without a scheme (a file's path) names it.
    pub bare_path: bool,
    /// Whether its schema changes can run in one transaction (MariaDB commits each by itself).
    pub transactional_ddl: bool,
}

impl Entry {
    /// Whether `url` names this dialect.
    pub fn names(&self, url: &str) -> bool {
        self.schemes.iter().any(|scheme| url.starts_with(scheme))
            || (self.bare_path && !url.contains("://"))
    }
}

/// The dialects of this build (by feature), in the order a URL is matched against them.
pub const DIALECTS: &[Entry] = &[
    #[cfg(feature = "postgres")]
    <crate::PgDialect as Dialect>::ENTRY,
    #[cfg(feature = "mysql")]
    <crate::MySqlDialect as Dialect>::ENTRY,
    #[cfg(feature = "sqlite")]
    <crate::SqliteDialect as Dialect>::ENTRY,
];

/// Code to run with a dialect chosen at run time ([`by_url`], [`by_name`]).
pub trait WithDialect {
    /// What it gives.
    type Output;
    /// Runs with dialect `D`.
    fn run<D: Dialect>(self, entry: &'static Entry) -> Self::Output;
}

/// No dialect of this build is named so.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no dialect of this build takes {0}: it knows {known}", known = known())]
pub struct UnknownDialect(pub String);

/// The dialects of this build, and their schemes, for messages.
fn known() -> String {
    let names: Vec<String> = DIALECTS
        .iter()
        .map(|entry| format!("{} ({})", entry.name, entry.schemes.join(", ")))
        .collect();
    names.join(", ")
}

/// Runs `with` with the dialect whose entry names `url` (see [`Entry::names`]).
pub fn by_url<W: WithDialect>(url: &str, with: W) -> Result<W::Output, UnknownDialect> {
    match DIALECTS.iter().find(|entry| entry.names(url)) {
        Some(entry) => by_name(entry.name, with),
        None => Err(UnknownDialect(format!(
            "the URL {}",
            idem_core::telemetry::redact_url(url)
        ))),
    }
}

/// Runs `with` with the dialect called `name` in [`DIALECTS`].
pub fn by_name<W: WithDialect>(name: &str, with: W) -> Result<W::Output, UnknownDialect> {
    let unknown = || UnknownDialect(format!("the name {name:?}"));
    let entry = DIALECTS
        .iter()
        .find(|entry| entry.name == name)
        .ok_or_else(unknown)?;
    // From the entry to its type: the one place the dialects of this build are listed by type.
    match entry.name {
        #[cfg(feature = "postgres")]
        "postgres" => Ok(with.run::<crate::PgDialect>(entry)),
        #[cfg(feature = "mysql")]
        "mysql" => Ok(with.run::<crate::MySqlDialect>(entry)),
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(with.run::<crate::SqliteDialect>(entry)),
        _ => Err(unknown()),
    }
}

#[cfg(all(test, feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod tests {
    use super::*;

    /// Gives the entry of the dialect it runs with.
    struct EntryOf;

    impl WithDialect for EntryOf {
        type Output = (Entry, Entry);

        fn run<D: Dialect>(self, entry: &'static Entry) -> (Entry, Entry) {
            (D::ENTRY, *entry)
        }
    }

    #[test]
    fn a_url_picks_its_dialect_from_the_table() {
        for (url, name) in [
            ("postgres://app@db/orders", "postgres"),
            ("postgresql://db/orders", "postgres"),
            ("mysql://root@db/test", "mysql"),
            ("mariadb://root@db/test", "mysql"),
            ("sqlite:orders.db", "sqlite"),
            ("/var/lib/orders.db", "sqlite"),
        ] {
            let (typed, listed) = by_url(url, EntryOf).unwrap();
            assert_eq!((typed.name, listed.name), (name, name), "{url}");
        }
        let unknown = by_url("oracle://scott:tiger@db/orders", EntryOf).unwrap_err();
        assert!(!unknown.to_string().contains("tiger"), "{unknown}");
        assert!(
            unknown.to_string().contains("mysql (mysql://, mariadb://)"),
            "{unknown}"
        );
    }

    /// Each entry of the table runs with the dialect type whose entry it is.
    #[test]
    fn every_entry_names_its_own_type() {
        for entry in DIALECTS {
            let (typed, listed) = by_name(entry.name, EntryOf).unwrap();
            assert_eq!(typed, *entry);
            assert_eq!(listed, *entry);
        }
        assert_eq!(DIALECTS.len(), 3);
        assert!(by_name("oracle", EntryOf).is_err());
    }
}
