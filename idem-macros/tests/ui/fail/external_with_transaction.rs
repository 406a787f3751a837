use idem::{Context, HandlerError, idempotent};

#[idempotent(store = Postgres, mode = "external")]
async fn handler(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    _m: serde_json::Value,
    _ctx: &Context<'_>,
) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
