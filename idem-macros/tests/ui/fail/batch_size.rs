use idem::{Batch, BatchError, idempotent};

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
}

#[idempotent(store = Postgres, key = "orders.order_id", batch = 0)]
async fn place_orders(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    _orders: Batch<Order>,
) -> Result<(), BatchError> {
    Ok(())
}

fn main() {}
