use idem::{HandlerError, idempotent};
use std::rc::Rc;

#[idempotent(store = Postgres)]
async fn handler(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _m: serde_json::Value) -> Result<(), HandlerError> {
    let local = Rc::new(1);
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    let _ = local;
    Ok(())
}

fn main() {}
