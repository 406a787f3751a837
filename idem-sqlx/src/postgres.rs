//! The PostgreSQL inbox.

use crate::inbox::{Dialect, SqlInbox, check, commit, rollback};
use crate::{Migrations, stored_fingerprint};
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

/// The PostgreSQL inbox. `migrate()` takes an advisory lock, so several processes may run it
/// at once.
pub type PgInbox = SqlInbox<Postgres>;

impl Dialect for Postgres {
    const CLAIM: &'static str = CLAIM;
    const EXISTING: &'static str = EXISTING;
    const COMPLETE: &'static str = COMPLETE;
    const MIGRATIONS: Migrations = MIGRATIONS;
    const PREPARE: Option<&'static str> = None;
    const BEGIN: Option<&'static str> = None;
    // Serializes concurrent migrations from several processes.
    const LOCK: Option<&'static str> = Some(LOCK);
    const VERSION_TABLE: &'static str = VERSION_TABLE;
    const READ_VERSION: &'static str = READ_VERSION;
    const WRITE_VERSION: &'static str = WRITE_VERSION;
}

impl PgInbox {
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
        check(self).await
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
