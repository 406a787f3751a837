use idem::{HandlerError, idempotent};

#[idempotent(store = Postgres)]
fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _m: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
