//! The second hop: the shipping handler (consumer `shipping`) consumes the `OrderBilled` events
//! the order handler staged in its outbox (queue `<ORDERS_QUEUE>.billed`), once per database.
//! In its transaction it records the shipment and counts one more parcel for the customer,
//! which is not idempotent either, and appends the shipment to `shipment_log` (no unique key:
//! a second run would show there as a second row). The event's message id (derived from the
//! order's) is the dedup key.

use crate::handlers::OrderBilled;
use idem::sqlx::{self, MySql, Postgres, Sqlite, Transaction};
use idem::{HandlerError, idempotent};

/// The consumer identity of the shipping handlers.
pub const CONSUMER: &str = "shipping";

/// The tables the shipping handler writes.
pub const SCHEMA: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS shipments (order_id TEXT PRIMARY KEY, customer TEXT)",
    "CREATE TABLE IF NOT EXISTS parcels (customer TEXT PRIMARY KEY, n BIGINT)",
    "CREATE TABLE IF NOT EXISTS shipment_log (order_id TEXT NOT NULL, customer TEXT NOT NULL)",
];

/// The same tables on MySQL/MariaDB.
pub const MYSQL_SCHEMA: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS shipments (order_id VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin PRIMARY KEY, customer VARCHAR(191)) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS parcels (customer VARCHAR(191) PRIMARY KEY, n BIGINT) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS shipment_log (order_id VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL, customer VARCHAR(191) NOT NULL) ENGINE = InnoDB",
];

/// The shipment's row, written once: a second run (which idem never makes) goes on to the
/// parcels and the log, where it shows.
const INSERT_SHIPMENT: &str = "INSERT INTO shipments (order_id, customer) VALUES ($1, $2)
    ON CONFLICT (order_id) DO NOTHING";
/// Not idempotent: run twice, it counts twice.
const ADD_PARCEL: &str = "INSERT INTO parcels (customer, n) VALUES ($1, 1)
    ON CONFLICT (customer) DO UPDATE SET n = parcels.n + 1";
/// Append-only: run twice, it writes two rows.
const LOG_SHIPMENT: &str = "INSERT INTO shipment_log (order_id, customer) VALUES ($1, $2)";
const MYSQL_INSERT_SHIPMENT: &str = "INSERT INTO shipments (order_id, customer) VALUES (?, ?)
    ON DUPLICATE KEY UPDATE order_id = order_id";
const MYSQL_ADD_PARCEL: &str =
    "INSERT INTO parcels (customer, n) VALUES (?, 1) ON DUPLICATE KEY UPDATE n = n + 1";
const MYSQL_LOG_SHIPMENT: &str = "INSERT INTO shipment_log (order_id, customer) VALUES (?, ?)";

/// The name of the shipping function the runtime runs on each database.
pub fn function(db: &crate::Db) -> &'static str {
    match db {
        crate::Db::Sqlite(_) => "ship_order_sqlite",
        crate::Db::Postgres(_) => "ship_order_postgres",
        crate::Db::MySql(_) => "ship_order_mysql",
    }
}

#[idempotent(queue = "orders.billed", consumer = "shipping", store = Sqlite)]
pub async fn ship_order_sqlite(
    tx: &mut Transaction<'_, Sqlite>,
    billed: OrderBilled,
) -> Result<(), HandlerError> {
    sqlx::query(INSERT_SHIPMENT)
        .bind(&billed.order_id)
        .bind(&billed.customer)
        .execute(&mut **tx)
        .await?;
    sqlx::query(ADD_PARCEL)
        .bind(&billed.customer)
        .execute(&mut **tx)
        .await?;
    sqlx::query(LOG_SHIPMENT)
        .bind(&billed.order_id)
        .bind(&billed.customer)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(queue = "orders.billed", consumer = "shipping", store = Postgres)]
pub async fn ship_order_postgres(
    tx: &mut Transaction<'_, Postgres>,
    billed: OrderBilled,
) -> Result<(), HandlerError> {
    sqlx::query(INSERT_SHIPMENT)
        .bind(&billed.order_id)
        .bind(&billed.customer)
        .execute(&mut **tx)
        .await?;
    sqlx::query(ADD_PARCEL)
        .bind(&billed.customer)
        .execute(&mut **tx)
        .await?;
    sqlx::query(LOG_SHIPMENT)
        .bind(&billed.order_id)
        .bind(&billed.customer)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(queue = "orders.billed", consumer = "shipping", store = MySql)]
pub async fn ship_order_mysql(
    tx: &mut Transaction<'_, MySql>,
    billed: OrderBilled,
) -> Result<(), HandlerError> {
    sqlx::query(MYSQL_INSERT_SHIPMENT)
        .bind(&billed.order_id)
        .bind(&billed.customer)
        .execute(&mut **tx)
        .await?;
    sqlx::query(MYSQL_ADD_PARCEL)
        .bind(&billed.customer)
        .execute(&mut **tx)
        .await?;
    sqlx::query(MYSQL_LOG_SHIPMENT)
        .bind(&billed.order_id)
        .bind(&billed.customer)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
