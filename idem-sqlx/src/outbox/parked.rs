//! Parked outbox rows (`{outbox}_parked`): a row the broker refused (no queue is bound for it,
//! or it cannot be carried as it is) is moved out of the relay's way, with the reason, by the
//! relay pass that sent it, so that the rows behind it are always relayed. The relay puts a
//! row parked for [`PARK_RETRY`] back into the outbox, behind the rows staged since (a queue
//! declared late takes it then); a row still refused [`DEFAULT_GIVE_UP`] (or the store's
//! [`SqlInbox::outbox_give_up`]) after it was staged is given up: an outbox dead letter, kept
//! with its reason, counted, and no longer tried. An operator lists parked rows, releases them
//! at once, or drops them (`idem outbox parked`, `idem outbox release`, `idem outbox drop`). A released row keeps its id; the same id
//! staged again while its row was parked is one message, so releasing merges the two instead
//! of failing on the outbox's unique id (which would stop every later pass).

use crate::dialect::{Conn, Dialect};
use crate::error::store_error;
use crate::exec::Param;
use crate::exec::Sql;
use crate::inbox::SqlInbox;
use idem_core::model::StoreError;
use std::time::Duration;

pub use crate::config::DEFAULT_GIVE_UP;

/// How long a row stays parked before the relay tries it again.
pub const PARK_RETRY: Duration = Duration::from_secs(30);

pub use crate::statements::ParkedStatements;

/// PostgreSQL's parked rows.
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: ParkedStatements = ParkedStatements {
    park: r#"INSERT INTO "{outbox}_parked" (seq, message_id, consumer, key, exchange, routing_key,
        body, headers, correlation_id, content_type, created_at, parked_at, failure)
    SELECT seq, message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, created_at, now(), $1 FROM "{outbox}" WHERE seq = $2"#,
    list: r#"SELECT seq, message_id, consumer, key, exchange, routing_key, failure,
        (EXTRACT(EPOCH FROM parked_at) * 1000)::int8 AS parked_ms,
        (EXTRACT(EPOCH FROM given_up_at) * 1000)::int8 AS given_up_ms
    FROM "{outbox}_parked" ORDER BY seq"#,
    unpark: r#"INSERT INTO "{outbox}" (message_id, consumer, key, exchange, routing_key, body,
        headers, correlation_id, content_type, created_at)
    SELECT message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, created_at FROM "{outbox}_parked" WHERE seq = $1
    ON CONFLICT (message_id) DO NOTHING"#,
    remove: r#"DELETE FROM "{outbox}_parked" WHERE seq = $1"#,
    due: r#"SELECT seq FROM "{outbox}_parked" WHERE parked_at < now() - $1 * interval '1 millisecond'
        AND given_up_at IS NULL
    ORDER BY seq LIMIT $2 FOR UPDATE SKIP LOCKED"#,
    give_up: r#"UPDATE "{outbox}_parked" SET given_up_at = now()
    WHERE given_up_at IS NULL AND created_at < now() - $1 * interval '1 millisecond'"#,
};

/// PostgreSQL's table of parked rows (schema version 9).
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES_TABLE: &str = r#"CREATE TABLE IF NOT EXISTS "{outbox}_parked" (
    seq            bigint      PRIMARY KEY,
    message_id     text        NOT NULL,
    consumer       text        NOT NULL,
    key            text        NOT NULL,
    exchange       text        NOT NULL,
    routing_key    text        NOT NULL,
    body           bytea       NOT NULL,
    headers        text        NOT NULL,
    correlation_id text        NOT NULL,
    content_type   text        NOT NULL,
    created_at     timestamptz NOT NULL,
    parked_at      timestamptz NOT NULL,
    failure        text        NOT NULL
)"#;

/// MySQL's and MariaDB's parked rows.
#[cfg(feature = "mysql")]
pub(crate) const MYSQL: ParkedStatements = ParkedStatements {
    park: r#"INSERT INTO `{outbox}_parked` (seq, message_id, consumer, `key`, exchange, routing_key,
        body, headers, correlation_id, content_type, created_at, parked_at, failure)
    SELECT seq, message_id, consumer, `key`, exchange, routing_key, body, headers, correlation_id,
        content_type, created_at, UTC_TIMESTAMP(6), ? FROM `{outbox}` WHERE seq = ?"#,
    list: r#"SELECT seq, message_id, consumer, `key`, exchange, routing_key, failure,
        CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', parked_at) DIV 1000 AS SIGNED) AS parked_ms,
        CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', given_up_at) DIV 1000 AS SIGNED) AS given_up_ms
    FROM `{outbox}_parked` ORDER BY seq"#,
    unpark: r#"INSERT INTO `{outbox}` (message_id, consumer, `key`, exchange, routing_key, body,
        headers, correlation_id, content_type, created_at)
    SELECT message_id, consumer, `key`, exchange, routing_key, body, headers, correlation_id,
        content_type, created_at FROM `{outbox}_parked` p WHERE p.seq = ?
    ON DUPLICATE KEY UPDATE message_id = `{outbox}`.message_id"#,
    remove: "DELETE FROM `{outbox}_parked` WHERE seq = ?",
    due: r#"SELECT seq FROM `{outbox}_parked` WHERE parked_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND
        AND given_up_at IS NULL
    ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED"#,
    give_up: r#"UPDATE `{outbox}_parked` SET given_up_at = UTC_TIMESTAMP(6)
    WHERE given_up_at IS NULL AND created_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND"#,
};

/// MySQL's and MariaDB's table of parked rows (schema version 9).
#[cfg(feature = "mysql")]
pub(crate) const MYSQL_TABLE: &str = r#"CREATE TABLE IF NOT EXISTS `{outbox}_parked` (
    seq            BIGINT       NOT NULL PRIMARY KEY,
    message_id     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    consumer       VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    `key`          VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL,
    exchange       VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    routing_key    VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    body           LONGBLOB     NOT NULL,
    headers        LONGTEXT     NOT NULL,
    correlation_id VARCHAR(255) NOT NULL,
    content_type   VARCHAR(255) NOT NULL,
    created_at     DATETIME(6)  NOT NULL,
    parked_at      DATETIME(6)  NOT NULL,
    failure        TEXT         NOT NULL
) ENGINE = InnoDB"#;

/// SQLite's parked rows.
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: ParkedStatements = ParkedStatements {
    park: r#"INSERT INTO "{outbox}_parked" (seq, message_id, consumer, key, exchange, routing_key,
        body, headers, correlation_id, content_type, created_at, parked_at, failure)
    SELECT seq, message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, created_at, {now}, ?1 FROM "{outbox}" WHERE seq = ?2"#,
    list: r#"SELECT seq, message_id, consumer, key, exchange, routing_key, failure,
        parked_at AS parked_ms, given_up_at AS given_up_ms FROM "{outbox}_parked" ORDER BY seq"#,
    unpark: r#"INSERT INTO "{outbox}" (message_id, consumer, key, exchange, routing_key, body,
        headers, correlation_id, content_type, created_at)
    SELECT message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, created_at FROM "{outbox}_parked" WHERE seq = ?1
    ON CONFLICT (message_id) DO NOTHING"#,
    remove: r#"DELETE FROM "{outbox}_parked" WHERE seq = ?1"#,
    due: r#"SELECT seq FROM "{outbox}_parked" WHERE parked_at < {now} - ?1 AND given_up_at IS NULL
    ORDER BY seq LIMIT ?2"#,
    give_up: r#"UPDATE "{outbox}_parked" SET given_up_at = {now}
    WHERE given_up_at IS NULL AND created_at < {now} - ?1"#,
};

/// SQLite's table of parked rows (schema version 9).
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_TABLE: &str = r#"CREATE TABLE IF NOT EXISTS "{outbox}_parked" (
    seq            INTEGER PRIMARY KEY,
    message_id     TEXT    NOT NULL,
    consumer       TEXT    NOT NULL,
    key            TEXT    NOT NULL,
    exchange       TEXT    NOT NULL,
    routing_key    TEXT    NOT NULL,
    body           BLOB    NOT NULL,
    headers        TEXT    NOT NULL,
    correlation_id TEXT    NOT NULL,
    content_type   TEXT    NOT NULL,
    created_at     INTEGER NOT NULL,
    parked_at      INTEGER NOT NULL,
    failure        TEXT    NOT NULL
)"#;

/// PostgreSQL: parked rows are given up after a while (schema version 12).
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES_GIVE_UP: &str =
    r#"ALTER TABLE "{outbox}_parked" ADD COLUMN IF NOT EXISTS given_up_at timestamptz"#;

/// MariaDB: parked rows are given up after a while (schema version 12).
#[cfg(feature = "mysql")]
pub(crate) const MYSQL_GIVE_UP: &str =
    "ALTER TABLE `{outbox}_parked` ADD COLUMN IF NOT EXISTS given_up_at DATETIME(6) NULL";

/// SQLite: parked rows are given up after a while (schema version 12).
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_GIVE_UP: &str =
    r#"ALTER TABLE "{outbox}_parked" ADD COLUMN given_up_at INTEGER"#;

/// A parked outbox row, as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedRow {
    /// Its sequence number in the outbox when it was parked.
    pub seq: i64,
    /// The message id it is published with.
    pub message_id: String,
    /// The consumer that staged it (empty: staged outside any handler).
    pub consumer: String,
    /// The key of the run it was staged in.
    pub key: String,
    /// Where it goes.
    pub exchange: String,
    /// With which routing key.
    pub routing_key: String,
    /// Why the broker refused it.
    pub failure: String,
    /// When it was parked, in milliseconds since the Unix epoch.
    pub parked_at_ms: i64,
    /// When the relay gave it up (it kept being refused for [`SqlInbox::outbox_give_up`]
    /// after it was staged), in milliseconds since the Unix epoch: an outbox dead letter, which
    /// the relay no longer tries and only an operator releases.
    pub given_up_at_ms: Option<i64>,
}

impl<DB: Dialect> SqlInbox<DB> {
    /// The outbox rows parked because the broker refused them, oldest first.
    pub async fn parked(&self) -> Result<Vec<ParkedRow>, StoreError> {
        let fail = |e| store_error("read parked rows", e);
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let rows = DB::Db::fetch_all(&mut *conn, &self.sql.parked.list, &[])
            .await
            .map_err(fail)?;
        rows.iter()
            .map(|row| {
                let text = |column| DB::Db::text(row, column);
                Ok(ParkedRow {
                    seq: DB::Db::int(row, "seq")?,
                    message_id: text("message_id").map(crate::keys::shown::<DB>)?,
                    consumer: text("consumer")?,
                    key: text("key").map(crate::keys::shown::<DB>)?,
                    exchange: text("exchange").map(crate::keys::shown::<DB>)?,
                    routing_key: text("routing_key").map(crate::keys::shown::<DB>)?,
                    failure: text("failure")?,
                    parked_at_ms: DB::Db::int(row, "parked_ms")?,
                    given_up_at_ms: DB::Db::int_opt(row, "given_up_ms")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(fail)
    }

    /// Puts the parked rows `seqs` back into the outbox (with their ids; the relay takes them
    /// at its next pass; one whose id was staged again since is merged into that row), in one
    /// transaction; returns how many it released.
    pub async fn release_parked(&self, seqs: &[i64]) -> Result<u64, StoreError> {
        let fail = |e| store_error("release parked rows", e);
        let mut tx = self.begin_tx().await?;
        let released = unpark::<DB>(&self.sql.parked, &mut tx, seqs)
            .await
            .map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        Ok(released)
    }

    /// Gives up the parked rows staged longer than [`SqlInbox::outbox_give_up`] ago (outbox
    /// dead letters from then on), then puts back into the outbox at most `limit` rows parked
    /// longer than `after` ago, so that a row refused for a while (its queue was not declared
    /// yet, say) is tried again, behind the rows staged since; returns how many it gave up and
    /// how many it released.
    pub(crate) async fn release_due(
        &self,
        after: Duration,
        limit: u32,
    ) -> Result<(u64, u64), StoreError> {
        let fail = |e| store_error("release parked rows", e);
        let sql = &self.sql.parked;
        let mut tx = self.begin_tx().await?;
        let millis = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let given_up = DB::Db::execute(&mut *tx, &sql.give_up, &[Param::Int(millis(self.give_up))])
            .await
            .map_err(fail)?;
        let after = millis(after);
        let params = [Param::Int(after), Param::Int(i64::from(limit))];
        let due = DB::Db::fetch_all(&mut *tx, &sql.due, &params)
            .await
            .map_err(fail)?;
        if due.is_empty() {
            tx.commit().await.map_err(fail)?;
            return Ok((given_up, 0));
        }
        let seqs = due
            .iter()
            .map(|row| DB::Db::int(row, "seq"))
            .collect::<Result<Vec<_>, _>>()
            .map_err(fail)?;
        let released = unpark::<DB>(sql, &mut tx, &seqs).await.map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        Ok((given_up, released))
    }

    /// Removes the parked rows `seqs` for good (an operator gave up on them: they are never
    /// published); returns how many it removed.
    pub async fn drop_parked(&self, seqs: &[i64]) -> Result<u64, StoreError> {
        let fail = |e| store_error("drop parked rows", e);
        let mut tx = self.begin_tx().await?;
        let mut dropped = 0;
        for seq in seqs {
            dropped += DB::Db::execute(&mut *tx, &self.sql.parked.remove, &[Param::Int(*seq)])
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)?;
        Ok(dropped)
    }
}

/// Moves the parked rows `seqs` back into the outbox in `tx` (merged into a row of the same id
/// there); how many parked rows it removed.
async fn unpark<DB: Dialect>(
    sql: &ParkedStatements<std::sync::Arc<str>>,
    tx: &mut sqlx::Transaction<'_, DB::Db>,
    seqs: &[i64],
) -> Result<u64, sqlx::Error> {
    let mut released = 0;
    for seq in seqs {
        let params = [Param::Int(*seq)];
        DB::Db::execute(&mut **tx, &sql.unpark, &params).await?;
        released += DB::Db::execute(&mut **tx, &sql.remove, &params).await?;
    }
    Ok(released)
}

/// The parked rows' statements, for a relay pass's transaction: moves the row `seq` out of
/// the outbox's way with `failure` (the caller deletes it from the outbox with the rows it
/// published).
pub(crate) async fn park<DB: Dialect>(
    sql: &ParkedStatements<std::sync::Arc<str>>,
    conn: &mut Conn<DB>,
    seq: i64,
    failure: &str,
) -> Result<(), sqlx::Error> {
    let params = [Param::Text(failure), Param::Int(seq)];
    DB::Db::execute(conn, &sql.park, &params).await.map(drop)
}
