//! The PostgreSQL inbox: a claim in one round trip (the insert returns the existing row), and
//! a batch's claims, results and removals with array parameters.

use crate::dialect::{Dialect, Driver, Entry};
use crate::error::{existing_claim, store_error};
use crate::exec::RowsAffected;
use crate::inbox::SqlInbox;
use crate::statements::{
    AdminStatements, BatchStatements, DeliveryStatements, LeaseStatements, MigrationStatements,
    PROBE, Prepared, SAVEPOINTS, Statements, SweepStatements,
};
use idem_core::{
    model::ErrorClass, model::Fingerprint, model::StoreError, model::StoredOutput, store::Claim,
    store::ClaimRequest, store::StoreKind,
};
use sqlx::postgres::{PgConnection, PgQueryResult, PgRow};
use sqlx::{AssertSqlSafe, Postgres, Row};
use std::collections::HashMap;

const MIGRATIONS: &[(i32, &[&str])] = &[
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
    (
        3,
        &[
            r#"CREATE TABLE IF NOT EXISTS "{table}_deliveries" (
            consumer   text        NOT NULL,
            key        text        NOT NULL,
            deliveries bigint      NOT NULL,
            expires_at timestamptz NOT NULL,
            PRIMARY KEY (consumer, key)
        )"#,
            r#"CREATE INDEX IF NOT EXISTS "{table}_deliveries_exp" ON "{table}_deliveries" (expires_at)"#,
        ],
    ),
    (
        4,
        &[
            r#"CREATE TABLE IF NOT EXISTS "{table}_dead_letters" (
            consumer         text        NOT NULL,
            key              text        NOT NULL,
            keyed            integer     NOT NULL,
            queue            text        NOT NULL,
            reason           text        NOT NULL,
            detail           text        NOT NULL,
            attempts         integer     NOT NULL,
            message_id       text,
            fingerprint      bytea       NOT NULL,
            dead_lettered_at timestamptz NOT NULL,
            PRIMARY KEY (consumer, key)
        )"#,
            r#"CREATE INDEX IF NOT EXISTS "{table}_dead_letters_queue" ON "{table}_dead_letters" (queue, dead_lettered_at)"#,
        ],
    ),
    (
        5,
        &[r#"CREATE TABLE IF NOT EXISTS "{table}_versions" (
            consumer   text        NOT NULL,
            entity     text        NOT NULL,
            version    bigint      NOT NULL,
            updated_at timestamptz NOT NULL,
            PRIMARY KEY (consumer, entity)
        )"#],
    ),
    (6, crate::outbox::POSTGRES_TABLE),
    (7, crate::outbox::POSTGRES_UNOWNED_INDEX),
    // PostgreSQL prepares a table's CHECK expressions anew in every statement that writes it:
    // version 1's check of `status` cost each per-message claim 10–25 µs of the server's CPU
    // in a pgbench run (BENCHMARKS.md, 2026-12-04, night). Only idem's own statements write
    // the column, each with a literal.
    (
        8,
        &[r#"ALTER TABLE "{table}" DROP CONSTRAINT IF EXISTS "{table}_status_check""#],
    ),
    // Version 9 made MySQL's key columns hold any key of up to 512 bytes, without padding;
    // this dialect's already do (see `keys` for how PostgreSQL holds keys with NUL).
    (9, &[]),
    // Version 10: the outbox rows the broker refused are parked out of the relay's way
    // (`parked.rs`).
    (10, &[crate::outbox::parked::POSTGRES_TABLE]),
    // Version 11: the relay finds the rows parked long enough to try again by their time.
    (
        11,
        &[r#"CREATE INDEX IF NOT EXISTS "{outbox}_parked_at" ON "{outbox}_parked" (parked_at)"#],
    ),
    // Version 12: parked rows are given up (outbox dead letters) once they kept being refused
    // for the store's give-up time after they were staged.
    (12, &[crate::outbox::parked::POSTGRES_GIVE_UP]),
    // Version 13: a dead letter's record keeps when its failures began and its consumer's
    // retention, for a replay to tell whether the inbox still knows its key.
    (
        13,
        &[
            r#"ALTER TABLE "{table}_dead_letters" ADD COLUMN IF NOT EXISTS first_failed_at timestamptz,
            ADD COLUMN IF NOT EXISTS retention_ms bigint"#,
        ],
    ),
    // Version 14: an ordered handler's key whose message was dead-lettered is parked, its
    // later messages kept behind it until an operator releases it (`parking.rs`). An older
    // idem ignores the new tables (a partition it consumes moves past a dead letter, as it
    // always did), so the oldest reader stays.
    (14, crate::parking::POSTGRES_TABLES),
];

/// Wakes `wake` at each notification on [`crate::wake::CHANNEL`] naming `outbox`, on a
/// connection of its own; a lost connection is opened again (and wakes once: a notification
/// may have been missed meanwhile).
async fn listen(pool: sqlx::PgPool, outbox: String, wake: std::sync::Arc<crate::wake::Wake>) {
    loop {
        let listening = async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
            listener.listen(crate::wake::CHANNEL).await?;
            wake.notify.notify_one();
            loop {
                let notification = listener.recv().await?;
                if notification.payload() == outbox {
                    wake.notify.notify_one();
                }
            }
        };
        let result: Result<(), sqlx::Error> = listening.await;
        if let Err(e) = result {
            tracing::debug!(error = %e, "listening for staged outbox rows failed; listening again");
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

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

/// The insert of [`CLAIM`] behind a transaction-scoped advisory lock on (consumer, key)
/// (parameter 6: [`lock_key`]), taken without waiting: no row is inserted when another
/// transaction holds it (its claim of the key is not committed yet), nor when the key exists;
/// [`EXISTING`] then tells which. A plain insert: the new key, the common case, costs one
/// cheap statement.
const TRY_CLAIM: &str = r#"INSERT INTO "{table}" (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at)
SELECT $1::text, $2::text, $3::bytea, 'completed', $4::int4, now(), now(), now() + $5 * interval '1 second'
WHERE pg_try_advisory_xact_lock($6::int8)
ON CONFLICT (consumer, key) DO NOTHING"#;

/// The advisory lock of a key: the first 8 bytes of the SHA-256 of (consumer, key). Two keys
/// sharing one (a chance of 2^-64 per pair in flight at once) would answer each other 409.
fn lock_key(request: &ClaimRequest<'_>) -> i64 {
    let text = format!("idem-lock\x1f{}\x1f{}", request.consumer, request.key);
    let digest = Fingerprint::of(text.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    i64::from_be_bytes(first)
}

const EXISTING: &str = r#"SELECT FALSE AS claimed, fingerprint, outcome FROM "{table}" WHERE consumer = $1 AND key = $2"#;

const COMPLETE: &str = r#"UPDATE "{table}" SET outcome = $1 WHERE consumer = $2 AND key = $3"#;

/// How long a batch's claim waits for a key another transaction holds (see `claim_batch`).
pub const BATCH_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Sets [`BATCH_LOCK_WAIT`] in the transaction, returning the setting it had (read before it
/// is set: the set depends on the read).
const BOUND_LOCK_WAIT: &str = "SELECT p.previous
    FROM (SELECT current_setting('lock_timeout') AS previous OFFSET 0) AS p,
    LATERAL (SELECT set_config('lock_timeout', '2s', true) WHERE p.previous IS NOT NULL) AS s";

/// Claims a batch's keys in one statement, in the order of its arrays, which `claim_batch`
/// below sorts by key: two batches sharing keys lock them in the same order, and the server
/// sorts nothing (the insert takes the rows of `unnest` as they come; were a plan ever to
/// reorder them, the deadlock it could cause is transient and retried). It answers only for
/// the keys it did not insert: one row per such key, with the committed row's fingerprint and
/// result when the statement's snapshot sees it, or NULLs when it does not (the row was
/// committed while the insert waited for it, after the snapshot was taken): [`EXISTING_BATCH`]
/// reads those in a fresh one. A key it does not answer for is claimed, so a batch of new keys
/// costs no row in the answer.
///
/// Each existing key is looked up on its own through the primary key (a `LATERAL` with
/// `LIMIT 1`), so a generic plan cached while the table was small stays an index lookup per
/// key however large the table grows.
const CLAIM_BATCH: &str = r#"
WITH claimed AS (
    INSERT INTO "{table}" (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at)
    SELECT $1, i.key, i.fingerprint, 'completed', i.attempts, now(), now(), now() + $5 * interval '1 second'
    FROM unnest($2::text[], $3::bytea[], $4::int4[]) AS i(key, fingerprint, attempts)
    ON CONFLICT (consumer, key) DO NOTHING
    RETURNING key
)
SELECT u.key, e.fingerprint, e.outcome
FROM unnest($2::text[]) AS u(key)
LEFT JOIN LATERAL (
    SELECT fingerprint, outcome FROM "{table}"
    WHERE consumer = $1 AND key = u.key
    LIMIT 1
) AS e ON TRUE
WHERE NOT EXISTS (SELECT 1 FROM claimed AS c WHERE c.key = u.key)"#;

const EXISTING_BATCH: &str = r#"SELECT key, FALSE AS claimed, fingerprint, outcome FROM "{table}" WHERE consumer = $1 AND key = ANY($2)"#;

const COMPLETE_BATCH: &str = r#"UPDATE "{table}" AS t SET outcome = u.outcome
FROM unnest($2::text[], $3::text[]) AS u(key, outcome)
WHERE t.consumer = $1 AND t.key = u.key"#;

const UNCLAIM: &str = r#"DELETE FROM "{table}" WHERE consumer = $1 AND key = ANY($2)"#;

/// External mode's statements; see [`LeaseStatements`] for their bind order.
const LEASE: LeaseStatements = LeaseStatements {
    insert: r#"INSERT INTO "{table}" (consumer, key, fingerprint, status, attempts, created_at, expires_at, owner, locked_until)
    VALUES ($1, $2, $3, 'in_progress', 1, now(), now() + $4 * interval '1 second', $5,
            now() + $6 * interval '1 millisecond')
    ON CONFLICT (consumer, key) DO NOTHING"#,
    takeover: r#"UPDATE "{table}" SET owner = $1, locked_until = now() + $2 * interval '1 millisecond',
        attempts = attempts + 1
    WHERE consumer = $3 AND key = $4 AND status = 'in_progress' AND locked_until < now()
        AND fingerprint = $5"#,
    read: r#"SELECT status, attempts, fingerprint, outcome,
        COALESCE((EXTRACT(EPOCH FROM (locked_until - now())) * 1000)::int8, 0) AS remaining_ms
    FROM "{table}" WHERE consumer = $1 AND key = $2"#,
    settle: r#"UPDATE "{table}" SET status = $1, outcome = $2, completed_at = now(), locked_until = NULL
    WHERE consumer = $3 AND key = $4 AND owner = $5 AND status = 'in_progress'"#,
    release: r#"UPDATE "{table}" SET locked_until = now()
    WHERE consumer = $1 AND key = $2 AND owner = $3 AND status = 'in_progress'"#,
    abandon: r#"DELETE FROM "{table}"
    WHERE consumer = $1 AND key = $2 AND owner = $3 AND status = 'in_progress'"#,
};

/// The sweeper's statements; see [`SweepStatements`].
const SWEEP: SweepStatements = SweepStatements {
    lock: "SELECT pg_try_advisory_lock(hashtext('idem.sweep.{table}'))::int::int8",
    unlock: "SELECT pg_advisory_unlock(hashtext('idem.sweep.{table}'))",
    // By physical row address: the rows are locked by the subquery, so their addresses hold,
    // and the outer delete is a TID scan whatever the table's statistics say.
    delete: r#"DELETE FROM "{table}" WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM "{table}" WHERE expires_at < now()
        ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))"#,
    lag: r#"SELECT COALESCE((EXTRACT(EPOCH FROM now() - min(expires_at)) * 1000)::int8, 0)
    FROM "{table}" WHERE expires_at < now()"#,
    delete_deliveries: r#"DELETE FROM "{table}_deliveries" WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM "{table}_deliveries" WHERE expires_at < now()
        ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))"#,
    // As the planner estimates: the rows per page of the last ANALYZE times the pages now;
    // never analyzed, counted up to 1,000,000.
    rows: r#"SELECT CASE WHEN c.reltuples > 0 AND c.relpages > 0
        THEN (c.reltuples / c.relpages
              * (pg_relation_size(c.oid) / current_setting('block_size')::int8))::int8
        ELSE (SELECT count(*) FROM (SELECT 1 FROM "{table}" LIMIT 1000000) s) END
    FROM pg_class c WHERE c.oid = to_regclass('"{table}"')"#,
    oldest: r#"SELECT COALESCE((SELECT (EXTRACT(EPOCH FROM now() - created_at) * 1000)::int8
        FROM "{table}" ORDER BY expires_at LIMIT 1), 0)"#,
    expired: r#"SELECT count(*) FROM (SELECT 1 FROM "{table}" WHERE expires_at < now()
        LIMIT 1000000) s"#,
};

/// The poison limit's statements; see [`DeliveryStatements`].
const DELIVERIES: DeliveryStatements = DeliveryStatements {
    count: r#"INSERT INTO "{table}_deliveries" AS d (consumer, key, deliveries, expires_at)
    VALUES ($1, $2, 1, now() + $3 * interval '1 second')
    ON CONFLICT (consumer, key) DO UPDATE SET deliveries = d.deliveries + 1,
        expires_at = excluded.expires_at
    RETURNING deliveries"#,
    read: None,
    uncount: r#"UPDATE "{table}_deliveries" SET deliveries = deliveries - 1
    WHERE consumer = $1 AND key = $2 AND deliveries > 0"#,
};

/// Dead-letter records and the operator's statements; see [`AdminStatements`].
const ADMIN: AdminStatements = AdminStatements {
    record: r#"INSERT INTO "{table}_dead_letters" AS l (consumer, key, keyed, queue, reason, detail,
        attempts, message_id, fingerprint, dead_lettered_at, first_failed_at, retention_ms)
    VALUES ($1, $2, $3, $4, $5, $6, $7, NULLIF($8, ''), $9, now(),
        COALESCE(to_timestamp(NULLIF($10::int8, 0) / 1000.0), now()), NULLIF($11::int8, 0))
    ON CONFLICT (consumer, key) DO UPDATE SET keyed = excluded.keyed, queue = excluded.queue,
        reason = excluded.reason, detail = excluded.detail, attempts = excluded.attempts,
        message_id = excluded.message_id, fingerprint = excluded.fingerprint,
        dead_lettered_at = excluded.dead_lettered_at,
        first_failed_at = LEAST(l.first_failed_at, excluded.first_failed_at),
        retention_ms = excluded.retention_ms"#,
    dead_letters: r#"SELECT consumer, key, keyed, queue, reason, detail, attempts,
        COALESCE(message_id, '') AS message_id, fingerprint,
        (EXTRACT(EPOCH FROM dead_lettered_at) * 1000)::int8 AS at_ms,
        COALESCE((EXTRACT(EPOCH FROM first_failed_at) * 1000)::int8, 0) AS first_ms,
        COALESCE(retention_ms, 0) AS retention_ms
    FROM "{table}_dead_letters" WHERE queue = $1 ORDER BY dead_lettered_at"#,
    dead_letter_of: r#"SELECT consumer, key, keyed, queue, reason, detail, attempts,
        COALESCE(message_id, '') AS message_id, fingerprint,
        (EXTRACT(EPOCH FROM dead_lettered_at) * 1000)::int8 AS at_ms,
        COALESCE((EXTRACT(EPOCH FROM first_failed_at) * 1000)::int8, 0) AS first_ms,
        COALESCE(retention_ms, 0) AS retention_ms
    FROM "{table}_dead_letters" WHERE consumer = $1 AND key = $2"#,
    forget_dead_letter: r#"DELETE FROM "{table}_dead_letters" WHERE consumer = $1 AND key = $2"#,
    forget_dead_letter_at: r#"DELETE FROM "{table}_dead_letters" WHERE consumer = $1 AND key = $2
        AND (EXTRACT(EPOCH FROM dead_lettered_at) * 1000)::int8 = $3"#,
    stats: r#"SELECT consumer, status, count(*)::int8 AS row_count,
        (EXTRACT(EPOCH FROM min(created_at)) * 1000)::int8 AS oldest_ms,
        (count(*) FILTER (WHERE expires_at < now()))::int8 AS expired
    FROM "{table}" GROUP BY consumer, status ORDER BY consumer, status"#,
    dead_letter_stats: r#"SELECT consumer, count(*)::int8 AS row_count,
        (EXTRACT(EPOCH FROM min(dead_lettered_at)) * 1000)::int8 AS oldest_ms
    FROM "{table}_dead_letters" GROUP BY consumer ORDER BY consumer"#,
    show: r#"SELECT status, attempts, outcome, fingerprint,
        (EXTRACT(EPOCH FROM created_at) * 1000)::int8 AS created_ms,
        COALESCE((EXTRACT(EPOCH FROM completed_at) * 1000)::int8, 0) AS completed_ms,
        (EXTRACT(EPOCH FROM expires_at) * 1000)::int8 AS expires_ms, owner,
        COALESCE((EXTRACT(EPOCH FROM locked_until) * 1000)::int8, 0) AS locked_ms
    FROM "{table}" WHERE consumer = $1 AND key = $2"#,
    deliveries_of: r#"SELECT deliveries FROM "{table}_deliveries" WHERE consumer = $1 AND key = $2"#,
    forget: r#"DELETE FROM "{table}" WHERE consumer = $1 AND key = $2"#,
    forget_failed: r#"DELETE FROM "{table}" WHERE consumer = $1 AND key = $2 AND status = 'failed'"#,
    forget_deliveries: r#"DELETE FROM "{table}_deliveries" WHERE consumer = $1 AND key = $2"#,
};

const LOCK: &str = "SELECT pg_advisory_xact_lock(hashtext('idem.migrate'))::text";
const VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_schema_version (
    inbox_table text PRIMARY KEY, version integer NOT NULL, migrated_at timestamptz NOT NULL)";
const READ_VERSION: &str = "SELECT version FROM idem_schema_version WHERE inbox_table = $1";
const WRITE_VERSION: &str = "INSERT INTO idem_schema_version (inbox_table, version, migrated_at)
    VALUES ($1, $2, now()) ON CONFLICT (inbox_table) DO UPDATE SET version = $2, migrated_at = now()";

/// The PostgreSQL inbox. `migrate()` takes an advisory lock, so several processes may run it
/// at once.
pub type PgInbox = SqlInbox<PgDialect>;

/// The dialect of PostgreSQL, on sqlx's `Postgres` driver.
#[derive(Debug, Clone, Copy)]
pub struct PgDialect;

impl Driver for Postgres {
    type Dialect = PgDialect;
}

impl RowsAffected for PgQueryResult {
    fn rows_affected(&self) -> u64 {
        PgQueryResult::rows_affected(self)
    }
}

impl Dialect for PgDialect {
    type Db = Postgres;
    const ENTRY: Entry = Entry {
        name: "postgres",
        schemes: &["postgres://", "postgresql://"],
        bare_path: false,
        transactional_ddl: true,
    };
    const DURABILITY: &'static str = crate::durability::POSTGRES;
    const ESCAPES_NUL: bool = true;
    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    async fn connect(url: &str, max: u32) -> Result<sqlx::PgPool, sqlx::Error> {
        let options = crate::urls::postgres_options(url)?;
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(max)
            .connect_with(options)
            .await
    }

    fn listen(
        pool: sqlx::Pool<Postgres>,
        outbox: String,
        wake: std::sync::Arc<crate::wake::Wake>,
    ) -> bool {
        tokio::spawn(listen(pool, outbox, wake));
        true
    }

    const KIND: StoreKind = StoreKind::new("Postgres", "postgres", "idem::sql::PgInbox");
    const STATEMENTS: Statements = Statements {
        claim: CLAIM,
        try_claim: Some(TRY_CLAIM),
        existing: EXISTING,
        complete: COMPLETE,
        unclaim: UNCLAIM,
        probe: PROBE,
        savepoint: SAVEPOINTS,
        lease: LEASE,
        sweep: SWEEP,
        deliveries: DELIVERIES,
        admin: ADMIN,
        versions: crate::versions::POSTGRES,
        outbox: crate::outbox::POSTGRES,
        parked: crate::outbox::parked::POSTGRES,
        parking: crate::parking::POSTGRES,
        rows: None,
        batch: Some(BatchStatements {
            claim: CLAIM_BATCH,
            existing: EXISTING_BATCH,
            complete: COMPLETE_BATCH,
        }),
    };
    const MIGRATION: MigrationStatements = MigrationStatements {
        steps: MIGRATIONS,
        prepare: None,
        // Serializes concurrent migrations from several processes.
        lock: Some(LOCK),
        unlock: None,
        version_table: VERSION_TABLE,
        read_version: READ_VERSION,
        write_version: WRITE_VERSION,
        server_version: None,
        server: None,
    };

    /// Claims in one round trip; a row inserted by a transaction that committed while this one
    /// waited is read in a fresh snapshot.
    async fn claim(
        sql: &Prepared,
        conn: &mut PgConnection,
        request: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        let fail = |e| store_error("claim", e);
        let row = sqlx::query(AssertSqlSafe(sql.claim.clone()))
            .bind(request.consumer)
            .bind(request.key)
            .bind(request.fingerprint.as_bytes().as_slice())
            .bind(i32::try_from(request.attempt).unwrap_or(i32::MAX))
            .bind(crate::config::secs(request.retention))
            .fetch_optional(&mut *conn)
            .await
            .map_err(fail)?;
        let row = match row {
            Some(row) => row,
            None => sqlx::query(AssertSqlSafe(sql.existing.clone()))
                .bind(request.consumer)
                .bind(request.key)
                .fetch_optional(&mut *conn)
                .await
                .map_err(fail)?
                .ok_or_else(|| {
                    // Only possible when the transaction's snapshot predates the winner's commit
                    // (REPEATABLE READ or SERIALIZABLE as the default isolation); a retry sees it.
                    StoreError::new(
                        "claim",
                        ErrorClass::Transient,
                        "the key is taken by a transaction this snapshot cannot see yet",
                    )
                })?,
        };
        claim_from_row(&row)
    }

    /// `TRY_CLAIM`: one round trip for a new key; a key that exists or is busy is then read
    /// with `EXISTING` (no committed row: another transaction's claim holds it).
    async fn try_claim(
        sql: &Prepared,
        conn: &mut PgConnection,
        request: &ClaimRequest<'_>,
    ) -> Result<Option<Claim>, StoreError> {
        let Some(statement) = &sql.try_claim else {
            return Self::claim(sql, conn, request).await.map(Some);
        };
        let fail = |e| store_error("claim", e);
        let inserted = sqlx::query(AssertSqlSafe(statement.clone()))
            .bind(request.consumer)
            .bind(request.key)
            .bind(request.fingerprint.as_bytes().as_slice())
            .bind(i32::try_from(request.attempt).unwrap_or(i32::MAX))
            .bind(crate::config::secs(request.retention))
            .bind(lock_key(request))
            .execute(&mut *conn)
            .await
            .map_err(fail)?;
        if inserted.rows_affected() == 1 {
            return Ok(Some(Claim::Claimed));
        }
        let existing = sqlx::query(AssertSqlSafe(sql.existing.clone()))
            .bind(request.consumer)
            .bind(request.key)
            .fetch_optional(&mut *conn)
            .await
            .map_err(fail)?;
        existing.as_ref().map(claim_from_row).transpose()
    }

    /// Claims a batch's keys and reads the existing ones in one round trip (a key missing from
    /// the answer is claimed); a key committed by another transaction while the claim waited
    /// for it is read with one more select.
    async fn claim_batch(
        sql: &Prepared,
        conn: &mut PgConnection,
        requests: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        let Some(first) = requests.first() else {
            return Ok(Vec::new());
        };
        let batch = batch_statements(sql)?;
        let fail = |e| store_error("claim", e);
        // The order in which the insert locks the keys.
        let sorted = crate::claim::in_key_order(requests);
        let keys: Vec<&str> = sorted.iter().map(|r| r.key).collect();
        let fingerprints: Vec<&[u8]> = sorted
            .iter()
            .map(|r| r.fingerprint.as_bytes().as_slice())
            .collect();
        let attempts: Vec<i32> = sorted
            .iter()
            .map(|r| i32::try_from(r.attempt).unwrap_or(i32::MAX))
            .collect();
        // A key another transaction holds is waited for at most BATCH_LOCK_WAIT: then the
        // claim fails (55P03, transient), and the pass runs its members one by one, so that
        // only the held one waits. Only the claim: the handlers' statements then wait as the
        // session's own setting says.
        let previous: String = sqlx::query_scalar(BOUND_LOCK_WAIT)
            .fetch_one(&mut *conn)
            .await
            .map_err(fail)?;
        let rows = sqlx::query(AssertSqlSafe(batch.claim.clone()))
            .bind(first.consumer)
            .bind(&keys)
            .bind(&fingerprints)
            .bind(&attempts)
            .bind(crate::config::secs(first.retention))
            .fetch_all(&mut *conn)
            .await
            .map_err(fail)?;
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(&previous)
            .execute(&mut *conn)
            .await
            .map_err(fail)?;
        // Only the keys that were not inserted come back: with their committed row, or with
        // NULLs when this statement's snapshot cannot see it.
        let read = |e| store_error("claim", e);
        let mut found = HashMap::with_capacity(rows.len());
        let mut unseen = Vec::new();
        for row in &rows {
            let key: String = row.try_get("key").map_err(read)?;
            match row
                .try_get::<Option<Vec<u8>>, _>("fingerprint")
                .map_err(read)?
            {
                Some(fingerprint) => {
                    let claim =
                        existing_claim(&fingerprint, row.try_get("outcome").map_err(read)?)?;
                    found.insert(key, claim);
                }
                None => unseen.push(key),
            }
        }
        if !unseen.is_empty() {
            // Planned for these keys each time: this runs rarely (a race with another claim),
            // and a generic plan cached while the table was small may scan the whole key range
            // of the consumer.
            let rows = sqlx::query(AssertSqlSafe(batch.existing.clone()))
                .persistent(false)
                .bind(first.consumer)
                .bind(&unseen)
                .fetch_all(&mut *conn)
                .await
                .map_err(fail)?;
            read_claims(&rows, &mut found)?;
            if unseen.iter().any(|key| !found.contains_key(key)) {
                // Only possible when the transaction's snapshot predates the winner's commit
                // (REPEATABLE READ or SERIALIZABLE as the default isolation); a retry sees it.
                return Err(StoreError::new(
                    "claim",
                    ErrorClass::Transient,
                    "a key is taken by a transaction this snapshot cannot see yet",
                ));
            }
        }
        // In the requests' order, not the claim's.
        Ok(requests
            .iter()
            .map(|request| found.remove(request.key).unwrap_or(Claim::Claimed))
            .collect())
    }

    /// Stores a batch's results with one update.
    async fn complete_batch(
        sql: &Prepared,
        conn: &mut PgConnection,
        completed: &[(ClaimRequest<'_>, &StoredOutput)],
    ) -> Result<(), StoreError> {
        let Some((first, _)) = completed.first() else {
            return Ok(());
        };
        let batch = batch_statements(sql)?;
        let keys: Vec<&str> = completed.iter().map(|(r, _)| r.key).collect();
        let outputs: Vec<&str> = completed.iter().map(|(_, o)| o.as_json()).collect();
        sqlx::query(AssertSqlSafe(batch.complete.clone()))
            .bind(first.consumer)
            .bind(&keys)
            .bind(&outputs)
            .execute(conn)
            .await
            .map(drop)
            .map_err(|e| store_error("complete", e))
    }

    async fn unclaim(
        sql: &Prepared,
        conn: &mut PgConnection,
        consumer: &str,
        keys: &[&str],
    ) -> Result<(), StoreError> {
        sqlx::query(AssertSqlSafe(sql.unclaim.clone()))
            .persistent(false)
            .bind(consumer)
            .bind(keys)
            .execute(conn)
            .await
            .map(drop)
            .map_err(|e| store_error("unclaim", e))
    }
}

fn claim_from_row(row: &PgRow) -> Result<Claim, StoreError> {
    let read = |e| store_error("claim", e);
    if row.try_get::<bool, _>("claimed").map_err(read)? {
        return Ok(Claim::Claimed);
    }
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(read)?;
    existing_claim(&fingerprint, row.try_get("outcome").map_err(read)?)
}

/// Adds each row's claim to `found`, by key.
fn read_claims(rows: &[PgRow], found: &mut HashMap<String, Claim>) -> Result<(), StoreError> {
    for row in rows {
        let key: String = row.try_get("key").map_err(|e| store_error("claim", e))?;
        found.insert(key, claim_from_row(row)?);
    }
    Ok(())
}

/// The batch statements; every PostgreSQL inbox has them.
fn batch_statements(sql: &Prepared) -> Result<&BatchStatements<std::sync::Arc<str>>, StoreError> {
    sql.batch.as_ref().ok_or_else(|| {
        StoreError::new(
            "claim",
            ErrorClass::Permanent,
            "the PostgreSQL inbox was built without its batch statements",
        )
    })
}
