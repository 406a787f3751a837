//! The PostgreSQL inbox.

use crate::inbox::{Dialect, SqlInbox};
use crate::methods::savepoint;
use crate::{Migrations, existing_claim};
use idem_core::{Claim, ClaimRequest, InboxStore, StoreError, StoreKind, StoredOutput};
use sqlx::{AssertSqlSafe, Postgres, Row, Transaction};
use std::collections::{HashMap, HashSet};

const MIGRATIONS: Migrations = &[
    (
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
    ),
    (
        2,
        &[
            r#"ALTER TABLE "{table}" ADD COLUMN IF NOT EXISTS owner text,
        ADD COLUMN IF NOT EXISTS locked_until timestamptz"#,
        ],
    ),
];

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

/// Claims a batch's keys in one statement, in key order (two batches sharing keys lock them in
/// the same order); returns the keys it inserted. The others exist, committed, and
/// [`EXISTING_BATCH`] reads them in a fresh snapshot.
const CLAIM_BATCH: &str = r#"
INSERT INTO "{table}" (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at)
SELECT $1, i.key, i.fingerprint, 'completed', i.attempts, now(), now(), now() + $5 * interval '1 second'
FROM unnest($2::text[], $3::bytea[], $4::int4[]) AS i(key, fingerprint, attempts)
ORDER BY i.key
ON CONFLICT (consumer, key) DO NOTHING
RETURNING key"#;

const EXISTING_BATCH: &str =
    r#"SELECT key, fingerprint, outcome FROM "{table}" WHERE consumer = $1 AND key = ANY($2)"#;

const COMPLETE_BATCH: &str = r#"UPDATE "{table}" AS t SET outcome = u.outcome
FROM unnest($2::text[], $3::text[]) AS u(key, outcome)
WHERE t.consumer = $1 AND t.key = u.key"#;

const UNCLAIM: &str = r#"DELETE FROM "{table}" WHERE consumer = $1 AND key = ANY($2)"#;

/// External mode's statements; see [`crate::lease`] for their bind order.
const LEASE: crate::lease::LeaseStatements = [
    r#"INSERT INTO "{table}" (consumer, key, fingerprint, status, attempts, created_at, expires_at, owner, locked_until)
    VALUES ($1, $2, $3, 'in_progress', 1, now(), now() + $4 * interval '1 second', $5,
            now() + $6 * interval '1 millisecond')
    ON CONFLICT (consumer, key) DO NOTHING"#,
    r#"UPDATE "{table}" SET owner = $1, locked_until = now() + $2 * interval '1 millisecond',
        attempts = attempts + 1
    WHERE consumer = $3 AND key = $4 AND status = 'in_progress' AND locked_until < now()
        AND fingerprint = $5"#,
    r#"SELECT status, attempts, fingerprint, outcome,
        COALESCE((EXTRACT(EPOCH FROM (locked_until - now())) * 1000)::int8, 0) AS remaining_ms
    FROM "{table}" WHERE consumer = $1 AND key = $2"#,
    r#"UPDATE "{table}" SET status = $1, outcome = $2, completed_at = now(), locked_until = NULL
    WHERE consumer = $3 AND key = $4 AND owner = $5 AND status = 'in_progress'"#,
    r#"UPDATE "{table}" SET locked_until = now()
    WHERE consumer = $1 AND key = $2 AND owner = $3 AND status = 'in_progress'"#,
];

/// The sweeper's statements; see [`crate::sweep`].
const SWEEP: crate::sweep::SweepStatements = [
    "SELECT pg_try_advisory_lock(hashtext('idem.sweep.{table}'))::int::int8",
    "SELECT pg_advisory_unlock(hashtext('idem.sweep.{table}'))",
    // By physical row address: the rows are locked by the subquery, so their addresses hold,
    // and the outer delete is a TID scan whatever the table's statistics say.
    r#"DELETE FROM "{table}" WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM "{table}" WHERE expires_at < now()
        ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))"#,
    r#"SELECT COALESCE((EXTRACT(EPOCH FROM now() - min(expires_at)) * 1000)::int8, 0)
    FROM "{table}" WHERE expires_at < now()"#,
];

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
    const UNCLAIM: &'static str = UNCLAIM;
    const BATCH: [&'static str; 3] = [CLAIM_BATCH, EXISTING_BATCH, COMPLETE_BATCH];
    const LEASE: crate::lease::LeaseStatements = LEASE;
    const SWEEP: crate::sweep::SweepStatements = SWEEP;
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
    existing_claim(&fingerprint, row.try_get("outcome").map_err(read)?)
}

crate::lease::lease_ops!(Postgres);
crate::sweep::sweep_ops!(Postgres);

impl InboxStore for PgInbox {
    type Tx = Transaction<'static, Postgres>;
    const KIND: StoreKind = StoreKind::Postgres;

    crate::methods::shared_methods!();

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
            .bind(crate::config::secs(request.retention))
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

    async fn claim_batch(
        &self,
        tx: &mut Self::Tx,
        requests: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        let Some(first) = requests.first() else {
            return Ok(Vec::new());
        };
        let fail = |e| StoreError::sqlx("claim", e);
        let keys: Vec<&str> = requests.iter().map(|r| r.key).collect();
        let fingerprints: Vec<&[u8]> = requests
            .iter()
            .map(|r| r.fingerprint.as_bytes().as_slice())
            .collect();
        let attempts: Vec<i32> = requests
            .iter()
            .map(|r| i32::try_from(r.attempt).unwrap_or(i32::MAX))
            .collect();
        let [claim, existing, _] = &self.sql.batch;
        let inserted: Vec<String> = sqlx::query_scalar(AssertSqlSafe(claim.clone()))
            .bind(first.consumer)
            .bind(&keys)
            .bind(&fingerprints)
            .bind(&attempts)
            .bind(crate::config::secs(first.retention))
            .fetch_all(&mut **tx)
            .await
            .map_err(fail)?;
        let inserted: HashSet<&str> = inserted.iter().map(String::as_str).collect();
        let taken: Vec<&str> = keys
            .iter()
            .copied()
            .filter(|k| !inserted.contains(k))
            .collect();
        let mut found = HashMap::with_capacity(taken.len());
        if !taken.is_empty() {
            // Planned for these keys each time (one statement per batch): a cached generic
            // plan made while the table was small may scan the whole key range of the
            // consumer, and without ANALYZE it is never replaced.
            let rows = sqlx::query(AssertSqlSafe(existing.clone()))
                .persistent(false)
                .bind(first.consumer)
                .bind(&taken)
                .fetch_all(&mut **tx)
                .await
                .map_err(fail)?;
            for row in rows {
                let key: String = row.try_get("key").map_err(fail)?;
                let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(fail)?;
                let claim = existing_claim(&fingerprint, row.try_get("outcome").map_err(fail)?)?;
                found.insert(key, claim);
            }
        }
        keys.iter()
            .map(|key| {
                if inserted.contains(key) {
                    return Ok(Claim::Claimed);
                }
                found.remove(*key).ok_or_else(|| {
                    StoreError::new(
                        "claim",
                        idem_core::ErrorClass::Transient,
                        "a key is taken by a transaction this snapshot cannot see yet",
                    )
                })
            })
            .collect()
    }

    async fn complete_batch(
        &self,
        tx: &mut Self::Tx,
        completed: &[(ClaimRequest<'_>, &StoredOutput)],
    ) -> Result<(), StoreError> {
        let Some((first, _)) = completed.first() else {
            return Ok(());
        };
        let keys: Vec<&str> = completed.iter().map(|(r, _)| r.key).collect();
        let outputs: Vec<&str> = completed.iter().map(|(_, o)| o.as_json()).collect();
        sqlx::query(AssertSqlSafe(self.sql.batch[2].clone()))
            .bind(first.consumer)
            .bind(&keys)
            .bind(&outputs)
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(|e| StoreError::sqlx("complete", e))
    }

    async fn savepoint(&self, tx: &mut Self::Tx, first: bool) -> Result<(), StoreError> {
        savepoint(tx, first).await
    }

    async fn unclaim(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        keys: &[&str],
    ) -> Result<(), StoreError> {
        sqlx::query(AssertSqlSafe(self.sql.unclaim.clone()))
            .persistent(false)
            .bind(consumer)
            .bind(keys)
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(|e| StoreError::sqlx("unclaim", e))
    }

    crate::lease::lease_methods!();
}
