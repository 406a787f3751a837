//! The PostgreSQL inbox.

use crate::inbox::{Dialect, SqlInbox, commit, rollback};
use crate::{MigrateError, Migrations, SCHEMA_VERSION, pending, stored_fingerprint};
use idem_core::{Claim, ClaimRequest, InboxStore, StoreError, StoreKind, StoredOutput};
use sqlx::{AssertSqlSafe, Postgres, Row, Transaction};

const MIGRATIONS: Migrations = &[(
    1,
    &[
        r#"CREATE TABLE IF NOT EXISTS "{table}" (
            consumer     text        NOT NULL,
            key          text        NOT NULL,
            fingerprint  bytea       NOT NULL,
            status       text        NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
            outcome      text,
            attempts     integer     NOT NULL,
            created_at   timestamptz NOT NULL,
            completed_at timestamptz,
            expires_at   timestamptz NOT NULL,
            PRIMARY KEY (consumer, key)
        )"#,
        r#"CREATE INDEX IF NOT EXISTS "{table}_expires_at" ON "{table}" (expires_at)"#,
    ],
)];

/// Claims in one round trip: the insert, and for an existing row its fingerprint and result.
///
/// In a transactional claim the row is written as `completed`: nobody can see it before the
/// transaction commits, and it commits only once the handler's writes are done. When the key
/// exists the statement returns the row; when a concurrent transaction committed the row while
/// this insert waited on it, the row is outside this statement's snapshot and nothing is
/// returned, and [`EXISTING`] reads it in a fresh one.
const CLAIM: &str = r#"
WITH claimed AS (
    INSERT INTO "{table}" (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at)
    VALUES ($1, $2, $3, 'completed', $4, now(), now(), now() + $5 * interval '1 second')
    ON CONFLICT (consumer, key) DO NOTHING
    RETURNING 1
)
SELECT TRUE AS claimed, NULL::bytea AS fingerprint, NULL::text AS outcome FROM claimed
UNION ALL
SELECT FALSE, fingerprint, outcome FROM "{table}"
WHERE consumer = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claimed)"#;

const EXISTING: &str = r#"SELECT FALSE AS claimed, fingerprint, outcome FROM "{table}" WHERE consumer = $1 AND key = $2"#;

const COMPLETE: &str = r#"UPDATE "{table}" SET outcome = $3 WHERE consumer = $1 AND key = $2"#;

const LOCK: &str = "SELECT pg_advisory_xact_lock(hashtext('idem.migrate'))::text";
const VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_schema_version (
    inbox_table text PRIMARY KEY, version integer NOT NULL, migrated_at timestamptz NOT NULL)";
const READ_VERSION: &str = "SELECT version FROM idem_schema_version WHERE inbox_table = $1";
const WRITE_VERSION: &str = "INSERT INTO idem_schema_version (inbox_table, version, migrated_at)
    VALUES ($1, $2, now()) ON CONFLICT (inbox_table) DO UPDATE SET version = $2, migrated_at = now()";

/// The PostgreSQL inbox.
pub type PgInbox = SqlInbox<Postgres>;

impl PgInbox {
    /// Creates or upgrades the inbox table. Safe to run from several processes at once (an
    /// advisory lock serializes them) and on every start.
    pub async fn migrate(&self) -> Result<(), MigrateError> {
        let table = &self.config.table;
        let err = MigrateError::database;
        let mut tx = self.pool.begin().await.map_err(err(table))?;
        sqlx::query(LOCK)
            .execute(&mut *tx)
            .await
            .map_err(err(table))?;
        sqlx::query(VERSION_TABLE)
            .execute(&mut *tx)
            .await
            .map_err(err(table))?;
        let current: Option<i32> = sqlx::query_scalar(READ_VERSION)
            .bind(table.as_str())
            .fetch_optional(&mut *tx)
            .await
            .map_err(err(table))?;
        let statements = pending(MIGRATIONS, table, current.unwrap_or(0))?;
        if statements.is_empty() {
            return Ok(());
        }
        for statement in statements {
            sqlx::query(statement)
                .execute(&mut *tx)
                .await
                .map_err(err(table))?;
        }
        sqlx::query(WRITE_VERSION)
            .bind(table.as_str())
            .bind(SCHEMA_VERSION)
            .execute(&mut *tx)
            .await
            .map_err(err(table))?;
        tx.commit().await.map_err(err(table))
    }

    async fn existing(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        request: &ClaimRequest<'_>,
    ) -> Result<Option<Claim>, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.sql.existing.clone()))
            .bind(request.consumer)
            .bind(request.key)
            .fetch_optional(&mut **tx)
            .await
            .map_err(|e| StoreError::sqlx("claim", e))?;
        row.map(|row| claim_from_row(&row)).transpose()
    }
}

impl Dialect for Postgres {
    const CLAIM: &'static str = CLAIM;
    const EXISTING: &'static str = EXISTING;
    const COMPLETE: &'static str = COMPLETE;
}

fn claim_from_row(row: &sqlx::postgres::PgRow) -> Result<Claim, StoreError> {
    let read = |e| StoreError::sqlx("claim", e);
    if row.try_get::<bool, _>("claimed").map_err(read)? {
        return Ok(Claim::Claimed);
    }
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(read)?;
    let output: Option<String> = row.try_get("outcome").map_err(read)?;
    Ok(Claim::Existing {
        fingerprint: stored_fingerprint(&fingerprint)?,
        output: output.map(StoredOutput::from_json),
    })
}

impl InboxStore for PgInbox {
    type Tx = Transaction<'static, Postgres>;
    const KIND: StoreKind = StoreKind::Postgres;

    async fn check(&self) -> Result<(), StoreError> {
        sqlx::query(AssertSqlSafe(self.sql.probe.clone()))
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|e| {
                StoreError::new(
                    "check",
                    idem_core::ErrorClass::Permanent,
                    format!("inbox table `{}`: {e}", self.config.table_name()),
                )
            })
    }

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.pool
            .begin()
            .await
            .map_err(|e| StoreError::sqlx("begin", e))
    }

    async fn claim(
        &self,
        tx: &mut Self::Tx,
        request: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.sql.claim.clone()))
            .bind(request.consumer)
            .bind(request.key)
            .bind(request.fingerprint.as_bytes().as_slice())
            .bind(i32::try_from(request.attempt).unwrap_or(i32::MAX))
            .bind(self.config.retention_secs())
            .fetch_optional(&mut **tx)
            .await
            .map_err(|e| StoreError::sqlx("claim", e))?;
        match row {
            Some(row) => claim_from_row(&row),
            None => self.existing(tx, request).await?.ok_or_else(|| {
                // Only possible when the transaction's snapshot predates the winner's commit
                // (REPEATABLE READ or SERIALIZABLE as the default isolation); a retry sees it.
                StoreError::new(
                    "claim",
                    idem_core::ErrorClass::Transient,
                    "the key is taken by a transaction this snapshot cannot see yet",
                )
            }),
        }
    }

    async fn complete(
        &self,
        tx: &mut Self::Tx,
        request: &ClaimRequest<'_>,
        output: &StoredOutput,
    ) -> Result<(), StoreError> {
        sqlx::query(AssertSqlSafe(self.sql.complete.clone()))
            .bind(request.consumer)
            .bind(request.key)
            .bind(output.as_json())
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(|e| StoreError::sqlx("complete", e))
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        commit(tx).await
    }

    async fn rollback(&self, tx: Self::Tx) {
        rollback(tx).await
    }
}
