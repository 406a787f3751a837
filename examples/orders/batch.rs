//! The order handler as a batch handler (`ORDERS_BATCH_HANDLER=1`), once per database: the same
//! books as `handlers.rs`, written set-based. It receives only the new orders of a batch
//! (copies and orders booked before are settled by idem without it) and writes them with one
//! multi-row insert into `orders` and one into `ledger` and one upsert of each customer's
//! total, in the transaction that holds their inbox rows. It shares the consumer `orders` and its key source (the message id) with
//! the one-order handlers, and so their inbox rows: switching between the two never books an
//! order twice. Each order's `OrderBilled` event is staged with one multi-row insert, stamped
//! by that order's context (`ctx.item(i)`): the same message ids as the one-order handlers.

use crate::handlers::{Billing, OrderPlaced};
use idem::sql::Driver;
use idem::sqlx::{self, MySql, Postgres, QueryBuilder, Sqlite, Transaction};
use idem::{Batch, BatchError, Context, idempotent};
use std::collections::BTreeMap;

/// Rows per statement on MySQL and SQLite (three placeholders a row, well under their limits).
const ROWS_PER_STATEMENT: usize = 1_000;

/// Stages every order's `OrderBilled` event, each caused by its own order.
async fn stage_events<DB: Driver>(
    tx: &mut Transaction<'_, DB>,
    orders: &Batch<OrderPlaced>,
    ctx: &Context<'_>,
    billing: &Billing,
) -> Result<(), BatchError> {
    let mut events = Vec::with_capacity(orders.len());
    for (i, order) in orders.iter().enumerate() {
        events.push((i, billing.event(order)?));
    }
    idem::outbox::stage_all(tx, ctx, events).await?;
    Ok(())
}

/// Each customer's total in `orders`, by customer: rows are locked in the same order by every
/// batch, so concurrent batches wait for each other instead of deadlocking.
fn totals(orders: &Batch<OrderPlaced>) -> BTreeMap<&str, i64> {
    let mut totals = BTreeMap::new();
    for order in orders.iter() {
        *totals.entry(order.customer.as_str()).or_default() += order.amount_cents;
    }
    totals
}

#[idempotent(queue = "orders", consumer = "orders", store = Postgres)]
pub async fn place_orders_batch_postgres(
    tx: &mut Transaction<'_, Postgres>,
    orders: Batch<OrderPlaced>,
    ctx: &Context<'_>,
    billing: &Billing,
) -> Result<(), BatchError> {
    let ids: Vec<&str> = orders.iter().map(|o| o.order_id.as_str()).collect();
    let customers: Vec<&str> = orders.iter().map(|o| o.customer.as_str()).collect();
    let amounts: Vec<i64> = orders.iter().map(|o| o.amount_cents).collect();
    sqlx::query(
        "INSERT INTO orders (order_id, customer, amount_cents)
         SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])
         ON CONFLICT (order_id) DO NOTHING",
    )
    .bind(&ids)
    .bind(&customers)
    .bind(&amounts)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO ledger (order_id, customer, cents)
         SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])",
    )
    .bind(&ids)
    .bind(&customers)
    .bind(&amounts)
    .execute(&mut **tx)
    .await?;
    let (customers, cents): (Vec<&str>, Vec<i64>) = totals(&orders).into_iter().unzip();
    sqlx::query(
        "INSERT INTO balances (customer, cents)
         SELECT * FROM unnest($1::text[], $2::bigint[])
         ON CONFLICT (customer) DO UPDATE SET cents = balances.cents + excluded.cents",
    )
    .bind(&customers)
    .bind(&cents)
    .execute(&mut **tx)
    .await?;
    stage_events(tx, &orders, ctx, billing).await
}

#[idempotent(queue = "orders", consumer = "orders", store = MySql)]
pub async fn place_orders_batch_mysql(
    tx: &mut Transaction<'_, MySql>,
    orders: Batch<OrderPlaced>,
    ctx: &Context<'_>,
    billing: &Billing,
) -> Result<(), BatchError> {
    for chunk in orders.chunks(ROWS_PER_STATEMENT) {
        let mut insert =
            QueryBuilder::<MySql>::new("INSERT INTO orders (order_id, customer, amount_cents) ");
        insert.push_values(chunk, |mut row, order| {
            row.push_bind(&order.order_id)
                .push_bind(&order.customer)
                .push_bind(order.amount_cents);
        });
        insert.push(" ON DUPLICATE KEY UPDATE order_id = order_id");
        insert.build().execute(&mut **tx).await?;
        let mut record =
            QueryBuilder::<MySql>::new("INSERT INTO ledger (order_id, customer, cents) ");
        record.push_values(chunk, |mut row, order| {
            row.push_bind(&order.order_id)
                .push_bind(&order.customer)
                .push_bind(order.amount_cents);
        });
        record.build().execute(&mut **tx).await?;
    }
    let totals: Vec<(&str, i64)> = totals(&orders).into_iter().collect();
    for chunk in totals.chunks(ROWS_PER_STATEMENT) {
        let mut upsert = QueryBuilder::<MySql>::new("INSERT INTO balances (customer, cents) ");
        upsert.push_values(chunk, |mut row, (customer, cents)| {
            row.push_bind(*customer).push_bind(*cents);
        });
        upsert.push(" ON DUPLICATE KEY UPDATE cents = cents + VALUES(cents)");
        upsert.build().execute(&mut **tx).await?;
    }
    stage_events(tx, &orders, ctx, billing).await
}

#[idempotent(queue = "orders", consumer = "orders", store = Sqlite)]
pub async fn place_orders_batch_sqlite(
    tx: &mut Transaction<'_, Sqlite>,
    orders: Batch<OrderPlaced>,
    ctx: &Context<'_>,
    billing: &Billing,
) -> Result<(), BatchError> {
    for chunk in orders.chunks(ROWS_PER_STATEMENT) {
        let mut insert =
            QueryBuilder::<Sqlite>::new("INSERT INTO orders (order_id, customer, amount_cents) ");
        insert.push_values(chunk, |mut row, order| {
            row.push_bind(&order.order_id)
                .push_bind(&order.customer)
                .push_bind(order.amount_cents);
        });
        insert.push(" ON CONFLICT (order_id) DO NOTHING");
        insert.build().execute(&mut **tx).await?;
        let mut record =
            QueryBuilder::<Sqlite>::new("INSERT INTO ledger (order_id, customer, cents) ");
        record.push_values(chunk, |mut row, order| {
            row.push_bind(&order.order_id)
                .push_bind(&order.customer)
                .push_bind(order.amount_cents);
        });
        record.build().execute(&mut **tx).await?;
    }
    let totals: Vec<(&str, i64)> = totals(&orders).into_iter().collect();
    for chunk in totals.chunks(ROWS_PER_STATEMENT) {
        let mut upsert = QueryBuilder::<Sqlite>::new("INSERT INTO balances (customer, cents) ");
        upsert.push_values(chunk, |mut row, (customer, cents)| {
            row.push_bind(*customer).push_bind(*cents);
        });
        upsert
            .push(" ON CONFLICT (customer) DO UPDATE SET cents = balances.cents + excluded.cents");
        upsert.build().execute(&mut **tx).await?;
    }
    stage_events(tx, &orders, ctx, billing).await
}
