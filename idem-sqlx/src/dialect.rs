//! [`Dialect`]: what one database brings to the inbox. Its statements and migrations, by
//! name; how its transactions start; and the few claims it makes its own way (PostgreSQL
//! claims in one round trip and a batch with array parameters; the others insert, then read).
//! Everything else is generic code over `DB: Dialect` (`inbox.rs`, `claim.rs`, `lease.rs`,
//! `sweep.rs`, `migrate.rs`).

use crate::claim;
use crate::exec::Sql;
use crate::statements::{MigrationStatements, Prepared, Statements};
use idem_core::{
    model::StoreError, model::StoredOutput, store::Claim, store::ClaimRequest, store::StoreKind,
};
use std::future::Future;

/// A SQL database idem can keep an inbox in.
pub trait Dialect: Sql {
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

    /// Bind parameter `n` (from 1) in statement text put together at run time (default `?`).
    fn placeholder(n: usize) -> String {
        let _ = n;
        "?".to_owned()
    }

    /// Starts listening, on a connection of `pool`'s own, for the notifications that rows were
    /// staged in `outbox` outside any handler, waking `wake` at each; `false` (the default):
    /// the database sends none, and the relays poll.
    fn listen(
        pool: sqlx::Pool<Self>,
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
        conn: &'a mut Self::Connection,
        request: &'a ClaimRequest<'a>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a {
        claim::insert_then_read::<Self>(sql, conn, request)
    }

    /// Claims one key like [`Dialect::claim`], but answers `None` instead of waiting behind
    /// another transaction's uncommitted claim of it. The default cannot tell, and waits.
    fn try_claim<'a>(
        sql: &'a Prepared,
        conn: &'a mut Self::Connection,
        request: &'a ClaimRequest<'a>,
    ) -> impl Future<Output = Result<Option<Claim>, StoreError>> + Send + 'a {
        async move { Self::claim(sql, conn, request).await.map(Some) }
    }

    /// Claims a batch's distinct keys, answering in `requests`' order. The default claims
    /// with multi-row statements where the dialect has them (`claim::claim_rows`), else one
    /// by one.
    fn claim_batch<'a>(
        sql: &'a Prepared,
        conn: &'a mut Self::Connection,
        requests: &'a [ClaimRequest<'a>],
    ) -> impl Future<Output = Result<Vec<Claim>, StoreError>> + Send + 'a {
        async move {
            if let Some(rows) = &sql.rows {
                return claim::claim_rows::<Self>(rows, conn, requests).await;
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
        conn: &'a mut Self::Connection,
        completed: &'a [(ClaimRequest<'a>, &'a StoredOutput)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        async move {
            for (request, output) in completed {
                claim::complete::<Self>(sql, &mut *conn, request, output).await?;
            }
            Ok(())
        }
    }

    /// Removes the markers of `keys`, claimed in this transaction by messages that then
    /// failed. The default removes them one by one.
    fn unclaim<'a>(
        sql: &'a Prepared,
        conn: &'a mut Self::Connection,
        consumer: &'a str,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        claim::unclaim_each::<Self>(sql, conn, consumer, keys)
    }
}
