//! The order handler, once per database: the same work, in the same transaction as the inbox
//! row; and the `OrderBilled` event it stages in the outbox, in that transaction too, for the
//! shipping handler (`shipping.rs`).

use idem::sql::Driver;
use idem::sqlx::{self, MySql, Postgres, Sqlite, Transaction};
use idem::{Context, HandlerError, Outgoing, idempotent};
use serde::{Deserialize, Serialize};

/// The message: AMQP `message_id` = `order_id`, the dedup key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderPlaced {
    pub order_id: String,
    pub customer: String,
    pub amount_cents: i64,
}

/// The event an order causes: published once its transaction commits, with a message id
/// derived from the order's (so a re-run stages the same id, and shipping deduplicates it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderBilled {
    pub order_id: String,
    pub customer: String,
    pub amount_cents: i64,
}

impl From<&OrderPlaced> for OrderBilled {
    fn from(order: &OrderPlaced) -> Self {
        Self {
            order_id: order.order_id.clone(),
            customer: order.customer.clone(),
            amount_cents: order.amount_cents,
        }
    }
}

/// Where `OrderBilled` events go: the queue `<ORDERS_QUEUE>.billed` (handler state).
#[derive(Debug, Clone)]
pub struct Billing {
    pub queue: String,
}

impl Billing {
    /// The billing of the orders consumed from `queue`.
    pub fn of(queue: &str) -> Self {
        Self {
            queue: format!("{queue}.billed"),
        }
    }

    /// The event of `order`, to stage.
    pub fn event(&self, order: &OrderPlaced) -> Result<Outgoing, HandlerError> {
        Ok(Outgoing::to_queue(&self.queue, &OrderBilled::from(order))?)
    }

    /// Stages the event of `order` in the order's transaction.
    async fn stage<DB: Driver>(
        &self,
        tx: &mut Transaction<'_, DB>,
        ctx: &Context<'_>,
        order: &OrderPlaced,
    ) -> Result<(), HandlerError> {
        idem::outbox::stage(tx, ctx, self.event(order)?).await?;
        Ok(())
    }
}

/// The tables the example writes: the orders, each customer's balance, and the ledger, one row
/// per booking of an order. The ledger has no unique key, on purpose: an order booked twice
/// would show there as two rows (and in the balance as twice its amount), which is what the
/// demo and the tests check never happens.
pub const SCHEMA: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS orders (order_id TEXT PRIMARY KEY, customer TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS balances (customer TEXT PRIMARY KEY, cents BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS ledger (order_id TEXT NOT NULL, customer TEXT NOT NULL, cents BIGINT NOT NULL)",
];

/// The same tables on MySQL/MariaDB (keys need a length there).
pub const MYSQL_SCHEMA: [&str; 3] = [
    // An order id is any key idem takes: up to 512 bytes, compared without padding.
    "CREATE TABLE IF NOT EXISTS orders (order_id VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin PRIMARY KEY, customer VARCHAR(191) NOT NULL, amount_cents BIGINT NOT NULL) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS balances (customer VARCHAR(191) PRIMARY KEY, cents BIGINT NOT NULL) ENGINE = InnoDB",
    "CREATE TABLE IF NOT EXISTS ledger (order_id VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL, customer VARCHAR(191) NOT NULL, cents BIGINT NOT NULL) ENGINE = InnoDB",
];

/// The order's row, written once: a second booking of the order (which idem never runs) would
/// not fail here but go on to the balance and the ledger, where it shows.
const INSERT_ORDER: &str =
    "INSERT INTO orders (order_id, customer, amount_cents) VALUES ($1, $2, $3)
    ON CONFLICT (order_id) DO NOTHING";
/// Deliberately not idempotent: run twice, it adds twice.
const ADD_TO_BALANCE: &str = "INSERT INTO balances (customer, cents) VALUES ($1, $2)
    ON CONFLICT (customer) DO UPDATE SET cents = balances.cents + excluded.cents";
/// Append-only: run twice, it writes two rows.
const RECORD_IN_LEDGER: &str = "INSERT INTO ledger (order_id, customer, cents) VALUES ($1, $2, $3)";

#[idempotent(queue = "orders", consumer = "orders", store = Sqlite)]
pub async fn place_order_sqlite(
    tx: &mut Transaction<'_, Sqlite>,
    order: OrderPlaced,
    ctx: &Context<'_>,
    billing: &Billing,
) -> Result<(), HandlerError> {
    sqlx::query(INSERT_ORDER)
        .bind(&order.order_id)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(ADD_TO_BALANCE)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(RECORD_IN_LEDGER)
        .bind(&order.order_id)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    billing.stage(tx, ctx, &order).await
}

#[idempotent(queue = "orders", consumer = "orders", store = Postgres)]
pub async fn place_order_postgres(
    tx: &mut Transaction<'_, Postgres>,
    order: OrderPlaced,
    ctx: &Context<'_>,
    billing: &Billing,
) -> Result<(), HandlerError> {
    sqlx::query(INSERT_ORDER)
        .bind(&order.order_id)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(ADD_TO_BALANCE)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(RECORD_IN_LEDGER)
        .bind(&order.order_id)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    billing.stage(tx, ctx, &order).await
}

const MYSQL_INSERT_ORDER: &str =
    "INSERT INTO orders (order_id, customer, amount_cents) VALUES (?, ?, ?)
    ON DUPLICATE KEY UPDATE order_id = order_id";
const MYSQL_ADD_TO_BALANCE: &str = "INSERT INTO balances (customer, cents) VALUES (?, ?)
    ON DUPLICATE KEY UPDATE cents = cents + VALUES(cents)";
const MYSQL_RECORD_IN_LEDGER: &str =
    "INSERT INTO ledger (order_id, customer, cents) VALUES (?, ?, ?)";

#[idempotent(queue = "orders", consumer = "orders", store = MySql)]
pub async fn place_order_mysql(
    tx: &mut Transaction<'_, MySql>,
    order: OrderPlaced,
    ctx: &Context<'_>,
    billing: &Billing,
) -> Result<(), HandlerError> {
    sqlx::query(MYSQL_INSERT_ORDER)
        .bind(&order.order_id)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(MYSQL_ADD_TO_BALANCE)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(MYSQL_RECORD_IN_LEDGER)
        .bind(&order.order_id)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    billing.stage(tx, ctx, &order).await
}
