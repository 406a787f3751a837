use idem::{Batch, BatchError, Context, idempotent};

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
}

#[idempotent(store = Postgres, key = "orders.order_id")]
async fn place_orders(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    _orders: Batch<Order>,
    _ctx: &Context<'_>,
) -> Result<(), BatchError> {
    Ok(())
}

fn main() {}
