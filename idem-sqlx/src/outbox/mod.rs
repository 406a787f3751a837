//! The transactional outbox (`{outbox}`: `idem_outbox` beside `idem_inbox`), in one place:
//! messages staged in the caller's transaction ([`stage`], [`stage_all`], [`SqlInbox::stage`]),
//! published once it committed and removed once the broker confirmed them (by a relay pass,
//! `relay`, which the runtime's dispatch and relay run), rows the broker refused moved out of
//! the way (`parked`); the notifications that wake a relay are `crate::wake`. Each dialect's
//! statements and table are here.
//!
//! A row's destination is kept as its two [`idem_core::model::Destination::parts`]: its topic
//! (`""` for a queue) in `exchange` and its key (a queue's name) in `routing_key`. The columns
//! keep their first names so that processes of an older idem stage into the same table during
//! a rolling upgrade.

pub mod parked;
mod relay;

use crate::config::TableName;
use crate::dialect::{Conn, Dialect, Driver};
use crate::error::store_error;
use crate::exec::Param;
use crate::exec::Sql;
use crate::inbox::SqlInbox;
use crate::statements::OutboxStatements;
use idem_core::model::outgoing::headers_to_json;
use idem_core::{model::Context, model::ErrorClass, model::Outgoing, model::StoreError};
use sqlx::Transaction;
use sqlx_core::transaction::TransactionManager;

/// PostgreSQL: rows taken with `FOR UPDATE SKIP LOCKED`.
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: OutboxStatements = OutboxStatements {
    stage: r#"INSERT INTO "{outbox}" (message_id, consumer, key, exchange, routing_key, body, headers,
        correlation_id, content_type, created_at)
    VALUES {rows}"#,
    run: r#"SELECT seq, message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, (EXTRACT(EPOCH FROM now() - created_at) * 1000)::int8 AS age_ms
    FROM "{outbox}" WHERE ({runs}) AND created_at <= now() ORDER BY seq FOR UPDATE SKIP LOCKED"#,
    run_match: "(consumer = {c} AND key = {k})",
    older: r#"SELECT seq, message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, (EXTRACT(EPOCH FROM now() - created_at) * 1000)::int8 AS age_ms
    FROM "{outbox}" WHERE created_at < now() - $1 * interval '1 millisecond'
    ORDER BY seq LIMIT $2 FOR UPDATE SKIP LOCKED"#,
    unowned: r#"SELECT seq, message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, (EXTRACT(EPOCH FROM now() - created_at) * 1000)::int8 AS age_ms
    FROM "{outbox}" WHERE consumer = '' AND created_at <= now() ORDER BY seq LIMIT $1
    FOR UPDATE SKIP LOCKED"#,
    delete: r#"DELETE FROM "{outbox}" WHERE seq IN ({seqs})"#,
    remove: r#"DELETE FROM "{outbox}" WHERE message_id IN ({ids})"#,
    prelude: None,
    lazy_commit: Some("SET LOCAL synchronous_commit = off"),
    // Else a backlog the statistics have not seen is planned as a few rows, all read and
    // sorted before the limit applies (a pass over 100,000 rows took ~100 ms instead of ~1).
    in_order: Some("SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off"),
    now: "now()",
    at: "to_timestamp({p}::int8 / 1000.0)",
    notify: Some("SELECT pg_notify('idem_outbox', '{outbox}')::text"),
};

/// PostgreSQL's outbox table.
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES_TABLE: &[&str] = &[
    r#"CREATE TABLE IF NOT EXISTS "{outbox}" (
            seq            bigserial   PRIMARY KEY,
            message_id     text        NOT NULL UNIQUE,
            consumer       text        NOT NULL,
            key            text        NOT NULL,
            exchange       text        NOT NULL,
            routing_key    text        NOT NULL,
            body           bytea       NOT NULL,
            headers        text        NOT NULL,
            correlation_id text        NOT NULL,
            content_type   text        NOT NULL,
            created_at     timestamptz NOT NULL
        )"#,
    r#"CREATE INDEX IF NOT EXISTS "{outbox}_run" ON "{outbox}" (consumer, key)"#,
];

/// PostgreSQL's index of the rows staged outside any handler, in the order staged: the pass a
/// `NOTIFY` wakes ([`OutboxStatements::unowned`]) reads its rows from it however many rows
/// handlers staged beside them (schema version 7). Rows staged by handlers stay out of it.
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES_UNOWNED_INDEX: &[&str] =
    &[r#"CREATE INDEX IF NOT EXISTS "{outbox}_unowned" ON "{outbox}" (seq) WHERE consumer = ''"#];

/// MySQL and MariaDB: rows taken with `FOR UPDATE SKIP LOCKED`, in a READ COMMITTED
/// transaction (no gap locks to hold up the handlers staging new rows).
#[cfg(feature = "mysql")]
pub(crate) const MYSQL: OutboxStatements = OutboxStatements {
    stage: r#"INSERT INTO `{outbox}` (message_id, consumer, `key`, exchange, routing_key, body, headers,
        correlation_id, content_type, created_at)
    VALUES {rows}"#,
    run: r#"SELECT seq, message_id, consumer, `key`, exchange, routing_key, body, headers, correlation_id,
        content_type, TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000 AS age_ms
    FROM `{outbox}` WHERE ({runs}) AND created_at <= UTC_TIMESTAMP(6) ORDER BY seq
    FOR UPDATE SKIP LOCKED"#,
    run_match: "(consumer = {c} AND `key` = {k})",
    older: r#"SELECT seq, message_id, consumer, `key`, exchange, routing_key, body, headers, correlation_id,
        content_type, TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000 AS age_ms
    FROM `{outbox}` WHERE created_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND
    ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED"#,
    unowned: r#"SELECT seq, message_id, consumer, `key`, exchange, routing_key, body, headers, correlation_id,
        content_type, TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000 AS age_ms
    FROM `{outbox}` WHERE consumer = '' AND created_at <= UTC_TIMESTAMP(6) ORDER BY seq LIMIT ?
    FOR UPDATE SKIP LOCKED"#,
    // Driven by the list, one primary-key lookup per row: a plain `IN` list may be planned as
    // a scan, which waits on (and deadlocks with) the rows other passes hold.
    delete: r#"DELETE o FROM JSON_TABLE('[{seqs}]', '$[*]' COLUMNS (seq BIGINT PATH '$')) AS j
    STRAIGHT_JOIN `{outbox}` o ON o.seq = j.seq"#,
    remove: "DELETE FROM `{outbox}` WHERE message_id IN ({ids})",
    prelude: Some("SET TRANSACTION ISOLATION LEVEL READ COMMITTED"),
    lazy_commit: None,
    in_order: None,
    now: "UTC_TIMESTAMP(6)",
    at: "TIMESTAMPADD(MICROSECOND, {p} * 1000, '1970-01-01 00:00:00')",
    notify: None,
};

/// MySQL's outbox table.
#[cfg(feature = "mysql")]
pub(crate) const MYSQL_TABLE: &[&str] = &[r#"CREATE TABLE IF NOT EXISTS `{outbox}` (
            seq            BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
            message_id     VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            consumer       VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            `key`          VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            exchange       VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            routing_key    VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            body           LONGBLOB     NOT NULL,
            headers        LONGTEXT     NOT NULL,
            correlation_id VARCHAR(255) NOT NULL,
            content_type   VARCHAR(255) NOT NULL,
            created_at     DATETIME(6)  NOT NULL,
            UNIQUE KEY message_id (message_id),
            KEY run (consumer, `key`)
        ) ENGINE = InnoDB"#];

/// SQLite: a relay pass holds the write lock (`BEGIN IMMEDIATE`), so passes take turns.
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: OutboxStatements = OutboxStatements {
    stage: r#"INSERT INTO "{outbox}" (message_id, consumer, key, exchange, routing_key, body, headers,
        correlation_id, content_type, created_at)
    VALUES {rows}"#,
    run: r#"SELECT seq, message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, {now} - created_at AS age_ms
    FROM "{outbox}" WHERE ({runs}) AND created_at <= {now} ORDER BY seq"#,
    run_match: "(consumer = {c} AND key = {k})",
    older: r#"SELECT seq, message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, {now} - created_at AS age_ms
    FROM "{outbox}" WHERE created_at < {now} - ?1 ORDER BY seq LIMIT ?2"#,
    unowned: r#"SELECT seq, message_id, consumer, key, exchange, routing_key, body, headers, correlation_id,
        content_type, {now} - created_at AS age_ms
    FROM "{outbox}" WHERE consumer = '' AND created_at <= {now} ORDER BY seq LIMIT ?1"#,
    delete: r#"DELETE FROM "{outbox}" WHERE seq IN ({seqs})"#,
    remove: r#"DELETE FROM "{outbox}" WHERE message_id IN ({ids})"#,
    prelude: None,
    lazy_commit: None,
    in_order: None,
    now: "{now}",
    at: "{p}",
    notify: None,
};

/// SQLite's outbox table (`AUTOINCREMENT`: a sequence number is never reused, so the order
/// staged holds across deletes).
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_TABLE: &[&str] = &[
    r#"CREATE TABLE IF NOT EXISTS "{outbox}" (
            seq            INTEGER PRIMARY KEY AUTOINCREMENT,
            message_id     TEXT    NOT NULL UNIQUE,
            consumer       TEXT    NOT NULL,
            key            TEXT    NOT NULL,
            exchange       TEXT    NOT NULL,
            routing_key    TEXT    NOT NULL,
            body           BLOB    NOT NULL,
            headers        TEXT    NOT NULL,
            correlation_id TEXT    NOT NULL,
            content_type   TEXT    NOT NULL,
            created_at     INTEGER NOT NULL
        )"#,
    r#"CREATE INDEX IF NOT EXISTS "{outbox}_run" ON "{outbox}" (consumer, key)"#,
];

/// Stages `message` in the outbox of the handler's store, in the handler's transaction `tx`:
/// it is published once `tx` commits, and never if it rolls back. The message is stamped by
/// [`Context::outgoing`] first (its id derived from the consumer, the key and its ordinal in
/// this run; correlation and causation from the message being processed). Returns its
/// message id. The statement is that of the driver's own dialect ([`Driver`]).
pub async fn stage<DB: Driver>(
    tx: &mut Transaction<'_, DB>,
    ctx: &Context<'_>,
    message: Outgoing,
) -> Result<String, StoreError> {
    let message = ctx.outgoing(message);
    let table = match ctx.outbox_table() {
        Some(table) => table.to_owned(),
        None => TableName::default().outbox(),
    };
    let id = insert::<DB::Dialect>(tx, &table, ctx.consumer(), ctx.run_key(), &message).await?;
    keep::<DB::Dialect>(tx, ctx, std::slice::from_ref(&message));
    Ok(id)
}

/// Tells `ctx` that `messages` were staged in `tx`, at `tx`'s savepoint depth: the dispatch
/// publishes them from memory when that is the handler's own transaction, outside any
/// savepoint.
fn keep<DB: Dialect>(tx: &Transaction<'_, DB::Db>, ctx: &Context<'_>, messages: &[Outgoing]) {
    let connection: &Conn<DB> = tx;
    let depth = <<DB::Db as sqlx::Database>::TransactionManager as TransactionManager>::get_transaction_depth(connection);
    ctx.keep_staged(
        messages,
        crate::inbox::transaction_identity::<DB>(tx),
        depth,
    );
}

impl<DB: Dialect> SqlInbox<DB> {
    /// Stages `message` in this inbox's outbox in `tx`, a transaction of the caller's own (an
    /// HTTP handler producing an event): it is published once `tx` commits, by the relay of a
    /// runtime using this inbox, and never if `tx` rolls back. The message needs its own id,
    /// which the outbox holds once (a second staging of it fails); returns it.
    pub async fn stage(
        &self,
        tx: &mut Transaction<'_, DB::Db>,
        message: Outgoing,
    ) -> Result<String, StoreError> {
        let Some(id) = message.message_id() else {
            return Err(StoreError::new(
                "stage",
                ErrorClass::Permanent,
                "a message staged outside a handler needs a message id (Outgoing::with_message_id)",
            ));
        };
        let id = id.to_owned();
        insert::<DB>(tx, &self.outbox, "", &id, &message).await?;
        if let Some(notify) = &self.sql.outbox.notify {
            // Delivered at the commit: the relays listening take the row at once.
            DB::Db::execute(&mut **tx, notify, &[])
                .await
                .map_err(|e| store_error("stage", e))?;
        }
        Ok(id)
    }

    /// Stages `messages` in this inbox's outbox in `tx`, as staged by `consumer` grouped
    /// under `run` (the store's side of `OutboxStore::stage_rows`).
    pub(crate) async fn stage_in(
        &self,
        tx: &mut Transaction<'_, DB::Db>,
        consumer: &str,
        run: &str,
        messages: &[Outgoing],
    ) -> Result<(), StoreError> {
        insert_rows::<DB>(tx, &self.outbox, consumer, run, messages).await
    }
}

/// Rows per staging statement (nine or ten parameters a row, well under every dialect's
/// limit).
const ROWS_PER_STATEMENT: usize = 500;

/// Inserts `message` (stamped, with its id) into `table` in `tx`, as staged by `consumer`
/// grouped under `run`.
async fn insert<DB: Dialect>(
    tx: &mut Transaction<'_, DB::Db>,
    table: &str,
    consumer: &str,
    run: &str,
    message: &Outgoing,
) -> Result<String, StoreError> {
    insert_rows::<DB>(tx, table, consumer, run, std::slice::from_ref(message)).await?;
    Ok(message.message_id().unwrap_or_default().to_owned())
}

/// Inserts `messages` (stamped, with their ids) into `table` in `tx`, in order, with
/// multi-row statements.
async fn insert_rows<DB: Dialect>(
    tx: &mut Transaction<'_, DB::Db>,
    table: &str,
    consumer: &str,
    run: &str,
    messages: &[Outgoing],
) -> Result<(), StoreError> {
    // A message a broker cannot carry is refused here, where it is made, not by the relay.
    for message in messages {
        message
            .check()
            .map_err(|e| StoreError::new("stage", ErrorClass::Permanent, e))?;
    }
    // The run is the staging handler's key.
    let run = &*crate::keys::stored::<DB>(run);
    for chunk in messages.chunks(ROWS_PER_STATEMENT) {
        let headers: Vec<String> = chunk
            .iter()
            .map(|m| headers_to_json(&m.envelope.headers))
            .collect();
        let mut params = Vec::with_capacity(chunk.len() * 10);
        let mut rows = Vec::with_capacity(chunk.len());
        // The texts a message carries from its input (a correlation id with NUL, say) as the
        // dialect can hold them (`keys`).
        let texts: Vec<[std::borrow::Cow<'_, str>; 5]> = chunk
            .iter()
            .map(|message| {
                let envelope = &message.envelope;
                let (topic, key) = message.destination.parts();
                [
                    envelope.message_id.as_deref().unwrap_or_default(),
                    topic,
                    key,
                    envelope.correlation_id.as_deref().unwrap_or_default(),
                    envelope.content_type.as_deref().unwrap_or_default(),
                ]
                .map(crate::keys::stored::<DB>)
            })
            .collect();
        let now_ms = idem_core::model::epoch_ms();
        let due: Vec<Option<i64>> = chunk.iter().map(|m| m.scheduled_after(now_ms)).collect();
        for (((message, headers), texts), due) in chunk.iter().zip(&headers).zip(&texts).zip(&due) {
            let [id, exchange, routing_key, correlation_id, content_type] = texts;
            let first = params.len() + 1;
            params.extend([
                Param::Text(id),
                Param::Text(consumer),
                Param::Text(run),
                Param::Text(exchange),
                Param::Text(routing_key),
                Param::Bytes(&message.envelope.body),
                Param::Text(headers),
                Param::Text(correlation_id),
                Param::Text(content_type),
            ]);
            let placeholders: Vec<String> = (first..first + 9).map(DB::placeholder).collect();
            // A scheduled message is kept as staged when it is due: the relay takes it then.
            let created = match due {
                Some(at) => {
                    params.push(Param::Int(*at));
                    DB::STATEMENTS
                        .outbox
                        .at
                        .replace("{p}", &DB::placeholder(first + 9))
                }
                None => DB::STATEMENTS.outbox.now.to_owned(),
            };
            rows.push(format!("({}, {created})", placeholders.join(", ")));
        }
        let sql: std::sync::Arc<str> = DB::STATEMENTS
            .outbox
            .stage
            .replace("{outbox}", table)
            .replace("{rows}", &rows.join(", "))
            .replace("{now}", DB::NOW)
            .into();
        DB::Db::execute(&mut **tx, &sql, &params)
            .await
            .map_err(|e| store_error("stage", e))?;
    }
    Ok(())
}

/// Stages several messages in one statement, in the handler's transaction `tx`: each
/// `(index, message)` is caused by message `index` of a batch handler's batch and stamped by
/// its context (`ctx.item(index)`, see [`stage`]); for a single message's context, index 0.
/// Returns their message ids, in order. An index outside the batch is refused.
pub async fn stage_all<DB: Driver>(
    tx: &mut Transaction<'_, DB>,
    ctx: &Context<'_>,
    messages: impl IntoIterator<Item = (usize, Outgoing)>,
) -> Result<Vec<String>, StoreError> {
    let mut stamped = Vec::new();
    for (index, message) in messages {
        let Some(item) = ctx.item(index) else {
            return Err(StoreError::new(
                "stage",
                ErrorClass::Permanent,
                format!("message {index} is not in the batch"),
            ));
        };
        stamped.push(item.outgoing(message));
    }
    let table = match ctx.outbox_table() {
        Some(table) => table.to_owned(),
        None => TableName::default().outbox(),
    };
    insert_rows::<DB::Dialect>(tx, &table, ctx.consumer(), ctx.run_key(), &stamped).await?;
    keep::<DB::Dialect>(tx, ctx, &stamped);
    Ok(stamped
        .iter()
        .map(|m| m.message_id().unwrap_or_default().to_owned())
        .collect())
}
