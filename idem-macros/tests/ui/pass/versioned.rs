//! A versioned handler: integer versions of any width, optional or not, nested entity fields.
use idem::{HandlerError, idempotent};

#[derive(serde::Deserialize)]
struct Meta {
    order_id: String,
    version: Option<u32>,
}

#[derive(serde::Deserialize)]
struct StatusUpdate {
    meta: Meta,
    status: String,
}

#[idempotent(store = Postgres, queue = "status", version = "update.meta.version", entity = "update.meta.order_id")]
async fn track(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    update: StatusUpdate,
) -> Result<(), HandlerError> {
    let _ = update.status;
    Ok(())
}

fn main() {}
