use idem::{HandlerError, idempotent};

#[idempotent(store = Postgres)]
async fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>, _m: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
