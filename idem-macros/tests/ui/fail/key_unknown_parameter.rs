use idem::{HandlerError, idempotent};

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
}

#[idempotent(store = Postgres, key = "ordr.order_id")]
async fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, order: Order) -> Result<(), HandlerError> {
    let _ = order.order_id;
    Ok(())
}

fn main() {}
