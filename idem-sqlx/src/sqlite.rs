//! The SQLite inbox, the embedded default.
//!
//! Transactions start with `BEGIN IMMEDIATE`, so a claim takes the database's write lock up
//! front and concurrent claims queue on the busy timeout instead of failing on a lock upgrade.
//! `SQLITE_BUSY` and `SQLITE_LOCKED` are classified as transient, so a claim that waited too
//! long is retried, never lost. Timestamps are Unix milliseconds.

use crate::dialect::{Dialect, Driver, Entry};
use crate::exec::RowsAffected;
use crate::inbox::SqlInbox;
use crate::statements::{
    AdminStatements, DeliveryStatements, LeaseStatements, MigrationStatements, PROBE,
    RowStatements, SAVEPOINTS, Statements, SweepStatements,
};
use idem_core::store::StoreKind;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteQueryResult};
use sqlx::{Sqlite, SqlitePool};
use std::str::FromStr;
use std::time::Duration;

/// The busy timeout [`pool`] sets: how long a claim waits for the write lock before it is
/// reported as a transient failure.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

const MIGRATIONS: &[(i32, &[&str])] = &[
    (
        1,
        &[
            r#"CREATE TABLE IF NOT EXISTS "{table}" (
            consumer     TEXT    NOT NULL,
            key          TEXT    NOT NULL,
            fingerprint  BLOB    NOT NULL,
            status       TEXT    NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
            outcome      TEXT,
            attempts     INTEGER NOT NULL,
            created_at   INTEGER NOT NULL,
            completed_at INTEGER,
            expires_at   INTEGER NOT NULL,
            PRIMARY KEY (consumer, key)
        ) WITHOUT ROWID"#,
            r#"CREATE INDEX IF NOT EXISTS "{table}_expires_at" ON "{table}" (expires_at)"#,
        ],
    ),
    (
        2,
        &[
            r#"ALTER TABLE "{table}" ADD COLUMN owner TEXT"#,
            r#"ALTER TABLE "{table}" ADD COLUMN locked_until INTEGER"#,
        ],
    ),
    (
        3,
        &[
            r#"CREATE TABLE IF NOT EXISTS "{table}_deliveries" (
            consumer   TEXT    NOT NULL,
            key        TEXT    NOT NULL,
            deliveries INTEGER NOT NULL,
            expires_at INTEGER NOT NULL,
            PRIMARY KEY (consumer, key)
        ) WITHOUT ROWID"#,
            r#"CREATE INDEX IF NOT EXISTS "{table}_deliveries_exp" ON "{table}_deliveries" (expires_at)"#,
        ],
    ),
    (
        4,
        &[
            r#"CREATE TABLE IF NOT EXISTS "{table}_dead_letters" (
            consumer         TEXT    NOT NULL,
            key              TEXT    NOT NULL,
            keyed            INTEGER NOT NULL,
            queue            TEXT    NOT NULL,
            reason           TEXT    NOT NULL,
            detail           TEXT    NOT NULL,
            attempts         INTEGER NOT NULL,
            message_id       TEXT,
            fingerprint      BLOB    NOT NULL,
            dead_lettered_at INTEGER NOT NULL,
            PRIMARY KEY (consumer, key)
        ) WITHOUT ROWID"#,
            r#"CREATE INDEX IF NOT EXISTS "{table}_dead_letters_queue" ON "{table}_dead_letters" (queue, dead_lettered_at)"#,
        ],
    ),
    (
        5,
        &[r#"CREATE TABLE IF NOT EXISTS "{table}_versions" (
            consumer   TEXT        NOT NULL,
            entity     TEXT        NOT NULL,
            version    INTEGER     NOT NULL,
            updated_at INTEGER     NOT NULL,
            PRIMARY KEY (consumer, entity)
        ) WITHOUT ROWID"#],
    ),
    (6, crate::outbox::SQLITE_TABLE),
    // Version 7 indexed the rows staged outside any handler for the pass a NOTIFY wakes,
    // which this dialect does not have.
    (7, &[]),
    // Version 8 dropped PostgreSQL's check of `status`, which that server builds again for
    // every statement; this dialect keeps it.
    (8, &[]),
    // Version 9 made MySQL's key columns hold any key of up to 512 bytes, without padding;
    // this dialect's already do.
    (9, &[]),
    // Version 10: the outbox rows the broker refused are parked out of the relay's way
    // (`parked.rs`).
    (10, &[crate::outbox::parked::SQLITE_TABLE]),
    // Version 11: the relay finds the rows parked long enough to try again by their time.
    (
        11,
        &[r#"CREATE INDEX IF NOT EXISTS "{outbox}_parked_at" ON "{outbox}_parked" (parked_at)"#],
    ),
    // Version 12: parked rows are given up (outbox dead letters) once they kept being refused
    // for the store's give-up time after they were staged.
    (12, &[crate::outbox::parked::SQLITE_GIVE_UP]),
    // Version 13: a dead letter's record keeps when its failures began and its consumer's
    // retention, for a replay to tell whether the inbox still knows its key.
    (
        13,
        &[
            r#"ALTER TABLE "{table}_dead_letters" ADD COLUMN first_failed_at INTEGER"#,
            r#"ALTER TABLE "{table}_dead_letters" ADD COLUMN retention_ms INTEGER"#,
        ],
    ),
    // Version 14: an ordered handler's key whose message was dead-lettered is parked, its
    // later messages kept behind it until an operator releases it (`parking.rs`). An older
    // idem ignores the new tables (a partition it consumes moves past a dead letter, as it
    // always did), so the oldest reader stays.
    (14, crate::parking::SQLITE_TABLES),
];

const CLAIM: &str = r#"
INSERT INTO "{table}" (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at)
VALUES (?1, ?2, ?3, 'completed', ?4,
        CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER),
        CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER),
        CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) + ?5 * 1000)
ON CONFLICT (consumer, key) DO NOTHING"#;

const EXISTING: &str =
    r#"SELECT fingerprint, outcome FROM "{table}" WHERE consumer = ?1 AND key = ?2"#;

const COMPLETE: &str = r#"UPDATE "{table}" SET outcome = ?1 WHERE consumer = ?2 AND key = ?3"#;

const UNCLAIM: &str = r#"DELETE FROM "{table}" WHERE consumer = ?1 AND key = ?2"#;

/// A batch's multi-row claim; see [`RowStatements`]. The transaction holds the write lock
/// (`BEGIN IMMEDIATE`), so the read sees every committed row.
const ROWS: RowStatements = RowStatements {
    insert: r#"INSERT INTO "{table}"
    (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at, owner)
    VALUES "#,
    row: "(?, ?, ?, 'completed', ?, {now}, {now}, {now} + ? * 1000, ?)",
    insert_end: " ON CONFLICT (consumer, key) DO NOTHING",
    read: r#"SELECT key, fingerprint, outcome, COALESCE(owner = ?, 0) AS ours
    FROM "{table}" WHERE consumer = ? AND key IN ("#,
    read_end: ")",
};

/// External mode's statements; see [`LeaseStatements`] for their bind order. `{now}` is the time
/// in Unix milliseconds.
const LEASE: LeaseStatements = LeaseStatements {
    insert: r#"INSERT INTO "{table}" (consumer, key, fingerprint, status, attempts, created_at, expires_at, owner, locked_until)
    VALUES (?1, ?2, ?3, 'in_progress', 1, {now}, {now} + ?4 * 1000, ?5, {now} + ?6)
    ON CONFLICT (consumer, key) DO NOTHING"#,
    takeover: r#"UPDATE "{table}" SET owner = ?1, locked_until = {now} + ?2, attempts = attempts + 1
    WHERE consumer = ?3 AND key = ?4 AND status = 'in_progress' AND locked_until < {now}
        AND fingerprint = ?5"#,
    read: r#"SELECT status, attempts, fingerprint, outcome, COALESCE(locked_until - {now}, 0) AS remaining_ms
    FROM "{table}" WHERE consumer = ?1 AND key = ?2"#,
    settle: r#"UPDATE "{table}" SET status = ?1, outcome = ?2, completed_at = {now}, locked_until = NULL
    WHERE consumer = ?3 AND key = ?4 AND owner = ?5 AND status = 'in_progress'"#,
    release: r#"UPDATE "{table}" SET locked_until = {now} - 1
    WHERE consumer = ?1 AND key = ?2 AND owner = ?3 AND status = 'in_progress'"#,
    abandon: r#"DELETE FROM "{table}"
    WHERE consumer = ?1 AND key = ?2 AND owner = ?3 AND status = 'in_progress'"#,
};

/// The sweeper's statements; see [`SweepStatements`]. The lock is this process's (see
/// `LOCAL_SWEEP_LOCK`); across processes each batch queues on the database's write lock.
const SWEEP: SweepStatements = SweepStatements {
    lock: "SELECT 1",
    unlock: "SELECT 1",
    delete: r#"DELETE FROM "{table}" WHERE (consumer, key) IN (
        SELECT consumer, key FROM "{table}" WHERE expires_at < {now} ORDER BY expires_at LIMIT ?1)"#,
    lag: r#"SELECT COALESCE({now} - MIN(expires_at), 0) FROM "{table}" WHERE expires_at < {now}"#,
    delete_deliveries: r#"DELETE FROM "{table}_deliveries" WHERE (consumer, key) IN (
        SELECT consumer, key FROM "{table}_deliveries" WHERE expires_at < {now}
        ORDER BY expires_at LIMIT ?1)"#,
    rows: r#"SELECT count(*) FROM "{table}""#,
    oldest: r#"SELECT COALESCE((SELECT {now} - created_at FROM "{table}" ORDER BY expires_at
        LIMIT 1), 0)"#,
    expired: r#"SELECT count(*) FROM (SELECT 1 FROM "{table}" WHERE expires_at < {now}
        LIMIT 1000000)"#,
};

/// The poison limit's statements; see [`DeliveryStatements`].
const DELIVERIES: DeliveryStatements = DeliveryStatements {
    count: r#"INSERT INTO "{table}_deliveries" (consumer, key, deliveries, expires_at)
    VALUES (?1, ?2, 1, {now} + ?3 * 1000)
    ON CONFLICT (consumer, key) DO UPDATE SET deliveries = deliveries + 1,
        expires_at = excluded.expires_at
    RETURNING deliveries"#,
    read: None,
    uncount: r#"UPDATE "{table}_deliveries" SET deliveries = deliveries - 1
    WHERE consumer = ?1 AND key = ?2 AND deliveries > 0"#,
};

/// Dead-letter records and the operator's statements; see [`AdminStatements`]. Times are
/// already milliseconds.
const ADMIN: AdminStatements = AdminStatements {
    record: r#"INSERT INTO "{table}_dead_letters" (consumer, key, keyed, queue, reason, detail,
        attempts, message_id, fingerprint, dead_lettered_at, first_failed_at, retention_ms)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, NULLIF(?8, ''), ?9, {now}, COALESCE(NULLIF(?10, 0), {now}),
        NULLIF(?11, 0))
    ON CONFLICT (consumer, key) DO UPDATE SET keyed = excluded.keyed, queue = excluded.queue,
        reason = excluded.reason, detail = excluded.detail, attempts = excluded.attempts,
        message_id = excluded.message_id, fingerprint = excluded.fingerprint,
        dead_lettered_at = excluded.dead_lettered_at,
        first_failed_at = min(COALESCE(first_failed_at, excluded.first_failed_at),
            excluded.first_failed_at),
        retention_ms = excluded.retention_ms"#,
    dead_letters: r#"SELECT consumer, key, keyed, queue, reason, detail, attempts,
        COALESCE(message_id, '') AS message_id, fingerprint, dead_lettered_at AS at_ms,
        COALESCE(first_failed_at, 0) AS first_ms, COALESCE(retention_ms, 0) AS retention_ms
    FROM "{table}_dead_letters" WHERE queue = ?1 ORDER BY dead_lettered_at"#,
    dead_letter_of: r#"SELECT consumer, key, keyed, queue, reason, detail, attempts,
        COALESCE(message_id, '') AS message_id, fingerprint, dead_lettered_at AS at_ms,
        COALESCE(first_failed_at, 0) AS first_ms, COALESCE(retention_ms, 0) AS retention_ms
    FROM "{table}_dead_letters" WHERE consumer = ?1 AND key = ?2"#,
    forget_dead_letter: r#"DELETE FROM "{table}_dead_letters" WHERE consumer = ?1 AND key = ?2"#,
    forget_dead_letter_at: r#"DELETE FROM "{table}_dead_letters" WHERE consumer = ?1 AND key = ?2
        AND dead_lettered_at = ?3"#,
    stats: r#"SELECT consumer, status, count(*) AS row_count, min(created_at) AS oldest_ms,
        sum(CASE WHEN expires_at < {now} THEN 1 ELSE 0 END) AS expired
    FROM "{table}" GROUP BY consumer, status ORDER BY consumer, status"#,
    dead_letter_stats: r#"SELECT consumer, count(*) AS row_count, min(dead_lettered_at) AS oldest_ms
    FROM "{table}_dead_letters" GROUP BY consumer ORDER BY consumer"#,
    show: r#"SELECT status, attempts, outcome, fingerprint, created_at AS created_ms,
        COALESCE(completed_at, 0) AS completed_ms, expires_at AS expires_ms, owner,
        COALESCE(locked_until, 0) AS locked_ms
    FROM "{table}" WHERE consumer = ?1 AND key = ?2"#,
    deliveries_of: r#"SELECT deliveries FROM "{table}_deliveries" WHERE consumer = ?1 AND key = ?2"#,
    forget: r#"DELETE FROM "{table}" WHERE consumer = ?1 AND key = ?2"#,
    forget_failed: r#"DELETE FROM "{table}" WHERE consumer = ?1 AND key = ?2 AND status = 'failed'"#,
    forget_deliveries: r#"DELETE FROM "{table}_deliveries" WHERE consumer = ?1 AND key = ?2"#,
};

const VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_schema_version (
    inbox_table TEXT PRIMARY KEY, version INTEGER NOT NULL, migrated_at INTEGER NOT NULL)";
const READ_VERSION: &str = "SELECT version FROM idem_schema_version WHERE inbox_table = ?1";
const WRITE_VERSION: &str = "INSERT INTO idem_schema_version (inbox_table, version, migrated_at)
    VALUES (?1, ?2, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
    ON CONFLICT (inbox_table) DO UPDATE SET version = excluded.version, migrated_at = excluded.migrated_at";

/// Opens a SQLite pool set up as idem needs it: the file is created when missing, the journal
/// is in WAL mode (readers never block the writer) and connections wait up to
/// [`BUSY_TIMEOUT`] for the write lock. `url` is a `sqlite:` URL or a file path.
pub async fn pool(url: &str) -> Result<SqlitePool, sqlx::Error> {
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(connect_options(url)?)
        .await
}

/// The connect options [`pool`] uses, for callers that build their own pool.
pub fn connect_options(url: &str) -> Result<SqliteConnectOptions, sqlx::Error> {
    let options = if url.starts_with("sqlite:") {
        SqliteConnectOptions::from_str(url)?
    } else {
        SqliteConnectOptions::new().filename(url)
    };
    Ok(options
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(BUSY_TIMEOUT))
}

/// The SQLite inbox. `migrate()` also switches the database to WAL mode.
pub type SqliteInbox = SqlInbox<SqliteDialect>;

/// The dialect of SQLite, on sqlx's `Sqlite` driver.
#[derive(Debug, Clone, Copy)]
pub struct SqliteDialect;

impl Driver for Sqlite {
    type Dialect = SqliteDialect;
}

impl RowsAffected for SqliteQueryResult {
    fn rows_affected(&self) -> u64 {
        SqliteQueryResult::rows_affected(self)
    }
}

impl Dialect for SqliteDialect {
    type Db = Sqlite;
    const ENTRY: Entry = Entry {
        name: "sqlite",
        schemes: &["sqlite:"],
        bare_path: true,
        transactional_ddl: true,
    };

    async fn connect(url: &str, max: u32) -> Result<SqlitePool, sqlx::Error> {
        SqlitePoolOptions::new()
            .max_connections(max)
            .connect_with(connect_options(url)?)
            .await
    }
    const DURABILITY: &'static str = crate::durability::SQLITE;
    const KIND: StoreKind = StoreKind::new("Sqlite", "sqlite", "idem::sql::SqliteInbox");
    // SQLite runs in process: the single-row statements of a batch cost no round trips.
    const STATEMENTS: Statements = Statements {
        claim: CLAIM,
        try_claim: None,
        existing: EXISTING,
        complete: COMPLETE,
        unclaim: UNCLAIM,
        probe: PROBE,
        savepoint: SAVEPOINTS,
        lease: LEASE,
        sweep: SWEEP,
        deliveries: DELIVERIES,
        admin: ADMIN,
        versions: crate::versions::SQLITE,
        outbox: crate::outbox::SQLITE,
        parked: crate::outbox::parked::SQLITE,
        parking: crate::parking::SQLITE,
        batch: None,
        rows: Some(ROWS),
    };
    const MIGRATION: MigrationStatements = MigrationStatements {
        steps: MIGRATIONS,
        // Persistent for file databases; an in-memory database answers "memory" and stays so.
        prepare: Some("PRAGMA journal_mode = WAL"),
        lock: None,
        unlock: None,
        version_table: VERSION_TABLE,
        read_version: READ_VERSION,
        write_version: WRITE_VERSION,
        server_version: None,
        server: None,
    };
    const NOW: &'static str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";
    // Takes the write lock up front, so concurrent claims and migrations queue.
    const BEGIN: Option<&'static str> = Some("BEGIN IMMEDIATE");
    const LOCAL_SWEEP_LOCK: bool = true;
}
