use idem::{HandlerError, idempotent};

#[idempotent(store = Oracle)]
async fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _m: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
