use idem::{Batch, BatchError, idempotent};

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
}

#[idempotent(store = Postgres, key = "orders.order_id", mode = "external")]
async fn mail_orders(_orders: Batch<Order>) -> Result<(), BatchError> {
    Ok(())
}

fn main() {}
