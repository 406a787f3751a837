//! Parked outbox rows (`{outbox}_parked`): a row the broker refused for good (no queue is bound
//! for it, or it cannot be carried as it is) is moved out of the relay's way, with the reason,
//! by the relay pass that sent it, so that the rows behind it are always relayed and it is never
//! sent again by itself. An operator lists them and releases them (`idem outbox parked`,
//! `idem outbox release`): a released row goes back to the outbox, with its id, and the relay
//! takes it at its next pass.

use crate::dialect::Dialect;
use crate::error::store_error;
use crate::exec::Param;
use crate::inbox::SqlInbox;
use idem_core::StoreError;

/// The statements of the parked rows. Times are read as milliseconds since the Unix epoch.
#[derive(Debug, Clone)]
pub struct ParkedStatements<S = &'static str> {
    /// Copies an outbox row into the parked rows (the failure, the row's `seq`).
    pub park: S,
    /// Lists the parked rows, oldest first: `seq`, `message_id`, `consumer`, `key`,
    /// `exchange`, `routing_key`, `failure`, `parked_ms`.
    pub list: S,
    /// Copies a parked row back into the outbox, with its id and staging time (its `seq`).
    pub unpark: S,
    /// Removes a parked row (its `seq`).
    pub remove: S,
}

/// PostgreSQL's parked rows.
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: ParkedStatements = ParkedStatements {
    park: r#"INSERT INTO "{outbox}_parked" (seq, message_id, consumer, key, exchange, routing_key,
        body, headers, correlation_id, content_type, created_at, parked_at, failure)
    SELECT seq, message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, created_at, now(), $1 FROM "{outbox}" WHERE seq = $2"#,
    list: r#"SELECT seq, message_id, consumer, key, exchange, routing_key, failure,
        (EXTRACT(EPOCH FROM parked_at) * 1000)::int8 AS parked_ms
    FROM "{outbox}_parked" ORDER BY seq"#,
    unpark: r#"INSERT INTO "{outbox}" (message_id, consumer, key, exchange, routing_key, body,
        headers, correlation_id, content_type, created_at)
    SELECT message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, created_at FROM "{outbox}_parked" WHERE seq = $1"#,
    remove: r#"DELETE FROM "{outbox}_parked" WHERE seq = $1"#,
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
        CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', parked_at) DIV 1000 AS SIGNED) AS parked_ms
    FROM `{outbox}_parked` ORDER BY seq"#,
    unpark: r#"INSERT INTO `{outbox}` (message_id, consumer, `key`, exchange, routing_key, body,
        headers, correlation_id, content_type, created_at)
    SELECT message_id, consumer, `key`, exchange, routing_key, body, headers, correlation_id,
        content_type, created_at FROM `{outbox}_parked` WHERE seq = ?"#,
    remove: "DELETE FROM `{outbox}_parked` WHERE seq = ?",
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
        parked_at AS parked_ms FROM "{outbox}_parked" ORDER BY seq"#,
    unpark: r#"INSERT INTO "{outbox}" (message_id, consumer, key, exchange, routing_key, body,
        headers, correlation_id, content_type, created_at)
    SELECT message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, created_at FROM "{outbox}_parked" WHERE seq = ?1"#,
    remove: r#"DELETE FROM "{outbox}_parked" WHERE seq = ?1"#,
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
}

impl<DB: Dialect> SqlInbox<DB> {
    /// The outbox rows parked because the broker refused them, oldest first.
    pub async fn parked(&self) -> Result<Vec<ParkedRow>, StoreError> {
        let fail = |e| store_error("read parked rows", e);
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let rows = DB::fetch_all(&mut *conn, &self.sql.parked.list, &[])
            .await
            .map_err(fail)?;
        rows.iter()
            .map(|row| {
                let text = |column| DB::text(row, column);
                Ok(ParkedRow {
                    seq: DB::int(row, "seq")?,
                    message_id: text("message_id")?,
                    consumer: text("consumer")?,
                    key: text("key").map(crate::keys::shown::<DB>)?,
                    exchange: text("exchange")?,
                    routing_key: text("routing_key")?,
                    failure: text("failure")?,
                    parked_at_ms: DB::int(row, "parked_ms")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(fail)
    }

    /// Puts the parked rows `seqs` back into the outbox (with their ids; the relay takes them
    /// at its next pass), in one transaction; returns how many it released.
    pub async fn release_parked(&self, seqs: &[i64]) -> Result<u64, StoreError> {
        let fail = |e| store_error("release parked rows", e);
        let sql = &self.sql.parked;
        let mut tx = self.begin_tx().await?;
        let mut released = 0;
        for seq in seqs {
            let params = [Param::Int(*seq)];
            released += DB::execute(&mut *tx, &sql.unpark, &params)
                .await
                .map_err(fail)?;
            DB::execute(&mut *tx, &sql.remove, &params)
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)?;
        Ok(released)
    }
}

/// The parked rows' statements, for a relay pass's transaction: moves the row `seq` out of
/// the outbox's way with `failure` (the caller deletes it from the outbox with the rows it
/// published).
pub(crate) async fn park<DB: Dialect>(
    sql: &ParkedStatements<std::sync::Arc<str>>,
    conn: &mut DB::Connection,
    seq: i64,
    failure: &str,
) -> Result<(), sqlx::Error> {
    let params = [Param::Text(failure), Param::Int(seq)];
    DB::execute(conn, &sql.park, &params).await.map(drop)
}
