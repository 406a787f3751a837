use idem::{HandlerError, idempotent};

#[idempotent(store = Postgres, mode = "external", lease = "30 seconds", retention = "1w")]
async fn handler(_m: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(store = Postgres, mode = "eventually")]
async fn other(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _m: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
