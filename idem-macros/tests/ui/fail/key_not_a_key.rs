use idem::{HandlerError, idempotent};

#[derive(serde::Deserialize)]
struct Reading {
    celsius: f64,
}

#[idempotent(store = Postgres, key = "reading.celsius")]
async fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, reading: Reading) -> Result<(), HandlerError> {
    let _ = reading.celsius;
    Ok(())
}

fn main() {}
