use idem::{HandlerError, idempotent};

#[derive(serde::Deserialize)]
struct Update {
    order_id: String,
    version: String,
}

#[idempotent(store = Postgres, version = "update.version", entity = "update.order_id")]
async fn track(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, update: Update) -> Result<(), HandlerError> {
    let _ = (update.order_id, update.version);
    Ok(())
}

fn main() {}
