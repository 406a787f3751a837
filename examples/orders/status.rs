//! Order status updates, consumed in order per order and never applied older than what is
//! there: an ordered handler (`ORDERS_STATUS_PARTITIONS` partitions behind the exchange
//! `${ORDERS_QUEUE}.status`, routing key = order id) with `version = "update.version"`.

use idem::sqlx::{self, MySql, Postgres, Sqlite, Transaction};
use idem::{HandlerError, idempotent};
use serde::{Deserialize, Serialize};

/// The consumer identity of the status handler.
pub const CONSUMER: &str = "order-status";

/// The message: AMQP `message_id` = `<order_id>:<version>`, the dedup key; routing key = order id.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusUpdate {
    pub order_id: String,
    pub status: String,
    pub version: i64,
}

/// The exchange the status updates are published to: `<orders queue>.status`.
pub fn exchange(queue: &str) -> String {
    format!("{queue}.status")
}

/// The tables the status handler writes, on SQLite.
pub const SQLITE_SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS order_status (order_id TEXT PRIMARY KEY, status TEXT NOT NULL, version BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS status_log (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id TEXT NOT NULL, version BIGINT NOT NULL)",
];

/// The same tables on PostgreSQL.
pub const POSTGRES_SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS order_status (order_id TEXT PRIMARY KEY, status TEXT NOT NULL, version BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS status_log (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, version BIGINT NOT NULL)",
];

/// The same tables on MySQL/MariaDB.
pub const MYSQL_SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS order_status (order_id VARCHAR(191) PRIMARY KEY, status TEXT NOT NULL, version BIGINT NOT NULL) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS status_log (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id VARCHAR(191) NOT NULL, version BIGINT NOT NULL) ENGINE = InnoDB",
];

const UPSERT: &str = "INSERT INTO order_status (order_id, status, version) VALUES ($1, $2, $3)
    ON CONFLICT (order_id) DO UPDATE SET status = excluded.status, version = excluded.version";
const LOG: &str = "INSERT INTO status_log (order_id, version) VALUES ($1, $2)";

#[idempotent(queue = "orders.status", consumer = "order-status", store = Sqlite,
             version = "update.version", entity = "update.order_id")]
pub async fn set_status_sqlite(
    tx: &mut Transaction<'_, Sqlite>,
    update: StatusUpdate,
) -> Result<(), HandlerError> {
    sqlx::query(UPSERT)
        .bind(&update.order_id)
        .bind(&update.status)
        .bind(update.version)
        .execute(&mut **tx)
        .await?;
    sqlx::query(LOG)
        .bind(&update.order_id)
        .bind(update.version)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(queue = "orders.status", consumer = "order-status", store = Postgres,
             version = "update.version", entity = "update.order_id")]
pub async fn set_status_postgres(
    tx: &mut Transaction<'_, Postgres>,
    update: StatusUpdate,
) -> Result<(), HandlerError> {
    sqlx::query(UPSERT)
        .bind(&update.order_id)
        .bind(&update.status)
        .bind(update.version)
        .execute(&mut **tx)
        .await?;
    sqlx::query(LOG)
        .bind(&update.order_id)
        .bind(update.version)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

const MYSQL_UPSERT: &str = "INSERT INTO order_status (order_id, status, version) VALUES (?, ?, ?)
    ON DUPLICATE KEY UPDATE status = VALUES(status), version = VALUES(version)";
const MYSQL_LOG: &str = "INSERT INTO status_log (order_id, version) VALUES (?, ?)";

#[idempotent(queue = "orders.status", consumer = "order-status", store = MySql,
             version = "update.version", entity = "update.order_id")]
pub async fn set_status_mysql(
    tx: &mut Transaction<'_, MySql>,
    update: StatusUpdate,
) -> Result<(), HandlerError> {
    sqlx::query(MYSQL_UPSERT)
        .bind(&update.order_id)
        .bind(&update.status)
        .bind(update.version)
        .execute(&mut **tx)
        .await?;
    sqlx::query(MYSQL_LOG)
        .bind(&update.order_id)
        .bind(update.version)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
