use idem::{HandlerError, idempotent};

struct Config {
    region: String,
}

#[idempotent(store = Postgres)]
async fn route(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    _m: serde_json::Value,
    config: Config,
) -> Result<(), HandlerError> {
    let _ = config.region;
    Ok(())
}

fn main() {}
