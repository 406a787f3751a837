use idem::{HandlerError, idempotent};

struct Receipt;

#[idempotent(store = Postgres)]
async fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _m: serde_json::Value) -> Result<Receipt, HandlerError> {
    Ok(Receipt)
}

fn main() {}
