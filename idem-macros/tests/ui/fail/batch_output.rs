use idem::{Batch, BatchError, idempotent};

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
}

#[idempotent(store = Postgres, key = "orders.order_id")]
async fn count_orders(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    orders: Batch<Order>,
) -> Result<u64, BatchError> {
    Ok(orders.len() as u64)
}

fn main() {}
