use idem::{HandlerError, idempotent};

#[derive(serde::Deserialize)]
struct Update {
    order_id: String,
    version: i64,
}

#[idempotent(store = Postgres, mode = "external", version = "update.version", entity = "update.order_id")]
async fn notify(update: Update) -> Result<(), HandlerError> {
    let _ = (update.order_id, update.version);
    Ok(())
}

fn main() {}
