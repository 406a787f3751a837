//! Batch handlers: `idem::Batch<T>` as the payload, with or without per-message results and
//! state, `?` on database errors.
use idem::{Batch, BatchError, HandlerError, idempotent};

struct Tariff {
    cents_per_unit: i64,
}

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
    units: i64,
}

#[idempotent(store = Postgres, queue = "orders", key = "orders.order_id", batch = 500)]
async fn place_orders(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    orders: idem::Batch<Order>,
) -> Result<(), BatchError> {
    let ids: Vec<&str> = orders.iter().map(|o| o.order_id.as_str()).collect();
    sqlx::query("INSERT INTO orders (order_id) SELECT * FROM unnest($1::text[])")
        .bind(&ids)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(store = Sqlite, queue = "prices", key = "orders.order_id")]
async fn price_orders(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    orders: Batch<Order>,
    tariff: &Tariff,
) -> Result<Vec<i64>, HandlerError> {
    if let Some(i) = orders.iter().position(|o| o.units < 0) {
        return Err(HandlerError::permanent(format!("order {i} has negative units")));
    }
    Ok(orders.iter().map(|o| o.units * tariff.cents_per_unit).collect())
}

/// A batch handler's context: `ctx.item(i)` is message `i`'s, to stage what it causes.
#[idempotent(store = Postgres, queue = "bills", key = "orders.order_id")]
async fn bill_orders(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    orders: Batch<Order>,
    ctx: &idem::Context<'_>,
) -> Result<(), BatchError> {
    for (i, order) in orders.iter().enumerate() {
        let item = ctx.item(i).ok_or(HandlerError::permanent("no such message"))?;
        let billed = idem::Outgoing::to_queue("billed", &order.order_id)?;
        idem::outbox::stage(tx, item, billed).await?;
    }
    Ok(())
}

#[idempotent(store = MySql, queue = "checks")]
async fn check_orders(
    _tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    orders: Batch<Order>,
) -> Result<Vec<bool>, BatchError> {
    match orders.iter().position(|o| o.units == 0) {
        Some(i) => Err(BatchError::item(i, HandlerError::permanent("no units"))),
        None => Ok(orders.iter().map(|o| o.units > 10).collect()),
    }
}

fn main() {}
