//! The MySQL / MariaDB inbox (InnoDB).
//!
//! A claim is `INSERT IGNORE`: on a duplicate key InnoDB takes a shared lock on the existing
//! row, so a copy waits behind an uncommitted claim of the same key and then either finds the
//! committed row or, if the claim rolled back, inserts its own. Because `INSERT IGNORE` also
//! downgrades data errors to warnings, keys and consumers longer than the columns hold are
//! refused before the insert instead of being truncated into someone else's key.
//!
//! Deadlocks (1213) and lock wait timeouts (1205) are transient (see
//! [`idem_core::classify_mysql_number`]): the message is retried, never lost. Keys compare
//! byte for byte (`utf8mb4_bin`): `A-1` and `a-1` are different messages. Timestamps are UTC.

use crate::Migrations;
use crate::inbox::{Dialect, SqlInbox};
use crate::methods::unclaim_each;
use idem_core::{Claim, ClaimRequest, ErrorClass, InboxStore, StoreError, StoreKind, StoredOutput};
use sqlx::{AssertSqlSafe, MySql, Transaction};

/// The longest key (and consumer) the MySQL inbox holds, in characters: the primary key of two
/// `utf8mb4` columns must fit InnoDB's 3072-byte index limit.
pub const MAX_KEY_CHARS: usize = 191;

const MIGRATIONS: Migrations = &[
    (
        1,
        &[r#"CREATE TABLE IF NOT EXISTS `{table}` (
            consumer     VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            `key`        VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            fingerprint  BINARY(32)   NOT NULL,
            status       VARCHAR(16)  NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
            outcome      LONGTEXT,
            attempts     INT          NOT NULL,
            created_at   DATETIME(6)  NOT NULL,
            completed_at DATETIME(6),
            expires_at   DATETIME(6)  NOT NULL,
            owner        VARCHAR(128),
            locked_until DATETIME(6),
            PRIMARY KEY (consumer, `key`),
            KEY `{table}_expires_at` (expires_at)
        ) ENGINE = InnoDB"#],
    ),
    // Version 2 added the lease columns, which version 1 of this dialect already has.
    (2, &[]),
];

const PROBE: &str = r#"SELECT consumer, `key`, fingerprint, status, outcome, attempts, created_at, completed_at,
    expires_at, owner, locked_until FROM `{table}` WHERE 1 = 0"#;

const CLAIM: &str = r#"INSERT IGNORE INTO `{table}`
    (consumer, `key`, fingerprint, status, attempts, created_at, completed_at, expires_at)
    VALUES (?, ?, ?, 'completed', ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
            UTC_TIMESTAMP(6) + INTERVAL ? SECOND)"#;

/// A locking read: it sees the latest committed row, whatever the transaction's snapshot.
const EXISTING: &str = r#"SELECT fingerprint, outcome FROM `{table}` WHERE consumer = ? AND `key` = ? LOCK IN SHARE MODE"#;

const COMPLETE: &str = r#"UPDATE `{table}` SET outcome = ? WHERE consumer = ? AND `key` = ?"#;

const UNCLAIM: &str = r#"DELETE FROM `{table}` WHERE consumer = ? AND `key` = ?"#;

/// External mode's statements; see [`crate::lease`] for their bind order.
const LEASE: crate::lease::LeaseStatements = [
    r#"INSERT IGNORE INTO `{table}`
        (consumer, `key`, fingerprint, status, attempts, created_at, expires_at, owner, locked_until)
    VALUES (?, ?, ?, 'in_progress', 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? SECOND, ?,
            UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND)"#,
    r#"UPDATE `{table}` SET owner = ?,
        locked_until = UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, attempts = attempts + 1
    WHERE consumer = ? AND `key` = ? AND status = 'in_progress'
        AND locked_until < UTC_TIMESTAMP(6) AND fingerprint = ?"#,
    r#"SELECT status, attempts, fingerprint, outcome,
        CAST(COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) DIV 1000, 0) AS SIGNED)
            AS remaining_ms
    FROM `{table}` WHERE consumer = ? AND `key` = ? LOCK IN SHARE MODE"#,
    r#"UPDATE `{table}` SET status = ?, outcome = ?, completed_at = UTC_TIMESTAMP(6), locked_until = NULL
    WHERE consumer = ? AND `key` = ? AND owner = ? AND status = 'in_progress'"#,
    r#"UPDATE `{table}` SET locked_until = UTC_TIMESTAMP(6)
    WHERE consumer = ? AND `key` = ? AND owner = ? AND status = 'in_progress'"#,
];

/// The sweeper's statements; see [`crate::sweep`].
const SWEEP: crate::sweep::SweepStatements = [
    "SELECT CAST(COALESCE(GET_LOCK('idem.sweep.{table}', 0), 0) AS SIGNED)",
    "DO RELEASE_LOCK('idem.sweep.{table}')",
    "DELETE FROM `{table}` WHERE expires_at < UTC_TIMESTAMP(6) ORDER BY expires_at LIMIT ?",
    r#"SELECT CAST(COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(expires_at), UTC_TIMESTAMP(6)) DIV 1000, 0) AS SIGNED)
    FROM `{table}` WHERE expires_at < UTC_TIMESTAMP(6)"#,
];

/// Serializes concurrent migrations from several processes. `GET_LOCK` belongs to the session,
/// so [`UNLOCK`] releases it before the connection goes back to the pool.
const LOCK: &str = "SELECT GET_LOCK('idem.migrate', 300)";
const UNLOCK: &str = "DO RELEASE_LOCK('idem.migrate')";
const VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_schema_version (
    inbox_table VARCHAR(64) PRIMARY KEY, version INT NOT NULL, migrated_at DATETIME(6) NOT NULL)
    ENGINE = InnoDB";
const READ_VERSION: &str = "SELECT version FROM idem_schema_version WHERE inbox_table = ?";
const WRITE_VERSION: &str = "INSERT INTO idem_schema_version (inbox_table, version, migrated_at)
    VALUES (?, ?, UTC_TIMESTAMP(6))
    ON DUPLICATE KEY UPDATE version = VALUES(version), migrated_at = VALUES(migrated_at)";

/// The MySQL / MariaDB inbox. `migrate()` takes a named lock (`GET_LOCK`), so several processes
/// may run it at once. MySQL runs DDL outside transactions; every migration statement is
/// idempotent for that reason.
pub type MySqlInbox = SqlInbox<MySql>;

impl Dialect for MySql {
    const CLAIM: &'static str = CLAIM;
    const EXISTING: &'static str = EXISTING;
    const COMPLETE: &'static str = COMPLETE;
    const UNCLAIM: &'static str = UNCLAIM;
    const BATCH: [&'static str; 3] = ["", "", ""];
    const LEASE: crate::lease::LeaseStatements = LEASE;
    const SWEEP: crate::sweep::SweepStatements = SWEEP;
    const MIGRATIONS: Migrations = MIGRATIONS;
    const PROBE: &'static str = PROBE;
    const PREPARE: Option<&'static str> = None;
    const BEGIN: Option<&'static str> = None;
    const LOCK: Option<&'static str> = Some(LOCK);
    const UNLOCK: Option<&'static str> = Some(UNLOCK);
    const VERSION_TABLE: &'static str = VERSION_TABLE;
    const READ_VERSION: &'static str = READ_VERSION;
    const WRITE_VERSION: &'static str = WRITE_VERSION;
}

/// Refuses keys the columns cannot hold (`INSERT IGNORE` would truncate them).
fn check_lengths(request: &ClaimRequest<'_>) -> Result<(), StoreError> {
    for (what, value) in [("key", request.key), ("consumer", request.consumer)] {
        let chars = value.chars().count();
        if chars > MAX_KEY_CHARS {
            return Err(StoreError::new(
                "claim",
                ErrorClass::Permanent,
                format!(
                    "the {what} has {chars} characters; the MySQL inbox holds at most {MAX_KEY_CHARS}"
                ),
            ));
        }
    }
    Ok(())
}

crate::claim::insert_then_read!(MySql);
crate::lease::lease_ops!(MySql);
crate::sweep::sweep_ops!(MySql);

impl InboxStore for MySqlInbox {
    type Tx = Transaction<'static, MySql>;
    const KIND: StoreKind = StoreKind::MySql;

    crate::methods::shared_methods!();

    async fn claim(
        &self,
        tx: &mut Self::Tx,
        request: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        check_lengths(request)?;
        self.claim_insert_then_read(tx, request).await
    }

    async fn complete(
        &self,
        tx: &mut Self::Tx,
        request: &ClaimRequest<'_>,
        output: &StoredOutput,
    ) -> Result<(), StoreError> {
        sqlx::query(AssertSqlSafe(self.sql.complete.clone()))
            .bind(output.as_json())
            .bind(request.consumer)
            .bind(request.key)
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(|e| StoreError::sqlx("complete", e))
    }

    async fn savepoint(&self, tx: &mut Self::Tx, _first: bool) -> Result<(), StoreError> {
        // A savepoint with the name of an existing one replaces it.
        sqlx::raw_sql("SAVEPOINT idem_message")
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(|e| StoreError::sqlx("savepoint", e))
    }

    async fn unclaim(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        keys: &[&str],
    ) -> Result<(), StoreError> {
        unclaim_each(self, tx, consumer, keys).await
    }

    async fn lease(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
        lease: std::time::Duration,
    ) -> Result<idem_core::Lease, StoreError> {
        check_lengths(request)?;
        self.lease_key(request, owner, lease).await
    }

    async fn settle(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
        end: idem_core::LeaseEnd,
        output: &StoredOutput,
    ) -> Result<bool, StoreError> {
        self.settle_key(request, owner, end, output).await
    }

    async fn release(&self, request: &ClaimRequest<'_>, owner: &str) -> Result<(), StoreError> {
        self.release_key(request, owner).await
    }
}
