use idem::{HandlerError, idempotent};

#[idempotent(key = "message_id")]
async fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _m: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {
    // The function is still emitted, so this call compiles.
    let _ = handler;
}
