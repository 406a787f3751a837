//! The MariaDB inbox (InnoDB), through sqlx's MySQL driver: MariaDB 10.6 or later. MySQL
//! itself is refused when the inbox is migrated ([`MIN_MARIADB`]): these statements use
//! MariaDB's collations and syntax, and only MariaDB is tested.
//!
//! A claim is `INSERT IGNORE`: on a duplicate key InnoDB takes a shared lock on the existing
//! row, so a copy waits behind an uncommitted claim of the same key and then either finds the
//! committed row or, if the claim rolled back, inserts its own. Because `INSERT IGNORE` also
//! downgrades data errors to warnings, keys and consumers longer than the columns hold are
//! refused before the insert instead of being truncated into someone else's key.
//!
//! Deadlocks (1213) and lock wait timeouts (1205) are transient (see
//! [`crate::classify_mysql_number`]): the message is retried, never lost. Keys compare byte
//! for byte (`utf8mb4_bin`): `A-1` and `a-1` are different messages. Timestamps are UTC.

use crate::dialect::{Dialect, Driver, Entry};
use crate::exec::RowsAffected;
use crate::inbox::SqlInbox;
use crate::statements::{
    AdminStatements, DeliveryStatements, LeaseStatements, MigrationStatements, RowStatements,
    SavepointStatements, Statements, SweepStatements,
};
use idem_core::{model::ErrorClass, model::StoreError, store::ClaimRequest, store::StoreKind};
use sqlx::MySql;
use sqlx::mysql::MySqlQueryResult;

/// The longest consumer name the MySQL inbox holds, in characters: the primary key of the
/// consumer (191 `utf8mb4` characters) and the key (512 bytes of any UTF-8) fits InnoDB's
/// 3,072-byte index limit.
pub const MAX_CONSUMER_CHARS: usize = 191;

const MIGRATIONS: &[(i32, &[&str])] = &[
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
    (
        3,
        &[r#"CREATE TABLE IF NOT EXISTS `{table}_deliveries` (
            consumer   VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            `key`      VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            deliveries BIGINT       NOT NULL,
            expires_at DATETIME(6)  NOT NULL,
            PRIMARY KEY (consumer, `key`),
            KEY expires_at (expires_at)
        ) ENGINE = InnoDB"#],
    ),
    (
        4,
        &[r#"CREATE TABLE IF NOT EXISTS `{table}_dead_letters` (
            consumer         VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            `key`            VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            keyed            INT          NOT NULL,
            queue            VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            reason           VARCHAR(64)  NOT NULL,
            detail           TEXT         NOT NULL,
            attempts         INT          NOT NULL,
            message_id       TEXT,
            fingerprint      BINARY(32)   NOT NULL,
            dead_lettered_at DATETIME(6)  NOT NULL,
            PRIMARY KEY (consumer, `key`),
            KEY queue (queue, dead_lettered_at)
        ) ENGINE = InnoDB"#],
    ),
    (
        5,
        &[r#"CREATE TABLE IF NOT EXISTS `{table}_versions` (
            consumer   VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            entity     VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            version    BIGINT       NOT NULL,
            updated_at DATETIME(6)  NOT NULL,
            PRIMARY KEY (consumer, entity)
        ) ENGINE = InnoDB"#],
    ),
    (6, crate::outbox::MYSQL_TABLE),
    // Version 7 indexed the rows staged outside any handler for the pass a NOTIFY wakes,
    // which this dialect does not have.
    (7, &[]),
    // Version 8 dropped PostgreSQL's check of `status`, which that server builds again for
    // every statement; this dialect keeps it.
    (8, &[]),
    // Version 9: a key is any UTF-8 string of up to 512 bytes, and two keys that differ in any
    // byte are two keys. `utf8mb4_bin` pads with spaces (`'k'` and `'k '` were one key) and 191
    // characters held less; `utf8mb4_nopad_bin` compares code points without padding, and the
    // primary key (764 + 2,048 bytes) stays within InnoDB's 3,072.
    (
        9,
        &[
            "ALTER TABLE `{table}` MODIFY `key` VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL",
            "ALTER TABLE `{table}_deliveries` MODIFY `key` VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL",
            "ALTER TABLE `{table}_dead_letters` MODIFY `key` VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL",
            "ALTER TABLE `{outbox}` MODIFY `key` VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL",
        ],
    ),
    // Version 10: a message id holds the 255 bytes a broker carries, and the outbox rows the
    // broker refused are parked out of the relay's way (`parked.rs`).
    (
        10,
        &[
            "ALTER TABLE `{outbox}` MODIFY message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
            crate::outbox::parked::MYSQL_TABLE,
        ],
    ),
    // Version 11: the relay finds the rows parked long enough to try again by their time.
    (
        11,
        &["CREATE INDEX IF NOT EXISTS parked_at ON `{outbox}_parked` (parked_at)"],
    ),
    // Version 12: parked rows are given up (outbox dead letters) once they kept being refused
    // for the store's give-up time after they were staged; and every text column that holds
    // what a message or a handler made says `utf8mb4`, so that a database whose default is
    // latin1 holds any text (idem's own ASCII columns, status and owner, keep theirs).
    (
        12,
        &[
            crate::outbox::parked::MYSQL_GIVE_UP,
            "ALTER TABLE `{table}` MODIFY outcome LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
            "ALTER TABLE `{table}_dead_letters` MODIFY reason VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, MODIFY detail TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, MODIFY message_id TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
            "ALTER TABLE `{outbox}` MODIFY headers LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, MODIFY correlation_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, MODIFY content_type VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
            "ALTER TABLE `{outbox}_parked` MODIFY headers LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, MODIFY correlation_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, MODIFY content_type VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, MODIFY failure TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
        ],
    ),
    // Version 13: a dead letter's record keeps when its failures began and its consumer's
    // retention, for a replay to tell whether the inbox still knows its key.
    (
        13,
        &[
            "ALTER TABLE `{table}_dead_letters` ADD COLUMN IF NOT EXISTS first_failed_at DATETIME(6) NULL, ADD COLUMN IF NOT EXISTS retention_ms BIGINT NULL",
        ],
    ),
    // Version 14: an ordered handler's key whose message was dead-lettered is parked, its
    // later messages kept behind it until an operator releases it (`parking.rs`). An older
    // idem ignores the new tables (a partition it consumes moves past a dead letter, as it
    // always did), so the oldest reader stays.
    (14, crate::parking::MYSQL_TABLES),
];

const PROBE: &str = r#"SELECT i.consumer, i.`key`, i.fingerprint, i.status, i.outcome, i.attempts, i.created_at,
    i.completed_at, i.expires_at, i.owner, i.locked_until, d.deliveries, d.expires_at,
    l.keyed, l.queue, l.reason, l.detail, l.attempts, l.message_id, l.fingerprint, l.dead_lettered_at,
    v.entity, v.version, v.updated_at, o.seq, o.message_id, o.consumer, o.`key`, o.exchange,
    o.routing_key, o.body, o.headers, o.correlation_id, o.content_type, o.created_at,
    p.seq, p.parked_at, p.failure, p.given_up_at
    FROM `{table}` i, `{table}_deliveries` d, `{table}_dead_letters` l, `{table}_versions` v,
    `{outbox}` o, `{outbox}_parked` p
    WHERE 1 = 0"#;

const CLAIM: &str = r#"INSERT IGNORE INTO `{table}`
    (consumer, `key`, fingerprint, status, attempts, created_at, completed_at, expires_at)
    VALUES (?, ?, ?, 'completed', ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
            UTC_TIMESTAMP(6) + INTERVAL ? SECOND)"#;

/// A locking read: it sees the latest committed row, whatever the transaction's snapshot.
const EXISTING: &str = r#"SELECT fingerprint, outcome FROM `{table}` WHERE consumer = ? AND `key` = ? LOCK IN SHARE MODE"#;

const COMPLETE: &str = r#"UPDATE `{table}` SET outcome = ? WHERE consumer = ? AND `key` = ?"#;

const UNCLAIM: &str = r#"DELETE FROM `{table}` WHERE consumer = ? AND `key` = ?"#;

/// A batch's multi-row claim; see [`RowStatements`]. The read does not lock: the insert already
/// waited for every other claim of these keys to end and holds a shared lock on each row it
/// found, and the read is the transaction's first, so it sees them as committed. A locking read
/// would also lock the rows its scan passes over (a small table is scanned whole), and two
/// claims of disjoint keys would deadlock on each other's new rows.
const ROWS: RowStatements = RowStatements {
    insert: r#"INSERT IGNORE INTO `{table}`
    (consumer, `key`, fingerprint, status, attempts, created_at, completed_at, expires_at, owner)
    VALUES "#,
    row: "(?, ?, ?, 'completed', ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? SECOND, ?)",
    insert_end: "",
    read: r#"SELECT `key`, fingerprint, outcome, CAST(COALESCE(owner = ?, 0) AS SIGNED) AS ours
    FROM `{table}` WHERE consumer = ? AND `key` IN ("#,
    read_end: ")",
};

/// External mode's statements; see [`LeaseStatements`] for their bind order.
const LEASE: LeaseStatements = LeaseStatements {
    insert: r#"INSERT IGNORE INTO `{table}`
        (consumer, `key`, fingerprint, status, attempts, created_at, expires_at, owner, locked_until)
    VALUES (?, ?, ?, 'in_progress', 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? SECOND, ?,
            UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND)"#,
    takeover: r#"UPDATE `{table}` SET owner = ?,
        locked_until = UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, attempts = attempts + 1
    WHERE consumer = ? AND `key` = ? AND status = 'in_progress'
        AND locked_until < UTC_TIMESTAMP(6) AND fingerprint = ?"#,
    read: r#"SELECT status, attempts, fingerprint, outcome,
        CAST(COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) DIV 1000, 0) AS SIGNED)
            AS remaining_ms
    FROM `{table}` WHERE consumer = ? AND `key` = ? LOCK IN SHARE MODE"#,
    settle: r#"UPDATE `{table}` SET status = ?, outcome = ?, completed_at = UTC_TIMESTAMP(6), locked_until = NULL
    WHERE consumer = ? AND `key` = ? AND owner = ? AND status = 'in_progress'"#,
    release: r#"UPDATE `{table}` SET locked_until = UTC_TIMESTAMP(6)
    WHERE consumer = ? AND `key` = ? AND owner = ? AND status = 'in_progress'"#,
    abandon: r#"DELETE FROM `{table}`
    WHERE consumer = ? AND `key` = ? AND owner = ? AND status = 'in_progress'"#,
};

/// The sweeper's statements; see [`SweepStatements`].
const SWEEP: SweepStatements = SweepStatements {
    lock: "SELECT CAST(COALESCE(GET_LOCK('idem.sweep.{table}', 0), 0) AS SIGNED)",
    unlock: "DO RELEASE_LOCK('idem.sweep.{table}')",
    delete: "DELETE FROM `{table}` WHERE expires_at < UTC_TIMESTAMP(6) ORDER BY expires_at LIMIT ?",
    lag: r#"SELECT CAST(COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(expires_at), UTC_TIMESTAMP(6)) DIV 1000, 0) AS SIGNED)
    FROM `{table}` WHERE expires_at < UTC_TIMESTAMP(6)"#,
    delete_deliveries: "DELETE FROM `{table}_deliveries` WHERE expires_at < UTC_TIMESTAMP(6) ORDER BY expires_at LIMIT ?",
    // InnoDB's own estimate.
    rows: "SELECT CAST(COALESCE(MAX(TABLE_ROWS), 0) AS SIGNED) FROM information_schema.TABLES
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{table}'",
    oldest: "SELECT CAST(COALESCE((SELECT TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000
        FROM `{table}` ORDER BY expires_at LIMIT 1), 0) AS SIGNED)",
    expired: "SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT 1 FROM `{table}`
        WHERE expires_at < UTC_TIMESTAMP(6) LIMIT 1000000) s",
};

/// The poison limit's statements; see [`DeliveryStatements`].
const DELIVERIES: DeliveryStatements = DeliveryStatements {
    count: r#"INSERT INTO `{table}_deliveries` (consumer, `key`, deliveries, expires_at)
    VALUES (?, ?, 1, UTC_TIMESTAMP(6) + INTERVAL ? SECOND)
    ON DUPLICATE KEY UPDATE deliveries = deliveries + 1, expires_at = VALUES(expires_at)"#,
    read: Some(
        "SELECT CAST(deliveries AS SIGNED) FROM `{table}_deliveries` WHERE consumer = ? AND `key` = ?",
    ),
    uncount: "UPDATE `{table}_deliveries` SET deliveries = deliveries - 1 WHERE consumer = ? AND `key` = ? AND deliveries > 0",
};

/// Dead-letter records and the operator's statements; see [`AdminStatements`]. Times are
/// read as `TIMESTAMPDIFF(MICROSECOND, epoch, t) DIV 1000`: the columns hold UTC.
const ADMIN: AdminStatements = AdminStatements {
    record: r#"INSERT INTO `{table}_dead_letters` (consumer, `key`, keyed, queue, reason, detail,
        attempts, message_id, fingerprint, dead_lettered_at, first_failed_at, retention_ms)
    VALUES (?, ?, ?, ?, ?, ?, ?, NULLIF(?, ''), ?, UTC_TIMESTAMP(6),
        COALESCE(TIMESTAMPADD(MICROSECOND, NULLIF(?, 0) * 1000, '1970-01-01 00:00:00'),
            UTC_TIMESTAMP(6)),
        NULLIF(?, 0))
    ON DUPLICATE KEY UPDATE keyed = VALUES(keyed), queue = VALUES(queue), reason = VALUES(reason),
        detail = VALUES(detail), attempts = VALUES(attempts), message_id = VALUES(message_id),
        fingerprint = VALUES(fingerprint), dead_lettered_at = VALUES(dead_lettered_at),
        first_failed_at = LEAST(COALESCE(first_failed_at, VALUES(first_failed_at)),
            VALUES(first_failed_at)),
        retention_ms = VALUES(retention_ms)"#,
    dead_letters: r#"SELECT consumer, `key`, keyed, queue, reason, detail, attempts, COALESCE(message_id, '') AS message_id, fingerprint, CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', dead_lettered_at) DIV 1000 AS SIGNED) AS at_ms, COALESCE(CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', first_failed_at) DIV 1000 AS SIGNED), 0) AS first_ms, COALESCE(retention_ms, 0) AS retention_ms FROM `{table}_dead_letters` WHERE queue = ? ORDER BY dead_lettered_at"#,
    dead_letter_of: r#"SELECT consumer, `key`, keyed, queue, reason, detail, attempts, COALESCE(message_id, '') AS message_id, fingerprint, CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', dead_lettered_at) DIV 1000 AS SIGNED) AS at_ms, COALESCE(CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', first_failed_at) DIV 1000 AS SIGNED), 0) AS first_ms, COALESCE(retention_ms, 0) AS retention_ms FROM `{table}_dead_letters` WHERE consumer = ? AND `key` = ?"#,
    forget_dead_letter: "DELETE FROM `{table}_dead_letters` WHERE consumer = ? AND `key` = ?",
    forget_dead_letter_at: "DELETE FROM `{table}_dead_letters` WHERE consumer = ? AND `key` = ? AND CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', dead_lettered_at) DIV 1000 AS SIGNED) = ?",
    stats: r#"SELECT consumer, status, CAST(count(*) AS SIGNED) AS row_count, CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', min(created_at)) DIV 1000 AS SIGNED) AS oldest_ms, CAST(sum(CASE WHEN expires_at < UTC_TIMESTAMP(6) THEN 1 ELSE 0 END) AS SIGNED) AS expired FROM `{table}` GROUP BY consumer, status ORDER BY consumer, status"#,
    dead_letter_stats: r#"SELECT consumer, CAST(count(*) AS SIGNED) AS row_count, CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', min(dead_lettered_at)) DIV 1000 AS SIGNED) AS oldest_ms FROM `{table}_dead_letters` GROUP BY consumer ORDER BY consumer"#,
    show: r#"SELECT status, attempts, outcome, fingerprint, CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', created_at) DIV 1000 AS SIGNED) AS created_ms, COALESCE(CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', completed_at) DIV 1000 AS SIGNED), 0) AS completed_ms, CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expires_at) DIV 1000 AS SIGNED) AS expires_ms, owner, COALESCE(CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', locked_until) DIV 1000 AS SIGNED), 0) AS locked_ms FROM `{table}` WHERE consumer = ? AND `key` = ?"#,
    deliveries_of: "SELECT CAST(deliveries AS SIGNED) AS deliveries FROM `{table}_deliveries` WHERE consumer = ? AND `key` = ?",
    forget: "DELETE FROM `{table}` WHERE consumer = ? AND `key` = ?",
    forget_failed: "DELETE FROM `{table}` WHERE consumer = ? AND `key` = ? AND status = 'failed'",
    forget_deliveries: "DELETE FROM `{table}_deliveries` WHERE consumer = ? AND `key` = ?",
};

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
pub type MySqlInbox = SqlInbox<MySqlDialect>;

/// The dialect of MySQL and MariaDB, on sqlx's `MySql` driver.
#[derive(Debug, Clone, Copy)]
pub struct MySqlDialect;

impl Driver for MySql {
    type Dialect = MySqlDialect;
}

impl RowsAffected for MySqlQueryResult {
    fn rows_affected(&self) -> u64 {
        MySqlQueryResult::rows_affected(self)
    }
}

impl Dialect for MySqlDialect {
    type Db = MySql;
    const ENTRY: Entry = Entry {
        name: "mysql",
        schemes: &["mysql://", "mariadb://"],
        bare_path: false,
        transactional_ddl: false,
    };

    async fn connect(url: &str, max: u32) -> Result<sqlx::MySqlPool, sqlx::Error> {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(max)
            .connect(url)
            .await
    }
    const DURABILITY: &'static str = crate::durability::MARIADB;
    const KIND: StoreKind = StoreKind::new("MySql", "mysql", "idem::sql::MySqlInbox");
    const STATEMENTS: Statements = Statements {
        claim: CLAIM,
        try_claim: None,
        existing: EXISTING,
        complete: COMPLETE,
        unclaim: UNCLAIM,
        probe: PROBE,
        // A savepoint with the name of an existing one replaces it.
        savepoint: SavepointStatements {
            first: "SAVEPOINT idem_message",
            next: "SAVEPOINT idem_message",
            rollback: "ROLLBACK TO SAVEPOINT idem_message",
        },
        lease: LEASE,
        sweep: SWEEP,
        deliveries: DELIVERIES,
        admin: ADMIN,
        versions: crate::versions::MYSQL,
        outbox: crate::outbox::MYSQL,
        parked: crate::outbox::parked::MYSQL,
        parking: crate::parking::MYSQL,
        batch: None,
        rows: Some(ROWS),
    };
    const MIGRATION: MigrationStatements = MigrationStatements {
        steps: MIGRATIONS,
        prepare: None,
        lock: Some(LOCK),
        unlock: Some(UNLOCK),
        version_table: VERSION_TABLE,
        read_version: READ_VERSION,
        write_version: WRITE_VERSION,
        server_version: Some("SELECT VERSION() AS version"),
        server: Some(mariadb_only),
    };

    /// Refuses keys the columns cannot hold (`INSERT IGNORE` would truncate them).
    fn check_request(request: &ClaimRequest<'_>) -> Result<(), StoreError> {
        check_lengths(request)
    }
}

/// The oldest MariaDB whose SQL this dialect speaks (`FOR UPDATE SKIP LOCKED` and
/// `JSON_TABLE` came in 10.6).
pub const MIN_MARIADB: (u32, u32) = (10, 6);

/// Refuses a server this dialect's statements do not run on: MySQL (its collations, index and
/// `IF NOT EXISTS` syntax differ from MariaDB's, and idem is tested on MariaDB only), and a
/// MariaDB older than [`MIN_MARIADB`]. `version` is what `SELECT VERSION()` answered.
fn mariadb_only(version: &str) -> Result<(), String> {
    if !version.contains("MariaDB") {
        return Err(format!(
            "the server is MySQL {version}: idem's `mysql` store runs on MariaDB {}.{} or later \
             only (MySQL is not supported); use MariaDB, PostgreSQL or SQLite",
            MIN_MARIADB.0, MIN_MARIADB.1
        ));
    }
    let mut parts = version.split(|c: char| !c.is_ascii_digit());
    let major = parts
        .next()
        .and_then(|p| p.parse::<u32>().ok())
        .unwrap_or(0);
    let minor = parts
        .next()
        .and_then(|p| p.parse::<u32>().ok())
        .unwrap_or(0);
    if (major, minor) < MIN_MARIADB {
        return Err(format!(
            "the server is MariaDB {version}: idem needs MariaDB {}.{} or later",
            MIN_MARIADB.0, MIN_MARIADB.1
        ));
    }
    Ok(())
}

/// Refuses what the columns cannot hold (`INSERT IGNORE` would truncate it): a consumer name
/// over [`MAX_CONSUMER_CHARS`], a key over the 512 bytes any key is limited to.
fn check_lengths(request: &ClaimRequest<'_>) -> Result<(), StoreError> {
    let consumer = request.consumer.chars().count();
    if consumer > MAX_CONSUMER_CHARS {
        return Err(StoreError::new(
            "claim",
            ErrorClass::Permanent,
            format!(
                "the consumer name has {consumer} characters; the MySQL inbox holds at most {MAX_CONSUMER_CHARS}"
            ),
        ));
    }
    if request.key.len() > idem_core::model::MAX_KEY_LEN {
        return Err(StoreError::new(
            "claim",
            ErrorClass::Permanent,
            format!(
                "the key has {} bytes; a key holds at most {}",
                request.key.len(),
                idem_core::model::MAX_KEY_LEN
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::mariadb_only;

    #[test]
    fn only_mariadb_from_10_6() {
        assert!(mariadb_only("10.11.19-MariaDB-0+deb12u1").is_ok());
        assert!(mariadb_only("11.4.2-MariaDB").is_ok());
        let mysql = mariadb_only("8.0.36").unwrap_err();
        assert!(mysql.contains("MySQL is not supported"), "{mysql}");
        assert!(!mysql.contains("  "), "one space between words: {mysql}");
        assert!(mariadb_only("10.5.23-MariaDB").is_err());
    }
}
