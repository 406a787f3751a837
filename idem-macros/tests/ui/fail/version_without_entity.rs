use idem::{HandlerError, idempotent};

#[derive(serde::Deserialize)]
struct Update {
    version: i64,
}

#[idempotent(store = Postgres, version = "update.version")]
async fn track(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, update: Update) -> Result<(), HandlerError> {
    let _ = update.version;
    Ok(())
}

fn main() {}
