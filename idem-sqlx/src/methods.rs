//! The transaction plumbing every dialect's `InboxStore` shares: the table check, begin,
//! commit and rollback, the per-message savepoints of a batch, and per-key unclaims.

use crate::inbox::{Dialect, SqlInbox, begin_on};
use idem_core::StoreError;
use sqlx::{Database, Pool, Transaction};

/// Fails unless the inbox table exists with the columns idem uses.
pub(crate) async fn check<DB: Dialect>(inbox: &SqlInbox<DB>) -> Result<(), StoreError>
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    sqlx::query(sqlx::AssertSqlSafe(inbox.sql.probe.clone()))
        .execute(&inbox.pool)
        .await
        .map(drop)
        .map_err(|e| {
            StoreError::new(
                "check",
                idem_core::ErrorClass::Permanent,
                format!("inbox table `{}`: {e}", inbox.config.table_name()),
            )
        })
}

/// Starts an inbox transaction.
pub(crate) async fn begin<DB: Dialect>(
    inbox: &SqlInbox<DB>,
) -> Result<Transaction<'static, DB>, StoreError> {
    begin_on(&inbox.pool)
        .await
        .map_err(|e| StoreError::sqlx("begin", e))
}

/// Removes the markers of `keys` claimed in `tx`, one statement per key (the dialects without
/// array parameters).
pub(crate) async fn unclaim_each<DB: Dialect>(
    inbox: &SqlInbox<DB>,
    tx: &mut Transaction<'static, DB>,
    consumer: &str,
    keys: &[&str],
) -> Result<(), StoreError>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    for key in keys {
        sqlx::query(sqlx::AssertSqlSafe(inbox.sql.unclaim.clone()))
            .bind(consumer)
            .bind(*key)
            .execute(&mut **tx)
            .await
            .map_err(|e| StoreError::sqlx("unclaim", e))?;
    }
    Ok(())
}

/// Commits an inbox transaction.
pub(crate) async fn commit<DB: Database>(tx: Transaction<'static, DB>) -> Result<(), StoreError> {
    tx.commit().await.map_err(|e| StoreError::sqlx("commit", e))
}

/// The savepoint each message of a batch runs under.
const SAVEPOINT: &str = "SAVEPOINT idem_message";
/// Ends one message's savepoint and starts the next one's, in one round trip.
const NEXT_SAVEPOINT: &str = "RELEASE SAVEPOINT idem_message; SAVEPOINT idem_message";
const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idem_message";

/// Starts the first message's savepoint of a batch, or moves on to the next message's.
pub(crate) async fn savepoint<DB: Database>(
    tx: &mut Transaction<'static, DB>,
    first: bool,
) -> Result<(), StoreError>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let statement = if first { SAVEPOINT } else { NEXT_SAVEPOINT };
    sqlx::raw_sql(statement)
        .execute(&mut **tx)
        .await
        .map(drop)
        .map_err(|e| StoreError::sqlx("savepoint", e))
}

/// Undoes the current message of a batch; the savepoint stays, for the next message.
pub(crate) async fn rollback_to_savepoint<DB: Database>(
    tx: &mut Transaction<'static, DB>,
) -> Result<(), StoreError>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    sqlx::raw_sql(ROLLBACK_TO_SAVEPOINT)
        .execute(&mut **tx)
        .await
        .map(drop)
        .map_err(|e| StoreError::sqlx("rollback to savepoint", e))
}

/// Rolls an inbox transaction back, logging a failure: a transaction that cannot be rolled back
/// is not committed either, and its connection is discarded.
pub(crate) async fn rollback<DB: Database>(tx: Transaction<'static, DB>) {
    if let Err(e) = tx.rollback().await {
        tracing::warn!(error = %e, "inbox rollback failed; the connection is discarded");
    }
}

/// The `InboxStore` methods every dialect implements alike: the table check, the retention, the
/// transaction's begin, savepoint rollback, commit and rollback, and the sweep.
macro_rules! shared_methods {
    () => {
        async fn check(&self) -> Result<(), idem_core::StoreError> {
            $crate::methods::check(self).await
        }

        fn retention(&self) -> std::time::Duration {
            self.config.retention_period()
        }

        async fn begin(&self) -> Result<Self::Tx, idem_core::StoreError> {
            $crate::methods::begin(self).await
        }

        async fn rollback_to_savepoint(
            &self,
            tx: &mut Self::Tx,
        ) -> Result<(), idem_core::StoreError> {
            $crate::methods::rollback_to_savepoint(tx).await
        }

        async fn sweep(
            &self,
            batch: u32,
            max_batches: u32,
        ) -> Result<idem_core::SweepReport, idem_core::StoreError> {
            self.sweep_expired(batch, max_batches).await
        }

        async fn commit(&self, tx: Self::Tx) -> Result<(), idem_core::StoreError> {
            $crate::methods::commit(tx).await
        }

        async fn rollback(&self, tx: Self::Tx) {
            $crate::methods::rollback(tx).await
        }
    };
}
pub(crate) use shared_methods;
