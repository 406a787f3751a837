use idem::{HandlerError, idempotent};

type SqliteTx<'c> = sqlx::Transaction<'c, sqlx::Sqlite>;

#[idempotent(store = Postgres)]
async fn handler(_tx: &mut SqliteTx<'_>, _m: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
