//! Parked keys (`{table}_parked_keys`) and the messages parked behind them
//! (`{table}_parked_messages`): an ordered handler's key whose message was dead-lettered keeps
//! its later messages here, in order, until an operator releases it (`idem dlq replay --key`,
//! `idem dlq skip --key`; see `idem_core::model::parking`). A skipped head is kept with the
//! operator's reason in `{table}_skipped`.
//!
//! Every change to a key's messages is made holding its key's row (`FOR UPDATE`; SQLite's
//! transactions hold the write lock from their start), so a message parked while the key is
//! being released is never missed by the emptiness check that frees it. Times are
//! milliseconds since the Unix epoch, as the writer's clock says.

use crate::dialect::{Dialect, Row};
use crate::error::store_error;
use crate::exec::{Param, Sql};
use crate::held::Held;
use crate::inbox::SqlInbox;
use crate::keys;
use idem_core::model::outgoing::{headers_from_json, headers_to_json};
use idem_core::model::{
    Envelope, Fingerprint, ParkKey, ParkedMessage, Parking, StoreError, epoch_ms,
};
use idem_core::store::ParkingStore;
use sqlx::Transaction;
use std::sync::Arc;

/// A key's state: its later messages are parked behind its dead-lettered head.
pub const PARKED: &str = "parked";
/// A key's state: an operator released it, and its parked messages are going back, in order.
pub const RELEASING: &str = "releasing";

/// The parked keys' statements; each documents its bind parameters, in order.
#[derive(Debug, Clone)]
pub struct ParkingStatements<S = &'static str> {
    /// Reads a key's `state` and `head_message_id`, holding its row (consumer, order key).
    pub lock: S,
    /// Reads a key's `state`, without a lock (consumer, order key).
    pub read: S,
    /// Parks a key, or parks it again behind a new head (consumer, order key, head message
    /// id, queue, source, reason, parked ms).
    pub park: S,
    /// Marks a key `releasing` (consumer, order key).
    pub releasing: S,
    /// Removes a key's row (consumer, order key).
    pub free: S,
    /// The first parked message of a key: `seq`, `fingerprint` (consumer, order key).
    pub lowest: S,
    /// The first parked message of a key but one, with its key's `parked_ms`: the columns of
    /// a message (consumer, order key, the `seq` left out).
    pub next: S,
    /// A parked message's `seq`, if it is the one named (seq, consumer, order key,
    /// fingerprint).
    pub find: S,
    /// A parked message's `seq` with a message id (consumer, order key, message id).
    pub find_id: S,
    /// Parks a message (consumer, order key, place, message id, correlation id, content
    /// type, published ms, body, headers, fingerprint, parked ms).
    pub insert: S,
    /// Removes a parked message (seq, consumer, order key, fingerprint).
    pub remove: S,
    /// How many messages a key holds: `n` (consumer, order key).
    pub remaining: S,
    /// Every parked key with its depth, oldest first: `consumer`, `order_key`, `state`,
    /// `head_message_id`, `queue`, `source`, `reason`, `parked_ms`, `depth`.
    pub list: S,
    /// Keeps a skipped head (consumer, order key, message id, reason, skipped ms, body).
    pub skipped: S,
    /// A consumer's parked keys: how many, `n`, and when the oldest was parked, `oldest`
    /// (0: none) (consumer).
    pub summary: S,
}

impl ParkingStatements {
    /// These statements for the inbox in `table`.
    pub(crate) fn fill(&self, fill: impl Fn(&str) -> Arc<str>) -> ParkingStatements<Arc<str>> {
        ParkingStatements {
            lock: fill(self.lock),
            read: fill(self.read),
            park: fill(self.park),
            releasing: fill(self.releasing),
            free: fill(self.free),
            lowest: fill(self.lowest),
            next: fill(self.next),
            find: fill(self.find),
            find_id: fill(self.find_id),
            insert: fill(self.insert),
            remove: fill(self.remove),
            remaining: fill(self.remaining),
            list: fill(self.list),
            skipped: fill(self.skipped),
            summary: fill(self.summary),
        }
    }
}

/// PostgreSQL's parked keys.
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: ParkingStatements = ParkingStatements {
    lock: r#"SELECT state, head_message_id FROM "{table}_parked_keys"
    WHERE consumer = $1 AND order_key = $2 FOR UPDATE"#,
    read: r#"SELECT state FROM "{table}_parked_keys" WHERE consumer = $1 AND order_key = $2"#,
    park: r#"INSERT INTO "{table}_parked_keys" AS k (consumer, order_key, head_message_id, queue,
        source, reason, parked_ms, state) VALUES ($1, $2, $3, $4, $5, $6, $7, 'parked')
    ON CONFLICT (consumer, order_key) DO UPDATE SET state = 'parked',
        head_message_id = excluded.head_message_id, queue = excluded.queue,
        source = excluded.source, reason = excluded.reason, parked_ms = excluded.parked_ms"#,
    releasing: r#"UPDATE "{table}_parked_keys" SET state = 'releasing'
    WHERE consumer = $1 AND order_key = $2"#,
    free: r#"DELETE FROM "{table}_parked_keys" WHERE consumer = $1 AND order_key = $2"#,
    lowest: r#"SELECT seq, fingerprint FROM "{table}_parked_messages"
    WHERE consumer = $1 AND order_key = $2 ORDER BY place, seq LIMIT 1"#,
    next: r#"SELECT m.seq, m.message_id, m.correlation_id, m.content_type, m.published_ms,
        m.body, m.headers, k.parked_ms
    FROM "{table}_parked_messages" m JOIN "{table}_parked_keys" k
        ON k.consumer = m.consumer AND k.order_key = m.order_key
    WHERE m.consumer = $1 AND m.order_key = $2 AND m.seq <> $3
    ORDER BY m.place, m.seq LIMIT 1"#,
    find: r#"SELECT seq FROM "{table}_parked_messages"
    WHERE seq = $1 AND consumer = $2 AND order_key = $3 AND fingerprint = $4"#,
    find_id: r#"SELECT seq FROM "{table}_parked_messages"
    WHERE consumer = $1 AND order_key = $2 AND message_id = $3"#,
    insert: r#"INSERT INTO "{table}_parked_messages" (consumer, order_key, place, message_id,
        correlation_id, content_type, published_ms, body, headers, fingerprint, parked_ms)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"#,
    remove: r#"DELETE FROM "{table}_parked_messages"
    WHERE seq = $1 AND consumer = $2 AND order_key = $3 AND fingerprint = $4"#,
    remaining: r#"SELECT count(*) AS n FROM "{table}_parked_messages"
    WHERE consumer = $1 AND order_key = $2"#,
    list: r#"SELECT k.consumer, k.order_key, k.state, k.head_message_id, k.queue, k.source,
        k.reason, k.parked_ms, (SELECT count(*) FROM "{table}_parked_messages" m
            WHERE m.consumer = k.consumer AND m.order_key = k.order_key) AS depth
    FROM "{table}_parked_keys" k ORDER BY k.parked_ms"#,
    skipped: r#"INSERT INTO "{table}_skipped" (consumer, order_key, message_id, reason,
        skipped_ms, body) VALUES ($1, $2, $3, $4, $5, $6)"#,
    summary: r#"SELECT count(*) AS n, COALESCE(min(parked_ms), 0) AS oldest
    FROM "{table}_parked_keys" WHERE consumer = $1"#,
};

/// PostgreSQL's tables of parked keys (schema version 14).
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES_TABLES: &[&str] = &[
    r#"CREATE TABLE IF NOT EXISTS "{table}_parked_keys" (
    consumer        text   NOT NULL,
    order_key       text   NOT NULL,
    state           text   NOT NULL,
    head_message_id text   NOT NULL,
    queue           text   NOT NULL,
    source          text   NOT NULL,
    reason          text   NOT NULL,
    parked_ms       bigint NOT NULL,
    PRIMARY KEY (consumer, order_key)
)"#,
    r#"CREATE TABLE IF NOT EXISTS "{table}_parked_messages" (
    seq            bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    consumer       text   NOT NULL,
    order_key      text   NOT NULL,
    place          bigint NOT NULL,
    message_id     text   NOT NULL,
    correlation_id text   NOT NULL,
    content_type   text   NOT NULL,
    published_ms   bigint NOT NULL,
    body           bytea  NOT NULL,
    headers        text   NOT NULL,
    fingerprint    bytea  NOT NULL,
    parked_ms      bigint NOT NULL
)"#,
    r#"CREATE INDEX IF NOT EXISTS "{table}_parked_messages_key" ON "{table}_parked_messages" (consumer, order_key, place, seq)"#,
    r#"CREATE TABLE IF NOT EXISTS "{table}_skipped" (
    consumer   text   NOT NULL,
    order_key  text   NOT NULL,
    message_id text   NOT NULL,
    reason     text   NOT NULL,
    skipped_ms bigint NOT NULL,
    body       bytea  NOT NULL
)"#,
];

/// MySQL's and MariaDB's parked keys.
#[cfg(feature = "mysql")]
pub(crate) const MYSQL: ParkingStatements = ParkingStatements {
    lock: "SELECT state, head_message_id FROM `{table}_parked_keys`
    WHERE consumer = ? AND order_key = ? FOR UPDATE",
    read: "SELECT state FROM `{table}_parked_keys` WHERE consumer = ? AND order_key = ?",
    park: "INSERT INTO `{table}_parked_keys` (consumer, order_key, head_message_id, queue,
        source, reason, parked_ms, state) VALUES (?, ?, ?, ?, ?, ?, ?, 'parked')
    ON DUPLICATE KEY UPDATE state = 'parked', head_message_id = VALUES(head_message_id),
        queue = VALUES(queue), source = VALUES(source), reason = VALUES(reason),
        parked_ms = VALUES(parked_ms)",
    releasing: "UPDATE `{table}_parked_keys` SET state = 'releasing'
    WHERE consumer = ? AND order_key = ?",
    free: "DELETE FROM `{table}_parked_keys` WHERE consumer = ? AND order_key = ?",
    lowest: "SELECT seq, fingerprint FROM `{table}_parked_messages`
    WHERE consumer = ? AND order_key = ? ORDER BY place, seq LIMIT 1",
    next: "SELECT m.seq, m.message_id, m.correlation_id, m.content_type, m.published_ms,
        m.body, m.headers, k.parked_ms
    FROM `{table}_parked_messages` m JOIN `{table}_parked_keys` k
        ON k.consumer = m.consumer AND k.order_key = m.order_key
    WHERE m.consumer = ? AND m.order_key = ? AND m.seq <> ?
    ORDER BY m.place, m.seq LIMIT 1",
    find: "SELECT seq FROM `{table}_parked_messages`
    WHERE seq = ? AND consumer = ? AND order_key = ? AND fingerprint = ?",
    find_id: "SELECT seq FROM `{table}_parked_messages`
    WHERE consumer = ? AND order_key = ? AND message_id = ?",
    insert: "INSERT INTO `{table}_parked_messages` (consumer, order_key, place, message_id,
        correlation_id, content_type, published_ms, body, headers, fingerprint, parked_ms)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    remove: "DELETE FROM `{table}_parked_messages`
    WHERE seq = ? AND consumer = ? AND order_key = ? AND fingerprint = ?",
    remaining: "SELECT CAST(count(*) AS SIGNED) AS n FROM `{table}_parked_messages`
    WHERE consumer = ? AND order_key = ?",
    list: "SELECT k.consumer, k.order_key, k.state, k.head_message_id, k.queue, k.source,
        k.reason, k.parked_ms, CAST((SELECT count(*) FROM `{table}_parked_messages` m
            WHERE m.consumer = k.consumer AND m.order_key = k.order_key) AS SIGNED) AS depth
    FROM `{table}_parked_keys` k ORDER BY k.parked_ms",
    skipped: "INSERT INTO `{table}_skipped` (consumer, order_key, message_id, reason,
        skipped_ms, body) VALUES (?, ?, ?, ?, ?, ?)",
    summary:
        "SELECT CAST(count(*) AS SIGNED) AS n, CAST(COALESCE(min(parked_ms), 0) AS SIGNED) AS oldest
    FROM `{table}_parked_keys` WHERE consumer = ?",
};

/// MySQL's and MariaDB's tables of parked keys (schema version 14).
#[cfg(feature = "mysql")]
pub(crate) const MYSQL_TABLES: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS `{table}_parked_keys` (
    consumer        VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    order_key       VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    state           VARCHAR(16)  NOT NULL,
    head_message_id TEXT         NOT NULL,
    queue           TEXT         NOT NULL,
    source          TEXT         NOT NULL,
    reason          TEXT         NOT NULL,
    parked_ms       BIGINT       NOT NULL,
    PRIMARY KEY (consumer, order_key)
) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS `{table}_parked_messages` (
    seq            BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    consumer       VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    order_key      VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    place          BIGINT       NOT NULL,
    message_id     TEXT         NOT NULL,
    correlation_id TEXT         NOT NULL,
    content_type   TEXT         NOT NULL,
    published_ms   BIGINT       NOT NULL,
    body           LONGBLOB     NOT NULL,
    headers        LONGTEXT     NOT NULL,
    fingerprint    VARBINARY(32) NOT NULL,
    parked_ms      BIGINT       NOT NULL,
    KEY `{table}_parked_messages_key` (consumer, order_key, place, seq)
) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS `{table}_skipped` (
    consumer   VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    order_key  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id TEXT     NOT NULL,
    reason     TEXT     NOT NULL,
    skipped_ms BIGINT   NOT NULL,
    body       LONGBLOB NOT NULL
) ENGINE = InnoDB",
];

/// SQLite's parked keys; its transactions hold the write lock from their start, so `lock`
/// needs no `FOR UPDATE`.
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: ParkingStatements = ParkingStatements {
    lock: r#"SELECT state, head_message_id FROM "{table}_parked_keys"
    WHERE consumer = ?1 AND order_key = ?2"#,
    read: r#"SELECT state FROM "{table}_parked_keys" WHERE consumer = ?1 AND order_key = ?2"#,
    park: r#"INSERT INTO "{table}_parked_keys" (consumer, order_key, head_message_id, queue,
        source, reason, parked_ms, state) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'parked')
    ON CONFLICT (consumer, order_key) DO UPDATE SET state = 'parked',
        head_message_id = excluded.head_message_id, queue = excluded.queue,
        source = excluded.source, reason = excluded.reason, parked_ms = excluded.parked_ms"#,
    releasing: r#"UPDATE "{table}_parked_keys" SET state = 'releasing'
    WHERE consumer = ?1 AND order_key = ?2"#,
    free: r#"DELETE FROM "{table}_parked_keys" WHERE consumer = ?1 AND order_key = ?2"#,
    lowest: r#"SELECT seq, fingerprint FROM "{table}_parked_messages"
    WHERE consumer = ?1 AND order_key = ?2 ORDER BY place, seq LIMIT 1"#,
    next: r#"SELECT m.seq, m.message_id, m.correlation_id, m.content_type, m.published_ms,
        m.body, m.headers, k.parked_ms
    FROM "{table}_parked_messages" m JOIN "{table}_parked_keys" k
        ON k.consumer = m.consumer AND k.order_key = m.order_key
    WHERE m.consumer = ?1 AND m.order_key = ?2 AND m.seq <> ?3
    ORDER BY m.place, m.seq LIMIT 1"#,
    find: r#"SELECT seq FROM "{table}_parked_messages"
    WHERE seq = ?1 AND consumer = ?2 AND order_key = ?3 AND fingerprint = ?4"#,
    find_id: r#"SELECT seq FROM "{table}_parked_messages"
    WHERE consumer = ?1 AND order_key = ?2 AND message_id = ?3"#,
    insert: r#"INSERT INTO "{table}_parked_messages" (consumer, order_key, place, message_id,
        correlation_id, content_type, published_ms, body, headers, fingerprint, parked_ms)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"#,
    remove: r#"DELETE FROM "{table}_parked_messages"
    WHERE seq = ?1 AND consumer = ?2 AND order_key = ?3 AND fingerprint = ?4"#,
    remaining: r#"SELECT count(*) AS n FROM "{table}_parked_messages"
    WHERE consumer = ?1 AND order_key = ?2"#,
    list: r#"SELECT k.consumer, k.order_key, k.state, k.head_message_id, k.queue, k.source,
        k.reason, k.parked_ms, (SELECT count(*) FROM "{table}_parked_messages" m
            WHERE m.consumer = k.consumer AND m.order_key = k.order_key) AS depth
    FROM "{table}_parked_keys" k ORDER BY k.parked_ms"#,
    skipped: r#"INSERT INTO "{table}_skipped" (consumer, order_key, message_id, reason,
        skipped_ms, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6)"#,
    summary: r#"SELECT count(*) AS n, COALESCE(min(parked_ms), 0) AS oldest
    FROM "{table}_parked_keys" WHERE consumer = ?1"#,
};

/// SQLite's tables of parked keys (schema version 14).
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_TABLES: &[&str] = &[
    r#"CREATE TABLE IF NOT EXISTS "{table}_parked_keys" (
    consumer        TEXT    NOT NULL,
    order_key       TEXT    NOT NULL,
    state           TEXT    NOT NULL,
    head_message_id TEXT    NOT NULL,
    queue           TEXT    NOT NULL,
    source          TEXT    NOT NULL,
    reason          TEXT    NOT NULL,
    parked_ms       INTEGER NOT NULL,
    PRIMARY KEY (consumer, order_key)
)"#,
    r#"CREATE TABLE IF NOT EXISTS "{table}_parked_messages" (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer       TEXT    NOT NULL,
    order_key      TEXT    NOT NULL,
    place          INTEGER NOT NULL,
    message_id     TEXT    NOT NULL,
    correlation_id TEXT    NOT NULL,
    content_type   TEXT    NOT NULL,
    published_ms   INTEGER NOT NULL,
    body           BLOB    NOT NULL,
    headers        TEXT    NOT NULL,
    fingerprint    BLOB    NOT NULL,
    parked_ms      INTEGER NOT NULL
)"#,
    r#"CREATE INDEX IF NOT EXISTS "{table}_parked_messages_key" ON "{table}_parked_messages" (consumer, order_key, place, seq)"#,
    r#"CREATE TABLE IF NOT EXISTS "{table}_skipped" (
    consumer   TEXT    NOT NULL,
    order_key  TEXT    NOT NULL,
    message_id TEXT    NOT NULL,
    reason     TEXT    NOT NULL,
    skipped_ms INTEGER NOT NULL,
    body       BLOB    NOT NULL
)"#,
];

/// A parked key, as an operator sees it (`idem dlq list`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedKey {
    /// The consumer whose key it is.
    pub consumer: String,
    /// The order key.
    pub order_key: String,
    /// [`PARKED`] or [`RELEASING`].
    pub state: String,
    /// The message id of the dead-lettered message it waits behind (empty: none).
    pub head_message_id: String,
    /// The queue the head was consumed from (its dead letter is in that queue's DLQ).
    pub queue: String,
    /// Where its messages are published (the partitions' source).
    pub source: String,
    /// Why the head was dead-lettered.
    pub reason: String,
    /// When it was parked, in milliseconds since the Unix epoch.
    pub parked_at_ms: i64,
    /// How many messages wait behind it.
    pub depth: i64,
}

/// Which place a message takes among its key's: behind the others, or before them all (a
/// replayed head).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Behind the key's messages (in the order parked).
    Behind,
    /// Before them all: the head an operator replays.
    First,
}

impl Place {
    fn value(self) -> i64 {
        match self {
            Self::Behind => 0,
            Self::First => -1,
        }
    }
}

impl<DB: Dialect> SqlInbox<DB> {
    /// Every parked key, oldest first, with how many messages wait behind it.
    pub async fn parked_keys(&self) -> Result<Vec<ParkedKey>, StoreError> {
        let fail = |e| store_error("read parked keys", e);
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let rows = DB::Db::fetch_all(&mut *conn, &self.sql.parking.list, &[])
            .await
            .map_err(fail)?;
        rows.iter()
            .map(|row| {
                let text = |column| DB::Db::text(row, column).map(keys::shown::<DB>);
                Ok(ParkedKey {
                    consumer: DB::Db::text(row, "consumer")?,
                    order_key: text("order_key")?,
                    state: DB::Db::text(row, "state")?,
                    head_message_id: text("head_message_id")?,
                    queue: text("queue")?,
                    source: text("source")?,
                    reason: text("reason")?,
                    parked_at_ms: DB::Db::int(row, "parked_ms")?,
                    depth: DB::Db::int(row, "depth")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(fail)
    }

    /// Starts the release of `consumer`'s parked `order_key`, in one transaction: `head` (the
    /// dead-lettered message, replayed) goes before its parked messages, or, skipped, is kept
    /// with `reason` in `{table}_skipped`; the key turns [`RELEASING`]. A key with nothing left
    /// to release is freed at once. Returns the key's first message to publish, if any;
    /// `Ok(None)` also when the key was not parked.
    pub async fn start_release(
        &self,
        consumer: &str,
        order_key: &str,
        head: Release<'_>,
    ) -> Result<Option<ParkedMessage>, StoreError> {
        let fail = |e| store_error("release a parked key", e);
        let sql = &self.sql.parking;
        let stored_key = keys::stored::<DB>(order_key);
        let key = [Param::Text(consumer), Param::Text(&stored_key)];
        let mut tx = self.begin_tx().await?;
        let Some(row) = DB::Db::fetch_optional(&mut *tx, &sql.lock, &key)
            .await
            .map_err(fail)?
        else {
            return Ok(None);
        };
        let state = DB::Db::text(&row, "state").map_err(fail)?;
        if state == PARKED {
            match head {
                Release::Replay(envelope) => {
                    insert::<DB>(
                        &sql.insert,
                        &mut tx,
                        consumer,
                        &stored_key,
                        Place::First,
                        envelope,
                    )
                    .await
                    .map_err(fail)?;
                }
                Release::Skip {
                    message_id,
                    reason,
                    body,
                } => {
                    let message_id = keys::stored::<DB>(message_id);
                    let reason = keys::stored::<DB>(reason);
                    let params = [
                        Param::Text(consumer),
                        Param::Text(&stored_key),
                        Param::Text(&message_id),
                        Param::Text(&reason),
                        Param::Int(epoch_ms()),
                        Param::Bytes(body),
                    ];
                    DB::Db::execute(&mut *tx, &sql.skipped, &params)
                        .await
                        .map_err(fail)?;
                }
                Release::Resume => {}
            }
            DB::Db::execute(&mut *tx, &sql.releasing, &key)
                .await
                .map_err(fail)?;
        }
        let first = next::<DB>(&sql.next, &mut tx, consumer, &stored_key, None)
            .await
            .map_err(fail)?;
        if first.is_none() {
            DB::Db::execute(&mut *tx, &sql.free, &key)
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)?;
        Ok(first)
    }
}

/// What becomes of a parked key's head when an operator releases the key.
#[derive(Debug, Clone, Copy)]
pub enum Release<'a> {
    /// Replayed: the dead-lettered message goes first, before the parked ones.
    Replay(&'a Envelope),
    /// Skipped: dropped, kept in `{table}_skipped` with the operator's reason.
    Skip {
        /// Its message id (empty: none).
        message_id: &'a str,
        /// Why the operator skipped it.
        reason: &'a str,
        /// Its body.
        body: &'a [u8],
    },
    /// Already released: the release goes on from the first message left.
    Resume,
}

impl<DB: Dialect> ParkingStore for SqlInbox<DB> {
    fn parks(&self) -> bool {
        true
    }

    async fn admit_ordered(
        &self,
        consumer: &str,
        order_key: &str,
        envelope: &Envelope,
        held: &mut Option<Held<DB>>,
    ) -> Result<Parking, StoreError> {
        let fail = |e| store_error("check a parked key", e);
        let sql = &self.sql.parking;
        let order_key = keys::stored::<DB>(order_key);
        let key = [Param::Text(consumer), Param::Text(&order_key)];
        // Most keys are not parked: one read, on the worker's connection, without a lock.
        let row = match held.as_mut() {
            Some(held) => DB::Db::fetch_optional(held.connection(), &sql.read, &key).await,
            None => {
                let mut conn = self.pool.acquire().await.map_err(fail)?;
                DB::Db::fetch_optional(&mut *conn, &sql.read, &key).await
            }
        };
        if row.map_err(fail)?.is_none() {
            return Ok(Parking::Run);
        }
        let mut tx = self.begin_tx().await?;
        let Some(row) = DB::Db::fetch_optional(&mut *tx, &sql.lock, &key)
            .await
            .map_err(fail)?
        else {
            return Ok(Parking::Run);
        };
        let state = DB::Db::text(&row, "state").map_err(fail)?;
        // A released copy is believed only for the parked message at its place with its body.
        if let Some((seq, fingerprint)) = idem_core::model::parking::released_claim(envelope) {
            let named = [
                Param::Int(seq),
                Param::Text(consumer),
                Param::Text(&order_key),
                Param::Bytes(fingerprint.as_bytes()),
            ];
            let held = DB::Db::fetch_optional(&mut *tx, &sql.find, &named)
                .await
                .map_err(fail)?;
            if held.is_some() {
                let turn = match state == RELEASING {
                    true => lowest::<DB>(&sql.lowest, &mut tx, consumer, &order_key)
                        .await
                        .map_err(fail)?
                        .is_some_and(|(first, _)| first == seq),
                    false => false,
                };
                tx.commit().await.map_err(fail)?;
                // Not its turn (the key was parked again, or an earlier one goes first): it
                // stays parked, and is published again when its turn comes.
                return Ok(if turn {
                    Parking::Released(seq)
                } else {
                    Parking::Parked
                });
            }
        }
        if state == PARKED {
            let head = DB::Db::text(&row, "head_message_id")
                .map(keys::shown::<DB>)
                .map_err(fail)?;
            // The head itself, delivered again (its dead letter was not moved yet): it runs,
            // and is dead-lettered again, or goes through.
            if !head.is_empty() && envelope.message_id.as_deref() == Some(head.as_str()) {
                return Ok(Parking::Run);
            }
        }
        let message_id = envelope.message_id.as_deref().unwrap_or("");
        let known = match message_id.is_empty() {
            true => None,
            false => {
                let message_id = keys::stored::<DB>(message_id);
                let params = [
                    Param::Text(consumer),
                    Param::Text(&order_key),
                    Param::Text(&message_id),
                ];
                DB::Db::fetch_optional(&mut *tx, &sql.find_id, &params)
                    .await
                    .map_err(fail)?
            }
        };
        // A copy of a message parked already stays one message.
        if known.is_none() {
            insert::<DB>(
                &sql.insert,
                &mut tx,
                consumer,
                &order_key,
                Place::Behind,
                envelope,
            )
            .await
            .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)?;
        Ok(Parking::Parked)
    }

    async fn parked_summary(&self, consumer: &str) -> Result<(u64, Option<i64>), StoreError> {
        let fail = |e| store_error("count parked keys", e);
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let params = [Param::Text(consumer)];
        let row = DB::Db::fetch_optional(&mut *conn, &self.sql.parking.summary, &params)
            .await
            .map_err(fail)?;
        let Some(row) = row else {
            return Ok((0, None));
        };
        let keys = DB::Db::int(&row, "n").map_err(fail)?;
        let oldest = DB::Db::int(&row, "oldest").map_err(fail)?;
        Ok((
            u64::try_from(keys).unwrap_or(0),
            (oldest > 0).then_some(oldest),
        ))
    }

    async fn next_parked(
        &self,
        consumer: &str,
        order_key: &str,
        after: i64,
    ) -> Result<Option<ParkedMessage>, StoreError> {
        let fail = |e| store_error("read the next parked message", e);
        let order_key = keys::stored::<DB>(order_key);
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        next::<DB>(
            &self.sql.parking.next,
            &mut conn,
            consumer,
            &order_key,
            Some(after),
        )
        .await
        .map_err(fail)
    }

    async fn finish_release(
        &self,
        consumer: &str,
        order_key: &str,
        seq: i64,
        fingerprint: &Fingerprint,
    ) -> Result<(), StoreError> {
        let fail = |e| store_error("finish a released message", e);
        let sql = &self.sql.parking;
        let order_key = keys::stored::<DB>(order_key);
        let key = [Param::Text(consumer), Param::Text(&order_key)];
        let mut tx = self.begin_tx().await?;
        let Some(row) = DB::Db::fetch_optional(&mut *tx, &sql.lock, &key)
            .await
            .map_err(fail)?
        else {
            return Ok(());
        };
        let params = [
            Param::Int(seq),
            Param::Text(consumer),
            Param::Text(&order_key),
            Param::Bytes(fingerprint.as_bytes()),
        ];
        DB::Db::execute(&mut *tx, &sql.remove, &params)
            .await
            .map_err(fail)?;
        let releasing = DB::Db::text(&row, "state").map_err(fail)? == RELEASING;
        let left = DB::Db::fetch_int(&mut *tx, &sql.remaining, &key)
            .await
            .map_err(fail)?;
        if releasing && left == 0 {
            DB::Db::execute(&mut *tx, &sql.free, &key)
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)
    }
}

/// Parks the key of `park` behind the dead letter `record` describes, in the record's
/// transaction `tx`; the released message it was (if any) leaves the parked messages.
pub(crate) async fn park_key<DB: Dialect>(
    sql: &ParkingStatements<Arc<str>>,
    tx: &mut Transaction<'_, DB::Db>,
    record: &idem_core::model::DeadLetterRecord,
    park: &ParkKey,
) -> Result<(), sqlx::Error> {
    let order_key = keys::stored::<DB>(&park.order_key);
    let head = keys::stored::<DB>(record.message_id.as_deref().unwrap_or(""));
    let (queue, source) = (
        keys::stored::<DB>(&record.queue),
        keys::stored::<DB>(&park.source),
    );
    let reason = format!("{}: {}", record.reason, record.detail);
    let reason = keys::stored::<DB>(&reason);
    let params = [
        Param::Text(&record.consumer),
        Param::Text(&order_key),
        Param::Text(&head),
        Param::Text(&queue),
        Param::Text(&source),
        Param::Text(&reason),
        Param::Int(epoch_ms()),
    ];
    DB::Db::execute(&mut **tx, &sql.park, &params).await?;
    if let Some(seq) = park.released {
        let params = [
            Param::Int(seq),
            Param::Text(&record.consumer),
            Param::Text(&order_key),
            Param::Bytes(record.fingerprint.as_bytes()),
        ];
        DB::Db::execute(&mut **tx, &sql.remove, &params).await?;
    }
    Ok(())
}

/// Parks `envelope` among `consumer`'s `order_key`'s messages, at `place`.
async fn insert<DB: Dialect>(
    sql: &Arc<str>,
    tx: &mut Transaction<'_, DB::Db>,
    consumer: &str,
    order_key: &str,
    place: Place,
    envelope: &Envelope,
) -> Result<(), sqlx::Error> {
    let stored = keys::stored::<DB>;
    let message_id = stored(envelope.message_id.as_deref().unwrap_or(""));
    let correlation_id = stored(envelope.correlation_id.as_deref().unwrap_or(""));
    let content_type = stored(envelope.content_type.as_deref().unwrap_or(""));
    let headers = stored(&headers_to_json(&envelope.headers)).into_owned();
    let fingerprint = Fingerprint::of(&envelope.body);
    let params = [
        Param::Text(consumer),
        Param::Text(order_key),
        Param::Int(place.value()),
        Param::Text(&message_id),
        Param::Text(&correlation_id),
        Param::Text(&content_type),
        Param::Int(envelope.published_at_ms.unwrap_or(0)),
        Param::Bytes(&envelope.body),
        Param::Text(&headers),
        Param::Bytes(fingerprint.as_bytes()),
        Param::Int(epoch_ms()),
    ];
    DB::Db::execute(&mut **tx, sql, &params).await.map(drop)
}

/// The first parked message of a key: its `seq` and fingerprint.
async fn lowest<DB: Dialect>(
    sql: &Arc<str>,
    tx: &mut Transaction<'_, DB::Db>,
    consumer: &str,
    order_key: &str,
) -> Result<Option<(i64, Vec<u8>)>, sqlx::Error> {
    let key = [Param::Text(consumer), Param::Text(order_key)];
    let row = DB::Db::fetch_optional(&mut **tx, sql, &key).await?;
    row.map(|row| {
        Ok((
            DB::Db::int(&row, "seq")?,
            DB::Db::bytes(&row, "fingerprint")?,
        ))
    })
    .transpose()
}

/// The first parked message of a key but the one at `except`, read back whole.
async fn next<DB: Dialect>(
    sql: &Arc<str>,
    conn: &mut crate::dialect::Conn<DB>,
    consumer: &str,
    order_key: &str,
    except: Option<i64>,
) -> Result<Option<ParkedMessage>, sqlx::Error> {
    let params = [
        Param::Text(consumer),
        Param::Text(order_key),
        Param::Int(except.unwrap_or(i64::MIN)),
    ];
    let row = DB::Db::fetch_optional(conn, sql, &params).await?;
    row.as_ref().map(read_message::<DB>).transpose()
}

/// A parked message as stored, its routing key its order key.
fn read_message<DB: Dialect>(row: &Row<DB>) -> Result<ParkedMessage, sqlx::Error> {
    let text = |column| DB::Db::text(row, column).map(keys::shown::<DB>);
    let some = |text: String| (!text.is_empty()).then_some(text);
    let headers =
        headers_from_json(&text("headers")?).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    let mut envelope = Envelope::new(DB::Db::bytes(row, "body")?);
    envelope.message_id = some(text("message_id")?);
    envelope.correlation_id = some(text("correlation_id")?);
    envelope.content_type = some(text("content_type")?);
    envelope.headers = headers;
    envelope.published_at_ms = Some(DB::Db::int(row, "published_ms")?).filter(|ms| *ms > 0);
    let parked_at_ms = DB::Db::int(row, "parked_ms")?;
    Ok(ParkedMessage::new(
        DB::Db::int(row, "seq")?,
        envelope,
        parked_at_ms,
    ))
}
