use idem::{HandlerError, idempotent};

struct Order {
    order_id: String,
}

#[idempotent(store = Postgres)]
async fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, order: Order) -> Result<(), HandlerError> {
    let _ = order.order_id;
    Ok(())
}

fn main() {}
