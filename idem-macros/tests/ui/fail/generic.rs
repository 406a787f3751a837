use idem::{HandlerError, idempotent};

#[idempotent(store = Postgres)]
async fn handler<T: serde::de::DeserializeOwned>(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _m: T) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
